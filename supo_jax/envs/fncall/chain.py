"""chain: the key reached after n hops through a hidden table, one lookup(key) per hop; loop
state key=<key>; hops=<int>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import FncallEnv, _distinct_keys, _finish, _params
from supo_jax.text.parsing import quote


class Chain(FncallEnv):
    family = "chain"
    state_keys = {"key": "str", "hops": "int"}
    size_range = (1, 5_000)
    tools = (ToolSpec("lookup", "Look up the key that a key points to.",
                      _params(key=("string", "a key"))),
             _finish("string", "the key reached after the required number of lookups"))

    @staticmethod
    def generate(rng, n):
        # the chain goes on past n hops, so the agent has to count them
        keys = _distinct_keys(rng, n + 1 + rng.randint(3, 8))
        return {"chain": keys, "answer": keys[n]}

    def _setup(self):
        c = self._task["chain"]
        self._table = dict(zip(c[:-1], c[1:]))
        self._looked = set()

    def prompt(self):
        return (f"A hidden table maps keys to keys. Start from key {self._task['chain'][0]} "
                f"and follow the table {self.n} times: lookup(key) returns the key it points "
                f"to. Make one call per turn and call finish with the key reached after exactly "
                f"{self.n} lookups. If asked to summarize, state the progress as "
                "key=<current key>; hops=<lookups done>.")

    def _call(self, name, a):
        k = a["key"]
        if k not in self._table:
            return error_result(f"no entry for key {quote(k, 40)}")
        self._looked.add(k)
        return StepResult(f"Key {k} points to {self._table[k]}.")

    def state(self):
        c, h = self._task["chain"], 0
        while h < len(c) - 1 and c[h] in self._looked:
            h += 1
        return {"key": c[h], "hops": h}

    @classmethod
    def parse_prompt(cls, prompt):
        m = re.search(r"Start from key (\w+) and follow the table (\d+) times", prompt)
        return m and {"start": m.group(1), "n": int(m.group(2))}

    @classmethod
    def initial_state(cls, p):
        return {"key": p["start"], "hops": 0}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Key (\w+) points to (\w+)\.", obs)
        if m and m.group(1) == s["key"]:
            return {"key": m.group(2), "hops": s["hops"] + 1}
        return s

    @classmethod
    def decide(cls, p, s):
        if s["hops"] >= p["n"]:
            return f"{s['hops']} lookups done; the key is {s['key']}.", "finish", {
                "answer": s["key"]}
        return (f"{s['hops']} lookups done. Look up {s['key']}.", "lookup", {"key": s["key"]})
