"""sections: the largest section total of a document of n sections of 6 pages, read with
read_page(section, page); loop state best=<int>; section=<int>; sum=<int>; page=<int>."""
from __future__ import annotations

import re

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import FncallEnv, _finish, _params


class Sections(FncallEnv):
    """n independent sub-tasks (sum one section's pages) whose details can be dropped once each
    is done: only the best total so far carries over, so the state stays four numbers however
    far the task goes. Folding one branch per section reaches far (the main thread keeps one
    return message a section); the scripted expert under fold does that (`subtask`). Its
    default of 8 sections needs 8 branches: context.max_branches (8) covers it; raise that
    setting with the size."""
    family = "sections"
    state_keys = {"best": "int", "section": "int", "sum": "int", "page": "int"}
    prompt_pattern = r"A document has (?P<n>\d+) sections of (?P<m>\d+) pages"
    start = {"best": 0, "section": 1, "sum": 0, "page": 1}
    size_range = (1, 1_000)
    default_size = 8
    per_section = 6
    tools = (ToolSpec("read_page", "Read one page of one section.",
                      _params(section=("integer", "section number, from 1"),
                              page=("integer", "page number within the section, from 1"))),
             _finish("integer", "the largest section total"))

    @classmethod
    def generate(cls, rng, n):
        values = [[rng.randint(1, 99) for _ in range(cls.per_section)] for _ in range(n)]
        return {"values": values, "answer": max(map(sum, values))}

    def prompt(self):
        n, m = self.n, self.per_section
        return (f"A document has {n} sections of {m} pages each, and each page shows one "
                f"number. A section's total is the sum of its {m} numbers. Find the largest "
                "section total. read_page(section, page) shows one page. Make one call per "
                "turn and call finish with the largest total. If asked to summarize, state the "
                "progress as best=<largest total of the sections done>; section=<section being "
                "read>; sum=<its total so far>; page=<next page of it to read>.")

    def _call(self, name, a):
        sec, page, m = a["section"], a["page"], self.per_section
        if not (1 <= sec <= self.n and 1 <= page <= m):
            return error_result(f"sections are numbered 1 to {self.n}, pages 1 to {m}")
        self._visited.add((sec - 1) * m + page - 1)
        return StepResult(f"Section {sec} page {page} reads "
                          f"{self._task['values'][sec - 1][page - 1]}.")

    def state(self):
        m, values = self.per_section, self._task["values"]
        k = self._first_unvisited(0)         # pages read in order, as one flat index
        done, at = divmod(min(k, self.n * m), m)
        return {"best": max((sum(v) for v in values[:done]), default=0), "section": done + 1,
                "sum": sum(values[done][:at]) if done < self.n else 0, "page": at + 1}

    @classmethod
    def update(cls, p, s, obs):
        got = re.search(r"Section (\d+) page (\d+) reads (-?\d+)\.", obs)
        if not got or (int(got.group(1)), int(got.group(2))) != (s["section"], s["page"]):
            return s
        total = s["sum"] + int(got.group(3))
        if s["page"] < p["m"]:
            return {**s, "sum": total, "page": s["page"] + 1}
        return {"best": max(s["best"], total), "section": s["section"] + 1, "sum": 0, "page": 1}

    @classmethod
    def decide(cls, p, s):
        if s["section"] > p["n"]:
            return (f"All sections are read; the largest total is {s['best']}.", "finish",
                    {"answer": s["best"]})
        return (f"Best {s['best']}; section {s['section']} at {s['sum']}.", "read_page",
                {"section": s["section"], "page": s["page"]})

    @classmethod
    def subtask(cls, p, s):
        return f"section {s['section']}" if s["section"] <= p["n"] else ""
