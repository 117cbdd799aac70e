"""The rollout driver: B tasks x G samples on a fixed number of sampler rows.

Rows advance independently. At each boundary (one decode call), the rows waiting for the
model (to act or to summarize) join the decode batch, the rows whose generation ended leave
it for their environment call, and the others keep decoding; a row whose tool answered
rejoins at the next boundary. A PolicyActor keeps each row's KV cache across turns: it
prefills only the tokens after the longest common prefix of what the row holds and what it
must see now, so within a segment only new tokens are prefilled and after a summary the row
restarts from the cached initial prompt.
Environment calls (building the environment, reset, step, and reading what they return)
run in a pool of worker threads, each under its own deadline; anything an environment
raises or returns that is not what the protocol says, and a call past its deadline, ends
only that rollout (reason env_error / timeout), on every process alike. A worker stuck in a
call is replaced, so hung calls never exhaust the pool. Finished rows free their slot for
queued rollouts.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import jax
import numpy as np

from supo_jax.agent.context import (ENV_FAILURES, FOLD_TOOLS, REASONS, ContextConfig,
                                    RolloutState, Segment, Turn, after_action, after_fold,
                                    after_summary, finish, fold_call, initial_state,
                                    request_tokens, state_from_json, state_to_json)
from supo_jax.agent.render import ChatFormat
from supo_jax.model.policy import Policy
from supo_jax.sampling.sampler import Generation, Sampler, SamplingParams

if TYPE_CHECKING:   # importing supo_jax.envs registers the built-in environments
    from supo_jax.envs.base import Reset


@dataclasses.dataclass(frozen=True)
class Request:
    row: int
    tokens: tuple[int, ...]      # the full context the policy sees (ends with the gen prompt)
    max_new: int
    messages: tuple[dict, ...]   # the same context as chat messages (scripted policies read it)
    summarize: bool
    # the random stream of its tokens (Sampler.start): the driver's (rollout, generation)
    # numbers, so that a rollout's tokens do not depend on the rows it decodes beside
    stream: tuple[int, int] | None = None


class Actor(Protocol):
    def act(self, requests: Sequence[Request]) -> list[Generation]: ...


class Expert(Protocol):
    """A scripted policy (supo_jax.envs.experts): the next action, or the summary when
    `summarize`, given the working context as chat messages."""
    def act(self, messages: list[dict], summarize: bool = False) -> str: ...


class PolicyActor:
    """A Flax policy behind a Sampler whose rows persist across turns.

    reuse_cache=False prefills every request from scratch (no prefix reuse): the
    baseline of benchmarks/rollout.py; it samples the same tokens up to float rounding.
    """

    def __init__(self, policy: Policy, fmt: ChatFormat, rows: int, max_len: int,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 reuse_cache: bool = True) -> None:
        self.sampler = Sampler(policy, rows, max_len)
        self.fmt, self.sampling, self.reuse_cache = fmt, sampling, reuse_cache
        self.rng = jax.random.key(seed)
        self.submitted = 0
        self.row_tokens: dict[int, list[int]] = {}
        self.prefilled = 0  # tokens prefilled (the cost the KV cache reuse saves)

    def _prefill(self, requests: Sequence[Request]) -> None:
        """Each request's row cut back to what it holds in common with the request's
        tokens, and the rest prefilled (one batch)."""
        appends = {}
        for r in requests:
            held = self.row_tokens.get(r.row, [])
            n = _common_prefix(held, r.tokens) if self.reuse_cache else 0
            if n == len(r.tokens):  # the model must see at least one new token
                n -= 1
            self.sampler.reset(r.row, n)
            appends[r.row] = r.tokens[n:]
            self.prefilled += len(r.tokens) - n
            self.row_tokens[r.row] = list(r.tokens)
        self.sampler.append(appends)

    def _streams(self, requests: Sequence[Request]) -> dict[int, tuple[int, int]]:
        """Each request's stream, else a new one of its row's."""
        out = {}
        for r in requests:
            self.submitted += 1
            out[r.row] = r.stream or (-1 - r.row, self.submitted)
        return out

    def act(self, requests: Sequence[Request]) -> list[Generation]:
        """Every request's generation, one batch from start to end (the same tokens as
        submit and advance for the same requests)."""
        self._prefill(requests)
        out = self.sampler.generate([r.row for r in requests], {r.row: r.max_new for r in requests},
                                    set(self.fmt.stop_ids), self.sampling, self.rng,
                                    self._streams(requests))
        for r in requests:
            self.row_tokens[r.row] += out[r.row].tokens
        return [out[r.row] for r in requests]

    # the stream the rollout driver uses: rows join and leave at decode-call boundaries
    def submit(self, requests: Sequence[Request]) -> None:
        """The requests' rows are prefilled and start generating (beside those that are),
        each drawing from its request's stream (else a new one of its row's)."""
        if requests:
            self._prefill(requests)
            self.sampler.start([r.row for r in requests], {r.row: r.max_new for r in requests},
                               set(self.fmt.stop_ids), self._streams(requests))

    def busy(self) -> bool:
        return bool(self.sampler.generating)

    def advance(self) -> dict[int, Generation]:
        """One decode call over the generating rows (at most the sampler's decode_chunk
        steps); {row: Generation} of those that ended in it."""
        ended = self.sampler.advance(self.sampling, self.rng)
        for row, g in ended.items():
            self.row_tokens[row] += g.tokens
        return ended


class _Batched:
    """A batch actor (act(requests) -> generations, e.g. ScriptedActor) as a stream: what
    is submitted at a boundary is generated at once and ends at the next advance."""

    def __init__(self, actor) -> None:
        self.actor, self.ended = actor, {}

    def submit(self, requests: Sequence[Request]) -> None:
        if requests:
            self.ended.update(zip([r.row for r in requests], self.actor.act(requests)))

    def busy(self) -> bool:
        return bool(self.ended)

    def advance(self) -> dict[int, Generation]:
        ended, self.ended = self.ended, {}
        return ended


def streaming(actor):
    """The actor as a stream (submit, busy, advance): itself when it is one."""
    return actor if hasattr(actor, "submit") else _Batched(actor)


class ScriptedActor:
    """A scripted expert (Expert.act(messages, summarize) -> text) speaking through the tokenizer."""

    def __init__(self, expert: Expert, fmt: ChatFormat) -> None:
        self.expert, self.fmt = expert, fmt
        self.cut_summaries = 0   # summaries longer than their budget (cut: they lose state)
        self.actions = self.cut_actions = 0   # actions, and those longer than their budget

    def act(self, requests: Sequence[Request]) -> list[Generation]:
        out = []
        for r in requests:
            # an expert that sizes its moves by the context (FoldingExpert) is told its size
            room = ({"room": (len(r.tokens), self._count)}
                    if getattr(self.expert, "reads_room", False) else {})
            ids = self.fmt.encode(self.expert.act(list(r.messages), r.summarize, **room)) + [
                self.fmt.stop_id]
            if r.summarize and len(ids) > r.max_new:
                self.cut_summaries += 1
                if self.cut_summaries == 1:   # once: a silent 0% otherwise
                    warnings.warn(
                        f"the scripted expert's summary takes {len(ids)} tokens and its budget "
                        f"is {r.max_new} (context.max_summary_tokens, or the room left in W): it "
                        "is cut, which ends the rollout (summary_cut); raise "
                        "context.max_summary_tokens or make the expert's summary() shorter",
                        stacklevel=2)
            if not r.summarize:
                self.actions += 1
                self.cut_actions += len(ids) > r.max_new
            ids = ids[:r.max_new]
            out.append(Generation(ids, [0.0] * len(ids)))
        return out

    def _count(self, text: str) -> int:
        return len(self.fmt.encode(text)) + 1    # + the stop token


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    a_, b_ = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(a_ != b_)[0]
    return int(diff[0]) if diff.size else n


@dataclasses.dataclass
class Rollout:
    task_id: str
    group_id: int
    sample: int
    segments: list[Segment]
    reward: float
    reason: str
    counters: dict
    transcript: list[dict]
    summaries_text: list[str] = dataclasses.field(default_factory=list)
    summary_probes: list = dataclasses.field(default_factory=list)  # env.probe per summary
    dropped: list = dataclasses.field(default_factory=list)  # actions dropped at L (SFT rows)
    # the info of the environment's last step when it ended the episode (JSON values; e.g.
    # BFCL's executed calls per turn, "calls")
    env_info: dict = dataclasses.field(default_factory=dict)
    # [[policy version, tokens it generated], ...] in generation order: the version (the
    # trainer's updates so far) of every generated token (several where the rollout was
    # suspended at a step's token budget and resumed under later weights); [] when untracked
    versions: list = dataclasses.field(default_factory=list)

    @property
    def answered(self) -> bool:
        return self.reason == "answer"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("segments", "dropped"):
            d[k] = [{"tokens": list(s.tokens), "mask": list(s.mask),
                     "logprobs": list(s.logprobs)} for s in getattr(self, k)]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Rollout:
        d = dict(d)
        for k in ("segments", "dropped"):
            d[k] = [Segment(tuple(s["tokens"]), tuple(s["mask"]), tuple(s["logprobs"]))
                    for s in d.get(k, ())]
        return cls(**d)


def _json_values(info: dict) -> dict:
    """The JSON-representable part of a step's info (it may cross processes and is written
    to rollout files)."""
    out = {}
    for k, v in info.items():
        try:
            out[str(k)] = json.loads(json.dumps(v))
        except (TypeError, ValueError):
            continue
    return out


CUT_NOTE = " ...[observation truncated]"


def _cut_observation(fmt: ChatFormat, text: str, limit: int) -> str:
    """Shorten an observation to at most `limit` tokens, saying it was cut (CUT_NOTE)."""
    text = str(text)
    if len(text) > 64 * limit:  # cheap guard before tokenizing huge strings
        text = text[:64 * limit]
    ids = fmt.encode(text)
    if len(ids) <= limit:
        return text
    note = CUT_NOTE
    keep = max(0, limit - len(fmt.encode(note)) - 2)
    return fmt.decode(ids[:keep]) + note


class EnvPool:
    """Daemon worker threads for environment calls. A call past its deadline cannot be
    stopped from Python (a thread cannot be killed), so `abandon` gives its worker a
    replacement: the pool keeps `workers` threads free of late calls, the worker of a late
    call leaves when the call returns, and a call that never returns does not keep the
    process from exiting."""

    def __init__(self, workers: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.late: set = set()      # futures abandoned in a worker: it was replaced
        self.live = 0
        for _ in range(max(1, workers)):
            self._add()

    def _add(self) -> None:
        self.live += 1
        threading.Thread(target=self._work, daemon=True, name="env").start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting driver
                fut.set_exception(e)
            with self.lock:
                if fut in self.late:        # replaced while in this call: leave
                    self.late.discard(fut)
                    self.live -= 1
                    return
        with self.lock:
            self.live -= 1

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.jobs.put((fut, fn, args))
        return fut

    def abandon(self, fut: cf.Future) -> None:
        """Give up on `fut` (past its deadline): cancel it if no worker took it yet, else
        start a worker to replace the one in it."""
        if fut.cancel():
            return
        with self.lock:
            if not fut.done() and fut not in self.late:
                self.late.add(fut)
                self._add()

    def shutdown(self) -> None:
        with self.lock:
            n = self.live
        for _ in range(n):
            self.jobs.put(None)


def _failure(e: BaseException, where: str) -> list:
    """A failed environment call as a rollout outcome: ["timeout" | "queued" | "env_error",
    message]. An exception naming a reason of ENV_FAILURES (its `rollout_reason`) ends the
    rollout with that reason."""
    if isinstance(e, cf.TimeoutError):
        return ["timeout", f"{where}: the environment did not answer in time"]
    if getattr(e, "rollout_reason", None) in ENV_FAILURES:
        return [e.rollout_reason, f"{where}: {e}"[:500]]
    return ["env_error", f"{where}: {e!r}"[:500]]


@dataclasses.dataclass
class Suspended:
    """A rollout to run: a task's sample not started yet (state None), or one cut at a
    step's token budget at its last complete turn (rollout.budget_tokens), with what it
    needs to go on in a later step. Its environment is not kept: resuming builds a fresh one
    from the task and replays `actions` into it, each checked against the digest of what it
    returned the first time (the environment must be deterministic given its task and
    actions; one that is not ends the rollout as env_error). JSON values throughout (a
    checkpoint holds it; every process of a run holds the same)."""
    task: dict
    group_id: int
    sample: int
    state: dict | None = None          # context.state_to_json
    transcript: list = dataclasses.field(default_factory=list)
    summaries: list = dataclasses.field(default_factory=list)
    probes: list = dataclasses.field(default_factory=list)
    actions: list = dataclasses.field(default_factory=list)   # [[action text, digest], ...]
    env_info: dict = dataclasses.field(default_factory=dict)
    generations: int = 0
    versions: list = dataclasses.field(default_factory=list)  # as Rollout.versions
    observations: list = dataclasses.field(default_factory=lambda: [0, 0])  # as _Row's

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Suspended:
        return cls(**d)


class _Row:
    def __init__(self, slot, task, group_id, sample, env, state):
        self.slot, self.task, self.group_id, self.sample = slot, task, group_id, sample
        self.env, self.state = env, state
        self.transcript: list[dict] = list(state.messages)
        self.summaries: list[str] = []
        self.probes: list = []
        self.env_info: dict = {}
        self.generations = 0     # the model's generations so far (its tokens' streams)
        self.actions: list = []  # the environment steps applied: [[action text, digest], ...]
        self.versions: list = []
        self.observations = [0, 0]   # the environment's observations, and those cut at the cap

    def add_tokens(self, version: int, n: int) -> None:
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += n
        else:
            self.versions.append([version, n])

    def suspend(self) -> Suspended:
        """This row, waiting for the model after its last complete turn."""
        return Suspended(self.task, self.group_id, self.sample, state_to_json(self.state),
                         list(self.transcript), list(self.summaries), list(self.probes),
                         [list(a) for a in self.actions], dict(self.env_info),
                         self.generations, [list(v) for v in self.versions],
                         list(self.observations))

    @classmethod
    def resumed(cls, slot: int, s: Suspended, env) -> _Row:
        r = cls(slot, s.task, s.group_id, s.sample, env, state_from_json(s.state))
        r.transcript, r.summaries, r.probes = list(s.transcript), list(s.summaries), list(s.probes)
        r.actions, r.env_info, r.generations = [list(a) for a in s.actions], dict(s.env_info), \
            s.generations
        r.versions = [list(v) for v in s.versions]
        r.observations = list(s.observations)
        return r


def _digest(out: list) -> str:
    """What an environment step returned (observation, done, reward, tool call, role), as a
    short digest: a resumed rollout's replay is checked against it."""
    return hashlib.sha1(json.dumps(out[1:6]).encode()).hexdigest()[:16]


def start_state(fmt: ChatFormat, cfg: ContextConfig, rs: Reset) -> RolloutState:
    """The rollout state of an env.reset() result; a ValueError naming
    context.working_context if its initial prompt does not fit the working context."""
    return _start(fmt, cfg, rs.system, rs.prompt, [t.schema() for t in rs.tools])


# the least room a <state> block sized from W may get (fewer: the run stops at start-up)
MIN_STATE_TOKENS = 16


def _start(fmt: ChatFormat, cfg: ContextConfig, system: str | None, prompt: str,
           tools: list[dict]) -> RolloutState:
    if cfg.state_request:   # state, clear: every reply begins with a <state> block
        prompt = f"{prompt}\n\n{cfg.state_request}"
    if cfg.manager == "fold":
        tools = list(tools) + [dict(t) for t in FOLD_TOOLS]
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    state = initial_state(fmt, msgs, tools)
    if len(state.prefix) >= cfg.limit(fmt):
        raise ValueError(f"the initial prompt ({len(state.prefix)} tokens) does not fit "
                         f"the working context: L = {cfg.limit(fmt)} tokens "
                         f"(W = {cfg.working_context}); raise context.working_context")
    reply = cfg.reply_budget(fmt, len(state.prefix))
    if (cfg.state_request and not cfg.max_state_tokens     # a <state> block sized from W
            and reply - cfg.max_action_tokens < MIN_STATE_TOKENS):
        raise ValueError(
            f"context.manager={cfg.manager} at W = {cfg.working_context} leaves "
            f"{max(0, reply - cfg.max_action_tokens)} tokens for a reply's <state> block beside "
            f"the prompt ({len(state.prefix)} tokens), an action (context.max_action_tokens = "
            f"{cfg.max_action_tokens}) and an observation (context.max_observation_tokens = "
            f"{cfg.max_observation_tokens}); raise context.working_context, lower those two, "
            "or set context.max_state_tokens")
    return dataclasses.replace(state, reply_budget=reply)


class Peers(Protocol):
    """The processes that run one set of rollouts together (supo_jax.rl.multihost.ProcessPeers):
    every process runs the same driver over all rows, with the same sampler calls; the
    environment of a row lives on the process that `owns` its slot, and what it returns
    (reset, step, probe outcomes as plain JSON values) reaches every process by `merge`."""
    def owns(self, slot: int) -> bool: ...
    def merge(self, mine: dict[int, object]) -> dict[int, object]: ...


class OneProcess:
    """Peers of a single-process run: it owns every row; merging is the identity."""
    def owns(self, slot: int) -> bool:
        return True

    def merge(self, mine: dict[int, object]) -> dict[int, object]:
        return mine


GRACE = 0.05   # of a decode call's time, waited for the tool calls made at its end
GATHER = 1.0   # decode calls' time the idle model waits for more calls after the first


def _release(env) -> None:
    """An environment's `release()` hook, where it has one, once its rollout has ended (a
    harness session answers its request in flight: supo_jax.serve.harness). It must not
    block; what it raises is logged, and the rollout stands (it is recorded already)."""
    hook = getattr(env, "release", None)
    if callable(hook):
        try:
            hook()
        except Exception:  # noqa: BLE001 - an environment's hook never fails the run
            logging.getLogger(__name__).exception("an environment's release() failed")


class _Driver:
    """The state of one run_rollouts call. Rows advance independently: at each boundary (one
    decode call of the actor), the rows whose reset or environment step came back join the
    decode batch (their new tokens prefilled), the rows whose generation ended leave it for
    their environment call (a tool step, or the probe of a summary) in the pool, and the
    others keep decoding meanwhile. Where no row is decoding, the driver waits for the first
    of its own environment calls to come back (or pass its deadline). Every process applies
    the same outcomes at the same boundary (peers.merge, once a boundary), so all make the
    same actor calls. rounds=True is the turn-synchronous reference (tests, benchmarks):
    each round generates for every waiting row until all have ended, then waits for all
    their environment calls."""

    def __init__(self, actor, summarizer, make_env, items, fmt, cfg, *, group_size, rows,
                 env_timeout_s, env_workers, progress, peers, rounds=False, budget_tokens=0,
                 version=0, reproducible=False, envs=None):
        self.actor = streaming(actor)
        self.summarizer = (streaming(summarizer) if cfg.manager == "frozen_summarizer"
                           else self.actor)
        self.make_env, self.peers, self.rounds = make_env, peers, rounds
        self.reproducible = reproducible
        # (group, sample) -> the live environment of a suspended rollout in this process,
        # kept across phases (a resume on this process then replays nothing)
        self.envs = {} if envs is None else envs
        self.group_size = group_size
        self.fmt, self.cfg, self.timeout, self.progress = fmt, cfg, env_timeout_s, progress
        self.queue: list[Suspended] = list(items)[::-1]
        self.free = list(range(rows))[::-1]
        self.active: dict[int, _Row] = {}
        self.starting: dict[int, Suspended] = {}    # slot -> its rollout: reset or replay out
        self.generating: set[int] = set()           # slots in the actor's decode batch
        self.ended: dict[int, Generation] = {}      # slot -> its generation, awaiting the env
        self.calls: dict[int, tuple] = {}           # slot -> (kind, future, deadline): mine
        self.built: dict[int, object] = {}          # slot -> the environment a reset built
        self.results: dict[tuple[int, int], Rollout] = {}
        self.pool = EnvPool(env_workers or rows)
        # rollout.budget_tokens: the generated tokens after which the rollouts left are cut
        self.budget, self.version = budget_tokens, version
        self.generated = 0                         # tokens of the generations that ended
        self.suspended: list[Suspended] | None = None   # set by the cut
        self.internal: dict[int, list] = {}     # slot -> the outcome of a fold tool call
        self.decode_s = 0.0                     # the last decode call's seconds

    def running(self) -> bool:
        return self.suspended is None and bool(self.queue or self.active or self.starting)

    def cut(self) -> None:
        """The step's token budget is spent and the turns in flight have ended (step drains
        them: nothing generating, no environment call out): every rollout not ended stops
        at its last complete turn, waiting for the model, with the rollouts not started; all
        in `suspended`, in (group, sample) order. Their environments stay in `envs`."""
        assert not (self.generating or self.ended or self.starting or self.calls)
        out = [r.suspend() for r in self.active.values()]
        for r in self.active.values():
            if r.env is not None:
                self.envs[(r.group_id, r.sample)] = r.env
        self.active, out = {}, out + self.queue
        self.queue = []
        self.suspended = sorted(out, key=lambda x: (x.group_id, x.sample))

    def close(self, row: _Row) -> None:
        st = row.state
        telemetry = getattr(row.env, "telemetry", None)   # an environment's counters (a
        if callable(telemetry):                               # harness session's), whatever
            row.env_info = {**row.env_info, **telemetry()}    # the end
        self.results[(row.group_id, row.sample)] = Rollout(
            task_id=str(row.task.get("task_id", row.group_id)), group_id=row.group_id,
            sample=row.sample, segments=list(st.segments), dropped=list(st.dropped),
            reward=float(st.reward), versions=row.versions,
            reason=st.reason, transcript=row.transcript, summaries_text=row.summaries,
            summary_probes=row.probes, env_info=row.env_info,
            counters=dict(steps=st.steps, tool_calls=st.tool_calls, summaries=st.summaries,
                          generated_tokens=st.generated_tokens,
                          summary_lengths=list(st.summary_lengths),
                          max_context=st.max_context, segments=len(st.segments),
                          effective_context=st.effective_context,
                          cleared=st.results_cleared, states=st.states, folds=st.folds,
                          clear_exhausted=st.clear_exhausted,
                          # the environment's observations, and those cut at
                          # context.max_observation_tokens
                          observations=row.observations[0],
                          observations_cut=row.observations[1]))
        del self.active[row.slot]
        self.free.append(row.slot)
        _release(row.env)
        if self.progress:
            self.progress(1)

    def _call(self, slot: int, kind: str, fn, *args, calls: int = 1) -> None:
        self.calls[slot] = (kind, self.pool.submit(fn, *args),
                            time.monotonic() + self.timeout * calls)

    def start_rows(self) -> None:
        """Fill free slots from the queue: the process that owns a slot builds and resets
        its environment in the pool (and replays a resumed rollout's actions into it)."""
        while self.free and self.queue:
            item = self.queue.pop()
            slot = self.free.pop()
            self.starting[slot] = item
            kept = self.envs.pop((item.group_id, item.sample), None)
            if self.peers.owns(slot):
                if item.state is None:
                    self._call(slot, "reset", self._reset, item.task)
                elif kept is not None:
                    self._call(slot, "reset", lambda env: (env, ["resumed"]), kept)
                else:
                    self._call(slot, "reset", self._replay, item, calls=1 + len(item.actions))

    def _reset(self, task: dict) -> tuple[object, list]:
        """In a pool worker: a new environment for `task` and its reset as plain values."""
        env = self.make_env()
        if hasattr(env, "call_formats"):   # Environment: read the template's call forms
            env.call_formats = self.fmt.call_formats
        if hasattr(env, "renders_tools"):  # whether the template shows the tools
            env.renders_tools = self.fmt.renders_tools
        rs = env.reset(task)
        if not isinstance(rs.prompt, str) or not isinstance(rs.system, (str, type(None))):
            raise TypeError(f"reset returned a prompt of type {type(rs.prompt).__name__} and "
                            f"a system of type {type(rs.system).__name__}: text expected")
        return env, ["ok", rs.system, rs.prompt,
                     json.loads(json.dumps([t.schema() for t in rs.tools]))]

    def _replay(self, item: Suspended) -> tuple[object, list]:
        """In a pool worker: a fresh environment for a suspended rollout, its actions
        replayed into it (each must return what it did the first time)."""
        env, _ = self._reset(item.task)
        for i, (action, digest) in enumerate(item.actions):
            out = self._step(env, action)
            if out[2] or out[-1] != digest:
                raise RuntimeError(
                    f"resuming the rollout: action {i + 1} of {len(item.actions)} replayed into "
                    "a fresh environment returned other than it did (the environment is not "
                    "deterministic given its task and actions)")
        return env, ["resumed"]

    def _started(self, slot: int, outcome: list) -> None:
        """A reset's outcome: the row starts (or goes on, resumed), or (a build, reset or
        replay that failed, timed out or returned what is not a prompt, or a prompt over L)
        its rollout ends at once."""
        item = self.starting.pop(slot)
        task, gi, s = item.task, item.group_id, item.sample
        env = self.built.pop(slot, None)
        kind, *rest = outcome
        if item.state is not None:
            row = self.active[slot] = _Row.resumed(slot, item, env)
            if kind != "resumed":
                row.state = finish(row.state, kind)
                row.transcript.append({"role": "error", "content": rest[0]})
                self.close(row)
            return
        if kind == "ok":
            try:
                self.active[slot] = _Row(slot, task, gi, s, env, _start(self.fmt, self.cfg, *rest))
                return
            except ValueError as e:
                kind, rest = "context_limit", [f"reset: {e!r}"[:500]]
        row = _Row(slot, task, gi, s, env, RolloutState("", (), (), (), ()))
        self.active[slot] = row
        row.state = finish(row.state, kind, close=False)
        row.transcript.append({"role": "error", "content": rest[0]})
        self.close(row)

    def submit_ready(self) -> None:
        """Every row waiting for the model joins its actor's decode batch (one submit per
        actor: one in all when the summarizer is the acting policy)."""
        cfg, by_actor = self.cfg, {}
        for slot in sorted(self.active):
            r = self.active[slot]
            if slot in self.generating or slot in self.ended or r.state.phase == "done":
                continue
            toks = request_tokens(self.fmt, r.state)
            is_sum = r.state.phase == "summarize"
            budget = cfg.budget(len(toks), is_sum, r.state.reply_budget)   # >= 1: the
            # manager leaves room
            a = self.summarizer if is_sum else self.actor
            by_actor.setdefault(id(a), (a, []))[1].append(Request(
                slot, toks, budget, r.state.messages, is_sum,
                stream=(r.group_id * self.group_size + r.sample, r.generations)))
            r.generations += 1
            self.generating.add(slot)
        for a, reqs in by_actor.values():
            a.submit(reqs)

    def advance(self) -> None:
        """One boundary's decoding (every row to its end in rounds mode); the rows whose
        generation ended leave for their environment call."""
        actors = [self.actor] + ([self.summarizer] if self.summarizer is not self.actor else [])
        while True:
            for a in actors:
                if a.busy():
                    for slot, g in a.advance().items():
                        self.generating.discard(slot)
                        self.ended[slot] = g
                        self.generated += len(g.tokens)
                        r = self.active[slot]
                        text = self.fmt.action_text(g.tokens)
                        if self.cfg.manager == "fold" and r.state.phase != "summarize" and (
                                op := fold_call(text)) is not None:
                            self.internal[slot] = ["fold", *op]   # the driver's own tools,
                            continue                              # alike on every process
                        if r.env is None:          # a row another process owns
                            continue
                        if r.state.phase == "summarize":
                            self._call(slot, "probe", self._probe, r.env, text)
                        else:
                            self._call(slot, "step", self._step, r.env, text)
            if not (self.rounds and any(a.busy() for a in actors)):
                return

    def collect(self, wait: bool) -> dict:
        """The outcomes of my environment calls that came back (or passed their deadline:
        abandoned, a timeout). wait: first wait for one of them (all of them in rounds mode)."""
        if wait and self.calls:
            futs = [f for _, f, _ in self.calls.values()]
            until = (max if self.rounds else min)(d for _, _, d in self.calls.values())
            cf.wait(futs, timeout=max(0.0, until - time.monotonic()),
                    return_when=cf.ALL_COMPLETED if self.rounds else cf.FIRST_COMPLETED)
            if not self.rounds and not all(f.done() for f in futs):
                # the model waits for the calls anyway: the others that come back within
                # GATHER decode calls' time join the same decode call, not a later one each
                cf.wait(futs, timeout=min(GATHER * self.decode_s,
                                          max(0.0, max(d for _, _, d in self.calls.values())
                                              - time.monotonic())))
        mine, now = {}, time.monotonic()
        for slot, (kind, f, deadline) in list(self.calls.items()):
            if f.done():
                out = f.exception() or f.result()
            elif now >= deadline:
                self.pool.abandon(f)
                out = cf.TimeoutError()
            else:
                continue
            del self.calls[slot]
            if kind == "probe":
                mine[slot] = ["probe", None if isinstance(out, BaseException) else out]
            elif isinstance(out, BaseException):
                mine[slot] = _failure(out, kind)
            elif kind == "reset":
                self.built[slot], mine[slot] = out
            else:
                mine[slot] = self._observation(out)
        return mine

    def apply(self, got: dict) -> None:
        """Every process applies the same outcomes, in slot order."""
        for slot in sorted(got):
            if slot in self.starting:
                self._started(slot, got[slot])
                continue
            r, g = self.active[slot], self.ended.pop(slot)
            if got[slot][0] == "fold":
                self.apply_fold(r, g, *got[slot][1:])
            elif r.state.phase == "summarize":
                self.apply_summary(r, g, got[slot][1])
            else:
                self.apply_env_result(r, g, got[slot])
            if r.state.phase == "done":
                self.close(r)

    @staticmethod
    def _probe(env, summary: str):
        """In a pool worker: whether a summary carries the state needed to continue
        (env.probe: a metric; None where it cannot say)."""
        try:
            v = env.probe(summary)
        except Exception:  # noqa: BLE001
            return None
        return None if v is None else bool(v)      # plain: it may cross processes as JSON

    def _step(self, env, action: str) -> list:
        """In a pool worker: env.act(action) as plain values, ["ok", observation (None when
        done), done, reward, whether it was a tool call, the observation's role, the step's
        info when it ended the episode]; raises if the result breaks the protocol."""
        res = env.act(action)
        done, reward, info = bool(res.done), float(res.reward), res.info or {}
        if not np.isfinite(reward):
            raise ValueError(f"the step's reward is {reward}: a finite number expected")
        if not isinstance(info, dict):
            raise TypeError(f"the step's info is a {type(info).__name__}: a dict expected")
        obs = None if done else str(res.observation)[:64 * self.cfg.max_observation_tokens]
        role = "user" if getattr(res, "role", "tool") == "user" else "tool"
        tool_call = "error" not in info and info.get("tool_call") is not False
        out = ["ok", obs, done, reward, tool_call, role, _json_values(info) if done else {}]
        return out + [_digest(out)]

    def _observation(self, out: list) -> list:
        """A step's outcome with its observation cut to max_observation_tokens (here, not in
        the worker: the tokenizer is not called from several threads)."""
        if out[1] is None:
            return out
        try:
            return [out[0], _cut_observation(self.fmt, out[1], self.cfg.max_observation_tokens),
                    *out[2:]]
        except Exception as e:  # noqa: BLE001
            return _failure(e, "observation")

    def apply_summary(self, r: _Row, g: Generation, probe) -> None:
        cfg = self.cfg
        text = self.fmt.action_text(g.tokens)
        turn = Turn(tuple(g.tokens), tuple(g.logprobs), text)
        r.add_tokens(self.version, len(g.tokens))
        r.transcript += [{"role": cfg.summary_role, "content": cfg.summary_instruction},
                         {"role": "assistant", "content": text, "summary": True}]
        r.state = after_summary(cfg, self.fmt, r.state, turn,
                                trained=cfg.manager != "frozen_summarizer")
        if r.state.reason == "summary_cut":
            r.transcript[-1]["cut"] = True
            return
        r.summaries.append(text)
        r.probes.append(probe)
        r.transcript.append(dict(r.state.messages[-1], continuation=True))

    def apply_fold(self, r: _Row, g: Generation, name: str, argument: str) -> None:
        """A call of the fold manager's branch or return (context.after_fold)."""
        text = self.fmt.action_text(g.tokens)
        r.add_tokens(self.version, len(g.tokens))
        argument = _cut_observation(self.fmt, argument, self.cfg.max_observation_tokens)
        r.state = after_fold(self.cfg, self.fmt, r.state, Turn(tuple(g.tokens),
                                                              tuple(g.logprobs), text),
                             name, argument)
        told = next(m for m in reversed(r.state.messages) if m["role"] == "tool")  # (a user
        r.transcript += [{"role": "assistant", "content": text},       # request kept after a
                         dict(told, fold=name)]                         # fold is in already)

    def apply_env_result(self, r: _Row, g: Generation, result: list) -> None:
        """An action's environment result (a timeout or an exception ends that rollout)."""
        text = self.fmt.action_text(g.tokens)
        turn = Turn(tuple(g.tokens), tuple(g.logprobs), text)
        r.transcript.append({"role": "assistant", "content": text})
        r.add_tokens(self.version, len(g.tokens))
        kind, *rest = result
        if kind != "ok":
            r.state = finish(r.state, kind)
            r.transcript.append({"role": "error", "content": rest[0]})
            return
        obs, done, reward, tool_call, role, final, digest = rest
        r.actions.append([text, digest])
        r.env_info = final
        if obs is not None:
            r.transcript.append({"role": role, "content": obs})
            r.observations[0] += 1
            r.observations[1] += str(obs).endswith(CUT_NOTE)
        n = len(r.state.tokens)
        r.state = after_action(self.cfg, self.fmt, r.state, turn, obs, done, reward,
                               tool_call=tool_call, role=role)
        if r.state.phase == "summarize" and len(r.state.tokens) == n:
            for m in r.transcript[-2:]:   # the pair reached L and left the context
                m["dropped"] = True

    def step(self) -> None:
        """One boundary: start rows in free slots, rows waiting for the model join the
        decode batch, one decode call, ended rows' environment calls go to the pool, the
        outcomes back by now are shared between processes and applied. In rounds mode, the
        starts' resets are waited for and applied first, and every call runs to its end.
        With the step's token budget spent, nothing starts (no rollout, no generation) and
        the turns in flight run to their end (their generations, then their environment
        calls); then the cut."""
        spent = self.budget and self.generated >= self.budget   # alike on every process
        if spent and not (self.generating or self.ended or self.starting):
            self.cut()
            return
        t_model = time.perf_counter()
        if not spent:
            self.start_rows()
            if self.rounds and self.starting:
                self.apply(self.peers.merge(self.collect(wait=True)))
            t_model = time.perf_counter()
            self.submit_ready()
        t0, made = time.perf_counter(), len(self.calls)
        decoding = self.actor.busy() or self.summarizer.busy()
        self.advance()
        if decoding:   # the model's time at this boundary: prefills (submit) and decoding
            self.decode_s = time.perf_counter() - t_model
        busy = self.actor.busy() or self.summarizer.busy()   # the same on every process
        if self.reproducible and self.calls:
            # every call answers by the next boundary: the schedule depends on the tokens only
            cf.wait([f for _, f, _ in self.calls.values()],
                    timeout=max(0.0, max(d for _, _, d in self.calls.values()) - time.monotonic()))
        elif busy and len(self.calls) > made:
            # calls made at this boundary that answer at once (local tools) rejoin at the
            # next one: a grace of GRACE x this decode call's time, so it costs at most that
            fresh = [f for _, f, _ in list(self.calls.values())[made:]]
            cf.wait(fresh, timeout=GRACE * (time.perf_counter() - t0))
        # nothing decoding: wait for an environment call of mine
        got = self.peers.merge(self.collect(wait=not (busy or self.internal)))
        got.update(self.internal)
        self.internal = {}
        self.apply(got)


def run_rollouts(actor: Actor, make_env: Callable[[], object], tasks: Sequence[dict],
                 fmt: ChatFormat, cfg: ContextConfig, *, group_size: int = 1, rows: int = 8,
                 summarizer: Actor | None = None, env_timeout_s: float = 30.0,
                 env_workers: int | None = None, progress: Callable[[int], None] | None = None,
                 peers: Peers | None = None, rounds: bool = False,
                 reproducible: bool = False) -> list[Rollout]:
    """Run group_size rollouts of every task; returns them in (task, sample) order.

    make_env() builds a fresh environment per rollout. Environment calls run in env_workers
    threads (default: one a row, so that every call starts when it is made: env_timeout_s
    is each call's own deadline). Rows advance independently (_Driver); an actor with
    submit/busy/advance (PolicyActor) decodes in chunks that rows join and leave, another
    (act(requests) -> generations) answers each boundary's requests at once.
    rounds=True: the turn-synchronous reference (each round waits for its longest action
    and its slowest environment call). reproducible=True: every environment call's outcome
    joins at the boundary after the one it was made at (the driver waits for it there), so
    the rows' schedule, and with it every sampler call, depends on the tokens alone: runs
    repeat to the bit. With the frozen_summarizer manager, `summarizer` writes the summaries
    (not trained).
    Several processes (peers: rl.multihost.ProcessPeers) call this together with the same
    arguments: each steps the environments of the rows it owns, all make the same sampler
    calls over all rows, and all return the same rollouts.
    """
    items = [Suspended(t, gi, s) for gi, t in enumerate(tasks) for s in range(group_size)]
    done, _, _ = rollout_phase(actor, make_env, items, fmt, cfg, group_size=group_size,
                               rows=rows, summarizer=summarizer, env_timeout_s=env_timeout_s,
                               env_workers=env_workers, progress=progress, peers=peers,
                               rounds=rounds, reproducible=reproducible)
    return [done[(gi, s)] for gi in range(len(tasks)) for s in range(group_size)]


def rollout_phase(actor: Actor, make_env: Callable[[], object], items: Sequence[Suspended],
                  fmt: ChatFormat, cfg: ContextConfig, *, group_size: int, rows: int = 8,
                  budget_tokens: int = 0, version: int = 0, summarizer: Actor | None = None,
                  env_timeout_s: float = 30.0, env_workers: int | None = None,
                  progress: Callable[[int], None] | None = None, peers: Peers | None = None,
                  rounds: bool = False, reproducible: bool = False, envs: dict | None = None
                  ) -> tuple[dict[tuple[int, int], Rollout], list[Suspended], dict]:
    """run_rollouts over rollouts to start or resume (`items`, started in their order; a
    rollout's random stream is group_id x group_size + sample, so (group, sample) pairs are
    distinct). budget_tokens > 0: once the generations that ended have that many tokens,
    nothing new starts, the turns in flight end, and the rollouts not ended are cut
    (_Driver.cut) and returned to go on in a later phase.
    version: the policy version (the trainer's updates so far) their new tokens are tagged
    with (Rollout.versions). envs: a dict the caller passes to every phase: the environments
    of rollouts suspended in this process that no call has touched since are kept in it, and a
    resume on this process takes its own back instead of replaying its actions into a new
    one. Returns ({(group, sample): ended rollout}, the suspended,
    {"generated_tokens"})."""
    if cfg.manager == "frozen_summarizer" and summarizer is None:
        raise ValueError("context manager frozen_summarizer needs a summarizer actor")
    d = _Driver(actor, summarizer, make_env, items, fmt, cfg, group_size=group_size, rows=rows,
                env_timeout_s=env_timeout_s, env_workers=env_workers, progress=progress,
                peers=peers or OneProcess(), rounds=rounds, budget_tokens=budget_tokens,
                version=version, reproducible=reproducible, envs=envs)
    try:
        while d.running():
            d.step()
    finally:
        d.pool.shutdown()
    return d.results, d.suspended or [], {"generated_tokens": d.generated}


def write_jsonl(rollouts: Sequence[Rollout], path: str) -> None:
    from supo_jax import storage

    storage.write_text(path, "".join(json.dumps(r.to_json()) + "\n" for r in rollouts))


def _share(xs):
    xs = [x for x in xs if x is not None]
    return sum(map(bool, xs)) / len(xs) if xs else float("nan")


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _harness_telemetry(rollouts: Sequence[Rollout]) -> dict:
    """Harness sessions' counters summed over the rollouts that have them (harness mode:
    supo_jax.serve.harness.HarnessEnv.telemetry); {} when none has."""
    infos = [r.env_info for r in rollouts if "requests" in (r.env_info or {})]
    if not infos:
        return {}
    return {f"harness_{k}": sum(i.get(k, 0) for i in infos)
            for k in ("requests", "retemplated", "rewritten", "sampling_ignored")}


def summarize(rollouts: Sequence[Rollout]) -> dict:
    """Aggregate metrics of docs/SUPO.md §7 over a batch of rollouts."""
    n = max(1, len(rollouts))
    with_sum = [r for r in rollouts if r.counters["summaries"] > 0]
    return {
        "rollouts": len(rollouts),
        "success_rate": sum(r.reward > 0 and r.answered for r in rollouts) / n,
        "reward_mean": sum(r.reward for r in rollouts) / n,
        "steps_mean": sum(r.counters["steps"] for r in rollouts) / n,
        "tool_calls_mean": sum(r.counters["tool_calls"] for r in rollouts) / n,
        "summaries_mean": sum(r.counters["summaries"] for r in rollouts) / n,
        "cleared_mean": sum(r.counters.get("cleared", 0) for r in rollouts) / n,
        "clear_exhausted_mean": sum(r.counters.get("clear_exhausted", 0) for r in rollouts) / n,
        "states_mean": sum(r.counters.get("states", 0) for r in rollouts) / n,
        "folds_mean": sum(r.counters.get("folds", 0) for r in rollouts) / n,
        "p_summary": len(with_sum) / n,
        "p_success_given_summary": (sum(r.reward > 0 for r in with_sum) / len(with_sum)
                                    if with_sum else float("nan")),
        "working_context_mean": sum(r.counters["max_context"] for r in rollouts) / n,
        "working_context_max": max((r.counters["max_context"] for r in rollouts), default=0),
        "effective_context_mean": _mean([r.counters.get("effective_context", 0) for r in rollouts]),
        "effective_context_max": max((r.counters.get("effective_context", 0) for r in rollouts),
                                     default=0),
        "generated_tokens_mean": sum(r.counters["generated_tokens"] for r in rollouts) / n,
        "overlong_rate": sum(not r.answered for r in rollouts) / n,
        "env_error_rate": sum(r.reason in ENV_FAILURES for r in rollouts) / n,
        "summary_cut_rate": sum(r.reason == "summary_cut" for r in rollouts) / n,
        "summary_state_share": _share([p for r in rollouts for p in r.summary_probes]),
        "summary_length_mean": _mean([x for r in rollouts for x in r.counters["summary_lengths"]]),
        # the share of the environment's observations cut at context.max_observation_tokens
        "observation_cut_rate": (sum(r.counters.get("observations_cut", 0) for r in rollouts)
                                 / max(1, sum(r.counters.get("observations", 0) for r in rollouts))),
        # a reset (a summary, or any new segment): the working context's tokens at its end
        # (the summary included) and the next segment's before its first generated token
        "reset_context_before_mean": _mean([len(s) for r in rollouts for s in r.segments[:-1]]),
        "reset_context_after_mean": _mean([s.mask.index(1) if 1 in s.mask else len(s)
                                           for r in rollouts for s in r.segments[1:]]),
        **_harness_telemetry(rollouts),
        "reasons": {k: sum(r.reason == k for r in rollouts) for k in REASONS
                    if any(r.reason == k for r in rollouts)},
    }
