"""tallest: find the tallest of n people with compare(i, j); loop state best=<index>;
next=<index>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import FncallEnv, _finish, _params


class Tallest(FncallEnv):
    family = "tallest"
    state_keys = {"best": "int", "next": "int"}
    prompt_pattern = r"Find the tallest of (?P<n>\d+) people"
    start = {"best": 0, "next": 1}
    size_range = (2, 700)
    tools = (ToolSpec("compare", "Tell which of two people is taller.",
                      _params(i=("integer", "index of a person"),
                              j=("integer", "index of another person"))),
             _finish("integer", "the index of the tallest person"))

    @staticmethod
    def generate(rng, n):
        heights = rng.sample(range(1400, 2200), n)  # mm, distinct: no ties
        return {"heights": heights, "answer": heights.index(max(heights))}

    def _setup(self):
        self._seen = {0}  # person 0 starts the scan as the best so far

    def prompt(self):
        n = self.n
        return (f"Find the tallest of {n} people, numbered 0 to {n - 1}. Heights are hidden: "
                "compare(i, j) tells which of two people is taller. Make one call per turn and "
                "call finish with the index of the tallest person. If asked to summarize, "
                "state the scan as best=<index>; next=<index>.")

    def _call(self, name, a):
        i, j = a["i"], a["j"]
        if not (0 <= i < self.n and 0 <= j < self.n):
            return error_result(f"people are numbered 0 to {self.n - 1}")
        if i == j:
            return error_result("compare two different people")
        self._seen |= {i, j}
        h = self._task["heights"]
        w, l = (i, j) if h[i] > h[j] else (j, i)
        return StepResult(f"Person {w} is taller than person {l}.")

    def state(self):
        nxt = next(k for k in range(self.n + 1) if k not in self._seen)
        h = self._task["heights"]
        return {"best": max(self._seen, key=h.__getitem__), "next": nxt}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Person (\d+) is taller than person (\d+)\.", obs)
        if m and {int(m.group(1)), int(m.group(2))} == {s["best"], s["next"]}:
            return {"best": int(m.group(1)), "next": s["next"] + 1}
        return s

    @classmethod
    def decide(cls, p, s):
        if s["next"] >= p["n"]:
            return f"Everyone is compared; person {s['best']} is the tallest.", "finish", {
                "answer": s["best"]}
        return (f"Best so far: person {s['best']}. Compare with person {s['next']}.",
                "compare", {"i": s["best"], "j": s["next"]})

    @classmethod
    def repair(cls, p, s):
        # a summary without `next` restarts the scan at 1, which then meets the best itself
        return {**s, "next": s["next"] + 1} if s["next"] == s["best"] else s
