"""The CPU-scale reproduction (experiments/reproduce_cpu.py): the embedded default task
(fncall/tallest, 5-9 people: 4-8 comparisons whose history overflows W = 446 tokens, so the
agent must summarize), with imperfect demonstration summaries and a larger eval split."""
import dataclasses

from supo_jax.config import Config


def config() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        env=dataclasses.replace(base.env, eval_tasks=32),
        train=dataclasses.replace(base.train, steps=24, save_every=8, eval_every=0, eval_samples=2,
                                  run_dir="runs/cpu_reproduce"),
        # a quarter of the demonstration summaries leave one state key out: the SFT policy
        # learns summaries that sometimes lose the scan, which RL can then fix; a third of the
        # demonstrations hold the whole history in one context of W * (S + 1), so the starting
        # policy can act in the long contexts of the GRPO baseline too (as an instruct model can)
        sft=dataclasses.replace(base.sft, summary_drop=0.25, full_context_demos=0.34),
    )
