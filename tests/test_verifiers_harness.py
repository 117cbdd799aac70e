"""A verifiers environment through harness mode (docs/HARNESS.md, "A verifiers environment"):
verifiers 0.4.0 in a venv of its own (made once, cached: supo_jax.harnesses.verifiers_venv),
its environment of fncall/pages (supo_jax/harnesses/verifiers_fncall.py) played by the
bridge the run starts (env.harness="verifiers:MODULE:FUNCTION"), the rewards verifiers'
scoring gives its traces."""
import json
import os
import re
import subprocess
import sys

import pytest

from supo_jax.config import ConfigError, load_config
from tests.helpers import train_through_bridge

pytestmark = pytest.mark.xdist_group("test_verifiers_harness")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
# tests/test_harness_train.py's settings for an untrained policy (W small enough that the
# server summarizes)
SETS = ["train.steps=2", "advantage.masked_reasons=[]", "loss.entropy_coef=0.05",
        "train.eval_every=0", "env.eval_tasks=1"]
# the environment as a run names it: up to 6 replies without a call answered "Call one of the
# tools." (the untrained policy rarely calls one), so that rollouts run long enough for the
# server's summaries and some end in verifiers (scored, their reward posted)
MODULE = """from supo_jax.harnesses.verifiers_fncall import load_environment


def pages():
    return load_environment(family="pages", nudges=6)
"""


@pytest.fixture(scope="module")
def python():
    """The cached verifiers venv's python (made here once, ~1 min; skipped only where the
    package index cannot be reached)."""
    from supo_jax.harnesses import verifiers_venv
    try:
        return verifiers_venv.ensure()
    except subprocess.CalledProcessError as e:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d",
                                os.devnull, "--quiet", "verifiers==0.4.0"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"the package index is unreachable: pip cannot fetch verifiers==0.4.0 "
                        f"({probe.stderr.decode()[-300:].strip()})")
        raise AssertionError(f"making the verifiers venv failed: {e}") from e


@pytest.mark.parametrize("sets, says", [
    (["env.harness=verifiers:no_function"], '"verifiers:MODULE:FUNCTION" expected'),
    (["env.harness=verifiers:a:b", "env.harness_python=/no/such/python"],
     "env.harness_python='/no/such/python' is not an executable python"),
])
def test_a_bad_verifiers_harness_is_named_at_start(sets, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        load_config(CONFIG, sets)
    assert "\n" not in str(e.value)


@pytest.mark.slow   # the venv (~1 min to make, the first time), a bridge started
def test_a_verifiers_environment_that_does_not_load_stops_the_run_at_start(python, tmp_path):
    from supo_jax.serve.harness import harness_mode
    cfg = load_config(CONFIG, ["env.harness=verifiers:no_such_module_xyz:f",
                               f"env.harness_python={python}", f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="the verifiers bridge stopped at start.*"
                                          "no_such_module_xyz"):
        with harness_mode(cfg):
            pass


@pytest.mark.slow   # ~20 s on 2 cores (a tiny run in a subprocess, the bridge in another)
def test_a_verifiers_environment_trains_two_supo_steps(python, tmp_path):
    """2 steps of the tiny policy under SUPO, every rollout a verifiers episode: summaries made
    by the server, and the rewards of the sessions that ended in verifiers posted by the
    bridge from verifiers' scoring of the trace."""
    (tmp_path / "my_verifiers_env.py").write_text(MODULE)
    out, metrics, log = train_through_bridge(
        python, tmp_path, CONFIG, ["env.harness=verifiers:my_verifiers_env:pages", *SETS])
    assert "verifiers bridge: my_verifiers_env:pages claims" in out
    rows = [x for x in metrics if "loss" in x]
    # the server summarized (tests/test_harness_train.py: at temperature 1 the untrained
    # policy's summaries run to their budget, summary_cut; a greedy evaluation's are made:
    # the one before training, whose rollout then ended in verifiers)
    assert all(x["summaries_mean"] + x["summary_cut_rate"] > 0 for x in rows)
    evals = [x for x in metrics if "eval/summaries_mean" in x]
    assert len(evals) == 2 and any(x["eval/summaries_mean"] > 0 for x in evals)
    with open(log) as f:
        sessions = [json.loads(x) for x in f]
    # every rollout of the run (2 steps x 2 tasks x 2, and the evaluation's) was a session
    # of the bridge; those that ended in verifiers were scored by its rubric and accepted
    assert len(sessions) >= 8
    scored = [s for s in sessions if s["status"] == 200]
    assert scored and all(s["rewards"] == {"reward": s["reward"]} for s in scored)
    assert all(s["reward"] in (0.0, 1.0) for s in scored)
    # the others were ended by the server (a cap, the context limit): no reward needed
    assert all(s["status"] == 410 for s in sessions if s["status"] != 200)


@pytest.mark.slow   # ~5 s once the venv is made: the bridge's start, 8 rollouts
def test_the_bridge_plays_the_builtin_loops_rollouts_token_for_token(python):
    """The scripted expert behind the sessions, the verifiers environment in the bridge: every
    rollout answers with verifiers' reward 1.0, summaries included, and equals the built-in
    loop's token for token (the harness's tools and prompt are our environment's)."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs.base import make_env, make_tasks
    from supo_jax.envs.fncall import expert_for
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.serve.app import Running, build_app
    from supo_jax.serve.harness import VerifiersBridge, harness_envs
    from supo_jax.serve.sessions import Sessions

    name = "fncall/pages"
    cfg = ContextConfig("supo", 1350, max_steps=200, max_summaries=10, max_summary_tokens=128,
                        trigger_rule="reserve")
    fmt = ChatFormat(tiny_tokenizer())
    tasks = make_tasks(name, "train", 2, seed=0, size=6)

    def run(make):
        return run_rollouts(ScriptedActor(expert_for(name), fmt), make, tasks, fmt, cfg,
                            group_size=2, rows=4)

    def comparable(r):
        d = r.to_json()
        del d["env_info"], d["summary_probes"]
        return d

    sessions = Sessions()
    server = Running(build_app(None, sessions))
    bridge = VerifiersBridge([python, os.path.join(ROOT, "supo_jax", "harnesses",
                                                   "verifiers_bridge.py"), server.url,
                              "supo_jax.harnesses.verifiers_fncall:load_environment",
                              "--workers", "4"])
    try:
        harness = run(harness_envs(None, sessions, server.url, timeout_s=60))
    finally:
        sessions.shutdown()
        bridge.stop()
        server.stop()
    assert all(r.reason == "answer" and r.reward == 1.0 for r in harness)
    assert all(r.counters["summaries"] > 0 for r in harness)
    assert [comparable(r) for r in harness] == [comparable(r) for r in run(lambda: make_env(name))]
