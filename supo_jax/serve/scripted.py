"""A scripted expert behind the endpoint: `supo-jax serve --policy scripted --env NAME`.

The engine of the server (serve/engine.py's interface: submit, close, rows, max_len) with
an environment's scripted expert in place of a model: each request's prompt, rendered in
ChatML (the `<|im_start|>role ... <|im_end|>` turns of Qwen, Hermes and SmolLM2 templates,
tool results as `<tool_response>` blocks or `tool` turns), is read back into messages, the
expert writes the reply (tool calls in the `<tool_call>` form it uses in rollouts), and the
reply's tokens come back at once, each with log-probability 0 (a deterministic policy). It
is how a harness nobody here wrote is checked end to end against an environment's ground
truth: the harness's own prompts and parsing, our endpoint, and a policy whose answers are
known (tests/test_bfcl_runner.py: BFCL's runner and scorer against bfcl/*).

A prompt that is not ChatML, or that the expert cannot place, ends its request with an
error (the client gets a 500 naming it); the server goes on.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from typing import Sequence

from supo_jax.agent.render import ChatFormat
from supo_jax.serve.engine import Event, Job, QueueFull

log = logging.getLogger(__name__)

_TURN = re.compile(r"<\|im_start\|>([a-z_]+)\n(.*?)(?:<\|im_end\|>|\Z)", re.S)
_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)
_THINK = re.compile(r"\A\s*<think>.*?</think>\s*", re.S)


def chatml_messages(text: str) -> list[dict]:
    """The messages of a ChatML prompt, without its final (empty) assistant turn: a user turn
    made only of `<tool_response>` blocks is one `tool` message a block (as Qwen's template
    renders them); a reasoning block heading an assistant turn is dropped. ValueError when
    the text holds no ChatML turn."""
    turns = _TURN.findall(text)
    if not turns:
        raise ValueError("the scripted policy reads ChatML prompts (<|im_start|>role ... "
                         "<|im_end|>); this prompt has no such turn")
    if turns[-1][0] == "assistant" and not _THINK.sub("", turns[-1][1]).strip():
        turns = turns[:-1]                       # the generation prompt
    out = []
    for role, content in turns:
        blocks = _RESPONSE.findall(content)
        if role == "user" and blocks and not _RESPONSE.sub("", content).strip():
            out += [{"role": "tool", "content": b} for b in blocks]
        elif role == "assistant":
            out.append({"role": role, "content": _THINK.sub("", content)})
        else:
            out.append({"role": role, "content": content})
    return out


class ScriptedEngine:
    """Serve `expert` (an object with act(messages) -> reply text, as ScriptedActor takes):
    one thread answers the jobs in turn; at most `queue` wait (QueueFull past that)."""

    policy = None                 # no model: the server offers no top_logprobs

    def __init__(self, expert, fmt: ChatFormat, max_len: int, *, rows: int = 8,
                 queue_limit: int | None = None):
        self.expert, self.fmt, self.max_len, self.rows = expert, fmt, max_len, rows
        self.queue_limit = 4 * rows if queue_limit is None else queue_limit
        self.jobs: queue.Queue = queue.Queue()
        self.answered = self.failed = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="scripted")
        self.thread.start()

    @property
    def waiting(self) -> list:
        return [None] * self.jobs.qsize()

    @property
    def free_rows(self) -> int:
        return max(0, self.rows - self.jobs.qsize())

    def submit(self, jobs: Sequence[Job]) -> None:
        if self.stopped:
            raise QueueFull("the engine is shutting down")
        if self.jobs.qsize() + len(jobs) > self.queue_limit + self.rows:
            raise QueueFull(f"{self.jobs.qsize()} requests wait (at most "
                            f"{self.queue_limit + self.rows})")
        for job in jobs:
            self.jobs.put(job)

    def close(self) -> None:
        self.stopped = True
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def reply(self, job: Job) -> Event:
        """The expert's reply to the job's prompt, as an event that ends it."""
        messages = chatml_messages(self.fmt.decode(job.tokens))
        tokens = self.fmt.encode(self.expert.act(messages)) + [self.fmt.stop_id]
        finish = "stop"
        if len(tokens) > job.max_new:     # cut at the request's budget
            tokens, finish = tokens[:job.max_new], "length"
        return Event(tuple(tokens), (0.0,) * len(tokens), finish)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or self.stopped:
                return
            if job.cancelled:
                continue
            try:
                event = self.reply(job)
                self.answered += 1
            except Exception as e:  # noqa: BLE001 - a prompt the expert cannot read fails its request
                self.failed += 1
                log.warning("scripted policy: %r", e)
                event = Event((), (), f"error: the scripted policy: {e}"[:300])
            try:
                job.on_event(event)
            except Exception:   # noqa: BLE001 - a client's callback never stops the engine
                log.exception("request callback")
