"""count: the red items of a row of hidden length, seen one at a time with look(i); loop state
count=<int>; next=<index>; last=<index or -1>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import FncallEnv, _finish, _params


class Count(FncallEnv):
    """Count the red items of a row whose length is hidden: only the observations say where it
    ends, so neither the number of calls nor the answer can be guessed without reading them."""
    family = "count"
    state_keys = {"count": "int", "next": "int", "last": "int"}
    prompt_pattern = r"Count the red items"
    start = {"count": 0, "next": 0, "last": -1}
    size_range = (1, 5_000)
    default_size = 12
    tools = (ToolSpec("look", "Show the colour of one item.",
                      _params(i=("integer", "index of an item, from 0"))),
             _finish("integer", "the number of red items"))

    @staticmethod
    def generate(rng, n):
        colours = [rng.choice(("red", "blue")) for _ in range(n)]
        return {"colours": colours, "answer": colours.count("red")}

    def _setup(self):
        self._looked, self._end_known = set(), False

    def prompt(self):
        return ("A row of items is numbered from 0; its length is hidden. look(i) shows the "
                "colour of item i and says when it is the last item. Count the red items. Make "
                "one call per turn and call finish with the number of red items. If asked to "
                "summarize, state the progress as count=<red items seen>; next=<next item>; "
                "last=<index of the last item, -1 while unknown>.")

    def _call(self, name, a):
        i, colours = a["i"], self._task["colours"]
        if i < 0:
            return error_result("items are numbered from 0")
        if i >= self.n:     # out of range, and it tells where the row ends
            self._end_known = True
            return error_result(f"there is no item {i}: the row has items 0 to {self.n - 1}")
        self._looked.add(i)
        self._end_known |= i == self.n - 1
        last = " It is the last item." if i == self.n - 1 else ""
        return StepResult(f"Item {i} is {colours[i]}.{last}")

    def state(self):
        nxt = next(k for k in range(self.n + 1) if k not in self._looked)
        return {"count": self._task["colours"][:nxt].count("red"), "next": nxt,
                "last": self.n - 1 if self._end_known else -1}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Item (\d+) is (red|blue)\.( It is the last item\.)?", obs)
        if m and int(m.group(1)) == s["next"]:
            k = int(m.group(1))
            return {"count": s["count"] + (m.group(2) == "red"), "next": k + 1,
                    "last": k if m.group(3) else s["last"]}
        m = re.search(r"there is no item \d+: the row has items 0 to (\d+)", obs)
        return {**s, "last": int(m.group(1))} if m else s

    @classmethod
    def decide(cls, p, s):
        if 0 <= s["last"] < s["next"]:
            return (f"The row is done; {s['count']} items are red.", "finish",
                    {"answer": s["count"]})
        return (f"Red so far: {s['count']}. Look at item {s['next']}.", "look", {"i": s["next"]})
