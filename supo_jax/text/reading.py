"""Reading a working context (chat dicts: user / assistant / tool) as a scripted policy does:
the task prompt, the previous summary (or the state manager's last <state> block) and the
tool observations since it."""
from __future__ import annotations

from supo_jax.text.parsing import extract_state, extract_summary
from supo_jax.text.templates import CONTINUATION

MAX_SUMMARY_CHARS = 20_000  # a reader looks at most this much of a summary


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
    if summary is None:      # context.manager=state: the last reply's <state> block
        held = [i for i in range(anchor + 1, len(messages))
                if messages[i].get("role") == "assistant"
                and extract_state(messages[i].get("content")) is not None]
        if held:
            anchor = held[-1]
            summary = extract_state(messages[anchor]["content"][-MAX_SUMMARY_CHARS:])
    obs = [m["content"] for m in messages[anchor + 1:] if m.get("role") == "tool"]
    return prompt, summary, obs


def asks_for_state(messages: list[dict]) -> bool:
    """Whether the task prompt (the first user message) asks every reply to begin with a
    <state></state> block (context.manager=state: STATE_INSTRUCTION)."""
    users = [m for m in messages if m.get("role") == "user"]
    return bool(users) and "<state></state>" in str(users[0].get("content"))
