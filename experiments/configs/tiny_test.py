"""The smallest end-to-end run: what the trainer tests use (seconds per step on 2 CPU cores)."""
from supo_jax.agent.context import ContextConfig
from supo_jax.text.templates import SHORT_SUMMARY_INSTRUCTION
from supo_jax.config import (Config, EnvSection, ModelSection, OptimSection, RolloutSection,
                             SFTSection, TrainSection)
from supo_jax.rl.configs import AdvantageConfig


def config() -> Config:
    return Config(
        model=ModelSection(tiny_hidden=32, tiny_layers=1, tiny_heads=2, tiny_kv_heads=1,
                           tiny_mlp=64, tiny_vocab=512),
        env=EnvSection(name="fncall/pages", knobs={"size": 6}, train_tasks=64, eval_tasks=2),
        context=ContextConfig(manager="supo", working_context=446, max_summaries=3, max_steps=16,
                              max_action_tokens=40, max_summary_tokens=40,
                              max_observation_tokens=64,
                              summary_instruction=SHORT_SUMMARY_INSTRUCTION,
                              trigger_rule="reserve", summary_role="user"),
        rollout=RolloutSection(tasks_per_step=2, group_size=2, rows=4),
        optim=OptimSection(lr=1e-3, minibatch_rows=4),
        # what this config had when Config()'s defaults were the CPU recipe's: an SFT warm
        # start and a quarter weight on negative advantages (the tests pin its behaviour)
        advantage=AdvantageConfig(negative_weight=0.25),
        train=TrainSection(steps=3, save_every=1, run_dir="runs/tiny_test", progress=False,
                           sft_warm_start=True),
        sft=SFTSection(num_demos=4, steps=3, batch_rows=4),
    )
