"""Multi-host training verified on one machine: two JAX processes on localhost.

Two `supo-jax train` processes (one CPU device each, JAX_PLATFORMS=cpu, a local
coordinator through SUPO_JAX_COORDINATOR / SUPO_JAX_NUM_PROCESSES / SUPO_JAX_PROCESS_ID)
share one global mesh: the tiny policy is sharded over both processes' devices, each
process runs the rollouts of its own share of each step's tasks, and both take two train
steps together. They must report the same losses, process 0 alone must write the logs,
and the Orbax checkpoint written collectively must restore in a single process to the
exported weights.
"""
import ast
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import flat_params

# its module fixtures are built on one worker; its tests are scheduled first
pytestmark = [pytest.mark.xdist_group("test_multihost"), pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
# no SFT; unmasked rows with an entropy bonus, so that the loss is non-zero and every
# update changes the parameters; short rollouts (8 turns, 2 summaries) and one eval task
SETS = ["train.steps=2", "train.sft_warm_start=false", "advantage.masked_reasons=[]",
        "loss.entropy_coef=0.05", "context.max_steps=8", "env.eval_tasks=1",
        "train.eval_before=false"]
N = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("multihost") / "run")
    port = _free_port()
    cmd = [sys.executable, "-m", "supo_jax.cli", "train", "--config", CONFIG,
           "--set", f"train.run_dir={run_dir}"]
    for s in SETS:
        cmd += ["--set", s]
    procs = []
    for i in range(N):
        # JAX_PLATFORMS=cpu also where the default platform is a GPU: two processes cannot
        # each own the one GPU of a machine, and the CPU backend's collectives (gloo) are
        # what this test checks
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JAX_PLATFORMS="cpu", SUPO_JAX_COORDINATOR=f"localhost:{port}",
                   SUPO_JAX_NUM_PROCESSES=str(N), SUPO_JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    return run_dir, [o for o, _ in outs]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_processes_share_one_mesh_and_their_tasks(two_process_run):
    _, outs = two_process_run
    for i, out in enumerate(outs):
        assert (f"process {i} of 2: mesh {{'data': 1, 'fsdp': 2, 'tensor': 1}} over 2 devices; "
                "rollouts of 1 of the 2 tasks of each step") in out, out


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
