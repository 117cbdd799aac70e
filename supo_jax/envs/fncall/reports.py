"""reports: the sum of the figures of n long reports, read with read_report(report); loop state
sum=<int>; next=<report> (as pages)."""
from __future__ import annotations

import random

from supo_jax.envs.base import StepResult, ToolSpec
from supo_jax.envs.fncall.common import _finish, _params
from supo_jax.envs.fncall.pages import Pages

# the filler: sentences of one subject, verb, object and time each, none holding a number
_SUBJECTS = ("The committee", "The auditor", "The regional office", "The survey team",
             "The board", "The north depot", "The supplier", "The night shift")
_VERBS = ("reviewed", "discussed", "postponed", "approved", "questioned", "revised", "noted",
          "archived")
_OBJECTS = ("the travel budget", "the quarterly schedule", "the safety checklist",
            "the staffing plan", "the supplier contracts", "the storage layout",
            "the printing costs", "the meeting minutes")
_WHENS = ("on Monday", "last week", "after lunch", "in the spring", "without comment",
          "at length", "before the audit", "once again")


def filler(seed: int, i: int) -> str:
    """Report i's text after its figure: 10 to 16 plausible sentences (about 100-200 tokens)
    that say nothing the task needs, the same for the same (seed, i)."""
    rng = random.Random(f"{seed}:{i}")
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                    f"{rng.choice(_WHENS)}." for _ in range(rng.randint(10, 16)))


class Reports(Pages):
    """Pages whose pages are long: each report states its figure in its first sentence, then
    goes on about nothing the task needs. Once read, a report is dead weight in the context:
    clearing old results or summarizing reaches far, keeping every result (`full`) does not.
    An observation cut at max_observation_tokens keeps the figure."""
    family = "reports"
    prompt_pattern = r"A file holds (?P<n>\d+) reports"
    item = "report"
    reading = r"Report (\d+): the figure is (-?\d+)\."
    size_range = (1, 2_000)
    default_size = 12
    tools = (ToolSpec("read_report", "Read one report of the file.",
                      _params(report=("integer", "report number, from 1"))),
             _finish("integer", "the sum of the figures of all reports"))

    @staticmethod
    def generate(rng, n):
        return {**Pages.generate(rng, n), "seed": rng.randrange(2 ** 31)}

    def prompt(self):
        n = self.n
        return (f"A file holds {n} reports, numbered 1 to {n}, and each report states one "
                f"figure. Find the sum of all {n} figures. read_report(report) shows one "
                "report. Make one call per turn and call finish with the sum. If asked to "
                "summarize, state the progress as sum=<sum of the figures read>; next=<next "
                "report to read>.")

    def _call(self, name, a):
        i = a["report"]
        return self._visit(i, 1, self.n, "reports") or StepResult(
            f"Report {i}: the figure is {self._task['values'][i - 1]}. "
            + filler(self._task["seed"], i))
