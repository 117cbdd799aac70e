"""Calls on BFCL's simulators without evaluating text, and BFCL's multi-turn verdict.

BFCL's executor rewrites each call string "name(arg=value, ...)" to a method call on the
task's simulator instance and runs it with `eval`. Here a call is parsed with `ast` (a plain
function name, arguments that are Python literals: anything else is refused), looked up
among the public methods of the task's instances (a later class wins a shared name, as in
BFCL) and invoked as a method call; its result is turned into text as BFCL does (str as is,
dict as JSON, else str(...); an exception "Error during execution: <message>"). The
functions BFCL refuses to run (kill, exit, quit, remove, unlink, popen, Popen, run) are
refused the same way. The one difference from BFCL: an argument that is an expression
(`ls(a=1+True)`) is refused here where BFCL would evaluate it; the environments' calls never
have one (their arguments are JSON values, written back with repr).

`score` is bfcl-eval's multi_turn_checker (and its runner's turn-count check) over such
calls: per user turn, the model's calls and the ground truth's run on two sets of instances
that persist over the turns; a turn whose ground truth has calls needs at least one model
call; after it, every instance must equal its ground-truth twin (public attributes), and
the ground truth's results must be a sub-multiset of all the model's results so far. A turn
whose ground truth is empty is not checked (its calls still run). Each set of instances is
a world of its own (data.new_instances), where bfcl-eval's two share the long scenario's
extra credit cards and bookings (docs/ENVIRONMENTS.md lists where the verdicts differ).
tests/test_bfcl.py checks the verdicts against bfcl-eval's own checker.

Here the calls run in the calling process, with no deadline: for the dataset's calls and
calls the environments already ran. The environments run theirs in worker processes
(worker.py), which use this module there.
"""
from __future__ import annotations

import ast
import inspect
import json
import threading

from supo_jax.envs.bfcl.data import check_category, entries, ground_truth, new_instances

REFUSED = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")
# one call at a time in a process: callers may be threads, and both CPython 3.11's ast
# constructor and BFCL's MathAPI (mpmath's global precision) are not thread-safe
_LOCK = threading.RLock()


def parse_call(text: str) -> tuple[str, list, dict]:
    """"name(a, k=v)" -> (name, [a], {k: v}), every argument a Python literal; ValueError
    saying what is wrong otherwise."""
    with _LOCK:
        return _parse_call(text)


def _parse_call(text: str) -> tuple[str, list, dict]:
    try:
        node = ast.parse(str(text).strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a call: {type(e).__name__}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("not a call of a function by name")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError("**arguments")
            kwargs[kw.arg] = ast.literal_eval(kw.value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"an argument is not a literal value ({e})") from None
    return node.func.id, args, kwargs


def format_call(name: str, arguments: dict) -> str:
    """A call in BFCL's decoded form: name(k=repr(v), ...)."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")"


def result_text(value) -> str:
    """A method's return value as BFCL records it."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class Simulators:
    """The simulator instances of one task (its world: class name -> instance) and the
    methods a call may name."""

    def __init__(self, instances: dict[str, object]):
        self.instances = instances
        self.methods: dict[str, object] = {}
        for inst in self.instances.values():      # a later class wins a shared name
            for name, _ in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = inst

    @classmethod
    def fresh(cls, entry: dict, category: str) -> Simulators:
        """A new world of the task, loaded with its initial_config (data.new_instances)."""
        return cls(new_instances(entry, category))

    def call(self, name: str, args: list, kwargs: dict) -> str:
        """Run one parsed call; its result as BFCL's text (errors included)."""
        if name in REFUSED:
            return f"Error during execution: Function call {name} is not allowed."
        if name not in self.methods:
            return f"Error during execution: name '{name}' is not defined"
        with _LOCK:
            try:
                return result_text(getattr(self.methods[name], name)(*args, **kwargs))
            except Exception as e:  # noqa: BLE001 - a bad call is an error result, as in BFCL
                return f"Error during execution: {e}"

    def run(self, text: str) -> str:
        """Run one call string (parsed, never evaluated)."""
        try:
            name, args, kwargs = parse_call(text)
        except ValueError as e:
            return f"Error during execution: {e}"
        return self.call(name, args, kwargs)

    def state(self) -> dict[str, dict]:
        """Each instance's public attributes (what BFCL's state check compares)."""
        return {c: {k: v for k, v in vars(i).items() if not k.startswith("_")}
                for c, i in self.instances.items()}


def _empty(steps: list) -> bool:
    return len(steps) == 0 or (len(steps) == 1 and len(steps[0]) == 0)


def verdict(category: str, task_id: str, calls: list[list[list[str]]]) -> dict:
    """{"valid": bool, "error_type": ..., "turn": ...} for the model's calls: per user turn,
    per step, the step's calls in BFCL's decoded form."""
    entry = entries(check_category(category))[task_id]
    truth_turns = ground_truth(category)[task_id]
    if len(calls) != len(truth_turns):
        return {"valid": False, "error_type": "multi_turn:force_terminated", "turn": None}
    model, truth = Simulators.fresh(entry, category), Simulators.fresh(entry, category)
    so_far: list[str] = []
    for i, truth_calls in enumerate(truth_turns):
        steps = [s for s in calls[i] if not _empty(s)]      # the runner drops empty steps
        for step in steps:
            so_far += [model.run(c) for c in step]
        expected = [truth.run(c) for c in truth_calls]
        if not truth_calls:
            continue
        if _empty(steps):
            return {"valid": False, "error_type": "multi_turn:empty_turn_model_response",
                    "turn": i}
        mine, theirs = model.state(), truth.state()
        for cls, attrs in theirs.items():
            if any(mine[cls].get(k) != v for k, v in attrs.items()):
                return {"valid": False, "error_type": "multi_turn:instance_state_mismatch",
                        "turn": i}
        left = list(so_far)
        for r in expected:
            if r not in left:
                return {"valid": False, "error_type": "multi_turn:execution_response_mismatch",
                        "turn": i}
            left.remove(r)
    return {"valid": True, "error_type": None, "turn": None}


def score(category: str, task_id: str, calls: list[list[list[str]]]) -> bool:
    """Whether BFCL's multi-turn checker passes the task for these calls (per user turn, per
    step, "name(arg=value, ...)" strings)."""
    return verdict(category, task_id, calls)["valid"]
