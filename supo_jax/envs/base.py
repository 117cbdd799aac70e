"""Environment protocol and registry.

An environment is plain Python run on the host. The rollout driver calls
`reset(task)` once, then `act(text)` with each model action (untrusted text):

    reset(task) -> Reset(prompt, tools, system)   # s1 of docs/SUPO.md §2
    act(text)   -> StepResult(observation, done, reward, info)

`act` parses the action against the tools of the last reset; a malformed action gives
an error observation (done=False, reward 0, info["error"]) and the episode goes on.
Valid calls go to `step`, which the environment implements; invalid argument *values*
(index out of range, unknown key) are error observations made by the environment
itself, while an exception raised by `step` is a bug and propagates (the driver ends
the rollout as env_error). The answer tool ends the episode with the verifier reward
in [0, 1].

Registry: `@register_env(name, tasks=generate_fn)` on a class or factory; `make_env`,
`make_tasks`, `list_envs`. A task generator has the signature
`generate(split: "train" | "eval", n: int, seed: int, **knobs) -> list[dict]`, draws
train and eval from disjoint seed streams, and returns JSON-serializable dicts with at
least "task_id" and "family".
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from supo_jax.text.parsing import parse_action


@dataclass(frozen=True)
class ToolSpec:
    """One tool: name, description and JSON-schema "parameters" object."""
    name: str
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI / transformers chat-template tool dict."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class Reset:
    """Start of an episode: the user prompt, the tools, an optional system prompt."""
    prompt: str
    tools: list[ToolSpec]
    system: str | None = None


@dataclass(frozen=True)
class StepResult:
    """Observation text for the model; done/reward end the episode; info for metrics (an
    "error" key: the action was not a valid call; "tool_call": False: a valid action that
    called no tool, e.g. a reply that ends a turn; neither counts in tool_calls); role:
    the observation's chat turn, "tool" (a tool's result) or "user" (a new user request, e.g.
    BFCL's next question: it stays in the context after a summary restart)."""
    observation: str
    done: bool = False
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    role: str = "tool"


def error_result(message: str) -> StepResult:
    """Error observation for a bad action: the episode goes on, no reward."""
    return StepResult(observation=f"Error: {message}", info={"error": message})


def _utf8(s: str) -> str:
    # lone surrogates echoed from model text would break tokenization downstream
    return s.encode("utf-8", "replace").decode("utf-8")


class Environment(abc.ABC):
    """Base class. Subclasses set `tools` (class attribute, or in reset when task-dependent)
    and implement `reset` and `step`."""
    name: str = "base"
    answer_tool: str = "finish"
    max_calls_per_step: int = 1
    tools: tuple[ToolSpec, ...] = ()
    # the call forms act() reads (supo_jax.text.parsing.CALL_FORMATS); the rollout loop sets
    # those of the policy's chat template
    call_formats: tuple[str, ...] = ("hermes",)

    @abc.abstractmethod
    def reset(self, task: dict) -> Reset:
        """Start an episode on a task dict (from the registered task generator)."""

    @abc.abstractmethod
    def step(self, name: str, arguments: dict) -> StepResult:
        """Run one validated call (name in tools, arguments match its schema)."""

    def act(self, text: str) -> StepResult:
        """Parse one model action and run its call(s); bad actions -> error observations.

        With max_calls_per_step > 1 the calls run in order (observations joined by
        newlines) and stop at the first that ends the episode. The result's info merges the
        steps' infos and adds "tools": the names of the calls run. Observations are made
        UTF-8-safe (lone surrogates echoed from model text are replaced).
        """
        parsed = parse_action(text, {t.name: t.parameters for t in self.tools},
                              self.answer_tool, self.max_calls_per_step,
                              formats=self.call_formats)
        if parsed.kind == "error":
            return error_result(parsed.error)
        results = []
        for name, arguments in parsed.calls:
            results.append(self.step(name, arguments))
            if results[-1].done:
                break
        last = results[-1]
        info = {k: v for r in results for k, v in r.info.items()}
        info["tools"] = [n for n, _ in parsed.calls[:len(results)]]
        obs = "\n".join(r.observation for r in results)
        return dataclasses.replace(last, observation=_utf8(obs), info=info)

    def probe(self, summary: str) -> bool | None:
        """Whether a summary carries the state needed to continue (a metric); None if unknown."""
        return None


_ENVS: dict[str, tuple[Callable[..., Environment], Callable[..., list[dict]] | None]] = {}


def register_env(name: str, tasks: Callable[..., list[dict]] | None = None):
    """Decorator: register an Environment class or factory under `name`, with its task set."""
    def wrap(factory):
        old = _ENVS.get(name, (factory,))[0]
        # same qualified name = the same definition re-imported (module reload), not a clash
        if (old.__module__, old.__qualname__) != (factory.__module__, factory.__qualname__):
            raise ValueError(f"environment {name!r} is already registered")
        _ENVS[name] = (factory, tasks)
        return factory
    return wrap


def _lookup(name: str):
    if name not in _ENVS:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(list_envs())}")
    return _ENVS[name]


def make_env(name: str, **kwargs) -> Environment:
    """A new environment instance (one per concurrent rollout: envs hold episode state)."""
    return _lookup(name)[0](**kwargs)


def task_generator(name: str) -> Callable[..., list[dict]] | None:
    """The registered task generator of environment `name` (None if it has none)."""
    return _lookup(name)[1]


def make_tasks(name: str, split: str, n: int, seed: int = 0, **knobs) -> list[dict]:
    """n tasks of environment `name` from its registered generator."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    gen = _lookup(name)[1]
    if gen is None:
        raise ValueError(f"environment {name!r} has no registered task set")
    try:
        return gen(split, n, seed, **knobs)
    except TypeError as e:
        if "argument" in str(e):  # an unknown knob: name it instead of a traceback
            raise ValueError(f"environment {name!r} task generator: {e}") from None
        raise


def list_envs() -> list[str]:
    """Registered environment names, sorted."""
    return sorted(_ENVS)
