"""SUPO.md §8 CodeGym-style setup on a TPU pod: Qwen2.5-7B-Instruct, W = 4K, S = 7, H = 100,
128 prompts x G = 8 per step, lr 1e-6, 100 steps. Point model.path at a local HF checkout:
    supo-jax train --config experiments/configs/paper_fncall_supo.py --set model.path=/ckpt/Qwen2.5-7B-Instruct
"""
from supo_jax.agent.context import ContextConfig
from supo_jax.config import (Config, EnvSection, MeshSection, ModelSection, OptimSection,
                             RolloutSection, TrainSection)


def config() -> Config:
    return Config(
        model=ModelSection(path="", dtype="float32", compute_dtype="bfloat16", remat="full"),
        env=EnvSection(name="fncall", knobs={"size": [24, 64]}, train_tasks=12800, eval_tasks=128),
        context=ContextConfig(manager="supo", working_context=4096, max_summaries=7, max_steps=100,
                              max_action_tokens=512, max_summary_tokens=1024),
        rollout=RolloutSection(tasks_per_step=128, group_size=8, rows=256, temperature=1.0),
        optim=OptimSection(lr=1e-6, minibatch_rows=256, micro=8, ppo_epochs=1),
        train=TrainSection(steps=100, save_every=10, eval_every=10, run_dir="runs/paper_fncall_supo",
                           eval_max_summaries=(0, 7, 14, 28), sft_warm_start=False),
        mesh=MeshSection(data=1, fsdp=-1, tensor=1),
    )
