"""records: count's task (the red items of a row of hidden length) where each look(i) shows a
long inspection record, the colour first; loop state count=<int>; next=<index>; last=<index or
-1> (as count)."""
from __future__ import annotations

from supo_jax.envs.base import StepResult, ToolSpec, error_result
from supo_jax.envs.fncall.common import _finish, _params
from supo_jax.envs.fncall.count import Count
from supo_jax.envs.fncall.reports import filler


class Records(Count):
    """Count whose observations are long: item i's record states its colour in its first
    sentence, then ~100-200 tokens that say nothing the task needs (reports' filler). The
    answer is count's running tally, which a small policy can keep; a record is dead weight once
    read, so clearing old results, folding or summarizing reaches far and `full` does not. An
    observation cut at max_observation_tokens keeps the colour."""
    family = "records"
    prompt_pattern = r"Count the red items"
    size_range = (1, 2_000)
    default_size = 6
    tools = (ToolSpec("look", "Show the inspection record of one item.",
                      _params(i=("integer", "index of an item, from 0"))),
             _finish("integer", "the number of red items"))

    @staticmethod
    def generate(rng, n):
        return {**Count.generate(rng, n), "seed": rng.randrange(2 ** 31)}

    def prompt(self):
        return ("A row of items is numbered from 0; its length is hidden. look(i) shows the "
                "inspection record of item i: its colour, whether it is the last item, then "
                "notes. Count the red items. Make one call per turn and call finish with the "
                "number of red items. If asked to summarize, state the progress as "
                "count=<red items seen>; next=<next item>; last=<index of the last item, -1 "
                "while unknown>.")

    def step(self, name, arguments):
        """finish is taken only once every item up to the last has been looked at: a count
        of 5-7 items has few values (a fixed guess is right about a third of the time), so an
        answer given before reading them all is refused (an error observation; the episode
        goes on), and reward comes only from reading the row, not from guessing."""
        if name == self.answer_tool and self._task is not None and not self._done:
            s = self.state()
            if not 0 <= s["last"] < s["next"]:
                return error_result(f"finish refused: item {s['next']} has not been looked "
                                    "at; look at every item up to the last one first")
        return super().step(name, arguments)

    def _call(self, name, a):
        got = super()._call(name, a)
        if "error" in got.info:
            return got
        return StepResult(f"{got.observation} " + filler(self._task["seed"], a["i"]))
