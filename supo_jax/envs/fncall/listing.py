"""listing: one key's value in n pages of four key=value entries, read with read_page(page);
loop state next=<page>; value=<int or -1>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec
from supo_jax.envs.fncall.common import FncallEnv, _distinct_keys, _finish, _params


class Listing(FncallEnv):
    """Find one key's value in a listing of n pages of four key=value entries each. The page
    that holds the key is uniform, so the number of calls cannot be guessed, and only reading
    tells where it is. Long observations and a small state: the opposite shape of `count`."""
    family = "listing"
    state_keys = {"next": "int", "value": "int"}
    start = {"next": 1, "value": -1}
    size_range = (1, 2_000)
    default_size = 12
    per_page = 4
    tools = (ToolSpec("read_page", "Show the entries of one page of the listing.",
                      _params(page=("integer", "page number, from 1"))),
             _finish("integer", "the value of the key"))

    @classmethod
    def generate(cls, rng, n):
        keys = _distinct_keys(rng, n * cls.per_page)
        values = [rng.randint(10, 999) for _ in keys]
        at = rng.randrange(len(keys))
        return {"keys": keys, "values": values, "key": keys[at], "answer": values[at]}

    def _page(self, p):
        lo = (p - 1) * self.per_page
        return list(zip(self._task["keys"][lo:lo + self.per_page],
                        self._task["values"][lo:lo + self.per_page]))

    def prompt(self):
        return (f"A listing has {self.n} pages, numbered 1 to {self.n}, each with "
                f"{self.per_page} key=value entries. Find the value of key "
                f"{self._task['key']}. read_page(page) shows one page. Make one call per turn "
                "and call finish with the value. If asked to summarize, state the progress as "
                "next=<next page to read>; value=<the value once found, -1 until then>.")

    def _call(self, name, a):
        p = a["page"]
        return self._visit(p, 1, self.n, "pages") or StepResult(
            f"Page {p}: " + ", ".join(f"{k}={v}" for k, v in self._page(p)) + ".")

    def state(self):
        nxt = self._first_unvisited(1)
        found = [v for q in range(1, nxt) for k, v in self._page(q) if k == self._task["key"]]
        return {"next": nxt, "value": found[0] if found else -1}

    @classmethod
    def parse_prompt(cls, prompt):
        m = re.search(r"A listing has (\d+) pages.*?Find the value of key (\w+)\.", prompt, re.S)
        return m and {"n": int(m.group(1)), "key": m.group(2)}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Page (\d+): ([^.]*)\.", obs)
        if not m or int(m.group(1)) != s["next"]:
            return s
        entries = dict(re.findall(r"(\w+)=(\d+)", m.group(2)))
        value = int(entries[p["key"]]) if p["key"] in entries else s["value"]
        return {"next": s["next"] + 1, "value": value}

    @classmethod
    def decide(cls, p, s):
        if s["value"] >= 0 or s["next"] > p["n"]:
            return f"Key {p['key']} has value {s['value']}.", "finish", {"answer": s["value"]}
        return (f"Key {p['key']} not found yet. Read page {s['next']}.", "read_page",
                {"page": s["next"]})
