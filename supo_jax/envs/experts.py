"""Scripted experts: the registry, and `StateExpert`, the small base class for writing one.

An expert is a scripted policy with `act(messages, summarize=False) -> action text` that
reads only the working context (chat dicts: user / assistant / tool), as the model does.
Experts are optional: they make SFT demonstrations (`sft.demos=expert`) and power
`supo-jax rollout --policy scripted`; training a model policy never needs one.

    register_expert(name, factory, prefix=False)   # factory(env_name, **kwargs) -> expert
    expert_for(env_name, **kwargs)                 # e.g. expert_for("search", summary_drop=0.2)
    has_expert(env_name)
    for_context(expert, ctx)                       # the expert as the context manager needs it

Environments register their own experts where they are defined (a module in `env.imports`
registers its environment and, optionally, its expert). A name registered with prefix=True
also serves "name/...": ("fncall/chain" -> "fncall").

Writing one: subclass StateExpert and implement start / update / decide over a JSON-able
state dict; the base class reads the working context, restarts from the last summary, turns
decisions into tool calls and writes summaries (the README's "Adding an environment" has a
complete example).
"""
from __future__ import annotations

import importlib
import json
import random
from typing import Callable

from supo_jax.text.parsing import fold_call, format_tool_call
from supo_jax.text.reading import asks_for_state, continuation_marker, read_context
from supo_jax.text.templates import CONTINUATION, FORCED_RETURN, SUMMARY_INSTRUCTION

_EXPERTS: dict[str, tuple[Callable, bool]] = {}


def register_expert(name: str, factory: Callable, prefix: bool = False) -> Callable:
    """Register factory(env_name, **kwargs) -> expert for env `name` (and "name/..." if
    prefix); a StateExpert subclass is a factory. Re-registering a name replaces it (module
    reloads)."""
    _EXPERTS[name] = (factory, prefix)
    return factory


def _entry(env_name: str):
    importlib.import_module("supo_jax.envs")  # the built-in suites register on import
    entry = _EXPERTS.get(env_name)
    if entry is None:
        head = env_name.split("/", 1)[0]
        if head != env_name and _EXPERTS.get(head, (None, False))[1]:
            entry = _EXPERTS[head]
    return entry


def has_expert(env_name: str) -> bool:
    return _entry(env_name) is not None


def expert_for(env_name: str, **kwargs):
    """The scripted expert of a registered environment; kwargs go to its factory (every
    expert takes summary_drop, seed and continuation)."""
    entry = _entry(env_name)
    if entry is None:
        raise ValueError(f"environment {env_name!r} has no scripted expert (experts: "
                         + ", ".join(n + ("[/...]" if p else "") for n, (_, p) in
                                     sorted(_EXPERTS.items()))
                         + "); register one with supo_jax.envs.experts.register_expert, or "
                         "give SFT demonstrations as JSONL (sft.demos=PATH) or none "
                         "(train.sft_warm_start=false)")
    return entry[0](env_name, **kwargs)


def list_experts() -> list[str]:
    importlib.import_module("supo_jax.envs")
    return sorted(_EXPERTS)


class StateExpert:
    """A scripted expert over an explicit state. Subclasses implement:

    start(prompt) -> state           the state before any call, from the task prompt
    update(state, observation) -> state   after one tool observation
    decide(state) -> (thought, tool, arguments)   the next call (the answer tool ends it)

    act() rebuilds the state from the working context on every call: start(prompt), then
    the previous summary's state (the JSON after "State:"), then update() over the
    observations since (with context.manager=state, the last reply's <state> block stands
    for the summary, and every reply begins with one: the summary text of the state before
    its call). A summary states the whole state as JSON (with probability
    summary_drop one key is left out on purpose: a resumed expert then takes that key
    from start()). Override summary(state, decision) for another summary text (and
    parse_summary(text) to read it back).
    """

    def __init__(self, env_name: str = "", summary_drop: float = 0.0, seed: int = 0,
                 continuation: str = CONTINUATION):
        self.env_name = env_name
        self.summary_drop = summary_drop
        self.rng = random.Random(seed)
        self.marker = continuation_marker(continuation)
        self.dropped = 0  # summaries made imperfect so far

    def start(self, prompt: str) -> dict:
        raise NotImplementedError

    def update(self, state: dict, observation: str) -> dict:
        raise NotImplementedError

    def decide(self, state: dict) -> tuple[str, str, dict]:
        raise NotImplementedError

    def summary(self, state: dict, decision: tuple[str, str, dict]) -> str:
        _, name, args = decision
        keys = list(state)
        if self.summary_drop > 0 and keys and self.rng.random() < self.summary_drop:
            keys.remove(self.rng.choice(keys))
            self.dropped += 1
        state_json = json.dumps({k: state[k] for k in keys}, separators=(", ", ": "))
        return f"State: {state_json}. Next: {name}({json.dumps(args)})."

    def parse_summary(self, text: str) -> dict:
        """The state a summary() text holds ({} where none can be read)."""
        i = text.find("State:")
        if i < 0:
            return {}
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[i + len("State:"):].lstrip())
        except ValueError:
            return {}
        return obj if isinstance(obj, dict) else {}

    def state_of(self, messages: list[dict]) -> dict:
        prompt, summary, observations = read_context(messages, self.marker)
        state = self.start(prompt)
        if summary is not None:
            state = {**state, **self.parse_summary(summary)}
        for obs in observations:
            state = self.update(state, obs)
        return state

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        state = self.state_of(messages)
        decision = self.decide(state)
        if summarize:
            return f"<summary>{self.summary(state, decision)}</summary>"
        thought, name, args = decision
        call = f"{thought}\n{format_tool_call(name, args)}".lstrip()
        if asks_for_state(messages):
            return f"<state>{self.summary(state, decision)}</state>\n{call}"
        return call



class FoldingExpert:
    """Any expert under context.manager=fold: it works in branches. In the main thread it
    opens a branch; in a branch it lets the wrapped expert make calls, then returns the
    wrapped expert's summary as the return message, so the main thread holds the branch
    calls and their messages only. A wrapped expert with `subtask(messages)` (the sub-task the
    context is in, "" once all are done, None where the task has none: fncall's sections)
    gets a branch per sub-task instead, returned once that sub-task is done; with none left it
    answers in the main thread. The wrapped expert sees the context as a SUPO restart: s1, the
    continuation holding the last return message (a FORCED_RETURN adds nothing), then the
    turns since. Once the driver refuses a branch (context.max_branches spent) it goes on in
    the main thread.

    How long a branch runs. Given the context's size (`act(..., room=(tokens, count))`, as the
    rollout driver's ScriptedActor passes it) and L (`limit`), the expert sizes its branches
    by what fits, a turn counted as the longest call and result the context shows: a branch
    that made a call returns once one more turn and its return message would no longer fit
    below L (a sub-task that does not fit one branch goes on in the next, from the return
    message), and no branch opens where its call, a turn and its return do not fit (it goes
    on in the main thread). Without them, a branch returns after `calls_per_branch` calls
    (halved for each branch the limit closed, its calls lost)."""

    reads_room = True   # ScriptedActor passes room=(context tokens, count(text) -> tokens)

    def __init__(self, expert, calls_per_branch: int = 4, continuation: str = CONTINUATION,
                 limit: int | None = None):
        if calls_per_branch < 1:
            raise ValueError(f"calls_per_branch={calls_per_branch} must be >= 1")
        self.expert, self.calls_per_branch = expert, calls_per_branch
        self.continuation, self.limit = continuation, limit

    def _view(self, messages: list[dict]) -> tuple[list[dict], int | None, bool, int]:
        """(what the wrapped expert reads, where in it the open branch starts or None in the
        main thread, whether a branch may still be opened, branches closed by the limit)."""
        s1 = next(i for i, m in enumerate(messages) if m.get("role") == "user")
        head, summary, since = messages[:s1 + 1], None, []
        opened, can_branch, forced, j = None, True, 0, s1 + 1
        while j < len(messages):
            m = messages[j]
            nxt = messages[j + 1] if j + 1 < len(messages) else None
            op = fold_call(m["content"]) if m.get("role") == "assistant" else None
            if op is None or nxt is None or nxt.get("role") != "tool":
                since.append(m)
                j += 1
                continue
            reply = str(nxt["content"])
            if reply.startswith("Branch opened"):
                opened = len(since)
            elif reply.startswith("error"):
                can_branch = can_branch and "no branches left" not in reply
            else:                       # a branch folded into its return message
                if reply != FORCED_RETURN:
                    summary, since = reply, []
                forced += reply == FORCED_RETURN
                opened = None
            j += 2
        if summary is not None:
            head = head + [{"role": "user", "continuation": True, "content":
                            self.continuation.format(prompt=head[-1]["content"], summary=summary)}]
        return head + since, None if opened is None else len(head) + opened, can_branch, forced

    def _subtask(self, view: list[dict]) -> str | None:
        sub = getattr(self.expert, "subtask", None)
        return sub(view) if sub is not None else None

    def _branch_done(self, view: list[dict], start: int, task: str | None, forced: int) -> bool:
        """Whether the open branch has done its work: its sub-task is no longer the one it
        opened in, or (no sub-tasks, no room known) it made its calls."""
        if task is not None:
            return task != self._subtask(view[:start])
        calls = sum(m.get("role") == "assistant" for m in view[start:])
        return calls >= max(1, self.calls_per_branch >> forced)

    @staticmethod
    def _turn(view: list[dict], count) -> int:
        """What one more call and its observation may add: the longest turn (a call of the
        task's tools and the tool result after it) the context holds, + 16 tokens of turn
        markup; 0 before any."""
        seen = [count(a["content"]) + count(str(t["content"])) + 16
                for a, t in zip(view, view[1:])
                if a.get("role") == "assistant" and t.get("role") == "tool"
                and fold_call(a["content"]) is None]
        return max(seen, default=0)

    def _return(self, view: list[dict]) -> str:
        from supo_jax.text.parsing import extract_summary
        ask = [{"role": "user", "content": SUMMARY_INSTRUCTION}]   # as a summary request ends
        text = self.expert.act(view + ask, True)
        return format_tool_call("return", {"message": extract_summary(text) or text})

    def act(self, messages: list[dict], summarize: bool = False, room=None) -> str:
        view, start, can_branch, forced = self._view(messages)
        if summarize:
            return self.expert.act(view + [{"role": "user", "content": SUMMARY_INSTRUCTION}],
                                   True)
        sized = room is not None and self.limit is not None
        task = self._subtask(view)
        if start is None and can_branch and task != "":
            call = format_tool_call("branch", {"description": task or "the next steps"})
            # a branch where its call, a turn and its return fit below L
            if not sized or room[0] + room[1](call) + self._turn(view, room[1]) + room[1](
                    self._return(view)) < self.limit:
                return call
        # a return, like a summary, follows a tool result: not a new user request
        if start is not None and view[-1].get("role") == "tool":
            # sized without sub-tasks: a branch runs while it fits
            if (task is not None or not sized) and self._branch_done(view, start, task, forced):
                return self._return(view)
            turn = self._turn(view[start:], room[1]) if sized else 0
            if turn:           # one more turn and the return would not fit: return now
                ret = self._return(view)
                if room[0] + turn + room[1](ret) >= self.limit:
                    return ret
        return self.expert.act(view)


def for_context(expert, ctx):
    """The expert as context manager ctx.manager needs it: under fold, a FoldingExpert (it
    works in branches sized by L); otherwise the expert itself (state blocks are the expert's
    own, asked for by the task prompt)."""
    if ctx.manager == "fold":
        return FoldingExpert(expert, continuation=ctx.continuation, limit=ctx.trigger)
    return expert
