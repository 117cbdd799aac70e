"""The suite: the family table, the `fncall` mixture env (each task runs in its family's env)
and task generation (the same tasks for the same (stream, split, seed))."""
from __future__ import annotations

import random

from supo_jax.envs.base import Environment, Reset
from supo_jax.envs.fncall.chain import Chain
from supo_jax.envs.fncall.common import FncallEnv
from supo_jax.envs.fncall.count import Count
from supo_jax.envs.fncall.graph import Graph
from supo_jax.envs.fncall.listing import Listing
from supo_jax.envs.fncall.pages import Pages
from supo_jax.envs.fncall.records import Records
from supo_jax.envs.fncall.reports import Reports
from supo_jax.envs.fncall.sections import Sections
from supo_jax.envs.fncall.tallest import Tallest

FAMILIES = ("tallest", "pages", "chain", "graph")
# `fncall` (the mixture) draws from FAMILIES; every family here is also `fncall/<family>`
FAMILY_ENVS: dict[str, type[FncallEnv]] = {c.family: c for c in (Tallest, Pages, Chain, Graph,
                                                                  Count, Listing, Reports,
                                                                  Sections, Records)}


class Fncall(Environment):
    """All families: each task runs in the env of its "family"."""
    name = "fncall"

    def __init__(self):
        self._env: FncallEnv | None = None

    @property
    def tools(self):
        return self._env.tools if self._env is not None else ()

    def reset(self, task: dict) -> Reset:
        if task.get("family") not in FAMILY_ENVS:
            raise ValueError(f"unknown fncall family {task.get('family')!r}")
        self._env = FAMILY_ENVS[task["family"]]()
        self._env.call_formats = self.call_formats   # the policy's call forms (set on this env)
        return self._env.reset(task)

    def _require(self) -> FncallEnv:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        return self._env

    def step(self, name, arguments):
        return self._require().step(name, arguments)

    def act(self, text):
        return self._require().act(text)

    def probe(self, summary):
        return None if self._env is None else self._env.probe(summary)


def generate_tasks(split: str, n: int, seed: int = 0, families=FAMILIES,
                   size: int | tuple[int, int] | None = None, *, _stream: str = "fncall"):
    """n tasks: family sampled uniformly from `families`; size is the difficulty n (int,
    inclusive (lo, hi) range, or None for each family's default). Each task is drawn from
    its own RNG seeded by (stream, split, seed, index): train and eval never share one.

    Task dict: {"task_id", "family", "n", "answer", <hidden data>} (JSON-serializable).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    families = tuple(families)
    for f in families:
        if f not in FAMILY_ENVS:
            raise ValueError(f"unknown fncall family {f!r}; choose from {FAMILIES}")
    if isinstance(size, (tuple, list)) and (len(size) != 2 or size[0] > size[1]):
        raise ValueError(f"size {list(size)}: an int, or a range [low, high] with low <= high")
    tasks = []
    for i in range(n):
        task_id = f"{_stream}:{split}:{seed}:{i}"
        rng = random.Random(task_id)  # str seeds are hashed stably (sha512), not per process
        cls = FAMILY_ENVS[families[0] if len(families) == 1 else rng.choice(families)]
        s = cls.default_size if size is None else size
        k = rng.randint(*s) if isinstance(s, (tuple, list)) else int(s)
        lo, hi = cls.size_range
        if not lo <= k <= hi:
            raise ValueError(f"size {k} out of range [{lo}, {hi}] for family {cls.family}")
        tasks.append({"task_id": task_id, "family": cls.family, "n": k, **cls.generate(rng, k)})
    return tasks
