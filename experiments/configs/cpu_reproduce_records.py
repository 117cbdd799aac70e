"""The reproduction (experiments/reproduce_cpu.py) on a task where every context manager's
scripted expert finishes and `full`'s does not, with count's learnable answer:
`fncall/records` with 5-7 items at W = 1024, observations up to 256 tokens (each record ~100-
200 tokens, the colour first, dead weight once read). There the expert solves 8/8 under supo,
state and fold, 8/8 and 7/8 under clear (5 and 7 items) and 0/8 under `full` at W
(experiments/manager_reach.py). count's own reproduction (cpu_reproduce.py, W = 512) suits
SUPO's claims but not the other managers (fold's and clear's experts solve none there), and
reports (cpu_reproduce_managers.py) asks for a sum the tiny policy never learns. Each run's
eval.json holds its manager's expert ceiling; state, fold and clear warm-start on
demonstrations their own expert recorded under them. Everything else is cpu_reproduce.py's."""
import dataclasses

from supo_jax.config import Config

from cpu_reproduce import config as cpu_reproduce  # experiments/configs/, as cpu_listing.py


def config() -> Config:
    base = cpu_reproduce()
    return dataclasses.replace(
        base,
        env=dataclasses.replace(base.env, name="fncall/records", knobs={"size": [5, 7]}),
        context=dataclasses.replace(base.context, working_context=1024,
                                    max_observation_tokens=256),
        train=dataclasses.replace(base.train, run_dir="runs/cpu_reproduce_records"),
    )
