"""SUPO.md §8 BrowseComp-Plus-style setup: search over a local corpus, W = 64K, S = 2.
    supo-jax train --config experiments/configs/paper_search_supo.py --set model.path=/ckpt/MODEL
"""
from supo_jax.agent.context import ContextConfig
from supo_jax.config import (Config, EnvSection, ModelSection, OptimSection, RolloutSection,
                             TrainSection)


def config() -> Config:
    return Config(
        model=ModelSection(path="", dtype="float32", compute_dtype="bfloat16", remat="full"),
        env=EnvSection(name="search", knobs={"corpus_size": 100_000, "hops": [3, 6]},
                       train_tasks=4096, eval_tasks=128),
        context=ContextConfig(manager="supo", working_context=65536, max_summaries=2,
                              max_steps=100, max_action_tokens=1024, max_summary_tokens=2048,
                              max_observation_tokens=4096),
        rollout=RolloutSection(tasks_per_step=64, group_size=8, rows=128),
        optim=OptimSection(lr=1e-6, minibatch_rows=128, micro=16),
        train=TrainSection(steps=160, save_every=10, eval_every=20, run_dir="runs/paper_search_supo",
                           eval_max_summaries=(0, 2, 5, 11, 23), sft_warm_start=False),
    )
