"""The batched rollout driver with scripted experts and with a real (tiny) policy."""
import functools
import time

import numpy as np
import pytest

from supo_jax.agent.context import ContextConfig as _ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent import rollout as rollout_mod
from supo_jax.agent.rollout import (PolicyActor, Rollout, ScriptedActor, Suspended, rollout_phase,
                                    run_rollouts, summarize)
from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, make_env, make_tasks
from supo_jax.envs.fncall import expert_for
from supo_jax.model.policy import new_policy
from supo_jax.model.tiny import tiny_config, tiny_tokenizer
from supo_jax.sampling.sampler import SamplingParams
from tests.helpers import same_rollouts

# W is small in these tests: the reserve rule keeps a full summary request within W (the paper's
# L = 0.95 W leaves too little room there); tests/test_context_bound.py covers both rules
ContextConfig = functools.partial(_ContextConfig, trigger_rule="reserve")

FAMILIES = ["tallest", "pages", "chain", "graph"]


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(tiny_tokenizer())


def _run(fmt, name, cfg, n=3, group=2, rows=4, actor=None, **kw):
    tasks = make_tasks(name, "train", n, seed=0, size=12)
    actor = actor or ScriptedActor(expert_for(name), fmt)
    return run_rollouts(actor, lambda: make_env(name), tasks, fmt, cfg, group_size=group,
                        rows=rows, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_succeeds_with_supo_and_fails_with_full_at_same_W(fmt, family):
    name = f"fncall/{family}"
    W = 1350
    supo = _run(fmt, name, ContextConfig("supo", W, max_steps=200, max_summaries=10,
                                         max_summary_tokens=128))
    full = _run(fmt, name, ContextConfig("full", W, max_steps=200))
    assert all(r.reason == "answer" and r.reward == 1.0 for r in supo)
    assert sum(r.counters["summaries"] for r in supo) > 0
    assert summarize(full)["success_rate"] < 1.0
    assert any(r.reason == "context_limit" for r in full)
    # with a context large enough for the whole history, full succeeds too
    big = _run(fmt, name, ContextConfig("full", 20_000, max_steps=200))
    assert all(r.reward == 1.0 for r in big)


def test_segment_invariants(fmt):
    cfg = ContextConfig("supo", 1350, max_steps=200, max_summaries=10, max_action_tokens=96,
                        max_summary_tokens=128)
    bound = cfg.working_context            # W is a hard bound on every row
    for r in _run(fmt, "fncall/pages", cfg, n=4):
        assert r.reason == "answer"
        assert len(r.segments) == r.counters["summaries"] + 1
        for s in r.segments:
            assert len(s.tokens) <= bound
            assert len(s.tokens) == len(s.mask) == len(s.logprobs)
        prefix = None
        for s in r.segments[1:]:
            # every segment after a summary starts with s1 followed by the continuation turn
            prefix = prefix or _common(r.segments[0].tokens, s.tokens)
            assert prefix > 0 and s.tokens[:prefix] == r.segments[0].tokens[:prefix]
            cont = fmt.decode(s.tokens[prefix:prefix + 200])
            assert "We are in the following stage" in cont
        # the summary ends each non-final segment and is trained
        for s in r.segments[:-1]:
            assert "</summary>" in fmt.decode(s.tokens[-40:]) and s.mask[-1] == 1
        # each summary dropped one action (it reached L): recorded as its context + the action
        # alone trained; that context is the summarized segment's context before the summary turn
        assert len(r.dropped) == r.counters["summaries"]
        for seg, d in zip(r.segments, r.dropped):
            first = d.mask.index(1)
            assert all(d.mask[first:]) and not any(d.mask[:first])
            assert "<tool_call>" in fmt.decode(d.tokens[first:])
            ctx = first - len(fmt.gen_prompt)   # then the summary request / this action differ
            assert d.tokens[:ctx] == seg.tokens[:ctx] and d.tokens[ctx:first] == tuple(fmt.gen_prompt)
            assert len(d.tokens) >= cfg.limit(fmt) - cfg.max_observation_tokens
            assert len(d.tokens) <= bound
        assert cfg.row_bound(fmt) == bound


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_caps_are_respected(fmt):
    r = _run(fmt, "fncall/chain", ContextConfig("supo", 1350, max_steps=200, max_summaries=0,
                                                max_summary_tokens=128))
    assert all(x.reason == "max_summaries" and x.counters["summaries"] == 0 for x in r)
    for x in r:
        # the action that reached L is dropped as at a summary, not trained in the last row
        (seg,), d = x.segments, x.dropped[-1]
        assert len(x.dropped) == 1
        first = d.mask.index(1)
        assert seg.tokens == d.tokens[:len(seg.tokens)] and seg.mask[-1] == 1
        assert len(seg.tokens) < first - len(fmt.gen_prompt)
    r = _run(fmt, "fncall/chain", ContextConfig("supo", 1350, max_steps=5, max_summaries=10,
                                                max_summary_tokens=128))
    assert all(x.reason == "max_steps" and x.counters["steps"] == 5 for x in r)


def test_truncate_and_window_managers_run(fmt):
    for m in ("truncate", "window"):
        ro = _run(fmt, "fncall/tallest", ContextConfig(m, 1350, max_steps=40, window_turns=3))
        for r in ro:
            assert r.reason in ("answer", "max_steps")
            assert r.counters["max_context"] <= 1350 + 96
            assert len(r.segments) >= 2   # cutting the context starts a new segment


class _Bulky(Environment):
    """Each ping returns a long result (a page of data); the 10th call is the answer."""
    name = "bulky"
    tools = (ToolSpec("ping", "ping", {"type": "object", "properties": {}}),)

    def reset(self, task):
        self.n = 0
        return Reset("Ping ten times.", list(self.tools))

    def step(self, name, arguments):
        self.n += 1
        return StepResult(f"result {self.n}: " + "data " * 60, done=self.n == 10,
                          reward=1.0)


class _Pinger:
    def act(self, messages, summarize):
        return '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("manager", ["truncate", "window"])
def test_truncate_and_window_keep_the_newest_turns_they_document(fmt, manager):
    """What the policy sees before each call: truncate keeps the newest turns, as many as fit
    below L (all of them until the context first reaches L, then as many as fit); window keeps
    the newest window_turns (here W never binds). Each in order, below L."""
    seen = []

    class Recording(ScriptedActor):
        def act(self, requests):
            seen.extend((len(r.tokens), [m["content"] for m in r.messages if m["role"] == "tool"])
                        for r in requests)
            return super().act(requests)

    cfg = ContextConfig(manager, 1200 if manager == "truncate" else 8000, max_steps=20,
                        window_turns=3)
    (r,) = run_rollouts(Recording(_Pinger(), fmt), _Bulky, [{"task_id": "t"}], fmt, cfg, rows=1)
    assert r.reason == "answer" and len(seen) == 10
    kept = []
    for t, (n_tokens, results) in enumerate(seen):    # t results so far
        ns = [int(x.split(":")[0].split()[1]) for x in results]
        assert ns == list(range(t - len(ns) + 1, t + 1)), (t, ns)    # the newest, in order
        assert n_tokens - len(fmt.gen_prompt) < cfg.limit(fmt)
        kept.append(len(ns))
    if manager == "window":
        assert kept == [min(t, 3) for t in range(10)]
    else:
        assert 1 <= max(kept) < 9 and kept == [min(t, max(kept)) for t in range(10)]


def test_clear_replaces_the_oldest_tool_results_and_keeps_the_rest(fmt):
    """Tool-result clearing at L: the oldest tool results read CLEARED (oldest first), the
    actions and the prompt stay, the context is back below L in a new segment, and the
    rollout answers where `full` ends at its limit."""
    from supo_jax.agent.context import CLEARED

    def run(manager):
        return run_rollouts(ScriptedActor(_Pinger(), fmt), _Bulky, [{"task_id": "t"}], fmt,
                            ContextConfig(manager, 1200, max_steps=20, max_state_tokens=256),
                            rows=1)

    assert [r.reason for r in run("full")] == ["context_limit"]
    ro = run("clear")
    r = ro[0]
    assert r.reason == "answer" and r.counters["steps"] == 10 and r.counters["cleared"] > 0
    assert r.counters["max_context"] <= 1200
    k = r.counters["cleared"]
    assert len(r.segments) >= 2                 # a cleared context starts a new segment
    last = fmt.decode(r.segments[-1].tokens)    # the working context the answer came in
    assert last.count(CLEARED) == k and "result 1:" not in last and "result 9:" in last
    call = '<tool_call>\n{"name": "ping", "arguments": {}}'
    assert "Ping ten times." in last and last.count(call) == 10     # the actions stay
    assert summarize(ro)["cleared_mean"] == k


class _Flaky(Environment):
    name = "flaky"
    tools = (ToolSpec("ping", "ping", {"type": "object", "properties": {}}),)

    def reset(self, task):
        self.mode = task["mode"]
        return Reset("Ping until done.", list(self.tools))

    def step(self, name, arguments):
        if self.mode == "crash":
            raise RuntimeError("backend exploded")
        if self.mode == "hang":
            time.sleep(3)
        return StepResult("pong")


def test_env_failures_end_only_their_rollout(fmt):
    tasks = [{"task_id": m, "mode": m} for m in ("ok", "crash", "hang")]
    ro = run_rollouts(ScriptedActor(_Pinger(), fmt), _Flaky, tasks, fmt,
                      ContextConfig("full", 2000, max_steps=3), rows=3, env_timeout_s=0.5)
    assert [r.reason for r in ro] == ["max_steps", "env_error", "timeout"]
    assert "backend exploded" in ro[1].transcript[-1]["content"]


class _Broken(Environment):
    """An environment that breaks the protocol as it is built to (the next of `modes`):
    raising when built, returning a prompt that is not text, a reward that is not a number,
    NaN, an info that is not a dict, an observation whose str() raises."""
    name = "broken"
    tools = _Flaky.tools
    modes = iter(())

    def __init__(self):
        self.mode = next(self.modes)
        if self.mode == "init":
            raise RuntimeError("cannot reach the tool server")

    def reset(self, task):
        return Reset(b"bytes" if self.mode == "prompt" else "Ping until done.", list(self.tools))

    def step(self, name, arguments):
        return StepResult("pong")

    def act(self, text):
        class Unprintable:
            def __str__(self):
                raise ValueError("no text")
        return {"reward": StepResult("pong", reward="high"),
                "nan": StepResult("pong", reward=float("nan")),
                "info": StepResult("pong", info=["not", "a", "dict"]),
                "obs": StepResult(Unprintable()),
                }.get(self.mode, StepResult("pong"))


def test_environments_that_break_the_protocol_fail_their_rollout_only(fmt):
    """Whatever an environment raises or returns out of protocol -- when built, in reset, in
    its step's reward, info or observation -- ends its own rollout as env_error, naming the
    cause; the healthy rollout of the batch runs to its end."""
    modes = ["ok", "init", "prompt", "reward", "nan", "info", "obs"]
    _Broken.modes = iter(modes)

    tasks = [{"task_id": m} for m in modes]
    ro = run_rollouts(ScriptedActor(_Pinger(), fmt), _Broken, tasks, fmt,
                      ContextConfig("full", 2000, max_steps=3), rows=len(modes))
    assert sorted(r.reason for r in ro) == ["env_error"] * 6 + ["max_steps"]
    said = " ".join(r.transcript[-1]["content"] for r in ro if r.reason == "env_error")
    for cause in ["cannot reach the tool server", "prompt of type bytes",
                  "could not convert string to float: 'high'", "reward is nan",
                  "info is a list", "no text"]:
        assert cause in said, (cause, said)


class _Hang(Environment):
    """Hangs in step until released (a tool that never answers), or answers at once."""
    name = "hang"
    tools = _Flaky.tools
    release = None

    def reset(self, task):
        self.hang = task["hang"]
        return Reset("Ping until done.", list(self.tools))

    def step(self, name, arguments):
        if self.hang:
            self.release.wait()
        return StepResult("pong")


def test_hung_calls_cost_one_timeout_each_and_never_exhaust_the_pool(fmt):
    """20 rollouts whose tool never answers, with 4 healthy ones, on 4 rows (a worker each):
    a hung call costs its row one timeout (each call its own deadline; the rows go on
    meanwhile), and the workers stuck in hung calls are replaced, so later resets and steps
    still run (the healthy rollouts end at max_steps, the hung ones as timeouts of a step)."""
    import threading

    _Hang.release = threading.Event()
    rounds = []

    class Rounds(ScriptedActor):
        def act(self, requests):
            rounds.append(len(requests))
            return super().act(requests)

    tasks = [{"task_id": i, "hang": i % 6 != 0} for i in range(24)]
    timeout = 0.4
    t0 = time.perf_counter()
    try:
        ro = run_rollouts(Rounds(_Pinger(), fmt), _Hang, tasks, fmt,
                          ContextConfig("full", 2000, max_steps=2), rows=4,
                          env_timeout_s=timeout)
    finally:
        _Hang.release.set()
    took = time.perf_counter() - t0
    assert [r.reason for r in ro] == ["max_steps" if t["hang"] is False else "timeout"
                                      for t in tasks]
    assert all("step" in r.transcript[-1]["content"] for r in ro if r.reason == "timeout")
    assert took < len(rounds) * timeout + 2.0, (took, len(rounds))


def test_initial_prompt_larger_than_W_fails_its_rollout_only(fmt):
    """A task whose prompt does not fit W, anywhere in the batch, ends its own rollouts
    (context_limit, the reason in the transcript); the others run. The trainer's start-time
    check still names context.working_context."""
    from supo_jax.agent.rollout import start_state
    from supo_jax.envs.base import Reset

    class Sized(Environment):
        tools = (ToolSpec("finish", "answer", {"type": "object", "properties": {}}),)

        def reset(self, task):
            return Reset("word " * task["words"], list(self.tools))

        def step(self, name, arguments):
            return StepResult("ok", done=True, reward=1.0)

    class Finisher:
        def act(self, messages, summarize):
            return '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>'

    cfg = ContextConfig("supo", 1000, max_summary_tokens=32)
    tasks = [{"task_id": str(i), "words": w} for i, w in enumerate((5, 2000, 5))]
    ro = run_rollouts(ScriptedActor(Finisher(), fmt), Sized, tasks, fmt, cfg, rows=2)
    assert [r.reason for r in ro] == ["answer", "context_limit", "answer"]
    assert "initial prompt" in ro[1].transcript[-1]["content"]
    with pytest.raises(ValueError, match="working_context"):
        start_state(fmt, cfg, Sized().reset(tasks[1]))


class _Recorder:
    """Wraps an actor and records every (request tokens, output) the sampler produced."""

    def __init__(self, actor):
        self.actor, self.seen = actor, []

    def act(self, reqs):
        out = self.actor.act(reqs)
        for r, g in zip(reqs, out):
            self.seen.append((tuple(r.tokens) + tuple(g.tokens), tuple(g.logprobs)))
        return out


@pytest.mark.slow
def test_policy_rollouts_train_on_exactly_what_the_sampler_saw(fmt):
    pol = new_policy(tiny_config("qwen2", vocab_size=len(fmt.tokenizer)), seed=0)
    cfg = ContextConfig("supo", 1100, max_steps=6, max_summaries=2, max_action_tokens=40,
                        max_summary_tokens=24)
    tasks = make_tasks("fncall/tallest", "train", 2, seed=0, size=12)

    def go(seed):
        actor = PolicyActor(pol, fmt, rows=4, max_len=cfg.row_bound(fmt),
                            sampling=SamplingParams(1.0), seed=seed)
        rec = _Recorder(actor)
        ro = run_rollouts(rec, lambda: make_env("fncall/tallest"), tasks, fmt, cfg, group_size=2,
                          rows=4)
        return ro, rec, actor

    ro, rec, actor = go(0)
    seen = {toks: lps for toks, lps in rec.seen}
    n_seg = 0
    for r in ro:
        assert r.reason in ("max_steps", "max_summaries", "context_limit", "answer",
                            "summary_cut")
        for s in r.segments:
            n_seg += 1
            assert s.tokens in seen   # a segment is one request + its sampled continuation
            gen = [lp for lp, m in zip(s.logprobs, s.mask) if m]
            assert np.allclose(gen[-len(seen[s.tokens]):], seen[s.tokens])
    assert n_seg >= len(ro)
    total_requested = sum(len(t) - len(l) for t, l in rec.seen)
    assert actor.prefilled < 0.5 * total_requested    # the KV cache is reused across turns
    ro2, _, _ = go(0)
    same_rollouts([r.to_json() for r in ro], [r.to_json() for r in ro2])   # same seed, same rollouts
    ro3, _, _ = go(1)
    assert [r.to_json() for r in ro] != [r.to_json() for r in ro3]
    assert Rollout.from_json(ro[0].to_json()).to_json() == ro[0].to_json()


class _Counted(ScriptedActor):
    """A scripted actor that counts its calls."""
    calls = 0

    def act(self, requests):
        self.calls += 1
        return super().act(requests)


def _jittery(name, seed):
    """make_env for `name` whose steps each take a random 0-20 ms (the order in which rows'
    tools answer changes from run to run)."""
    import random

    rng = random.Random(seed)

    def make():
        env = make_env(name)
        act = env.act

        def slow(text):
            time.sleep(0.02 * rng.random())
            return act(text)
        env.act = slow
        return env
    return make


@pytest.mark.parametrize("name", ["fncall/tallest", "fncall/count"])
def test_independent_rows_give_the_turn_synchronous_rollouts(fmt, name):
    """Rows that advance independently (each rejoins the decode batch when its own tool has
    answered) produce token for token the transcripts and rows of the turn-synchronous
    rounds, with a scripted actor and tools that answer in a random order; and they do not
    wait for each other (more, smaller actor batches)."""
    cfg = ContextConfig("supo", 1350, max_steps=60, max_summaries=6, max_summary_tokens=200)
    tasks = [t for size in (4, 9, 14) for t in make_tasks(name, "train", 2, seed=size, size=size)]
    out, calls = {}, {}
    for rounds in (True, False):
        actor = _Counted(expert_for(name), fmt)
        ro = run_rollouts(actor, _jittery(name, int(rounds)), tasks, fmt, cfg, group_size=2,
                          rows=5, rounds=rounds)
        out[rounds], calls[rounds] = [r.to_json() for r in ro], actor.calls
    assert out[True] == out[False]
    assert sum(r["counters"]["summaries"] for r in out[True]) >= 2
    assert calls[False] > calls[True]


class _SlowCounted(_Counted):
    """A scripted actor whose every call takes 60 ms, as a decode call does."""

    def act(self, requests):
        time.sleep(0.06)
        return super().act(requests)


def test_calls_back_within_a_decode_calls_time_join_one_decode_call(fmt, monkeypatch):
    """With nothing decoding, the model waits for the other environment calls up to GATHER
    decode calls' time after the first one is back: tools answering in 0-20 ms (a harness's
    HTTP turn) rejoin as one batch, as the turn-synchronous rounds do, instead of one call
    each; with GATHER = 0 they take more actor calls."""
    name = "fncall/tallest"
    cfg = ContextConfig("supo", 1350, max_steps=8, max_summaries=2, max_summary_tokens=200)
    tasks = make_tasks(name, "train", 6, seed=4, size=6)
    calls = {}
    for way, gather in (("rounds", None), ("gather", rollout_mod.GATHER), ("none", 0.0)):
        if gather is not None:
            monkeypatch.setattr(rollout_mod, "GATHER", gather)
        actor = _SlowCounted(expert_for(name), fmt)
        run_rollouts(actor, _jittery(name, 1), tasks, fmt, cfg, rows=6,
                     rounds=way == "rounds")
        calls[way] = actor.calls
    assert calls["gather"] <= calls["rounds"] + 1 < calls["none"], calls


@pytest.mark.slow
def test_policy_rows_sample_the_same_tokens_independent_or_in_rounds(fmt):
    """A PolicyActor whose rows join and leave the decode batch at chunk boundaries samples
    each rollout's tokens from its own stream: the rollouts equal the turn-synchronous
    rounds' (tokens exactly, logprobs to float rounding), whichever rows decode together."""
    pol = new_policy(tiny_config("qwen2", vocab_size=len(fmt.tokenizer)), seed=0)
    cfg = ContextConfig("supo", 1100, max_steps=6, max_summaries=2, max_action_tokens=40,
                        max_summary_tokens=24)
    tasks = [t for size in (4, 12, 20) for t in make_tasks("fncall/tallest", "train", 1,
                                                              seed=size, size=size)]
    out, calls = {}, {}
    for rounds in (True, False):
        actor = PolicyActor(pol, fmt, rows=4, max_len=cfg.row_bound(fmt),
                            sampling=SamplingParams(1.0), seed=3)
        actor.sampler.decode_chunk = 8
        out[rounds] = run_rollouts(actor, _jittery("fncall/tallest", int(rounds)), tasks, fmt,
                                   cfg, group_size=2, rows=4, rounds=rounds)
        calls[rounds] = actor.sampler.slot_steps
    for a, b in zip(out[True], out[False]):
        assert a.transcript == b.transcript and a.reason == b.reason
        assert [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
        for sa, sb in zip(a.segments, b.segments):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
    assert calls[True] != calls[False]     # other rows decoded together


def test_frozen_summarizer_writes_untrained_summaries(fmt):
    """ReSum-style: a separate frozen actor summarizes; its tokens carry no loss mask."""
    name = "fncall/pages"

    class Silent:   # the policy being trained: acts like the expert, never asked to summarize
        def __init__(self):
            self.expert = expert_for(name)

        def act(self, messages, summarize):
            assert not summarize, "the trained policy must not be asked for summaries"
            return self.expert.act(messages, False)

    cfg = ContextConfig("frozen_summarizer", 1350, max_steps=200, max_summaries=10,
                        max_summary_tokens=128)
    ro = _run(fmt, name, cfg, n=2, actor=ScriptedActor(Silent(), fmt),
              summarizer=ScriptedActor(expert_for(name), fmt))
    assert all(r.reason == "answer" and r.counters["summaries"] >= 1 for r in ro)
    for r in ro:
        for s in r.segments[:-1]:
            tail = fmt.decode(s.tokens[-30:])
            assert "</summary>" in tail and s.mask[-1] == 0   # summary present, not trained
    with pytest.raises(ValueError, match="summarizer"):
        _run(fmt, name, cfg, n=1)


@pytest.mark.slow
def test_observations_cut_at_the_cap_are_counted_and_said(fmt, capsys):
    """fncall/records' records (~100-200 tokens) under the CPU recipe's 64-token observation
    cap, at its reproduction's W = 1024: every observation is cut, so clearing old results has nothing to do; the rollout
    says so (observation_cut_rate 1.0 and one line naming the setting). With the cap its
    reproduction config uses (256), none is cut and the line is gone."""
    from supo_jax import cli

    args = ["rollout", "--env", "fncall/records", "--context", "clear", "--num", "2",
            "--set", "context.working_context=1024"]
    assert cli.main(args) in (0, None)
    out = capsys.readouterr().out
    assert "observation_cut_rate     1.0" in out
    assert "note: context.max_observation_tokens=64 cut 100% of the observations" in out
    assert cli.main(args + ["--set", "context.max_observation_tokens=256"]) in (0, None)
    out = capsys.readouterr().out
    assert "observation_cut_rate     0.0" in out and "note:" not in out
    # a training run says it once, at its start (the scripted expert's ceiling)
    from supo_jax.config import load_config
    from supo_jax.rl.trainer import expert_ceiling

    said = []
    for sets in ([], ["context.max_observation_tokens=1024"]):   # the tiny tokenizer's
        cfg = load_config(None, ["env.name=fncall/records", "context.manager=clear",
                                 "context.working_context=8192", *sets])
        expert_ceiling(cfg, fmt, n=2, log=said.append)
    cut = [x for x in said if "of the scripted expert's observations" in x]
    assert len(cut) == 1 and cut[0].startswith("context.max_observation_tokens=64 cut 100%")


def test_rollout_cli_on_every_env_and_a_real_checkpoint(tmp_path, capsys):
    """`supo-jax rollout --policy scripted` on every built-in environment (the command's own
    main, in this process: the scripted policy runs no model), then a real checkpoint through
    the command in a process of its own (one device)."""
    import json
    import subprocess
    import sys

    from supo_jax import cli
    from supo_jax.envs import list_envs
    from tests.helpers import make_hf_model

    env = dict(__import__("os").environ, XLA_FLAGS="")
    # the built-in ones (tests/worker_envs.py's, imported by another test, are no user's)
    # (tau2/mock's rollouts are tau2's, in harness mode: tests/test_tau2_harness.py)
    for name in [n for n in list_envs() if not n.endswith(("recorded/pages", "faulty/pages",
                                                           "stopping/pages"))
                 and not n.startswith("tau2/")]:
        out = tmp_path / f"{name.replace('/', '_')}.jsonl"
        knobs = (["--set", "context.working_context=4096", "--set", "context.max_steps=60",
                  "--set", "context.max_action_tokens=128", "--set", "context.max_summary_tokens=256",
                  "--set", "context.max_observation_tokens=512"] if name == "search" else
                 # BFCL's docs alone are ~15K tiny-tokenizer tokens: `full` with room for all
                 ["--set", "context.manager=full", "--set", "context.working_context=200000",
                  "--set", "context.max_steps=400", "--set", "context.max_action_tokens=8192",
                  "--set", "context.max_observation_tokens=100000"] if name.startswith("bfcl/")
                 # sections: 6 pages a section, so 4 sections fit the recipe's 30 steps
                 else ["--set", f"env.knobs.size={4 if name == 'fncall/sections' else 6}",
                       "--set", "context.working_context=1400"])
        code = cli.main(["rollout", "--env", name, "--policy", "scripted", "--num", "2",
                         "--out", str(out), *knobs])
        printed = capsys.readouterr()
        assert code in (0, None), (name, printed.err[-1500:])
        recs = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(recs) == 2 and all(x["reason"] == "answer" and x["reward"] == 1.0 for x in recs)
        assert "success_rate" in printed.out
        if name.startswith("bfcl/"):    # BFCL's decoded calls, per turn and step
            assert all(x["env_info"]["calls"] and isinstance(x["env_info"]["calls"][0], list)
                       for x in recs)
    # a real checkpoint (tiny HF model + tokenizer) through the same command
    ck = tmp_path / "ck"
    make_hf_model("qwen2_bias_gqa", str(ck), vocab=len(tiny_tokenizer()))
    tiny_tokenizer(str(ck))
    out = tmp_path / "real.jsonl"
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "rollout", "--env", "fncall/pages",
                        "--policy", str(ck), "--num", "2", "--out", str(out),
                        "--set", "context.working_context=1400", "--set", "env.knobs.size=6",
                        "--set", "context.max_steps=3", "--set", "context.max_action_tokens=64"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 2 and all(x["counters"]["steps"] >= 1 for x in recs)


@pytest.mark.slow
def test_policy_actor_without_cache_reuse_prefills_everything_and_samples_the_same(fmt):
    """reuse_cache=False (the rollout benchmark's baseline) re-prefills each whole request."""
    pol = new_policy(tiny_config("qwen2", vocab_size=len(fmt.tokenizer)), seed=0)
    cfg = ContextConfig("supo", 900, max_steps=8, max_summaries=1, max_action_tokens=40,
                        max_summary_tokens=16)
    tasks = make_tasks("fncall/tallest", "train", 2, seed=0, size=12)
    out = {}
    for reuse in (True, False):
        actor = PolicyActor(pol, fmt, rows=2, max_len=cfg.row_bound(fmt),
                            sampling=SamplingParams(0.0), reuse_cache=reuse)
        rec = _Recorder(actor)
        ro = run_rollouts(rec, lambda: make_env("fncall/tallest"), tasks, fmt, cfg, rows=2)
        out[reuse] = ro, actor.prefilled, sum(len(t) - len(l) for t, l in rec.seen)
    (ro_a, pre_a, req), (ro_b, pre_b, req_b) = out[True], out[False]
    assert req == req_b and pre_b == req > 1.5 * pre_a
    for a, b in zip(ro_a, ro_b):   # same tokens; logprobs equal up to float rounding
        assert [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
        assert a.reason == b.reason and a.counters == b.counters
        for sa, sb in zip(a.segments, b.segments):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-4)
    # the random policy asked for summaries (cut at their 16 tokens: summary_cut)
    assert sum(bool(m.get("summary")) for r in ro_a for m in r.transcript) > 0


def test_count_needs_summaries_at_W(fmt):
    """fncall/count (length hidden): the scripted expert solves it under supo and not under
    full at the same W: the history exceeds W."""
    tasks = make_tasks("fncall/count", "train", 4, seed=0, size=(30, 50))
    cfg = dict(working_context=1600, max_steps=200, max_summary_tokens=64, max_action_tokens=64)
    sup = run_rollouts(ScriptedActor(expert_for("fncall/count"), fmt), lambda: make_env("fncall/count"),
                       tasks, fmt, ContextConfig("supo", max_summaries=10, **cfg), rows=4)
    full = run_rollouts(ScriptedActor(expert_for("fncall/count"), fmt),
                        lambda: make_env("fncall/count"), tasks, fmt,
                        ContextConfig("full", **cfg), rows=4)
    assert all(r.reward == 1.0 for r in sup) and min(r.counters["summaries"] for r in sup) >= 1
    assert all(r.reason == "context_limit" for r in full)


_BASE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}CALL{%- endfor %}"
    "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
_CALLS = {   # how a family's chat template writes an assistant's tool call tc
    "llama3_json": "{{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + "
                   "(tc.function.arguments | tojson) + '}' }}",
    "mistral": "{{- '[TOOL_CALLS] [' + ({'name': tc.function.name, 'arguments': "
               "tc.function.arguments, 'id': tc.id} | tojson) + ']' }}",
    "seed_oss": "{{- '<seed:tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
                "{%- for k, v in tc.function.arguments.items() %}{{- '<parameter=' + k + '>' + "
                "(v | string) + '</parameter>\\n' }}{%- endfor %}"
                "{{- '</function>\\n</seed:tool_call>' }}",
}
_ACTIONS = {"llama3_json": '{"name": "finish", "parameters": {"answer": 3}}',
            "mistral": '[TOOL_CALLS] [{"name": "finish", "arguments": {"answer": 3}}]',
            "seed_oss": "<seed:tool_call>\n<function=finish>\n<parameter=answer>3</parameter>\n"
                        "</function>\n</seed:tool_call>"}


@pytest.mark.parametrize("form", sorted(_CALLS))
def test_a_chat_templates_own_tool_call_form_is_read(form):
    """The rollout loop reads actions in the form the policy's chat template writes tool
    calls in (seen on a probe call); the same text under a Hermes-only template is an error."""
    from supo_jax.sampling.sampler import Generation

    class Say:
        def __init__(self, fmt, text):
            self.ids = fmt.encode(text) + [fmt.stop_id]

        def act(self, reqs):
            return [Generation(list(self.ids), [0.0] * len(self.ids)) for _ in reqs]

    tok = tiny_tokenizer()
    tok.chat_template = _BASE_TEMPLATE.replace("CALL", _CALLS[form])
    native, hermes = ChatFormat(tok), ChatFormat(tiny_tokenizer())
    assert native.call_formats == ("hermes", form) and hermes.call_formats == ("hermes",)
    cfg = ContextConfig("supo", 2048, max_steps=2, max_summaries=0)
    for name in ("fncall/tallest", "fncall"):    # the mixture hands them to its family's env
        tasks = make_tasks(name, "train", 1, seed=0)
        for f, reason in ((native, "answer"), (hermes, "max_steps")):
            ro = run_rollouts(Say(f, _ACTIONS[form]), lambda: make_env(name), tasks, f, cfg,
                              rows=1)
            assert ro[0].reason == reason, (name, form, f.call_formats, ro[0].transcript[-1])


def test_a_scripted_expert_summary_cut_at_its_budget_is_said_once():
    """An expert whose summary outgrows max_summary_tokens is cut, which ends its rollout
    (summary_cut, the summary in no row): a warning says so, once, instead of a silent 0%."""
    fmt = ChatFormat(tiny_tokenizer(template="compact"))
    cfg = ContextConfig("supo", 500, max_steps=60, max_summaries=4, max_action_tokens=64,
                        max_summary_tokens=8, max_observation_tokens=64)
    actor = ScriptedActor(expert_for("fncall/tallest"), fmt)
    with pytest.warns(UserWarning, match="summary takes .* tokens and its budget is 8") as rec:
        ro = run_rollouts(actor, lambda: make_env("fncall/tallest"),
                     make_tasks("fncall/tallest", "eval", 4, size=9), fmt, cfg)
    assert actor.cut_summaries >= 2
    assert sum("summary takes" in str(w.message) for w in rec) == 1
    assert [r.reason for r in ro].count("summary_cut") == actor.cut_summaries
    for r in ro:    # no row trains a cut summary: every trained token is an action's
        for seg in r.segments:
            trained = [t for t, m in zip(seg.tokens, seg.mask) if m]
            assert "<summary>" not in fmt.decode(trained)


def _phases(actor_for, make, tasks, fmt, cfg, *, budget, group=2, rows=4, json_trip=True,
            restart=None, envs=None):
    """Rollouts run under a token budget a phase at a time (each phase: the suspended first,
    version = the phase's number) until all ended; the suspended go through JSON between
    phases, as through a checkpoint. restart(item, phase) -> bool: start it over instead.
    Returns ({(group, sample): rollout}, each phase's count of suspended rollouts that had
    started)."""
    import json

    items = [Suspended(t, gi, s) for gi, t in enumerate(tasks) for s in range(group)]
    done, counts, phase = {}, [], 0
    while items:
        got, items, stats = rollout_phase(actor_for(), make, items, fmt, cfg, group_size=group,
                                          rows=rows, budget_tokens=budget, version=phase,
                                          envs=envs)
        assert stats["generated_tokens"] >= budget or not items
        done.update(got)
        counts.append(sum(x.state is not None for x in items))   # started, to resume
        if json_trip:
            items = [Suspended.from_json(json.loads(json.dumps(x.to_json()))) for x in items]
        if restart:
            items = [Suspended(x.task, x.group_id, x.sample) if restart(x, phase) else x
                     for x in items]
        phase += 1
        assert phase < 200
    return done, counts


@pytest.mark.parametrize("name,keep", [("fncall/tallest", False), ("fncall/pages", False),
                                       ("fncall/pages", True)])
def test_rollouts_cut_at_a_token_budget_resume_to_the_straight_rollouts(fmt, name, keep):
    """Cut at a token budget and resumed in later phases (a fresh environment each time, the
    actions replayed into it, or with `envs` the suspended rollout's own environment where
    no call touched it since; the state through JSON), a scripted actor's rollouts are the
    rollouts run straight: transcripts, rows and rewards; each token's phase is recorded
    (Rollout.versions) and sums to the generated tokens."""
    cfg = ContextConfig("supo", 1350, max_steps=60, max_summaries=6, max_summary_tokens=200)
    tasks = [t for size in (4, 9, 14) for t in make_tasks(name, "train", 1, seed=size, size=size)]
    straight = run_rollouts(ScriptedActor(expert_for(name), fmt), _jittery(name, 0), tasks,
                            fmt, cfg, group_size=2, rows=4)
    built = []

    def make():
        built.append(1)
        return _jittery(name, 1)()
    envs = {} if keep else None
    done, counts = _phases(lambda: ScriptedActor(expert_for(name), fmt), make, tasks, fmt, cfg,
                           budget=300, envs=envs)
    assert len(counts) >= 3 and max(counts) > 0
    # one environment a rollout, and one a resume unless its own was kept
    assert (len(built) < len(straight) + sum(counts)) == keep
    assert len(built) <= len(straight) + sum(counts)
    for a in straight:
        b = done[(a.group_id, a.sample)]
        assert b.transcript == a.transcript and b.segments == a.segments
        assert (b.reward, b.reason, b.counters) == (a.reward, a.reason, a.counters)
        assert sum(n for _, n in b.versions) == b.counters["generated_tokens"]
        assert [v for v, _ in b.versions] == sorted({v for v, _ in b.versions})
    assert any(len(done[k].versions) > 1 for k in done)       # some went on under later phases
    assert all(a.versions == [[0, a.counters["generated_tokens"]]] for a in straight)


def test_a_resume_whose_replay_differs_fails_that_rollout_only(fmt):
    """An environment that answers differently to the same actions after a resume (not
    deterministic given its task and actions) ends that rollout as env_error, naming why;
    the others go on; a restarted one (max_staleness) runs from its task again."""
    name = "fncall/tallest"
    cfg = ContextConfig("supo", 1350, max_steps=60, max_summaries=6, max_summary_tokens=200)
    tasks = make_tasks(name, "train", 2, seed=3, size=9)
    builds = []

    def make():
        env = make_env(name)
        act, n = env.act, len(builds)
        builds.append(n)

        def drifting(text):
            out = act(text)
            if n >= 4 and out.observation:     # environments built after the first phase
                out = dataclasses.replace(out, observation=out.observation + " (drift)")
            return out
        env.act = drifting
        return env
    import dataclasses
    done, _ = _phases(lambda: ScriptedActor(expert_for(name), fmt), make, tasks, fmt, cfg,
                      budget=150, restart=lambda x, phase: x.group_id == 1 and phase == 0)
    bad = [r for k, r in done.items() if k[0] == 0]
    assert all(r.reason == "env_error" for r in bad)
    assert all("not deterministic given its task and actions" in r.transcript[-1]["content"]
               for r in bad)
    assert all(done[(1, s)].reason != "env_error" for s in range(2))


@pytest.mark.slow
def test_policy_rollouts_cut_and_resumed_under_the_same_weights_are_the_straight_ones(fmt):
    """A PolicyActor's rollouts cut at a token budget and resumed phase after phase (a new
    sampler each phase, the same weights and key) draw the same tokens as run straight: a
    resumed generation draws from the stream of the one the cut dropped."""
    pol = new_policy(tiny_config("qwen2", vocab_size=len(fmt.tokenizer)), seed=0)
    cfg = ContextConfig("supo", 1100, max_steps=6, max_summaries=2, max_action_tokens=40,
                        max_summary_tokens=24)
    tasks = [t for size in (4, 12, 20) for t in make_tasks("fncall/tallest", "train", 1,
                                                              seed=size, size=size)]

    def actor():
        a = PolicyActor(pol, fmt, rows=4, max_len=cfg.row_bound(fmt),
                        sampling=SamplingParams(1.0), seed=3)
        a.sampler.decode_chunk = 8
        return a
    straight = run_rollouts(actor(), _jittery("fncall/tallest", 0), tasks, fmt, cfg,
                            group_size=2, rows=4)
    done, counts = _phases(actor, _jittery("fncall/tallest", 1), tasks, fmt, cfg, budget=120)
    assert len(counts) >= 3
    for a in straight:
        b = done[(a.group_id, a.sample)]
        assert b.transcript == a.transcript and b.reason == a.reason
        assert [s.tokens for s in b.segments] == [s.tokens for s in a.segments]
        for sa, sb in zip(a.segments, b.segments):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_manager_keeps_the_latest_turn_and_the_expert_carries_its_state(fmt, family):
    """context.manager=state (MEM1-style): the prompt asks for <state> blocks, every turn
    after the second closes a row whose context is s1 + the previous turn and whose trained
    tokens are the new action; the scripted expert, reading back its last state block, solves
    tasks at a W where `full` runs out of context."""
    name = f"fncall/{family}"
    W = 1350
    ro = _run(fmt, name, ContextConfig("state", W, max_steps=200, max_action_tokens=400,
                                       max_state_tokens=256))
    full = _run(fmt, name, ContextConfig("full", W, max_steps=200))
    assert all(r.reason == "answer" and r.reward == 1.0 for r in ro), [r.reason for r in ro]
    assert any(r.reason == "context_limit" for r in full)
    for r in ro:
        assert "<state></state>" in r.transcript[0 if r.transcript[0]["role"] == "user" else 1][
            "content"]
        assert r.counters["states"] == r.counters["steps"]      # every reply carried one
        # a row a turn from the second on (the first row holds the first two actions)
        assert len(r.segments) == r.counters["steps"] - 1 >= 2
        for s in r.segments[1:]:
            assert len(s) <= W
            ctx = s.mask.index(1)
            assert sum(s.mask) == len(s) - ctx      # the action alone is trained, at the end


class _Shelf(Environment):
    """look(i) reads item i (its value is i * 10); finish(total) ends with reward 1 when the
    total is right (the sum of items 1-3)."""
    tools = (ToolSpec("look", "read an item", {"type": "object", "properties": {
                 "i": {"type": "integer"}}, "required": ["i"]}),
             ToolSpec("finish", "answer", {"type": "object", "properties": {
                 "total": {"type": "integer"}}, "required": ["total"]}))

    def reset(self, task):
        return Reset("Add the values of items 1, 2 and 3. " + "Note. " * 40, list(self.tools))

    def step(self, name, arguments):
        if name == "finish":
            return StepResult("", done=True, reward=float(arguments["total"] == 60))
        return StepResult(f"item {arguments['i']}: value {arguments['i'] * 10}")


class _Folder:
    """A scripted policy for context folding: opens a branch, looks at items 1-3 in it (a
    bad call first where `misuse`: a return outside a branch, then a branch inside the
    branch), returns their total, then finishes with the total the return message holds."""

    def __init__(self, misuse=False):
        self.misuse = misuse

    def act(self, messages, summarize=False):
        import json
        import re

        call = lambda n, a: f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>"
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        folded = [t for t in tools if t.startswith("total ")]
        if folded:
            return call("finish", {"total": int(folded[-1].split()[1])})
        if self.misuse and not any(t.startswith("error: no branch") for t in tools):
            return call("return", {"message": "too early"})
        if not any(t.startswith("Branch opened") for t in tools):
            return call("branch", {"description": "read the items"})
        if self.misuse and not any(t.startswith("error: a branch is open") for t in tools):
            return call("branch", {"description": "again"})
        seen = [int(v) for t in tools for v in re.findall(r"value (\d+)", t)]
        if len(seen) < 3:
            return call("look", {"i": len(seen) + 1})
        return call("return", {"message": f"total {sum(seen)}"})


@pytest.mark.parametrize("misuse", [False, True])
def test_fold_manager_folds_a_branch_into_its_return_message(fmt, misuse):
    """context.manager=fold: branch and return are shown as tools and run by the driver; on
    return the branch's turns leave the context (the branch call and a tool turn with the
    message stay), the row so far closes, and the rollout goes on from the folded context;
    out-of-turn calls get error observations."""
    cfg = ContextConfig("fold", 4000, max_steps=20)
    ro = run_rollouts(ScriptedActor(_Folder(misuse), fmt), _Shelf, [{"task_id": "t"}], fmt, cfg,
                      group_size=2, rows=2)
    for r in ro:
        assert r.reason == "answer" and r.reward == 1.0, r.transcript
        assert r.counters["folds"] == 1 and len(r.segments) == 2
        first, second = (fmt.tokenizer.decode(s.tokens) for s in r.segments)
        assert "value 30" in first and '"return"' in first
        assert "value 10" not in second and "total 60" in second and '"branch"' in second
        assert second.count("<tool_call>") >= 2 and '"finish"' in second
        errors = [m["content"] for m in r.transcript if m.get("fold") and
                  m["content"].startswith("error")]
        assert len(errors) == (2 if misuse else 0)
    # the tools shown include branch and return
    assert '"branch"' in fmt.tokenizer.decode(ro[0].segments[0].tokens[:400])


def test_fold_closes_a_branch_that_reaches_the_limit(fmt):
    """A branch that reaches L is folded with FORCED_RETURN (its last action closes a row) and
    the rollout goes on from the main thread."""
    from supo_jax.agent.context import FORCED_RETURN

    class Looker(_Folder):
        def act(self, messages, summarize=False):
            import json
            if any(m["content"] == FORCED_RETURN for m in messages if m["role"] == "tool"):
                return ('<tool_call>{"name": "finish", "arguments": {"total": 60}}'
                        '</tool_call>')
            if not any(m["content"].startswith("Branch opened") for m in messages
                       if m["role"] == "tool"):
                return '<tool_call>{"name": "branch", "arguments": {"description": "x"}}</tool_call>'
            return '<tool_call>%s</tool_call>' % json.dumps({"name": "look", "arguments": {"i": 1}})
    cfg = ContextConfig("fold", 1500, max_steps=60)
    (r,) = run_rollouts(ScriptedActor(Looker(), fmt), _Shelf, [{"task_id": "t"}], fmt, cfg,
                        rows=1)
    assert r.reason == "answer" and r.counters["folds"] == 1 and len(r.segments) == 2
    assert all(len(s) <= 1500 for s in r.segments)
    assert r.counters["steps"] > 5


def test_the_folding_expert_works_in_branches_where_full_runs_out(fmt):
    """Any expert under context.manager=fold (envs.experts.for_context): it opens a branch,
    makes its calls there, returns its state as the return message and goes on from it; on
    three fncall families it solves tasks at a W where `full` runs out of context, every row
    within W. With max_branches spent it goes on in the main thread (one refused branch)."""
    from supo_jax.envs.experts import FoldingExpert, for_context

    W = 2000
    for family in ("tallest", "pages", "chain"):
        name = f"fncall/{family}"
        tasks = make_tasks(name, "train", 2, seed=0, size=20)
        runs = {}
        for manager in ("fold", "full"):
            cfg = ContextConfig(manager, W, max_steps=200)
            runs[manager] = run_rollouts(ScriptedActor(for_context(expert_for(name), cfg), fmt),
                                         lambda: make_env(name), tasks, fmt, cfg, rows=2)
        assert all(r.reason == "context_limit" for r in runs["full"])
        for r in runs["fold"]:
            assert r.reason == "answer" and r.reward == 1.0, (family, r.reason)
            returns = [m["content"] for m in r.transcript if m.get("fold") == "return"]
            assert len(returns) >= 2 and all(t.startswith("State: ") for t in returns)
            assert len(r.segments) == len(returns) + 1          # a row a return, then the last
            assert r.counters["folds"] - len(returns) in (0, 1)  # answered in a branch or not
            assert all(len(s) <= W for s in r.segments)
            assert not any(m["content"].startswith("error") for m in r.transcript
                           if m["role"] == "tool")
    cfg = ContextConfig("fold", 4000, max_steps=200, max_branches=2)
    ex = FoldingExpert(expert_for("fncall/chain"), calls_per_branch=2)
    (r,) = run_rollouts(ScriptedActor(ex, fmt), lambda: make_env("fncall/chain"),
                        make_tasks("fncall/chain", "train", 1, seed=0, size=12), fmt, cfg, rows=1)
    assert r.reason == "answer" and r.reward == 1.0 and r.counters["folds"] == 2
    refused = [m for m in r.transcript if m["role"] == "tool"
               and m["content"].startswith("error: no branches left")]
    assert len(refused) == 1


@pytest.mark.parametrize("manager", ["state", "fold"])
def test_state_and_fold_rollouts_cut_at_a_budget_resume_to_the_straight_ones(fmt, manager):
    """Under `state` (the context rewritten every turn) and `fold` (an open branch, its
    start and the folds so far in the suspended state), rollouts cut at a token budget and
    resumed from JSON in later phases are the rollouts run straight."""
    from supo_jax.envs.experts import for_context

    name = "fncall/chain"
    cfg = ContextConfig(manager, 2000, max_steps=200, max_action_tokens=400)
    tasks = make_tasks(name, "train", 2, seed=0, size=14)
    actor = lambda: ScriptedActor(for_context(expert_for(name), cfg), fmt)
    straight = run_rollouts(actor(), _jittery(name, 0), tasks, fmt, cfg, group_size=2, rows=4)
    done, counts = _phases(actor, _jittery(name, 1), tasks, fmt, cfg, budget=300)
    assert len(counts) >= 3 and max(counts) > 0
    for a in straight:
        b = done[(a.group_id, a.sample)]
        assert a.reason == "answer" and (manager == "state" or a.counters["folds"] >= 2)
        assert b.transcript == a.transcript and b.segments == a.segments
        assert (b.reward, b.reason, b.counters) == (a.reward, a.reason, a.counters)


def test_a_user_request_that_comes_inside_a_branch_stays_after_the_fold(fmt):
    """fold: a user turn delivered inside a branch (a multi-turn environment's next request)
    is not folded away with the branch's work: the folded context ends with it, as a summary
    restart keeps the current request."""
    import json

    class Asking(_Shelf):
        def reset(self, task):
            self.looks = 0
            return super().reset(task)

        def step(self, name, arguments):
            if name == "look":
                self.looks += 1
                if self.looks == 2:
                    return StepResult("Also add item 4.", role="user")
            if name == "finish":
                return StepResult("", done=True, reward=float(arguments["total"] == 100))
            return super().step(name, arguments)

    class Folder:
        def act(self, messages, summarize=False):
            call = lambda n, a: f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>"
            tools = [m["content"] for m in messages if m["role"] == "tool"]
            if any(t.startswith("looked") for t in tools):   # folded: the request must show
                asked = any("item 4" in m["content"] for m in messages if m["role"] == "user")
                return call("finish", {"total": 100 if asked else 60})
            if not any(t.startswith("Branch opened") for t in tools):
                return call("branch", {"description": "read"})
            if messages[-1]["role"] == "user" or len(tools) < 3:
                return call("look", {"i": 1})
            return call("return", {"message": "looked"})

    cfg = ContextConfig("fold", 4000, max_steps=20)
    (r,) = run_rollouts(ScriptedActor(Folder(), fmt), Asking, [{"task_id": "t"}], fmt, cfg,
                        rows=1)
    assert r.reason == "answer" and r.reward == 1.0, r.transcript
    second = fmt.tokenizer.decode(r.segments[1].tokens)
    assert second.index("looked") < second.index("Also add item 4.") < second.rindex('"finish"')
    assert [m.get("fold") for m in r.transcript if m.get("fold")] == ["branch", "return"]
