"""The CPU-scale reproduction (experiments/reproduce_cpu.py) on `fncall/count`: count the red
items of a row of 5-9 whose length is hidden, one `look(i)` per turn. The number of calls a
rollout needs is the row's length, which only the observations reveal, and stopping early gives
a wrong count: the reward cannot be gamed by learning when to stop. At W = 512 the history
outgrows the working context (the scripted expert solves 17% under `full` at W, 100% under
SUPO with S = 3 and under `full` at W * (S + 1) = 2048). Built on the CPU recipe
(supo_jax/configs/cpu_recipe.py), with the settings its committed results were run with."""
import dataclasses

from supo_jax.config import Config
from supo_jax.configs.cpu_recipe import config as cpu_recipe


def config() -> Config:
    base = cpu_recipe()
    return dataclasses.replace(
        base,
        env=dataclasses.replace(base.env, name="fncall/count", knobs={"size": [5, 9]},
                                eval_tasks=32),
        context=dataclasses.replace(base.context, working_context=512),
        train=dataclasses.replace(base.train, steps=24, save_every=8, eval_every=0, eval_samples=2,
                                  run_dir="runs/cpu_reproduce"),
        # a quarter of the demonstration summaries leave one state key out: the SFT policy
        # learns summaries that sometimes lose the count, which RL can then fix; a third of the
        # demonstrations hold the whole history in one context of W * (S + 1), so the starting
        # policy can act in the long contexts of the GRPO baseline too (as an instruct model can)
        sft=dataclasses.replace(base.sft, summary_drop=0.25, full_context_demos=0.34,
                                steps=300),   # the 300 SFT steps the committed results used
        # the constant learning rate of 3e-4 and the one pass over each step's rollouts that the
        # committed results (experiments/results/) were run with
        optim=dataclasses.replace(base.optim, lr=3e-4, schedule="constant", ppo_epochs=1),
        # and without dynamic sampling (every group of a step trains) or a reduced weight on the
        # below-average rollouts, as they were run
        rollout=dataclasses.replace(base.rollout, dynamic_rounds=0),
        advantage=dataclasses.replace(base.advantage, negative_weight=1.0),
    )
