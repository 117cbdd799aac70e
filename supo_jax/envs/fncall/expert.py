"""The scripted fncall expert: plays each family's canonical algorithm from the working context."""
from __future__ import annotations

import random

from supo_jax.envs.fncall.common import format_state
from supo_jax.envs.fncall.suite import FAMILY_ENVS
from supo_jax.text.parsing import format_tool_call, quote
from supo_jax.text.reading import asks_for_state, continuation_marker, read_context
from supo_jax.text.templates import CONTINUATION


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
    Where the prompt asks for <state></state> blocks (context.manager=state), every action
    begins with one (the summary's text; the last one read back as the summary).
    """

    def __init__(self, families=tuple(FAMILY_ENVS.values()), summary_drop: float = 0.0,
                 seed: int = 0, continuation: str = CONTINUATION):
        self.families = tuple(families)
        self.summary_drop = summary_drop
        self.rng = random.Random(seed)
        self.marker = continuation_marker(continuation)
        self.dropped = 0  # summaries made imperfect so far

    def _state(self, messages: list[dict]):
        """(family, task parameters, loop state) read from the working context."""
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
        return fam, p, s

    def subtask(self, messages: list[dict]) -> str | None:
        """The sub-task the context is in ("" once all are done; None: the family has none):
        FoldingExpert opens a branch per sub-task."""
        fam, p, s = self._state(messages)
        return fam.subtask(p, s)

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        fam, p, s = self._state(messages)
        thought, name, args = fam.decide(p, s)
        if not summarize:
            call = f"{thought}\n{format_tool_call(name, args)}"
            if asks_for_state(messages):
                todo = f"{name}({', '.join(repr(v) for v in args.values())})"
                return (f"<state>State: {format_state(s, fam.state_keys)}. Next: {todo}."
                        f"</state>\n{call}")
            return call
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
