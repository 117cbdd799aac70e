"""Function-calling suite in the spirit of CodeGym (SUPO.md §8).

Procedurally generated families whose solution takes ~n atomic tool calls (one per
turn) and a loop state carried across them. Observations are a few dozen characters,
so a horizon of n steps overflows a working context of about n*40 tokens and the
agent must summarize its loop state to finish. Reward: 1.0 for the exact answer via
finish(answer), else 0.0.

family    tools                      answer                       loop state (summary keys)
tallest   compare(i, j)              index of the tallest person  best=<index>; next=<index>
pages     read_page(page)            sum of the n page numbers    sum=<int>; next=<page>
chain     lookup(key)                key reached after n hops     key=<key>; hops=<int>
graph     neighbors(node)            BFS distance source->target  layer=<int>; todo=[..];
                                                                  next_layer=[..]; seen=[..]
count     look(i)                    red items of a hidden-length count=<int>; next=<index>;
                                     row                          last=<index or -1>
listing   read_page(page)            one key's value in n pages   next=<page>; value=<int or -1>
                                     of 4 entries

The knob n is: people / pages / hops / nodes / items / pages. `fncall` (the mixture) draws
from the first four; count and listing run as `fncall/count` and `fncall/listing`. For "graph" the state is the BFS state
(nodes expanded layer by layer in ascending order; `seen` lists every node found),
about 3n tokens, so keep n <= ~40 there; the target is a node farthest from the source,
so the search expands most of the graph.

Canonical state and probe: each env computes, from the calls the agent has made so far,
the state of the family's canonical algorithm (linear scan / prefix read / chain walk /
BFS) that those calls have completed (e.g. tallest: next = smallest person never
compared except 0, best = tallest among the people compared). `probe(summary)` is True
iff the summary states every key, each key with a single value, and the values equal the
canonical state after the last or the second-to-last `act` (SUPO drops the overflowing
action from the summarizer's context, though the env ran it). Keys are matched
case-insensitively as `key=value` or `key: value`; list values are sets of ints.

`expert_for(env_name)` returns a scripted Expert that plays the canonical algorithm from
the working context alone (prompt, latest summary, observations after it).
"""
from __future__ import annotations

import itertools
import random
import re
from collections import deque
from functools import partial

from supo_jax.envs.base import (Environment, Reset, StepResult, ToolSpec, error_result,
                                register_env)
from supo_jax.envs.experts import register_expert
from supo_jax.text.parsing import extract_summary, format_tool_call, quote
from supo_jax.text.reading import MAX_SUMMARY_CHARS, continuation_marker, read_context
from supo_jax.text.templates import CONTINUATION

FAMILIES = ("tallest", "pages", "chain", "graph")
_VALUE = {"int": r"(-?\d{1,9})\b", "str": r"['\"]?([A-Za-z0-9]{1,64})",
          "ints": r"\[([^\[\]]*)\]"}  # no "[" inside: a scan stops at the next list


def _params(**props) -> dict:
    """JSON-schema object with every property required; props: name -> (type, description)."""
    return {"type": "object", "required": list(props),
            "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()}}


def _finish(type_: str, what: str) -> ToolSpec:
    return ToolSpec("finish", f"Submit the final answer: {what}. Ends the task.",
                    _params(answer=(type_, what)))


def format_state(state: dict, keys) -> str:
    """'best=7; next=12' (lists as [a, b, c])."""
    fmt = lambda v: "[" + ", ".join(map(str, v)) + "]" if isinstance(v, list) else str(v)
    return "; ".join(f"{k}={fmt(state[k])}" for k in keys)


class FncallEnv(Environment):
    """One family. Subclasses define the hidden task (generate), the tools (_call), the
    canonical state (state) and the expert policy (parse_prompt/initial_state/update/
    decide), which only ever sees text the agent sees."""
    family: str = ""
    state_keys: dict[str, str] = {}          # summary key -> "int" | "str" | "ints"
    size_range: tuple[int, int] = (1, 10_000)
    default_size: int = 24

    def __init__(self):
        self._task = None
        self._done = False
        self._trace: list[dict] = []  # canonical state before and after the last act

    @property
    def name(self) -> str:
        return f"fncall/{self.family}"

    # ---- episode -------------------------------------------------------------------
    def reset(self, task: dict) -> Reset:
        if task.get("family") != self.family:
            raise ValueError(f"{self.name} cannot run a task of family {task.get('family')!r}")
        self._task, self.n, self._done = task, task["n"], False
        self._visited: set = set()
        self._setup()
        self._trace = [self.state()]
        self._initial = self._trace[0]
        return Reset(prompt=self.prompt(), tools=list(self.tools))

    def step(self, name: str, arguments: dict) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        if name == self.answer_tool:
            self._done = True
            correct = arguments["answer"] == self._task["answer"]
            return StepResult("Answer submitted.", done=True, reward=float(correct),
                              info={"correct": correct})
        return self._call(name, arguments)

    def act(self, text: str) -> StepResult:
        result = super().act(text)
        self._trace = [self._trace[-1], self.state()]  # the probe needs the last two
        return result

    def probe(self, summary: str) -> bool | None:
        """Whether the summary states the loop state exactly (before or after the last act);
        None before any progress (a summary of the initial state proves nothing)."""
        if self._task is None or not isinstance(summary, str):
            return None
        if all(s == self._initial for s in self._trace):
            return None
        summary = summary[:MAX_SUMMARY_CHARS]
        found = self.parse_state(extract_summary(summary) or summary)
        return len(found) == len(self.state_keys) and found in self._trace

    @classmethod
    def parse_state(cls, text: str) -> dict:
        """The state keys stated in text with one unambiguous value each (others left out)."""
        out = {}
        for key, kind in cls.state_keys.items():
            values = set()
            for m in re.finditer(rf"\b{key}\s*[=:]\s*{_VALUE[kind]}", text, re.I):
                v = m.group(1)
                if kind == "int":
                    v = int(v)
                elif kind == "ints":
                    items = [x.strip() for x in v.split(",") if x.strip()]
                    if not all(re.fullmatch(r"\d{1,9}", x) for x in items):
                        values.add(None)
                        continue
                    v = tuple(sorted({int(x) for x in items}))
                values.add(v)
            if len(values) == 1 and None not in values:
                v = values.pop()
                out[key] = list(v) if kind == "ints" else v
        return out

    def _visit(self, i: int, lo: int, hi: int, what: str) -> StepResult | None:
        """Record a call on item i; the error observation instead when i is outside lo..hi."""
        if not lo <= i <= hi:
            return error_result(f"{what} are numbered {lo} to {hi}")
        self._visited.add(i)
        return None

    def _first_unvisited(self, lo: int) -> int:
        return next(k for k in itertools.count(lo) if k not in self._visited)

    # ---- family hooks --------------------------------------------------------------
    @staticmethod
    def generate(rng: random.Random, n: int) -> dict:
        """Hidden task data for difficulty n, including "answer"."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Derive lookup structures from self._task; reset the call history."""

    def prompt(self) -> str:
        raise NotImplementedError

    def _call(self, name: str, arguments: dict) -> StepResult:
        raise NotImplementedError

    def state(self) -> dict:
        """Canonical loop state completed by the calls made so far."""
        raise NotImplementedError

    # ---- expert hooks (text-only: never read hidden task data) -----------------------
    prompt_pattern: str = ""     # a regex the family's prompts match; named groups: integers
    start: dict = {}             # the initial loop state, where it does not depend on the prompt

    @classmethod
    def parse_prompt(cls, prompt: str) -> dict | None:
        """The task's parameters read from its prompt (None: not this family's prompt)."""
        if not cls.prompt_pattern:
            raise NotImplementedError
        m = re.search(cls.prompt_pattern, prompt, re.S)
        return m and {k: int(v) for k, v in m.groupdict().items()}

    @classmethod
    def initial_state(cls, p: dict) -> dict:
        return dict(cls.start)

    @classmethod
    def update(cls, p: dict, s: dict, observation: str) -> dict:
        raise NotImplementedError

    @classmethod
    def decide(cls, p: dict, s: dict) -> tuple[str, str, dict]:
        """(thought, tool name, arguments) of the next call."""
        raise NotImplementedError


    @classmethod
    def repair(cls, p: dict, s: dict) -> dict:
        """Make a state pieced together from an imperfect summary usable."""
        return s


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



class Pages(FncallEnv):
    family = "pages"
    state_keys = {"sum": "int", "next": "int"}
    prompt_pattern = r"A document has (?P<n>\d+) pages"
    start = {"sum": 0, "next": 1}

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
        p = a["page"]
        err = self._visit(p, 1, self.n, "pages")
        return err or StepResult(f"Page {p} reads {self._task['values'][p - 1]}.")

    def state(self):
        nxt = self._first_unvisited(1)
        return {"sum": sum(self._task["values"][:nxt - 1]), "next": nxt}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Page (\d+) reads (-?\d+)\.", obs)
        if m and int(m.group(1)) == s["next"]:
            return {"sum": s["sum"] + int(m.group(2)), "next": s["next"] + 1}
        return s

    @classmethod
    def decide(cls, p, s):
        if s["next"] > p["n"]:
            return f"All pages are read; the sum is {s['sum']}.", "finish", {"answer": s["sum"]}
        return (f"Sum so far: {s['sum']}. Read page {s['next']}.", "read_page",
                {"page": s["next"]})



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


_KEY_CHARS = "abcdefghijkmnpqrstuvwxyz23456789"


def _distinct_keys(rng: random.Random, m: int) -> list[str]:
    """m distinct random 4-character keys."""
    keys, seen = [], set()
    while len(keys) < m:
        k = "".join(rng.choice(_KEY_CHARS) for _ in range(4))
        if k not in seen:
            seen.add(k)
            keys.append(k)
    return keys


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



class Graph(FncallEnv):
    family = "graph"
    state_keys = {"layer": "int", "todo": "ints", "next_layer": "ints", "seen": "ints"}
    prompt_pattern = (r"An undirected graph has (?P<n>\d+) nodes.*?shortest path from node "
                      r"(?P<source>\d+) to node (?P<target>\d+)\.")
    size_range = (2, 2_000)
    default_size = 16
    tools = (ToolSpec("neighbors", "List the neighbors of a node.",
                      _params(node=("integer", "a node"))),
             _finish("integer", "the number of edges on a shortest path"))

    @staticmethod
    def generate(rng, n):
        label = list(range(n))
        rng.shuffle(label)
        edges = {tuple(sorted((label[i], label[rng.randrange(i)]))) for i in range(1, n)}
        for _ in range(n // 3):  # a few extra edges: cycles, several shortest paths
            a, b = rng.sample(range(n), 2)
            edges.add((min(a, b), max(a, b)))
        edges = sorted(edges)
        source = rng.randrange(n)
        dist = _bfs(_adjacency(n, edges), source)
        far = max(dist.values())
        target = rng.choice(sorted(v for v, d in dist.items() if d == far))
        return {"edges": [list(e) for e in edges], "source": source, "target": target,
                "answer": far}

    def _setup(self):
        self._adj = _adjacency(self.n, self._task["edges"])
        self._dist = _bfs(self._adj, self._task["source"])
        self._expanded = set()

    def prompt(self):
        t = self._task
        return (f"An undirected graph has {self.n} nodes numbered 0 to {self.n - 1}. Find the "
                f"number of edges on a shortest path from node {t['source']} to node "
                f"{t['target']}. neighbors(node) lists the neighbors of a node. Make one call "
                "per turn and call finish with the length. If asked to summarize, state the "
                "breadth-first search as layer=<distance being expanded>; todo=[nodes of that "
                "layer not yet expanded]; next_layer=[nodes found at distance layer+1]; "
                "seen=[all nodes found].")

    def _call(self, name, a):
        x = a["node"]
        if not 0 <= x < self.n:
            return error_result(f"nodes are numbered 0 to {self.n - 1}")
        self._expanded.add(x)
        return StepResult(f"Node {x} neighbors: {', '.join(map(str, self._adj[x]))}.")

    def state(self):
        seen = {self._task["source"]}.union(*(self._adj[x] for x in self._expanded))
        frontier = seen - self._expanded
        layer = min((self._dist[v] for v in frontier), default=max(self._dist.values()) + 1)
        at = lambda d: sorted(v for v in frontier if self._dist[v] == d)
        return {"layer": layer, "todo": at(layer), "next_layer": at(layer + 1),
                "seen": sorted(seen)}

    @classmethod
    def initial_state(cls, p):
        return {"layer": 0, "todo": [p["source"]], "next_layer": [], "seen": [p["source"]]}

    @classmethod
    def update(cls, p, s, obs):
        m = re.search(r"Node (\d+) neighbors: ([\d, ]*)\.", obs)
        if not m or int(m.group(1)) not in s["todo"]:
            return s
        new = {int(v) for v in m.group(2).split(",") if v.strip()} - set(s["seen"])
        s = {"layer": s["layer"], "todo": [v for v in s["todo"] if v != int(m.group(1))],
             "next_layer": sorted(set(s["next_layer"]) | new), "seen": sorted(set(s["seen"]) | new)}
        if not s["todo"]:  # layer done: the next layer becomes the one to expand
            s = {"layer": s["layer"] + 1, "todo": s["next_layer"], "next_layer": [],
                 "seen": s["seen"]}
        return s

    @classmethod
    def decide(cls, p, s):
        t = p["target"]
        if t in s["seen"] or not s["todo"]:
            d = s["layer"] if t in s["todo"] else s["layer"] + 1
            return f"Node {t} is at distance {d}.", "finish", {"answer": d}
        return (f"Layer {s['layer']}: expand node {s['todo'][0]}.", "neighbors",
                {"node": s["todo"][0]})



def _adjacency(n: int, edges) -> list[list[int]]:
    adj = [set() for _ in range(n)]
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    return [sorted(s) for s in adj]


def _bfs(adj, source: int) -> dict[int, int]:
    dist, queue = {source: 0}, deque([source])
    while queue:
        x = queue.popleft()
        for y in adj[x]:
            if y not in dist:
                dist[y] = dist[x] + 1
                queue.append(y)
    return dist


# `fncall` (the mixture) draws from FAMILIES; every family here is also `fncall/<family>`
FAMILY_ENVS: dict[str, type[FncallEnv]] = {c.family: c for c in (Tallest, Pages, Chain, Graph,
                                                                  Count, Listing)}


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


register_env("fncall", tasks=generate_tasks)(Fncall)
for _f, _cls in FAMILY_ENVS.items():
    register_env(f"fncall/{_f}", tasks=partial(generate_tasks, families=(_f,),
                                               _stream=f"fncall/{_f}"))(_cls)


class Expert:
    """Scripted policy for fncall tasks that reads only the working context.

    act(messages, summarize) -> action text. messages: chat dicts (user / assistant / tool).
    The task comes from the user prompt; the anchor is the last user message holding the
    continuation marker (the fixed sentence of `continuation` before "{summary}"; the text
    after it is the previous summary, <summary> tags optional), else the first user
    message. The loop state is the family's initial state, overwritten by the keys the
    summary states, then advanced by the "tool" messages after the anchor.
    summarize=True returns "<summary>...</summary>"; with probability summary_drop one state
    key is left out on purpose (a resumed expert then takes that key's initial value).
    """

    def __init__(self, families=tuple(FAMILY_ENVS.values()), summary_drop: float = 0.0,
                 seed: int = 0, continuation: str = CONTINUATION):
        self.families = tuple(families)
        self.summary_drop = summary_drop
        self.rng = random.Random(seed)
        self.marker = continuation_marker(continuation)
        self.dropped = 0  # summaries made imperfect so far

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        prompt, summary, observations = read_context(messages, self.marker)
        for fam in self.families:
            if (p := fam.parse_prompt(prompt)) is not None:
                break
        else:
            raise ValueError(f"no fncall family matches the prompt {quote(prompt)}")
        s = fam.initial_state(p)
        if summary is not None:
            s = fam.repair(p, {**s, **fam.parse_state(summary)})
        for o in observations:
            s = fam.repair(p, fam.update(p, s, o))
        thought, name, args = fam.decide(p, s)
        if not summarize:
            return f"{thought}\n{format_tool_call(name, args)}"
        keys = list(fam.state_keys)
        if self.summary_drop > 0 and self.rng.random() < self.summary_drop:
            keys.remove(self.rng.choice(keys))
            self.dropped += 1
            return f"<summary>State: {format_state(s, keys)}.</summary>"
        todo = f"{name}({', '.join(repr(v) for v in args.values())})"
        return f"<summary>State: {format_state(s, keys)}. Next: {todo}.</summary>"


def expert_for(env_name: str, **kwargs) -> Expert:
    """Expert for "fncall" (any family) or "fncall/<family>"; kwargs: summary_drop, seed."""
    if env_name == "fncall":
        return Expert(**kwargs)
    fam = env_name.removeprefix("fncall/")
    if not env_name.startswith("fncall/") or fam not in FAMILY_ENVS:
        raise ValueError(f"no expert for {env_name!r}; fncall envs: fncall, "
                         + ", ".join(f"fncall/{f}" for f in FAMILY_ENVS))
    return Expert(families=(FAMILY_ENVS[fam],), **kwargs)


register_expert("fncall", expert_for, prefix=True)
