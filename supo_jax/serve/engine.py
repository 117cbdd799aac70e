"""The serving engine: HTTP requests as rows of the policy's Sampler, continuously batched.

One thread owns the Sampler (sampling/sampler.py, the rows the rollout driver decodes on).
At each boundary (one decode call of up to `decode_chunk` tokens) waiting jobs take free
rows and are prefilled, every generating row advances by one decode call together, the
tokens each call produced go to their jobs (streamed), and rows that ended or whose client
went away are freed.

Prefix reuse: a job takes the free row whose cached tokens share the longest prefix with its
prompt and prefills only the rest (a conversation's next turn, or n choices of one prompt
after the first wave, reuse the KV cache already there); among rows sharing nothing, the
least recently freed, so the rows freed last keep their conversations longest.

Sampling settings are per row: every decode call passes each row's temperature and top_p
as arrays (Sampler.advance with {row: SamplingParams}), so one compiled program serves any
mix and a job starts in the first free row whatever its settings, first in, first out. A
greedy row samples what the sampler's own greedy generation does (argmax of the same
logits); each row draws from its own stream (seed, choice), whatever rows decode beside it.

Gathering: when no row decodes, the first job to arrive does not start alone if others are
on their way (a client's n choices, clients that start together, the next requests of
clients whose rows all ended in the same call): the engine waits until no job has arrived
for `gather_s` (at most 4 x gather_s), then admits them all in one prefill and one decode
call. Otherwise the first would decode a whole call alone while the rest wait for the next.

Back-pressure: at most `queue` jobs wait beyond the free rows; `submit` raises QueueFull
past that (the server's 429).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from supo_jax.model.policy import Policy
from supo_jax.sampling.sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every row is busy and the wait queue is full: try again later."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What one decode call gave a job: new tokens and their log-probabilities; `finish`
    ("stop", "length", "error: ...") on its last event."""
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One choice of one request: a prompt, its token budget, its sampling settings, its
    stop ids, its random stream (two jobs sampled at once need distinct ones), and the
    callback its events go to (called on the engine's thread: it must not block)."""
    tokens: tuple[int, ...]
    max_new: int
    sampling: SamplingParams
    stop_ids: frozenset
    stream: tuple[int, int]
    on_event: Callable[[Event], None]
    cancelled: bool = False
    row: int = -1
    sent: int = 0                  # tokens reported so far

    def cancel(self) -> None:
        """Drop the job at the next boundary (its client went away, or a stop string ended
        it): a waiting job never starts, a running one frees its row."""
        self.cancelled = True


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if diff.size else n


def pick_row(free: Sequence[int], held: dict[int, list[int]], prompt: Sequence[int],
             reuse: bool = True) -> tuple[int, int]:
    """(row, tokens of its cache kept) for a prompt: the free row whose cached tokens share
    the longest prefix with it, ties to the earliest in `free` (the least recently freed);
    at most len(prompt) - 1 kept, since the model must see one new token to give the next
    token's logits. reuse=False: the least recently freed row, nothing kept (re-prefill)."""
    if not reuse:
        return free[0], 0
    row = max(free, key=lambda r: common_prefix(held[r], prompt))
    return row, min(common_prefix(held[row], prompt), len(prompt) - 1)


class Engine:
    """`rows` sampler rows of `max_len` tokens (prompt + completion) over one policy, behind
    a thread; at most `queue` (default 4 x rows) jobs wait for a row. reuse_prefix=False
    prefills every prompt whole (the benchmark's baseline)."""

    def __init__(self, policy: Policy, rows: int = 8, max_len: int = 2048, *,
                 queue: int | None = None, seed: int = 0, decode_chunk: int = 16,
                 reuse_prefix: bool = True, gather_s: float = 0.005):
        self.sampler = Sampler(policy, rows, max_len, decode_chunk=decode_chunk)
        self.policy, self.max_len, self.rows = policy, max_len, rows
        self.reuse_prefix, self.gather_s = reuse_prefix, gather_s
        self.queue_limit = 4 * rows if queue is None else queue
        self.rng = jax.random.key(seed)
        self.held: dict[int, list[int]] = {r: [] for r in range(rows)}   # each row's cache
        self.free = list(range(rows))
        self.running: dict[int, Job] = {}
        self.waiting: list[Job] = []
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopped = False
        self.prefilled = self.reused = 0     # prompt tokens prefilled, and taken from a cache
        self.decode_calls = self.cancelled = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name="engine")
        self.thread.start()

    @property
    def free_rows(self) -> int:
        return len(self.free)

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue `jobs` (all or none): QueueFull when more than `queue` jobs would wait
        beyond the free rows; ValueError for a prompt the context cannot hold."""
        for job in jobs:
            if not 0 < len(job.tokens) < self.max_len or job.max_new > self.max_len - len(
                    job.tokens):
                raise ValueError(f"a prompt of {len(job.tokens)} tokens and {job.max_new} new "
                                 f"tokens: the context holds {self.max_len}")
        with self.lock:
            if self.stopped:
                raise QueueFull("the engine is shutting down")
            if len(self.waiting) + len(jobs) > self.queue_limit + len(self.free):
                raise QueueFull(f"all {self.rows} rows are busy and {len(self.waiting)} "
                                f"requests wait (at most {self.queue_limit})")
            self.waiting.extend(jobs)
        self.wake.set()

    def close(self) -> None:
        """Stop the engine's thread; the jobs still waiting or running end with an error."""
        with self.lock:
            self.stopped = True
        self.wake.set()
        self.thread.join(timeout=30)
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for job in waiting:
            self._emit(job, Event((), (), "error: the server is shutting down"))
        self._fail_all("error: the server is shutting down")

    # the engine thread

    def _loop(self) -> None:
        while not self.stopped:
            try:
                self._drop_cancelled()
                if not self.sampler.generating:
                    self._gather()
                self._admit()
                if not self.sampler.generating:
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                settings = {r: self.running[r].sampling for r in self.sampler.generating}
                ended = self.sampler.advance(settings, self.rng)
                self.decode_calls += 1
                self._report(ended)
            except Exception as e:   # noqa: BLE001 - the jobs in flight fail, the server goes on
                log.exception("serving engine")
                self._fail_all(f"error: {e!r}"[:300])

    def _gather(self) -> None:
        """While no row decodes: wait for the jobs sent with the first one waiting, until
        none arrives for gather_s (at most 4 x gather_s, or until they fill the free rows)."""
        seen, deadline = len(self.waiting), time.monotonic() + 4 * self.gather_s
        while 0 < seen < len(self.free) and time.monotonic() < deadline:
            time.sleep(self.gather_s)
            seen, before = len(self.waiting), seen
            if seen == before:
                return

    def _drop_cancelled(self) -> None:
        with self.lock:
            self.waiting = [j for j in self.waiting if not j.cancelled]
        for row, job in list(self.running.items()):
            if job.cancelled:
                self.cancelled += 1
                self._end(row, job, None)

    def _admit(self) -> None:
        """Waiting jobs into free rows, first in first out, whatever their settings, each
        into the row `pick_row` gives; their prompts prefilled past the prefix kept, in one
        call."""
        with self.lock:
            n = min(len(self.free), len(self.waiting))
            take, self.waiting = self.waiting[:n], self.waiting[n:]
        if not take:
            return
        appends = {}
        for job in take:
            row, keep = pick_row(self.free, self.held, job.tokens, self.reuse_prefix)
            self.free.remove(row)
            job.row = row
            self.sampler.reset(row, keep)
            appends[row] = list(job.tokens[keep:])
            self.reused += keep
            self.prefilled += len(job.tokens) - keep
            self.held[row] = list(job.tokens)
            self.running[row] = job
        self.sampler.append(appends)
        self.sampler.start([j.row for j in take], {j.row: j.max_new for j in take},
                           {j.row: set(j.stop_ids) for j in take},
                           {j.row: j.stream for j in take})

    def _report(self, ended: dict) -> None:
        """Each running job's new tokens since its last event; a row that ended frees."""
        for row, job in list(self.running.items()):
            g = ended[row] if row in ended else self.sampler.generating[row][0]
            new = Event(tuple(g.tokens[job.sent:]), tuple(g.logprobs[job.sent:]))
            job.sent = len(g.tokens)
            if row in ended:
                stopped = bool(g.tokens) and g.tokens[-1] in job.stop_ids
                self.held[row] = list(job.tokens) + list(g.tokens)
                self._end(row, job, dataclasses.replace(
                    new, finish="stop" if stopped else "length"))
            elif new.tokens:
                self._emit(job, new)

    def _end(self, row: int, job: Job, event: Event | None) -> None:
        g = self.sampler.generating.pop(row, None)
        if g is not None:    # cut before its end: the cache holds what it generated
            self.held[row] = list(job.tokens) + list(g[0].tokens)
        del self.running[row]
        self.free.append(row)
        if event is not None:
            self._emit(job, event)

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.on_event(event)
        except Exception:   # noqa: BLE001 - a client's callback never stops the engine
            log.exception("request callback")
            job.cancel()

    def _fail_all(self, why: str) -> None:
        for row, job in list(self.running.items()):
            self.held[row] = []
            self.sampler.generating.pop(row, None)
            self.sampler.reset(row, 0)
            del self.running[row]
            self.free.append(row)
            self._emit(job, Event((), (), why))
