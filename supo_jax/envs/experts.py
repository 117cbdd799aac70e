"""Registry of scripted experts, and the working-context reader they share.

An expert is a scripted policy with `act(messages, summarize=False) -> action text` that
reads only the working context (chat dicts: user / assistant / tool), as the model does.

    register_expert(name, factory, prefix=False)   # factory(env_name, **kwargs) -> expert
    expert_for(env_name, **kwargs)                 # e.g. expert_for("search", summary_drop=0.2)

`expert_for` first imports `supo_jax.envs` (which imports the built-in suites, and they
register their experts), then looks `env_name` up: an exact registration, else one made
with prefix=True for the part before the first "/" ("fncall/chain" -> "fncall").
The fncall suite keeps its own `fncall.expert_for`; it is registered here lazily.
"""
from __future__ import annotations

import importlib
from typing import Callable

from supo_jax.agent.parsing import extract_summary
from supo_jax.agent.templates import CONTINUATION

MAX_SUMMARY_CHARS = 20_000  # experts read at most this much of a summary

_EXPERTS: dict[str, tuple[Callable, bool]] = {}


def register_expert(name: str, factory: Callable, prefix: bool = False) -> Callable:
    """Register factory(env_name, **kwargs) -> expert for env `name` (and "name/..." if
    prefix). Re-registering a name replaces it (module reloads)."""
    _EXPERTS[name] = (factory, prefix)
    return factory


def expert_for(env_name: str, **kwargs):
    """The scripted expert for a registered environment; kwargs go to its factory (the
    built-in experts take summary_drop, seed, continuation)."""
    importlib.import_module("supo_jax.envs")  # the built-in suites register on import
    entry = _EXPERTS.get(env_name)
    if entry is None:
        head = env_name.split("/", 1)[0]
        if head != env_name and _EXPERTS.get(head, (None, False))[1]:
            entry = _EXPERTS[head]
    if entry is None:
        raise ValueError(f"no expert for {env_name!r}; experts: "
                         + ", ".join(n + ("[/...]" if p else "") for n, (_, p) in
                                     sorted(_EXPERTS.items())))
    return entry[0](env_name, **kwargs)


def list_experts() -> list[str]:
    importlib.import_module("supo_jax.envs")
    return sorted(_EXPERTS)


def continuation_marker(template: str = CONTINUATION) -> str:
    """The fixed sentence of a continuation template before "{summary}" (and "<summary>"):
    how an expert recognises the restarted context."""
    fixed = template.split("{summary}")[0].split("{prompt}")[-1]
    marker = fixed.split("<summary>")[0].strip()
    if not marker:
        raise ValueError("the continuation template has no fixed text before {summary}")
    return marker


def read_context(messages: list[dict], marker: str) -> tuple[str, str | None, list[str]]:
    """(prompt, previous summary or None, tool observations after it) of a working context.

    The anchor is the last user message holding `marker`, else the first user message.
    The prompt is the first user message (plus the text before the marker when the
    continuation turn repeats the task); the summary is the text after the marker
    (<summary> tags optional, at most MAX_SUMMARY_CHARS read).
    """
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ValueError("no user message in the context")
    anchor = max((i for i in users if marker in messages[i]["content"]), default=users[0])
    before, found, after = messages[anchor]["content"].partition(marker)
    # the task is in s1 (the first user turn) and/or repeated before the marker
    prompt = (messages[users[0]]["content"] + "\n" if anchor != users[0] else "") + before
    summary = None
    if found:
        after = after[:MAX_SUMMARY_CHARS]
        summary = extract_summary(after)
        summary = after.strip() if summary is None else summary
    obs = [m["content"] for m in messages[anchor + 1:] if m.get("role") == "tool"]
    return prompt, summary, obs


def _fncall_expert(env_name: str, **kwargs):
    from supo_jax.envs import fncall
    return fncall.expert_for(env_name, **kwargs)


register_expert("fncall", _fncall_expert, prefix=True)
