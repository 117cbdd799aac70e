"""docs/SUPO.md §8 BrowseComp-Plus-style setup: search over a local corpus, W = 64K, S = 2, 5 epochs
(320 steps x 64 tasks over 4,096 tasks), the paper's update setting by setting (supo_jax.config.PAPER_SUPO; tests/test_config.py checks it).
    supo-jax train --config experiments/configs/paper_search_supo.py --set model.path=/ckpt/MODEL
"""
from supo_jax.agent.context import NO_ANSWER, ContextConfig
from supo_jax.config import (Config, EnvSection, ModelSection, OptimSection, RolloutSection,
                             TrainSection)
from supo_jax.rl.configs import AdvantageConfig, LossConfig
from supo_jax.text.templates import SUMMARY_INSTRUCTION


def config() -> Config:
    return Config(
        model=ModelSection(path="", pretrained=True, dtype="float32", compute_dtype="bfloat16",
                           remat="full"),
        env=EnvSection(name="search", knobs={"corpus_size": 100_000, "hops": [3, 6]},
                       train_tasks=4096, eval_tasks=128),
        context=ContextConfig(manager="supo", working_context=65536, max_summaries=2,
                              max_steps=100, max_action_tokens=1024, max_summary_tokens=2048,
                              max_observation_tokens=4096, trigger_ratio=0.95,
                              trigger_rule="paper", summary_role="system",
                              summary_instruction=SUMMARY_INSTRUCTION,
                              show_dropped_to_summarizer=False, summary_counts_as_step=True),
        rollout=RolloutSection(tasks_per_step=64, group_size=8, rows=128, temperature=1.0,
                               dynamic_rounds=0, budget_tokens=0),
        advantage=AdvantageConfig(estimator="rollout_group", normalize_std=True,
                                  negative_weight=1.0, masked_reasons=NO_ANSWER,
                                  masked_count_in_stats=True, rollout_weight="tokens",
                                  permute_rewards=False),
        loss=LossConfig(objective="ppo", eps_low=0.2, eps_high=0.28, aggregation="token-mean",
                        kl_coef=0.0, entropy_coef=0.0),
        optim=OptimSection(lr=1e-6, schedule="constant", warmup_steps=0, minibatch_rows=128,
                           micro=16, ppo_epochs=1, max_kl=0.0),
        train=TrainSection(steps=320, save_every=10, eval_every=40, run_dir="runs/paper_search_supo",
                           eval_max_summaries=(0, 2, 5, 11, 23), sft_warm_start=False,
                           eval_temperature=0.0, eval_samples=1),
    )
