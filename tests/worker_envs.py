"""Environments for tests/rollout_worker.py, over fncall/pages and its tasks:

- recorded/pages: records which process reset which rollout (RESETS: task ids in order);
- faulty/pages: on process 1 only, the environments it builds fail in turn in their
  constructor, reset, step, and reward (a reward that is not a number), and one in five
  works: one host's tools failing while the other's work;
- stopping/pages: where SUPO_JAX_TEST_STOP="PROCESS:RESET:SIGNAL" is set, process PROCESS
  sends itself SIGNAL (KILL: kill -9; TERM: a preemption notice) at its RESET-th reset
  (from 1); otherwise fncall/pages.
"""
import dataclasses
import itertools
import os
import signal
import sys
import time

import jax

from supo_jax.envs.base import make_env, register_env, task_generator
from supo_jax.envs.experts import register_expert
from supo_jax.envs.fncall import expert_for

Pages = type(make_env("fncall/pages"))
RESETS: list[str] = []
FAULTS = ("init", "reset", "step", "reward", None)
_built = itertools.count()


def _tasks(split, n, seed, **knobs):
    return task_generator("fncall/pages")(split, n, seed, **knobs)


@register_env("recorded/pages", tasks=_tasks)
class RecordedPages(Pages):
    def reset(self, task):
        RESETS.append(task["task_id"])
        return super().reset(task)


@register_env("faulty/pages", tasks=_tasks)
class FaultyPages(Pages):
    def __init__(self, *args, **kwargs):
        self.fault = FAULTS[next(_built) % len(FAULTS)] if jax.process_index() == 1 else None
        if self.fault == "init":
            raise RuntimeError("injected fault: init")
        super().__init__(*args, **kwargs)

    def reset(self, task):
        if self.fault == "reset":
            raise RuntimeError("injected fault: reset")
        return super().reset(task)

    def act(self, text):
        res = super().act(text)
        if self.fault == "step":
            raise RuntimeError("injected fault: step")
        if self.fault == "reward":
            return dataclasses.replace(res, reward="injected fault: reward")
        return res


_resets = itertools.count(1)


@register_env("stopping/pages", tasks=_tasks)
class StoppingPages(Pages):
    def reset(self, task):
        n = next(_resets)
        stop = os.environ.get("SUPO_JAX_TEST_STOP")
        if stop:
            proc, at, sig = stop.split(":")
            if jax.process_index() == int(proc) and n == int(at):
                print(f"test: process {proc} sends itself SIG{sig} at {time.time()}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), getattr(signal, "SIG" + sig))
        return super().reset(task)


for _name in ("recorded/pages", "faulty/pages", "stopping/pages"):
    register_expert(_name, lambda name, **kw: expert_for("fncall/pages", **kw))
