"""docs/SUPO.md §8 CodeGym-style setup on a TPU pod: W = 4K, S = 7, H = 100, 128 prompts x G = 8 per
step, lr 1e-6, 100 steps, the paper's update setting by setting (supo_jax.config.PAPER_SUPO;
tests/test_config.py checks it). Point model.path at a local HF checkout:
    supo-jax train --config experiments/configs/paper_fncall_supo.py --set model.path=/ckpt/Qwen2.5-7B-Instruct
"""
from supo_jax.agent.context import NO_ANSWER, ContextConfig
from supo_jax.config import (Config, EnvSection, MeshSection, ModelSection, OptimSection,
                             RolloutSection, TrainSection)
from supo_jax.rl.configs import AdvantageConfig, LossConfig
from supo_jax.text.templates import SUMMARY_INSTRUCTION


def config() -> Config:
    return Config(
        model=ModelSection(path="", pretrained=True, dtype="float32", compute_dtype="bfloat16",
                           remat="full"),
        env=EnvSection(name="fncall", knobs={"size": [24, 64]}, train_tasks=12800, eval_tasks=128),
        context=ContextConfig(manager="supo", working_context=4096, max_summaries=7, max_steps=100,
                              max_action_tokens=512, max_summary_tokens=1024,
                              trigger_ratio=0.95, trigger_rule="paper", summary_role="system",
                              summary_instruction=SUMMARY_INSTRUCTION,
                              show_dropped_to_summarizer=False, summary_counts_as_step=True),
        rollout=RolloutSection(tasks_per_step=128, group_size=8, rows=256, temperature=1.0,
                               dynamic_rounds=0, budget_tokens=0),
        advantage=AdvantageConfig(estimator="rollout_group", normalize_std=True,
                                  negative_weight=1.0, masked_reasons=NO_ANSWER,
                                  masked_count_in_stats=True, rollout_weight="tokens",
                                  permute_rewards=False),
        loss=LossConfig(objective="ppo", eps_low=0.2, eps_high=0.28, aggregation="token-mean",
                        kl_coef=0.0, entropy_coef=0.0),
        optim=OptimSection(lr=1e-6, schedule="constant", warmup_steps=0, minibatch_rows=256,
                           micro=8, ppo_epochs=1, max_kl=0.0),
        train=TrainSection(steps=100, save_every=10, eval_every=10, run_dir="runs/paper_fncall_supo",
                           eval_max_summaries=(0, 7, 14, 28), sft_warm_start=False,
                           eval_temperature=0.0, eval_samples=1),
        mesh=MeshSection(data=1, fsdp=-1, tensor=1),
    )
