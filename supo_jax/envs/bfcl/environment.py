"""The environments bfcl/base, bfcl/long_context, bfcl/miss_func, bfcl/miss_param.

An episode is one BFCL multi-turn task. The initial prompt is the task's first user
question, with the tools of its simulator classes (BFCL's function docs as JSON schemas) in
the chat template. Each action's tool calls are parsed (parse_action) and each call is
checked on its own against its doc (arguments.check_arguments: names, declared types,
sizes): a call that fails is refused (not run, not recorded; "Error: <why>" in its place),
the step's other calls run, in order, as in BFCL. They run as method calls on the task's
world (never evaluated) in a worker process (worker.py) that is killed when the step's
calls together run past the task knob call_timeout_s (10 s), counted from when the worker
has them: the episode then ends at reward 0 (info "stopped"). The wait for a free worker
(a start included) has a bound of its own, the task knob queue_timeout_s (15 s): past it
the action raises worker.Queued (its rollout ends as "queued": the environment failed
it, not the model). Their results, as BFCL writes them, one a line, are
the observation. An action without a tool call ends the user turn, as in BFCL: the next
question arrives as a user turn (role "user": a summary restart keeps it; info tool_call
False: it is no tool call); after the last, the episode ends with BFCL's verdict on the
calls made (calls.verdict, replayed in a worker on worlds of its own under the same
deadline) as the reward, 1.0 or 0.0 (with the task knob partial_reward: the share of turns
before the first failing one). More than 20 steps in one turn ends the episode at 0
(BFCL's force-quit). miss_func: the held-out function's doc arrives at its turn in the user
message, as BFCL's prompting handlers give it ("{docs}\\nI have updated some more functions
you can choose from. What about now?"), and its tool is callable from then on. miss_param:
the question lacks a parameter, and the ground truth makes no call in that turn (the model
should ask). Where this departs from BFCL's executor, and why: docs/ENVIRONMENTS.md.

Each rollout has a world of its own, kept as pickled bytes between steps: nothing it does
reaches another rollout, and the same actions give the same observations in any process.

Tasks: every category's 200 tasks split by id number: those with number % 5 == 0 are the
eval split (40), the rest train (160); a split's tasks are shuffled by the seed and repeated
when more are asked for.

The scripted expert replays the ground truth: each turn's calls in one action (the tool
doc's parameter order names positional arguments), then a short text reply ending the turn;
its summaries record the task and the turn whose action was made last (a summary always
follows an action, which ran even when SUPO dropped it from the context: the expert assumes
the paper's SUPO, context.show_dropped_to_summarizer off), which is how it continues after a
summary restart.
"""
from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, register_env
from supo_jax.envs.bfcl import worker
from supo_jax.envs.bfcl.arguments import check_arguments, read_as_declared
from supo_jax.envs.bfcl.calls import format_call, parse_call
from supo_jax.envs.bfcl.data import CATEGORIES, entries, ground_truth, task_docs, world_bytes
from supo_jax.envs.experts import register_expert
from supo_jax.text.parsing import extract_state, format_tool_call, parse_action, quote
from supo_jax.text.reading import asks_for_state

MAX_STEPS_A_TURN = 20            # BFCL's MAXIMUM_STEP_LIMIT
CALL_TIMEOUT_S = 10.0            # a step's calls together, and the scoring replay
QUEUE_TIMEOUT_S = 15.0           # the wait for a free worker: env.timeout_s must exceed both
NEW_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"
_NO_ANSWER_TOOL = "__bfcl_no_answer_tool__"   # no call ends the episode: the turns do


def json_schema(p: dict) -> dict:
    """A BFCL parameter doc as JSON schema: dict -> object, float -> number, tuple -> array,
    any -> no type constraint; an object without properties takes any keys."""
    out = {k: v for k, v in p.items() if k not in ("type", "properties", "items")}
    t = p.get("type")
    mapped = {"dict": "object", "float": "number", "tuple": "array"}.get(t, t)
    if mapped and mapped != "any":
        out["type"] = mapped
    if "items" in p and isinstance(p["items"], dict):
        out["items"] = json_schema(p["items"])
    if "properties" in p:
        out["properties"] = {k: json_schema(v) for k, v in p["properties"].items()}
    elif mapped == "object":
        out["additionalProperties"] = True
    return out


def tool_spec(doc: dict) -> ToolSpec:
    params = json_schema(doc.get("parameters") or {"type": "dict", "properties": {}})
    params.setdefault("properties", {})
    params["type"] = "object"
    return ToolSpec(doc["name"], doc.get("description", ""), params)


def _question(turn: list[dict]) -> str:
    return "\n".join(m["content"] for m in turn if m.get("role") == "user")


def turn_text(entry: dict, k: int) -> str:
    """The user message of turn k: its question, or at a miss_func turn the held-out docs
    and BFCL's prompt for them."""
    later = task_docs(entry)[1]
    if k in later:
        return json.dumps(later[k]) + "\n" + NEW_FUNCTIONS
    return _question(entry["question"][k])


class _AnyCall(Mapping):
    """The tools parse_action is given: every name, with any arguments. It reads the calls as
    written; each is then checked on its own (a bad one does not refuse the others)."""
    _SCHEMA = {"type": "object", "additionalProperties": True}

    def __getitem__(self, name):
        if not isinstance(name, str):
            raise KeyError(name)
        return self._SCHEMA

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


_ANY_CALL = _AnyCall()


class BFCLEnv(Environment):
    answer_tool = _NO_ANSWER_TOOL
    max_calls_per_step = 256       # BFCL sets no limit to the calls of one step
    # the rollout loop sets whether the policy's chat template renders `tools`; where it does
    # not (SmolLM2's), the docs go into a system prompt, as BFCL's prompting handlers put them
    renders_tools = True

    def __init__(self, category: str):
        self.category = category
        self.name = f"bfcl/{category}"

    def reset(self, task: dict) -> Reset:
        self.task_id = task["task_id"]
        self.partial = bool(task.get("partial_reward", False))
        self.timeout_s = float(task.get("call_timeout_s", CALL_TIMEOUT_S))
        self.queue_s = float(task.get("queue_timeout_s", QUEUE_TIMEOUT_S))
        entry = self.entry = entries(self.category)[self.task_id]
        # the world, as bytes: each step's calls run on a copy in a worker process
        self.world = world_bytes(entry, self.category)
        docs, self.later = task_docs(entry)
        self.tools = tuple(tool_spec(d) for d in docs)
        # what an action may call: every function of the task's classes, offered yet or not
        # (BFCL's executor runs any of them; its own ground truth calls miss_func 49's `tail`
        # two turns before the doc arrives)
        self.docs = {d["name"]: d for d in docs + [d for ds in self.later.values() for d in ds]}
        self.questions = entry["question"]
        self.turn, self.steps = 0, 0
        self.calls: list[list[list[str]]] = [[]]
        system = None if self.renders_tools else (
            "You can call these functions (JSON docs), each call as <tool_call>{\"name\": ..., "
            "\"arguments\": {...}}</tool_call>; reply without a call when the request is done or "
            "cannot be done.\n" + json.dumps(docs))
        return Reset(prompt=_question(self.questions[0]), tools=list(self.tools), system=system)

    def refusal(self, name: str, arguments: dict) -> str | None:
        """Why one call is not run (None: it runs)."""
        if name not in self.docs:
            return f"unknown tool {quote(name)}"
        return check_arguments(self.docs[name], arguments)

    def act(self, text: str) -> StepResult:
        parsed = parse_action(text, _ANY_CALL, self.answer_tool, self.max_calls_per_step,
                              formats=self.call_formats)
        if parsed.kind == "error" and parsed.error.startswith("no tool call found"):
            return self._next_turn()
        self.steps += 1
        if parsed.kind == "error":      # not calls at all: the step is refused
            obs = StepResult(f"Error: {parsed.error}", info={"error": parsed.error})
        else:
            obs = self._run(parsed.calls)
        if obs.done:
            return obs
        if self.steps > MAX_STEPS_A_TURN:     # BFCL force-quits the task
            return StepResult("", done=True, reward=0.0,
                              info={"force_quit": True, "calls": self.calls})
        return obs

    def _run(self, calls) -> StepResult:
        """Check each call, run the valid ones in a worker; their results and the refusals,
        in order, one a line."""
        if "seed_oss" in self.call_formats:      # its values come as text
            calls = [(n, read_as_declared(self.docs[n], a) if n in self.docs else a)
                     for n, a in calls]
        refused = [self.refusal(n, a) for n, a in calls]
        valid = [(n, dict(a)) for (n, a), r in zip(calls, refused) if r is None]
        results = []
        if valid:
            try:
                self.world, results = worker.run(("step", self.world, valid), self.timeout_s,
                                                 self.queue_s)
            except worker.Stopped as e:
                return StepResult("", done=True, reward=0.0, info={
                    "stopped": f"the step's calls were stopped ({e})", "calls": self.calls})
            self.calls[self.turn].append([format_call(n, a) for n, a in valid])
        out = iter(results)
        lines = [f"Error: {r}" if r is not None else next(out) for r in refused]
        obs = "\n".join(lines).encode("utf-8", "replace").decode("utf-8")
        if not valid:
            return StepResult(obs, info={"error": next(r for r in refused if r is not None)})
        return StepResult(obs, info={"tools": [n for n, _ in valid]})

    def step(self, name: str, arguments: dict) -> StepResult:   # act() runs the calls
        raise NotImplementedError

    def _next_turn(self) -> StepResult:
        self.turn += 1
        if self.turn >= len(self.questions):
            reward, info = self.reward()
            return StepResult("", done=True, reward=reward, info={"calls": self.calls, **info})
        self.calls.append([])
        self.steps = 0
        if self.turn in self.later:           # miss_func: the held-out docs arrive now
            self.tools = self.tools + tuple(tool_spec(d) for d in self.later[self.turn])
        return StepResult(turn_text(self.entry, self.turn), role="user",
                          info={"turn": self.turn, "tool_call": False})

    def reward(self) -> tuple[float, dict]:
        """BFCL's verdict on the calls made, replayed in a worker: (reward, info)."""
        try:
            v = worker.run(("verdict", self.category, self.task_id, self.calls), self.timeout_s,
                           self.queue_s)
        except worker.Stopped as e:
            return 0.0, {"stopped": f"scoring was stopped ({e})"}
        if v["valid"]:
            return 1.0, {}
        if self.partial and v["turn"] is not None:
            return v["turn"] / len(self.questions), {}
        return 0.0, {}


def _number(task_id: str) -> int:
    return int(task_id.rsplit("_", 1)[1])


def split_ids(category: str, split: str) -> list[str]:
    """The task ids of a split: eval = id number % 5 == 0, train = the rest (sorted)."""
    ids = sorted(entries(category), key=_number)
    return [i for i in ids if (_number(i) % 5 == 0) == (split == "eval")]


def make_tasks_for(category: str):
    def generate(split: str, n: int, seed: int, partial_reward: bool = False,
                 call_timeout_s: float = CALL_TIMEOUT_S,
                 queue_timeout_s: float = QUEUE_TIMEOUT_S) -> list[dict]:
        for knob, v in (("call_timeout_s", call_timeout_s), ("queue_timeout_s", queue_timeout_s)):
            if not 0 < float(v) < math.inf:
                raise ValueError(f"{knob} must be a number of seconds > 0, got {v!r}")
        ids = split_ids(category, split)
        random.Random(f"{category}:{split}:{seed}").shuffle(ids)
        return [{"task_id": ids[k % len(ids)], "family": f"bfcl/{category}",
                 "category": category, "partial_reward": bool(partial_reward),
                 "call_timeout_s": float(call_timeout_s),
                 "queue_timeout_s": float(queue_timeout_s)} for k in range(n)]
    return generate


def _advance(entry: dict, turn: int, since: list[str]) -> int | None:
    """The turn an entry is at after the user turns `since` (from `turn`; a text equal to
    the current request keeps it), None where one of them is none of its later questions."""
    for text in since:
        turn = next((j for j in range(turn, len(entry["question"]))
                     if turn_text(entry, j) == text), None)
        if turn is None:
            return None
    return turn


class BFCLExpert:
    """The ground truth as a scripted policy (see the module docstring)."""

    def __init__(self, category: str):
        self.category = category

    def _locate(self, messages: list[dict]) -> tuple[str, int, bool]:
        """(task id, current turn, whether its calls were made) from the working context:
        after a summary restart from the summary ("BFCL <id> turn <k> done|pending") and the
        user turns since; before one from the questions seen."""
        users = [(i, m["content"]) for i, m in enumerate(messages) if m["role"] == "user"]
        # the mark: in a continuation (user) turn, or (context.manager=state) a reply's state
        held = users + [(i, extract_state(m["content"]) or "") for i, m in enumerate(messages)
                        if m["role"] == "assistant"]
        mark = next(((i, re.search(r"BFCL (\S+) turn (\d+) (done|pending)", t))
                     for i, t in sorted(held, reverse=True)
                     if re.search(r"BFCL \S+ turn \d+", t)), None)
        if mark is not None:
            at, m = mark
            tid, k = m.group(1), int(m.group(2))
            # the user turns since the continuation: the current request (kept by the restart;
            # a later one when the turn advanced in the dropped pair), then new turns
            since = [t for i, t in users if i > at]
            turn = _advance(entries(self.category)[tid], k, since)
            if turn is None:   # a task with the same first question (told apart only now,
                e = entries(self.category)       # when the state held the first question)
                first = _question(e[tid]["question"][0])
                tid, turn = next(((i, t) for i in sorted(e, key=_number)
                                  if _question(e[i]["question"][0]) == first
                                  and (t := _advance(e[i], k, since)) is not None), (tid, k))
            done = m.group(3) == "done" and turn == k
        else:
            questions = [t for _, t in users]
            # (under context.manager=state the first question ends with its instruction)
            cands = [i for i, e in entries(self.category).items()
                     if questions[0] in (q := _question(e["question"][0]),
                                         q + "\n\n" + questions[0].split("\n\n")[-1])]
            for k, q in enumerate(questions[1:], start=1):
                e = entries(self.category)
                narrowed = [i for i in cands if len(e[i]["question"]) > k
                            and turn_text(e[i], k) == q]
                cands = narrowed or cands
            tid, turn, done = sorted(cands, key=_number)[0], len(questions) - 1, False
        return tid, turn, done or messages[-1]["role"] == "tool"

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        # a summary request ends the messages with its instruction (a user message under
        # context.summary_role=user): not a question
        tid, turn, done = self._locate(messages[:-1] if summarize else messages)
        if summarize:
            # a summary is asked for right after an action, which ran even when SUPO dropped it
            # from the context: the expert's action for this turn (its calls, or the reply
            # ending it) was made
            return f"<summary>BFCL {tid} turn {turn} done</summary>"
        truth = ground_truth(self.category)[tid]
        # context.manager=state: every reply begins with the mark (this turn's calls are made
        # by this reply, or were)
        head = f"<state>BFCL {tid} turn {turn} done</state>\n" if asks_for_state(messages) else ""
        if done or turn >= len(truth) or not truth[turn]:
            return head + "Done."
        docs = {d["name"]: d for d in task_docs(entries(self.category)[tid])[0]}
        for later in task_docs(entries(self.category)[tid])[1].values():
            docs.update({d["name"]: d for d in later})
        out = []
        for call in truth[turn]:
            name, args, kwargs = parse_call(call)
            order = list((docs[name].get("parameters") or {}).get("properties", {}))
            kwargs = {**dict(zip(order, args)), **kwargs}
            out.append(format_tool_call(name, kwargs))
        return head + "\n".join(out)


for _c in CATEGORIES:
    register_env(f"bfcl/{_c}", tasks=make_tasks_for(_c))(
        lambda category=_c: BFCLEnv(category))
    register_expert(f"bfcl/{_c}", lambda env_name, **kw: BFCLExpert(env_name.split("/", 1)[1]))
