"""pages: the sum of the numbers on n pages, read with read_page(page); loop state
sum=<int>; next=<page>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec
from supo_jax.envs.fncall.common import FncallEnv, _finish, _params


class Pages(FncallEnv):
    family = "pages"
    state_keys = {"sum": "int", "next": "int"}
    prompt_pattern = r"A document has (?P<n>\d+) pages"
    start = {"sum": 0, "next": 1}
    item = "page"                               # what read_<item>(<item>) reads
    reading = r"Page (\d+) reads (-?\d+)\."    # an observation: (item, value)

    tools = (ToolSpec("read_page", "Read one page of the document.",
                      _params(page=("integer", "page number, from 1"))),
             _finish("integer", "the sum of the numbers on all pages"))

    @staticmethod
    def generate(rng, n):
        values = [rng.randint(1, 99) for _ in range(n)]
        return {"values": values, "answer": sum(values)}

    def prompt(self):
        n = self.n
        return (f"A document has {n} pages, numbered 1 to {n}, and each page shows one number. "
                f"Find the sum of all {n} numbers. read_page(page) shows one page. Make one "
                "call per turn and call finish with the sum. If asked to summarize, state the "
                "progress as sum=<sum of the pages read>; next=<next page to read>.")

    def _call(self, name, a):
        p = a[self.item]
        err = self._visit(p, 1, self.n, f"{self.item}s")
        return err or StepResult(f"Page {p} reads {self._task['values'][p - 1]}.")

    def state(self):
        nxt = self._first_unvisited(1)
        return {"sum": sum(self._task["values"][:nxt - 1]), "next": nxt}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(cls.reading, obs)
        if m and int(m.group(1)) == s["next"]:
            return {"sum": s["sum"] + int(m.group(2)), "next": s["next"] + 1}
        return s

    @classmethod
    def decide(cls, p, s):
        if s["next"] > p["n"]:
            return (f"All {cls.item}s are read; the sum is {s['sum']}.", "finish",
                    {"answer": s["sum"]})
        return (f"Sum so far: {s['sum']}. Read {cls.item} {s['next']}.", f"read_{cls.item}",
                {cls.item: s["next"]})
