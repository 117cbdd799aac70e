"""Harness mode (docs/HARNESS.md): an `openai`-SDK harness drives rollouts of the driver over
HTTP, and they are the built-in loop's, token for token and segment for segment. The harness
is docs/HARNESS.md's, run as written; the scripted expert is the policy behind the server."""
import json
import os
import re
import threading
import time

import openai
import pytest

from supo_jax.agent.context import ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts, summarize
from supo_jax.envs.base import make_env, make_tasks
from supo_jax.envs.fncall import expert_for
from supo_jax.model.tiny import tiny_tokenizer
from supo_jax.serve import sessions as sess
from supo_jax.serve.app import Running, build_app
from supo_jax.serve.harness import harness_envs
from supo_jax.serve.sessions import Sessions

pytestmark = pytest.mark.xdist_group("test_harness")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = open(os.path.join(ROOT, "docs", "HARNESS.md")).read()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, re.S)
ENV = "fncall/tallest"
# W small enough that the expert's rollouts summarize (the reserve rule: tests/test_rollout.py)
SUPO = ContextConfig("supo", 1350, max_steps=200, max_summaries=10, max_summary_tokens=128,
                     trigger_rule="reserve")
FULL = ContextConfig("full", 1350, max_steps=200, trigger_rule="reserve")


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(tiny_tokenizer())


@pytest.fixture(scope="module")
def served():
    sessions = Sessions()
    server = Running(build_app(None, sessions))
    yield sessions, server.url
    server.stop()


def doc_episode():
    """The harness function of docs/HARNESS.md, as written."""
    ns = {}
    exec(compile(BLOCKS[0], "docs/HARNESS.md harness", "exec"), ns)
    return ns["episode"]


def _tasks(n=2):
    return make_tasks(ENV, "train", n, seed=0, size=12)


def _run(fmt, cfg, make, tasks, **kw):
    return run_rollouts(ScriptedActor(expert_for(ENV), fmt), make, tasks, fmt, cfg,
                        group_size=2, rows=4, **kw)


def _comparable(r):
    """A rollout's record less what only an environment knows (its last step's info, its
    probe of a summary's state)."""
    d = r.to_json()
    del d["env_info"], d["summary_probes"]
    return d


def test_doc_blocks_run_as_written(fmt):
    assert len(BLOCKS) == 3     # the third, the out-of-process harness: test_harness_http.py
    ns = {"actor": ScriptedActor(expert_for(ENV), fmt), "fmt": fmt, "cfg": SUPO}
    exec(compile(BLOCKS[0], "docs/HARNESS.md harness", "exec"), ns)
    exec(compile(BLOCKS[1], "docs/HARNESS.md rollouts", "exec"), ns)
    rollouts = ns["rollouts"]
    assert len(rollouts) == 4 and all(r.reason == "answer" and r.reward == 1.0 for r in rollouts)
    assert len(ns["sessions"]) == 0


@pytest.mark.parametrize("manager, kw, counter", [
    ("state", dict(max_action_tokens=400, max_state_tokens=256), "states"),
    ("clear", dict(max_state_tokens=256), "cleared"),
    ("fold", {}, "folds"),
])
def test_every_context_manager_runs_on_the_server(fmt, served, manager, kw, counter):
    """The other managers' context edits (a state block, cleared tool results) and their own
    tools (fold's branch and return, answered by the driver: the harness never sees them)
    are the server's: the docs' harness gives the built-in loop's rollouts, token for token,
    with the manager at work in them."""
    from supo_jax.envs.experts import for_context

    sessions, url = served
    cfg = ContextConfig(manager, 1350 if manager == "state" else 2000, max_steps=200, **kw)
    tasks = make_tasks(ENV, "train", 2, seed=0, size=12 if manager == "state" else 20)

    def run(make):
        return run_rollouts(ScriptedActor(for_context(expert_for(ENV), cfg), fmt), make, tasks,
                            fmt, cfg, group_size=2, rows=4)

    builtin, harness = run(lambda: make_env(ENV)), run(harness_envs(doc_episode(), sessions, url))
    assert [_comparable(r) for r in harness] == [_comparable(r) for r in builtin]
    assert all(r.counters[counter] > 0 and len(r.segments) > 1 for r in harness)
    assert all(r.env_info["requests"] > 0 and r.env_info["rewritten"] == 0 for r in harness)


@pytest.mark.parametrize("cfg", [SUPO, FULL], ids=["supo", "full"])
def test_harness_rollouts_are_the_builtin_loops(fmt, served, cfg):
    sessions, url = served
    tasks = _tasks()
    builtin = _run(fmt, cfg, lambda: make_env(ENV), tasks)
    harness = _run(fmt, cfg, harness_envs(doc_episode(), sessions, url), tasks)
    assert [_comparable(r) for r in harness] == [_comparable(r) for r in builtin]
    if cfg.manager == "supo":
        assert all(r.reason == "answer" and r.reward == 1.0 for r in harness)
        assert all(r.counters["summaries"] > 0 for r in harness)
        assert all(len(r.segments) == r.counters["summaries"] + 1 for r in harness)
    else:   # full at this W: the server ends rollouts at the context limit
        assert any(r.reason == "context_limit" for r in harness)
    for r in harness:   # the session's counters, whatever the rollout's end
        assert r.env_info["retemplated"] == r.env_info["rewritten"] == 0
        assert r.env_info["sampling_ignored"] == 0
        if r.reason == "answer":
            # a request a step; a summary is a step too (docs/SUPO.md §2), made between two
            assert r.env_info["requests"] == r.counters["steps"] - r.counters["summaries"]
    stats = summarize(harness)   # the step's telemetry
    assert stats["harness_requests"] == sum(r.env_info["requests"] for r in harness) > 0
    assert stats["harness_retemplated"] == stats["harness_rewritten"] == 0
    assert "harness_requests" not in summarize(builtin)
    if cfg.manager == "supo":   # each reset: from near W down to s1 + the summary
        segs = [s for r in harness for s in r.segments]
        assert stats["reset_context_before_mean"] > max(len(s) for s in segs) / 2
        assert stats["reset_context_before_mean"] <= cfg.working_context
        assert 0 < stats["reset_context_after_mean"] < stats["reset_context_before_mean"]
    assert len(sessions) == 0    # every session closed (those the server ended too)


def _retemplating(task, client, model):
    """The doc's loop, re-templating every assistant message it keeps: content stripped,
    the arguments' keys reversed, sampling settings of its own (ignored)."""
    env = make_env(ENV)
    start = env.reset(task)
    messages = [{"role": "user", "content": start.prompt}]
    tools = [t.schema() for t in start.tools]
    while True:
        msg = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                             temperature=0.3).choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name,
            "arguments": json.dumps(dict(reversed(json.loads(c.function.arguments).items())))}}
            for c in msg.tool_calls]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        for c in msg.tool_calls:
            res = env.step(c.function.name, json.loads(c.function.arguments))
            if res.done:
                return res.reward
            messages.append({"role": "tool", "tool_call_id": c.id, "content": res.observation})


def test_a_retemplating_harness_trains_the_same_tokens_and_is_counted(fmt, served):
    sessions, url = served
    tasks = _tasks(1)
    builtin = _run(fmt, SUPO, lambda: make_env(ENV), tasks)
    harness = _run(fmt, SUPO, harness_envs(_retemplating, sessions, url), tasks)
    assert [_comparable(r) for r in harness] == [_comparable(r) for r in builtin]
    for r in harness:
        # every assistant turn but the last (the finish call is never sent back)
        assert r.env_info["retemplated"] == r.env_info["requests"] - 1 > 0
        assert r.env_info["sampling_ignored"] == r.env_info["requests"]


def test_a_rewriting_harness_gets_409_and_fails_its_rollout(fmt, served):
    sessions, url = served
    seen = []

    def rewriting(task, client, model):
        env = make_env(ENV)
        start = env.reset(task)
        messages = [{"role": "user", "content": start.prompt}]
        tools = [t.schema() for t in start.tools]
        for turn in range(100):
            if turn == 3:        # drop the first exchange: a rewrite, not a re-template
                del messages[1:3]
            try:
                msg = client.chat.completions.create(model=model, messages=messages,
                                                     tools=tools).choices[0].message
            except openai.APIStatusError as e:
                seen.append((e.status_code, e.body.get("code")))
                raise
            messages.append(msg.model_dump(exclude_none=True))
            c = msg.tool_calls[0]
            res = env.step(c.function.name, json.loads(c.function.arguments))
            if res.done:
                return res.reward
            messages.append({"role": "tool", "tool_call_id": c.id, "content": res.observation})

    rollouts = _run(fmt, SUPO, harness_envs(rewriting, sessions, url), _tasks(1))
    for r in rollouts:
        assert r.reason == "env_error" and r.reward == 0.0
        assert r.transcript[-1]["role"] == "error"
        assert "rewrites the conversation" in r.transcript[-1]["content"]
        # three answers sent; the step of the third failed on the fourth request (not counted)
        assert sum(m["role"] == "assistant" for m in r.transcript) == 3
        assert r.counters["steps"] == 2
        assert r.env_info["rewritten"] == 1 and r.env_info["requests"] == 3
    assert summarize(rollouts)["harness_rewritten"] == len(rollouts)
    deadline = time.monotonic() + 10   # the answers reach the harnesses' threads by now
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [(409, "history_rewritten")] * 2
    assert len(sessions) == 0


def test_a_failing_harness_fails_only_its_rollout(fmt, served):
    sessions, url = served
    episode = doc_episode()
    tasks = _tasks(4)
    hang = threading.Event()

    def flaky(task, client, model):
        kind = tasks.index(task)
        if kind == 0:
            raise RuntimeError("harness bug")
        if kind == 1:
            episode(task, client, model)
            return float("nan")
        if kind == 2:        # one request, then silence past the session's timeout
            client.chat.completions.create(model=model, messages=[
                {"role": "user", "content": make_env(ENV).reset(task).prompt}])
            hang.wait(10)
            return 1.0
        return episode(task, client, model)

    make = harness_envs(flaky, sessions, url, timeout_s=1.0)
    rollouts = _run(fmt, SUPO, make, tasks)
    hang.set()
    by_task = [rollouts[2 * i: 2 * i + 2] for i in range(4)]
    for r in by_task[0]:
        assert r.reason == "env_error" and "harness bug" in r.transcript[-1]["content"]
    for r in by_task[1]:
        assert r.reason == "env_error" and "finite" in r.transcript[-1]["content"]
    for r in by_task[2]:
        assert r.reason == "timeout" and "no request in time" in r.transcript[-1]["content"]
        assert [m["role"] for m in r.transcript] == ["user", "assistant", "error"]
    for r in by_task[3]:
        assert r.reason == "answer" and r.reward == 1.0
    assert len(sessions) == 0


def test_requests_are_read_against_the_held_conversation():
    """sessions.extend_history, pure: what extends, what is re-templated, what rewrites."""
    call = {"id": "c1", "type": "function", "function": {"name": "f",
                                                         "arguments": {"a": 1, "b": 2}}}
    held = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "thinking", "tool_calls": [call]},
            {"role": "tool", "content": "ok"}]
    new = [{"role": "tool", "content": "r2"}]
    assert sess.extend_history(held, held + new) == (new, set())
    reordered = dict(held[1], content="", tool_calls=[
        dict(call, function={"name": "f", "arguments": {"b": 2, "a": 1}})])
    assert sess.extend_history(held, [held[0], reordered, held[2]] + new) == (new, {1})
    for bad in ([held[0], held[2]],                                      # dropped turns
                [held[0], dict(held[1], tool_calls=[dict(call, function={
                    "name": "f", "arguments": {"a": 9, "b": 2}})]), held[2]],   # edited call
                [dict(held[0], content="go!")] + held[1:]):               # edited prompt
        with pytest.raises(sess.ApiError) as e:
            sess.extend_history(held, bad)
        assert e.value.status == 409
    plain = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": "<think>x</think> The answer is 4."}]
    assert sess.extend_history(plain, [plain[0], dict(plain[1], content="The answer is 4.")]
                               ) == ([], {1})
    assert sess.new_turn([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
                         ) == ("a\nb", "tool")
    for bad in ([], [{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}]):
        with pytest.raises(sess.ApiError):
            sess.new_turn(bad)


def test_a_greeting_before_the_first_user_message_is_folded_into_the_prompt():
    """sessions.first_turn, pure: [system,] [assistant...,] user (tau2-bench's agent greets
    first); the greeting is context of s1 (not sampled, not trained); other shapes are a 400."""
    system, hi = {"role": "system", "content": "S"}, {"role": "assistant", "content": "Hi!"}
    user = {"role": "user", "content": "go"}
    assert sess.first_turn([user]) == (None, "go")
    assert sess.first_turn([system, user]) == ("S", "go")
    assert sess.first_turn([system, hi, user]) == ("S", "Assistant: Hi!\n\ngo")
    assert sess.first_turn([hi, hi, user]) == (None, "Assistant: Hi!\n\nAssistant: Hi!\n\ngo")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
    for bad in ([], [system], [system, hi], [user, user], [system, system, user],
                [hi, system, user], [{"role": "tool", "content": "x"}, user],
                [system, dict(hi, tool_calls=[call]), user]):
        with pytest.raises(sess.ApiError) as e:
            sess.first_turn(bad)
        assert (e.value.status, e.value.code) == (400, "unsupported_first_request")


def test_a_harness_that_greets_first_runs_and_keeps_its_greeting_held(fmt, served):
    """The greeting is resent with every request (it is held, as the harness sent it) and the
    rollouts are the built-in loop's but for the prompt, which begins with it."""
    sessions, url = served
    episode = doc_episode()

    class Greeting:        # the doc's harness, its client's requests led by a greeting
        def __init__(self, client):
            self.chat = self
            self.completions = self
            self.client = client

        def create(self, messages, **kw):
            return self.client.chat.completions.create(messages=[
                {"role": "assistant", "content": "Hi! How can I help you today?"}] + messages,
                **kw)

    tasks = _tasks(1)
    rollouts = _run(fmt, SUPO, harness_envs(lambda t, c, m: episode(t, Greeting(c), m),
                                            sessions, url), tasks)
    builtin = _run(fmt, SUPO, lambda: make_env(ENV), tasks)
    for r, b in zip(rollouts, builtin):
        assert r.reason == "answer" and r.reward == 1.0
        assert r.transcript[0]["content"] == ("Assistant: Hi! How can I help you today?\n\n"
                                              + b.transcript[0]["content"])
        assert r.env_info["rewritten"] == 0
    assert len(sessions) == 0


@pytest.mark.slow   # ~15 s on 2 cores: a policy's compile and an update
def test_a_harness_trains_the_tiny_policy_one_step_through_the_server(served):
    """A random tiny policy (PolicyActor) behind the sessions: the harness's rollouts carry
    the sampler's tokens and log-probabilities, and the trainer's update takes them."""
    import itertools

    import jax
    import numpy as np

    from supo_jax.agent.rollout import PolicyActor
    from supo_jax.config import OptimSection
    from supo_jax.model.policy import new_policy
    from supo_jax.model.tiny import tiny_config
    from supo_jax.rl.batch import build_batch, rollout_advantages
    from supo_jax.rl.configs import AdvantageConfig, LossConfig
    from supo_jax.rl.train_step import make_optimizer
    from supo_jax.rl.trainer import ppo_update

    sessions, url = served
    tok = tiny_tokenizer()
    fmt = ChatFormat(tok)
    policy = new_policy(tiny_config("qwen2", vocab_size=len(tok)), seed=0, tokenizer=tok)
    cfg = ContextConfig("full", 1350, max_steps=4, max_action_tokens=12, trigger_rule="reserve")
    ticket = itertools.count()

    def one_reply(task, client, model):     # one turn; rewards 0 and 1 in turn
        prompt = make_env(ENV).reset(task).prompt
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
        return float(next(ticket) % 2)

    actor = PolicyActor(policy, fmt, rows=2, max_len=cfg.row_bound(fmt), seed=0)
    rollouts = run_rollouts(actor, harness_envs(one_reply, sessions, url), _tasks(1), fmt, cfg,
                            group_size=2, rows=2)
    assert sorted(r.reward for r in rollouts) == [0.0, 1.0]
    for r in rollouts:
        (seg,) = r.segments
        assert r.reason == "answer" and 0 < sum(seg.mask) <= 12
        assert all(lp < 0 for lp, m in zip(seg.logprobs, seg.mask) if m)
    adv = rollout_advantages(rollouts, AdvantageConfig())
    batch = build_batch(adv.segments, adv.segment_advantages, max_len=cfg.row_bound(fmt))
    graphdef, params = policy.split()
    tx = make_optimizer(1e-3)
    before = jax.tree.map(np.asarray, params)
    params, _, upd = ppo_update(policy, graphdef, params, tx.init(params), batch, tx=tx,
                                loss_cfg=LossConfig(), optim=OptimSection(), mesh=None, seed=0)
    assert np.isfinite(upd["loss"]) and upd["updates"] >= 1
    assert any(not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)))
