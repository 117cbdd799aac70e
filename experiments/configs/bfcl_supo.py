"""BFCL multi-turn long_context (supo_jax.envs.bfcl) with SUPO at W = 8192, S = 4, for a
pretrained instruct model on an accelerator: the paper's update (supo_jax.config.PAPER_SUPO)
setting by setting. The working context holds BFCL's tool docs (~5.4K tokens with SmolLM2's
tokenizer) and about 2.5K tokens of turns; 62% of long_context's ground-truth histories
exceed 8K tokens under `full` (experiments/results/bfcl_token_stats), and 8K x (S + 1) = 40K
covers its 90th percentile (41K). Set model.path to a local HF directory or .gguf (a device
has no network):

    supo-jax sft --config experiments/configs/bfcl_supo.py --set env.name=bfcl/base \\
        --set model.path=MODEL --set train.run_dir=runs/bfcl_sft       # ground-truth demos
    supo-jax train --config experiments/configs/bfcl_supo.py \\
        --set train.init_from=runs/bfcl_sft/sft --set train.run_dir=runs/bfcl_supo

experiments/bfcl_gpu.sh runs that against `full` at 8K and at 40K, three seeds each.
"""
from supo_jax.agent.context import NO_ANSWER, ContextConfig
from supo_jax.config import (Config, EnvSection, ModelSection, OptimSection, RolloutSection,
                             SFTSection, TrainSection)
from supo_jax.rl.configs import AdvantageConfig, LossConfig
from supo_jax.text.templates import SUMMARY_INSTRUCTION


def config() -> Config:
    return Config(
        model=ModelSection(path="", pretrained=True, dtype="float32", compute_dtype="bfloat16"),
        env=EnvSection(name="bfcl/long_context", train_tasks=160, eval_tasks=40,
                       timeout_s=60.0),
        context=ContextConfig(manager="supo", working_context=8192, max_summaries=4,
                              max_steps=100, max_action_tokens=1024, max_summary_tokens=512,
                              max_observation_tokens=2048, trigger_ratio=0.95,
                              trigger_rule="paper", summary_role="system",
                              summary_instruction=SUMMARY_INSTRUCTION,
                              show_dropped_to_summarizer=False, summary_counts_as_step=True),
        rollout=RolloutSection(tasks_per_step=16, group_size=8, rows=128, temperature=1.0,
                               dynamic_rounds=0, budget_tokens=0),
        advantage=AdvantageConfig(estimator="rollout_group", normalize_std=True,
                                  negative_weight=1.0, masked_reasons=NO_ANSWER,
                                  masked_count_in_stats=True, rollout_weight="tokens",
                                  permute_rewards=False),
        loss=LossConfig(objective="ppo", eps_low=0.2, eps_high=0.28, aggregation="token-mean",
                        kl_coef=0.0, entropy_coef=0.0),
        optim=OptimSection(lr=1e-6, schedule="constant", warmup_steps=0, minibatch_rows=32,
                           pack=True, ppo_epochs=1, max_kl=0.0),
        train=TrainSection(steps=60, save_every=10, eval_every=10, eval_temperature=0.0,
                           eval_samples=1, sft_warm_start=False, run_dir="runs/bfcl_supo",
                           eval_max_summaries=(0, 4, 8)),
        sft=SFTSection(num_demos=160, steps=300, batch_rows=8),
    )
