"""Multi-host training verified on one machine: JAX processes on localhost.

Two `supo-jax train` processes (one CPU device each, JAX_PLATFORMS=cpu, a local
coordinator through SUPO_JAX_COORDINATOR / SUPO_JAX_NUM_PROCESSES / SUPO_JAX_PROCESS_ID)
share one global mesh: the tiny policy is sharded over both processes' devices, both sample
every step's rollouts on a serving layout of those devices (each stepping its own rows' environments), and both
take two train steps together. They must report the same losses, process 0 alone must write
the logs, and the Orbax checkpoint written collectively must restore in a single process to
the exported weights.

Sampling on the serving layout (tests/rollout_worker.py): the same rollouts from 2 processes
x 4 devices, 1 process x 8 devices and 1 process x 1 device.
"""
import ast
import json
import os
import re
import socket
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import flat_params, same_run
from supo_jax.utils import PEER_LOST_EXIT as PEER_LOST

# its module fixtures are built on one worker; its tests are scheduled first
pytestmark = [pytest.mark.xdist_group("test_multihost"), pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
# no SFT; unmasked rows with an entropy bonus, so that the loss is non-zero and every
# update changes the parameters; short rollouts (8 turns, 2 summaries) and one eval task
# fncall/pages, where an environment variable can make a process stop itself
# (tests/worker_envs.py: stopping/pages)
# (no expert's ceiling: its resets would come before the step-1 reset that stops a process)
SETS = ["train.steps=2", "train.sft_warm_start=false", "advantage.masked_reasons=[]",
        "train.expert_ceiling=0",
        "loss.entropy_coef=0.05", "context.max_steps=8", "env.eval_tasks=1",
        "train.eval_before=false", "env.name=stopping/pages",
        'env.imports=["tests.worker_envs"]']
N = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(cmd: list[str], n: int, devices: int, **extra: str) -> list[subprocess.Popen]:
    """`cmd` as n JAX processes of `devices` CPU devices each (one coordinator on localhost),
    with `extra` environment variables."""
    port = _free_port()
    procs = []
    for i in range(n):
        # JAX_PLATFORMS=cpu also where the default platform is a GPU: two processes cannot
        # each own the one GPU of a machine, and the CPU backend's collectives (gloo) are
        # what this test checks
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu", **extra)
        if n > 1:
            env.update(SUPO_JAX_COORDINATOR=f"localhost:{port}", SUPO_JAX_NUM_PROCESSES=str(n),
                       SUPO_JAX_PROCESS_ID=str(i))
        # SIGINT as a terminal delivers it (KeyboardInterrupt), also where this suite runs
        # as a background job, whose children start with SIGINT ignored
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      preexec_fn=_sigint_default))
    return procs


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait(procs: list[subprocess.Popen], timeout: float = 400,
          kill: int | None = None) -> tuple[list, list[float]]:
    """Each process's (stdout, stderr), and the time.time() it was seen to exit; `kill`: a
    process to kill once another has exited (one that stopped itself)."""
    import threading
    import time

    outs, ends = [None] * len(procs), [0.0] * len(procs)

    def read(i, p):
        outs[i] = p.communicate()
        ends[i] = time.time()
        if kill is not None and i != kill:
            procs[kill].kill()

    readers = [threading.Thread(target=read, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    try:
        for t in readers:
            t.join(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for t in readers:
        t.join(10)
    return outs, ends


def _processes(cmd: list[str], n: int, devices: int, timeout: float = 400,
               **extra: str) -> list[str]:
    """Run `cmd` as n JAX processes of `devices` CPU devices each (with `extra` environment
    variables); their stdout, after asserting that each exited 0."""
    procs = _launch(cmd, n, devices, **extra)
    outs, _ = _wait(procs, timeout)
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    return [o for o, _ in outs]


def _train_cmd(run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "supo_jax.cli", "train", "--config", CONFIG,
           "--set", f"train.run_dir={run_dir}"]
    for s in SETS:
        cmd += ["--set", s]
    return cmd


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("multihost") / "run")
    return run_dir, _processes(_train_cmd(run_dir), N, 1)


# 6 tasks x 2 samples on 8 sampler rows (rows are reused), 8 turns with summaries, T = 1
# two kv heads, so that the serving layout can split them over tensor groups of 2 chips
# (fncall/pages, recording which process reset each rollout: tests/worker_envs.py)
ROLLOUT_SETS = ["rollout.tasks_per_step=6", "rollout.group_size=2", "rollout.rows=8",
                "context.max_steps=8", "model.tiny_kv_heads=2", "env.name=recorded/pages"]
# (processes, devices each) -> rollout.tensor: 1 process x 8 devices groups of one device,
# 2 processes x 4 devices the default (the largest group: 2 chips, the kv heads)
TENSOR = {(1, 1): 0, (1, 8): 1, (2, 4): 0}


@pytest.fixture(scope="module")
def rollout_run_dir(tmp_path_factory):
    """The run directory of the rollout workers: the first run trains the tokenizer, the
    others load it."""
    return str(tmp_path_factory.mktemp("rollout_run") / "run")


@pytest.fixture(scope="module")
def mesh_rollouts(tmp_path_factory, rollout_run_dir):
    """{(processes, devices each): every process's output} of tests/rollout_worker.py (the
    2-process launch also rolls out faulty/pages: SUPO_JAX_TEST_FAULTY)."""
    base = tmp_path_factory.mktemp("mesh_rollouts")
    run_dir = rollout_run_dir
    got = {}
    for n, d in [(1, 1), (1, 8), (2, 4)]:
        out = str(base / f"{n}x{d}")
        _processes([sys.executable, "-m", "tests.rollout_worker", run_dir, out] + ROLLOUT_SETS
                   + [f"rollout.tensor={TENSOR[n, d]}"], n, d,
                   **({"SUPO_JAX_TEST_FAULTY": "1"} if n > 1 else {}))
        got[n, d] = []
        for i in range(n):
            with open(os.path.join(out, f"rollouts_{i}.json")) as f:
                got[n, d].append(json.load(f))
    return got


def _tokens(rollouts):
    """Everything of each rollout but its logprobs."""
    return [dict(r, segments=[(s["tokens"], s["mask"]) for s in r["segments"]],
                 dropped=[(s["tokens"], s["mask"]) for s in r["dropped"]]) for r in rollouts]


def _logprobs(rollouts):
    return np.asarray([lp for r in rollouts for s in r["segments"] + r["dropped"]
                       for lp in s["logprobs"]])


def test_sampling_on_the_serving_layout_matches_one_process(mesh_rollouts):
    """2 processes x 4 devices decode on one 8-device serving layout (4 groups of 2 chips,
    no per-process copy) and each steps its own rows' environments: every process returns
    the same rollouts, and they are those of one process on 8 devices (8 groups of one
    device) and on 1 device (tokens, transcripts, rewards, summaries; logprobs to float
    rounding: the programs are partitioned differently)."""
    (one,), (eight,), two = (mesh_rollouts[k] for k in [(1, 1), (1, 8), (2, 4)])
    assert two[0]["processes"] == 2 and two[0]["devices"] == 8
    assert two[0]["mesh"] == eight["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert two[0]["serving_mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
    assert eight["serving_mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert one["mesh"] is None
    assert two[0]["rollouts"] == two[1]["rollouts"]
    ref = one["rollouts"]
    assert len(ref) == 12
    # the rollouts ran long enough to ask for summaries (the random policy's are cut at
    # their budget: summary_cut) and 12 rollouts reused the 8 rows
    assert sum(bool(m.get("summary")) for r in ref for m in r["transcript"]) >= 6
    assert sum(r["reason"] == "summary_cut" for r in ref) >= 6
    for got in (eight["rollouts"], two[0]["rollouts"]):
        assert _tokens(got) == _tokens(ref)
        np.testing.assert_allclose(_logprobs(got), _logprobs(ref), atol=1e-5)


def test_rollouts_cut_at_a_budget_are_suspended_alike_on_every_process(mesh_rollouts):
    """Rollouts cut at a token budget and resumed phase after phase (the same weights and
    key): both processes of the 2-process run hold the same suspended rollouts after every
    phase (each process replays the actions of the rows it owns when they resume), and on
    every layout the rollouts in the end are the straight ones (tokens, transcripts)."""
    two = mesh_rollouts[2, 4]
    assert two[0]["phases"] == two[1]["phases"]
    assert len(two[0]["phases"]) >= 3 and any(two[0]["phases"][:-1])
    assert two[0]["budget_rollouts"] == two[1]["budget_rollouts"]
    for got in mesh_rollouts.values():
        strip = [{k: v for k, v in r.items() if k != "versions"} for r in
                 got[0]["budget_rollouts"]]
        ref = [{k: v for k, v in r.items() if k != "versions"} for r in got[0]["rollouts"]]
        assert _tokens(strip) == _tokens(ref)
        np.testing.assert_allclose(_logprobs(strip), _logprobs(ref), atol=1e-5)


def _metrics(run_dir):
    from supo_jax import storage

    return [json.loads(x) for x in storage.read_text(storage.join(run_dir, "metrics.jsonl"))
            .splitlines() if x.strip()]


def test_processes_share_one_mesh_and_their_rows(mesh_rollouts):
    """2 processes x 4 devices: the policy's parameters live on all 8 devices of both
    processes (one mesh), each process resets the environments of its own rows only (every
    rollout reset once, by one process, both taking part), and a hundred exchanges of random
    sizes between them compile a handful of all-gather programs (padded to powers of two)."""
    two, (one,) = mesh_rollouts[2, 4], mesh_rollouts[1, 1]
    for p in two:
        assert p["param_devices"] == 8 and p["param_processes"] == 2
        assert p["resets"]                                  # both step environments
        assert p["exchange_compiles"] <= 10, p["exchange_compiles"]
        assert p["probe_compiles"] == 1          # the count above hears jax's compiles
    assert sorted(two[0]["resets"] + two[1]["resets"]) == sorted(one["resets"])
    assert len(one["resets"]) == 12


@pytest.fixture(scope="module")
def faulty_rollouts(mesh_rollouts):
    """2 processes x 4 devices over faulty/pages on the launch's 8 rows (its programs), after
    its other rollouts: process 1's environments fail in turn in their constructor, reset,
    step and reward (tests/worker_envs.py)."""
    return [p["faulty_rollouts"] for p in mesh_rollouts[2, 4]]


def test_one_hosts_failing_environments_fail_their_rollouts_not_the_run(faulty_rollouts):
    """Environments that raise when built, in reset or in step, or return a reward that is not
    a number, on one process only: both processes finish the batch (no wait in the
    exchange) with the same rollouts, those marked env_error with the failure named, the
    other process's rollouts untouched."""
    a, b = faulty_rollouts
    assert a == b and len(a) == 12
    errors = [r["transcript"][-1]["content"] for r in a if r["reason"] == "env_error"]
    for where in ("init", "reset", "step", "reward"):
        assert any(f"injected fault: {where}" in e for e in errors), (where, errors)
    assert {r["reason"] for r in a} <= {"env_error", "answer", "max_steps", "max_summaries",
                                        "context_limit", "summary_cut"}
    assert len(errors) < len(a) - 1        # process 0's rollouts ran


def test_processes_agree_on_the_losses(two_process_run):
    run_dir, outs = two_process_run
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 2]       # one writer: process 0; the final eval
    rows = rows[:2]
    assert all(r["rollouts"] == 4 for r in rows)       # 2 tasks x 2 samples, from both processes
    losses = [r["loss"] for r in rows]
    assert all(x != 0.0 for x in losses)
    m = re.search(r"process 1 of 2: losses by step (\[.*?\])", outs[1])
    assert m, outs[1]
    assert ast.literal_eval(m.group(1)) == losses       # exactly the same floats
    assert "success_rate" in outs[0] and "success_rate" not in outs[1]   # process 0 reports


def test_only_process_0_writes_logs_and_the_checkpoint_restores(two_process_run):
    run_dir, _ = two_process_run
    assert len(os.listdir(os.path.join(run_dir, "tb"))) == 1
    for f in ("config.json", "eval.json", "run.json", "hf/model.safetensors"):
        assert os.path.isfile(os.path.join(run_dir, f)), f
    import supo_jax
    from flax import nnx

    from supo_jax.checkpoint import RunCheckpoints
    from supo_jax.config import load_config
    from supo_jax.rl.train_step import make_optimizer
    from supo_jax.rl.runs import build_policy

    cfg = load_config(CONFIG, [f"train.run_dir={run_dir}"] + SETS)
    policy = build_policy(cfg, run_dir)          # one process, the run's tokenizer
    _, params = policy.split()
    initial = nnx.to_pure_dict(params)
    ck = RunCheckpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
    assert ck.steps() == [1, 2]
    tx = make_optimizer(cfg.optim.lr)
    step, restored, _, meta = ck.restore_latest(params, tx.init(params))
    ck.close()
    assert step == 2 and meta["step"] == 2
    restored = nnx.to_pure_dict(restored)
    exported = nnx.to_pure_dict(nnx.state(supo_jax.load_policy(os.path.join(run_dir, "hf")).model,
                                          nnx.Param))
    r, e, i0 = flat_params(restored), flat_params(exported), flat_params(initial)
    assert r.keys() == e.keys()
    for k in r:
        np.testing.assert_array_equal(r[k], e[k], err_msg=k)
    assert any(not np.array_equal(r[k], i0[k]) for k in r)   # the two steps trained it


@pytest.fixture
def bucket(monkeypatch):
    """A GCS API server on a loopback port (tests/gcs.py) that this process and the processes
    it launches use, by STORAGE_EMULATOR_HOST alone."""
    from tests import gcs

    server, host = gcs.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    yield f"gs://{gcs.BUCKET}"
    server.stop()


def test_preempted_then_killed_processes_resume_to_the_straight_runs_metrics(two_process_run,
                                                                             bucket):
    """Both processes of a run stop together on a SIGTERM to one of them (saving the step it
    arrived in); rerun, one is killed (kill -9) in the next step's rollouts: the other stops
    with one line naming it, within SUPO_JAX_HEARTBEAT_S / 4 and a beat; rerun again, the
    run ends with the metrics of a run never stopped. The run directory is in a bucket (a GCS
    API server on a loopback port, tests/gcs.py): both processes write each checkpoint there
    and every rerun resumes from it."""
    straight, _ = two_process_run
    run_dir = f"{bucket}/multihost"
    cmd = _train_cmd(run_dir)
    # process 1 steps 2 rollouts a step: its first reset is step 1's (step 2's on a rerun)
    procs = _launch(cmd, N, 1, SUPO_JAX_TEST_STOP="1:1:TERM")
    outs, _ = _wait(procs)
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for _, e in outs]
    assert all("stopped by SIGTERM after step 1 of 2" in e for _, e in outs)
    assert [r["step"] for r in _metrics(run_dir)] == [1]

    # kill -9: on CPU processes the survivor's collective fails at once (gloo: connection
    # reset by peer); a host that is lost without closing its connections hangs it instead:
    # SIGSTOP, where the PeerWatch stops the survivor
    # bounds with room for a loaded 2-core machine: KILL at once (the exit waits 2 beats + 1 s
    # for the other to fall quiet), STOP the watch's 10 s and a beat; jax.distributed's own
    # abort (40 s here after the last beat to the coordinator, which beats every 20 s: 20 s
    # after the stop at the soonest) is told apart by its exit status and its stack traces
    for sig, bound in [("KILL", 15), ("STOP", 10 + 2 + 15)]:
        procs = _launch(cmd, N, 1, SUPO_JAX_TEST_STOP=f"1:1:{sig}", SUPO_JAX_HEARTBEAT_S="40")
        outs, ends = _wait(procs, kill=1)
        err = outs[0][1]
        sent = float(re.search(rf"process 1 sends itself SIG{sig} at ([0-9.]+)",
                               outs[1][1]).group(1))
        assert procs[0].returncode == (75 if sig == "STOP" else 2), err[-2000:]
        assert procs[1].returncode == -9
        assert ends[0] - sent < bound, (sig, ends[0] - sent)
        assert "rerun every process with the same command: the run resumes from its last " \
               "checkpoint" in err.lower(), err[-2000:]
        assert "Check failure stack trace" not in err       # not jax.distributed's abort
        if sig == "STOP":
            assert ("supo-jax: error: process 0 of 2 stops: process 1 has not been heard "
                    "from in 10 s") in err, err[-2000:]
        assert [r["step"] for r in _metrics(run_dir)] == [1]

    # the last resume: under CI's load it lost process 1 twice (process 0: gloo's connection
    # closed, exit 75; experiments/LOG.md 2026-11-29, not yet understood): the documented
    # recovery, one rerun of every process, must then end the run as the straight one
    procs = _launch(cmd, N, 1)
    outs, _ = _wait(procs)
    if [p.returncode for p in procs] != [0, 0]:
        assert PEER_LOST in [p.returncode for p in procs], [e[-3000:] for _, e in outs]
        print("the last resume lost a process; rerun:", *[e[-3000:] for _, e in outs],
              sep="\n", file=sys.stderr)
        _processes(cmd, N, 1)
    timing = ("rollout_seconds", "update_seconds")
    same_run([{k: v for k, v in r.items() if k not in timing} for r in _metrics(run_dir)],
             [{k: v for k, v in r.items() if k not in timing} for r in _metrics(straight)])


@pytest.mark.parametrize("failing", [1, 0])
def test_an_error_on_one_process_stops_the_other_at_once(failing, tmp_path):
    """One process fails on its own (here a Ctrl-C on it alone, in step 1): the other stops
    within seconds, naming it, instead of waiting in its next collective (or for the
    runtime's shutdown barrier); neither ends in the runtime's abort."""
    run_dir = tmp_path / "run"
    cmd = _train_cmd(str(run_dir)) + ["--set", "train.steps=1"]
    procs = _launch(cmd, N, 1, SUPO_JAX_TEST_STOP=f"{failing}:1:INT")
    outs, ends = _wait(procs, timeout=200)
    codes = [130 if i == failing else 75 for i in range(N)]
    assert [p.returncode for p in procs] == codes, [e[-2000:] for _, e in outs]
    other = 1 - failing
    assert (f"process {other} of 2 stops: process {failing} stopped with an error: "
            "interrupted") in outs[other][1]
    assert abs(ends[0] - ends[1]) < 20      # a beat (5 s) and the exits, on a loaded machine
