"""A second new task family for the CPU recipe (issue: tasks nobody tuned for): `fncall/listing`,
one key's value in a listing of 5-10 pages of four key=value entries. The page holding the key
is uniform, so the number of calls varies and cannot be guessed; observations are long and the
state is small (next page, the value once found), the opposite shape of `count`. At W = 512
the scripted expert solves 41% under `full` and 97% under SUPO with S = 3. Every other setting
is the reproduction's (experiments/configs/cpu_reproduce.py): nothing is tuned for this task."""
import dataclasses

from supo_jax.config import Config

from cpu_reproduce import config as reproduce_config


def config() -> Config:
    base = reproduce_config()
    return dataclasses.replace(
        base,
        env=dataclasses.replace(base.env, name="fncall/listing", knobs={"size": [5, 10]}),
        train=dataclasses.replace(base.train, run_dir="runs/cpu_listing"),
    )
