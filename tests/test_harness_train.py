"""Harness mode from a config (docs/HARNESS.md, "Training with a harness"): env.harness names
the harness, `supo-jax train` serves its sessions for the run and trains through them; the
settings harness mode cannot run stop the run at start."""
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from supo_jax.config import ConfigError, load_config

pytestmark = pytest.mark.xdist_group("test_harness")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
DOC = open(os.path.join(ROOT, "docs", "HARNESS.md")).read()
HARNESS = re.findall(r"```python\n(.*?)```", DOC, re.S)[0]
COMMAND = re.findall(r"```sh\n(supo-jax train .*?)\n```", DOC, re.S)[0]
# rewards are all zero for an untrained tiny policy: train unmasked rows with an entropy bonus
# (tests/test_trainer.py's settings); W small enough that the server summarizes
SETS = ["train.steps=2", "advantage.masked_reasons=[]", "loss.entropy_coef=0.05",
        "train.eval_every=0", "env.eval_tasks=1"]


@pytest.mark.parametrize("sets, says", [
    (["env.harness=no_colon"], '"module:function" expected'),
    (["env.harness=no_such_module_xyz:episode"], "env.harness: cannot import"),
    (["env.harness=json:no_such_function"], "has no function 'no_such_function'"),
    (["env.harness=json:dumps", "rollout.budget_tokens=100",
      "optim.recompute_old_logprobs=true", "loss.behaviour_correction=tis"],
     "rollout.budget_tokens=100: a harness's episode cannot be suspended"),
])
def test_settings_harness_mode_cannot_run_are_named_at_start(sets, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        load_config(CONFIG, sets)
    assert "\n" not in str(e.value)


def test_a_harness_config_trains_only_with_its_sessions_server(tmp_path):
    """train(cfg) outside harness_mode stops at once, naming what runs it."""
    from supo_jax.rl.trainer import env_maker, train

    cfg = load_config(CONFIG, ["env.harness=json:dumps", "context.manager=full",
                               f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="run `supo-jax train`"):
        train(cfg)
    assert not os.listdir(tmp_path)
    from supo_jax.serve.harness import harness_mode
    with harness_mode(cfg) as url:
        assert url.startswith("http://127.0.0.1:")
        assert env_maker(cfg)().name == "harness"
    with pytest.raises(ConfigError):
        env_maker(cfg)


def _command(tmp_path, run_dir, *extra):
    """The doc's command (harness saved where it says) with a run directory and SETS; its
    environment."""
    (tmp_path / "my_harness.py").write_text(HARNESS)
    cmd = shlex.split(COMMAND)
    assert cmd[:2] == ["supo-jax", "train"]
    cmd = [sys.executable, "-m", "supo_jax.cli", *cmd[1:], "--set", f"train.run_dir={run_dir}"]
    for s in SETS + list(extra):
        cmd += ["--set", s]
    return cmd, dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.slow   # ~16 s (45 s with a cold compile cache): a tiny run in a subprocess
def test_the_docs_command_trains_two_supo_steps_through_the_harness(tmp_path):
    """docs/HARNESS.md's harness, saved as my_harness.py, and its command, as written (plus
    a run directory and tests/test_trainer.py's settings for an untrained policy): 2 steps
    whose rollouts are all sessions of the harness, with summaries made by the server."""
    run_dir = str(tmp_path / "run")
    cmd, env = _command(tmp_path, run_dir)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [x for x in _metrics(run_dir) if "loss" in x]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(math.isfinite(x["loss"]) for x in rows)
    assert all(x["env_error_rate"] == 0 for x in rows)
    # the step's harness telemetry: every rollout a session, none re-templated or rewritten
    assert all(x["harness_requests"] > 0 and x["harness_rewritten"] == 0 for x in rows)
    # the server asked the policy for summaries: in training (at temperature 1 the untrained
    # policy's summaries run to their token budget: summary_cut) and in the greedy
    # evaluations (sessions of the harness too), where they are made
    assert all(x["summaries_mean"] + x["summary_cut_rate"] > 0 for x in rows)
    evals = [x for x in _metrics(run_dir) if "eval/summaries_mean" in x]
    assert evals and all(x["eval/summaries_mean"] > 0 for x in evals)
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "2"))


@pytest.mark.slow   # ~45 s: three tiny runs in subprocesses
def test_kill_9_after_step_1_and_a_rerun_resumes_to_a_straight_runs_metrics(tmp_path):
    """A harness run killed (kill -9) once it has logged step 1, rerun: it resumes from its
    checkpoint and its metrics equal an uninterrupted run's (rollout.reproducible: the rows'
    schedule depends on the tokens alone, not on when the harness's requests arrive)."""
    import signal

    from tests.helpers import same_run, wait_while_running

    def drop_times(rows):
        return [{k: v for k, v in x.items() if not k.endswith("_seconds")} for x in rows]

    straight = str(tmp_path / "straight")
    cmd, env = _command(tmp_path, straight, "rollout.reproducible=true")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = str(tmp_path / "killed")
    cmd, env = _command(tmp_path, killed, "rollout.reproducible=true")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    wait_while_running(p, lambda: os.path.isfile(os.path.join(killed, "metrics.jsonl")) and any(
        x.get("step") == 1 and "loss" in x for x in _metrics(killed)), timeout=600)
    assert p.poll() is None, "the run finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    same_run(drop_times(_metrics(killed)), drop_times(_metrics(straight)))
