"""The out-of-process harness (docs/HARNESS.md, "The session protocol"): a harness process that
speaks HTTP alone (docs/HARNESS.md's script, no supo_jax import) claims the run's sessions,
drives them and reports their rewards; a bad reward, an unknown session, a session no process
claims fail that rollout only, with a 4xx naming the cause."""
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from supo_jax.agent.context import ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts
from supo_jax.envs.base import make_env, make_tasks
from supo_jax.envs.fncall import expert_for
from supo_jax.model.tiny import tiny_tokenizer
from supo_jax.serve.app import Running, build_app
from supo_jax.serve.harness import harness_envs
from supo_jax.serve.sessions import Sessions

pytestmark = pytest.mark.xdist_group("test_harness")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = open(os.path.join(ROOT, "docs", "HARNESS.md")).read()
SCRIPT = re.findall(r"```python\n(.*?)```", DOC, re.S)[2]   # the out-of-process harness
ENV = "fncall/pages"
SUPO = ContextConfig("supo", 1350, max_steps=200, max_summaries=10, max_summary_tokens=128,
                     trigger_rule="reserve")


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(tiny_tokenizer())


@pytest.fixture()
def served():
    sessions = Sessions()
    server = Running(build_app(None, sessions))
    yield sessions, server.url
    sessions.shutdown()     # the long polls of a harness process end: the server stops at once
    server.stop()


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "pages_harness.py"
    path.write_text(SCRIPT)
    return str(path)


def harness_process(script, url, workers=4):
    """The docs' script in a process of its own, with nothing of supo_jax on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.Popen([sys.executable, "-I", script, url, str(workers)], env=env,
                         cwd=os.path.dirname(script), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    return p


def stop(p):
    p.kill()
    p.wait()


def http(url, body=None, raw=None):
    """(status, JSON answer) of a GET, or a POST of `body` (or of the bytes `raw`)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or "null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or "null")


def _comparable(r):
    d = r.to_json()
    del d["env_info"], d["summary_probes"]
    return d


def test_a_harness_process_drives_the_rollouts_token_for_token(fmt, served, script):
    """The docs' script (HTTP alone, in a subprocess) with the scripted expert behind the
    sessions: every rollout answers, and equals the built-in loop's, summaries included."""
    sessions, url = served
    tasks = make_tasks(ENV, "train", 2, seed=0, size=6)
    actor = ScriptedActor(expert_for(ENV), fmt)
    builtin = run_rollouts(actor, lambda: make_env(ENV), tasks, fmt, SUPO, group_size=2, rows=4)
    p = harness_process(script, url)
    try:
        harness = run_rollouts(ScriptedActor(expert_for(ENV), fmt),
                               harness_envs(None, sessions, url, timeout_s=60), tasks, fmt,
                               SUPO, group_size=2, rows=4)
    finally:
        stop(p)
    assert all(r.reason == "answer" and r.reward == 1.0 for r in harness), p.stderr.read()
    assert all(r.counters["summaries"] > 0 for r in harness)
    assert [_comparable(r) for r in harness] == [_comparable(r) for r in builtin]
    assert all(r.env_info["requests"] == r.counters["steps"] - r.counters["summaries"]
               for r in harness)
    assert len(sessions) == 0


def test_a_bad_reward_gets_a_400_and_fails_only_its_rollout(fmt, served):
    """Rewards NaN and "1.0" (a string): 400 invalid_reward, the rollout env_error; 1.0: 200,
    the rollout answers. Later requests to an ended session get its end's error; an unknown
    session's, a 404."""
    sessions, url = served
    tasks = make_tasks(ENV, "train", 3, seed=0, size=6)
    rewards = {tasks[0]["task_id"]: b'{"reward": NaN}', tasks[1]["task_id"]: b'{"reward": "1.0"}',
               tasks[2]["task_id"]: b'{"reward": 1.0}'}
    seen = {}

    def one_turn():
        status, s = http(f"{url}/sessions/next?wait=30")
        assert status == 200 and s["base_url"] == f"{url}/sessions/{s['id']}/v1"
        prompt = make_env(ENV).reset(s["task"]).prompt
        status, _ = http(f"{s['base_url']}/chat/completions", {
            "model": s["model"], "messages": [{"role": "user", "content": prompt}]})
        assert status == 200
        reward = f"{url}/sessions/{s['id']}/reward"
        first = http(reward, raw=rewards[s["task"]["task_id"]])
        again = http(reward, {"reward": 1.0})
        chat = http(f"{s['base_url']}/chat/completions", {
            "model": s["model"], "messages": [{"role": "user", "content": prompt}]})
        seen[s["task"]["task_id"]] = [(st, (b.get("error") or {}).get("code"))
                                      for st, b in (first, again, chat)]

    workers = [threading.Thread(target=one_turn) for _ in tasks]
    for w in workers:
        w.start()
    rollouts = run_rollouts(ScriptedActor(expert_for(ENV), fmt),
                            harness_envs(None, sessions, url, timeout_s=30), tasks, fmt, SUPO,
                            group_size=1, rows=3)
    for w in workers:
        w.join(30)
    bad = [(400, "invalid_reward")] * 3
    assert seen[tasks[0]["task_id"]] == bad and seen[tasks[1]["task_id"]] == bad
    assert seen[tasks[2]["task_id"]] == [(200, None), (410, "session_ended"),
                                         (410, "session_ended")]
    for r in rollouts[:2]:
        assert r.reason == "env_error" and r.reward == 0.0
        assert "the reward must be a finite number" in r.transcript[-1]["content"]
    assert rollouts[2].reason == "answer" and rollouts[2].reward == 1.0
    for sid, want in ((sessions.instance + "0" * 24, (404, "session_not_found")),
                      ("z" * 32, (404, "session_not_found")),
                      # a session of an earlier run of the server (killed, started again)
                      (("1" if sessions.instance[0] == "0" else "0") * 32,
                       (503, "session_lost"))):
        status, body = http(f"{url}/sessions/{sid}/reward", {"reward": 1.0})
        assert (status, body["error"]["code"]) == want
    assert len(sessions) == 0


def test_a_session_no_process_claims_times_out(fmt, served):
    sessions, url = served
    (r,) = run_rollouts(ScriptedActor(expert_for(ENV), fmt),
                        harness_envs(None, sessions, url, timeout_s=0.5),
                        make_tasks(ENV, "train", 1, seed=0, size=6), fmt, SUPO,
                        group_size=1, rows=1)
    assert r.reason == "timeout" and "no harness process claimed" in r.transcript[-1]["content"]
    assert http(f"{url}/sessions/next?wait=0")[0] == 204    # the ended session is not handed out
    assert len(sessions) == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(run_dir, port, *extra):
    """`supo-jax train` of the tiny run (fncall/pages), its harness out of process."""
    cmd = [sys.executable, "-m", "supo_jax.cli", "train", "--config",
           os.path.join(ROOT, "experiments", "configs", "tiny_test.py")]
    for s in ["env.harness=http", f"env.harness_port={port}", f"train.run_dir={run_dir}",
              "train.steps=2", "advantage.masked_reasons=[]", "loss.entropy_coef=0.05",
              "train.eval_every=0", "env.eval_tasks=1", "rollout.reproducible=true", *extra]:
        cmd += ["--set", s]
    return cmd


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.slow   # ~50 s: three tiny runs in subprocesses, their harness in another
def test_a_harness_process_trains_through_a_kill_9_of_the_run(tmp_path, script):
    """`supo-jax train --set env.harness=http` with the docs' script as the harness, which
    outlives the runs: 2 steps of the tiny run (fncall/pages) through its sessions; a second
    run killed (kill -9) in its second step and started again on the same port resumes, the
    script drops the episodes the kill voided (connection errors, 503 session_lost) and
    claims the new sessions, and the metrics equal the uninterrupted run's."""
    import signal

    from tests.helpers import same_run, wait_while_running

    port = _free_port()
    p = harness_process(script, f"http://127.0.0.1:{port}")
    try:
        straight = tmp_path / "straight"
        r = subprocess.run(_train(straight, port), cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"harness sessions: http://127.0.0.1:{port}/sessions/next" in r.stdout
        rows = [x for x in _metrics(straight) if "loss" in x]
        assert [x["step"] for x in rows] == [1, 2]
        assert all(math.isfinite(x["loss"]) and x["env_error_rate"] == 0 for x in rows)
        assert all(x["harness_requests"] > 0 for x in rows)

        killed = tmp_path / "killed"
        run = subprocess.Popen(_train(killed, port), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        wait_while_running(run, lambda: (killed / "metrics.jsonl").is_file() and any(
            x.get("step") == 1 and "loss" in x for x in _metrics(killed)), timeout=600)
        assert run.poll() is None, "the run finished before it could be killed"
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        r = subprocess.run(_train(killed, port), cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout
        assert p.poll() is None, "the harness process died with the run"
    finally:
        stop(p)

    def drop_times(rows):
        return [{k: v for k, v in x.items() if not k.endswith("_seconds")} for x in rows]
    same_run(drop_times(_metrics(killed)), drop_times(_metrics(straight)))
