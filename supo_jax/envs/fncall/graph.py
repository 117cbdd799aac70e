"""graph: the BFS distance from a source node to a farthest target, exploring with
neighbors(node); loop state layer=<int>; todo=[..]; next_layer=[..]; seen=[..] (the BFS state:
nodes expanded layer by layer in ascending order)."""
from __future__ import annotations

import re
from collections import deque

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import FncallEnv, _finish, _params


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
