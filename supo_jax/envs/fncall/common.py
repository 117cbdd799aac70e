"""What every fncall family shares: the FncallEnv base class (episode, probe, summary
parsing, call bookkeeping, the family and expert hooks) and small helpers for tool schemas,
state text and random keys."""
from __future__ import annotations

import itertools
import random
import re

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, error_result
from supo_jax.text.parsing import extract_summary
from supo_jax.text.reading import MAX_SUMMARY_CHARS

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
    def subtask(cls, p: dict, s: dict) -> str | None:
        """Families made of independent sub-tasks: the one the state is in ("" once all are
        done), so an expert under fold opens a branch per sub-task; None: no sub-tasks."""
        return None

    @classmethod
    def repair(cls, p: dict, s: dict) -> dict:
        """Make a state pieced together from an imperfect summary usable."""
        return s


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
