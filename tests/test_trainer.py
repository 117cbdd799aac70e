"""Trainer runs: exact resume after kill -9, corrupt checkpoints, metrics, config errors."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from supo_jax.checkpoint import RunCheckpoints
from tests.helpers import same_run, wait_while_running

# its module fixtures are built on one worker; its tests are scheduled first
pytestmark = [pytest.mark.xdist_group("test_trainer"), pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_test.py")
# rewards are all zero for an untrained tiny policy: train unmasked rows with an entropy
# bonus so that every update really changes the parameters the next rollouts use
SETS = ["train.steps=4", "advantage.masked_reasons=[]", "loss.entropy_coef=0.05"]


# XLA GPU flags that make the trainer's runs repeat to the bit in another process (see _env)
DETERMINISTIC_GPU_FLAGS = ("--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0 "
                           "--xla_gpu_enable_triton_gemm=false")


def _env() -> dict:
    """The trainer subprocesses' environment: one device, the fastest trainer runs (on the
    CPU: no simulated devices).

    Where the default platform is a GPU the runs use it, and exact resume
    (test_sigterm_saves_the_step_and_a_rerun_resumes_exactly compares the metrics of a
    straight run with those of a stopped, a killed and a resumed process, float for float)
    needs XLA's GPU programs to repeat to the bit across processes. By default they need
    not: scatter-adds (the embedding gradient) accumulate with atomics in whatever order
    the threads arrive, and the autotuner times candidate kernels afresh in each process
    and may pick another, numerically different one in the resumed process than in the
    straight run.
    --xla_gpu_deterministic_ops=true selects deterministic implementations (XLA's flag
    for run-to-run determinism; `--xla_gpu_exclude_nondeterministic_ops` is the narrower
    one); --xla_gpu_autotune_level=0 turns autotuning off, so that every process takes the
    same default kernels; --xla_gpu_enable_triton_gemm=false sends matmuls to cuBLAS: with
    deterministic ops, XLA has been seen to find no Triton GEMM configuration for some
    fusions ("Failed to get configs"). All three flags are in jaxlib 0.10.2 and 0.11.2
    (an unknown flag would abort every run). The CPU backend is deterministic already:
    its runs get no flags, as before.
    """
    flags = DETERMINISTIC_GPU_FLAGS if jax.default_backend() == "gpu" else ""
    return dict(os.environ, XLA_FLAGS=flags)


ENV = _env()


def _cmd(run_dir, *extra):
    args = [sys.executable, "-m", "supo_jax.cli", "train", "--config", CONFIG,
            "--set", f"train.run_dir={run_dir}"]
    for s in SETS + list(extra):
        args += ["--set", s]
    return args


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("straight"))
    r = subprocess.run(_cmd(d), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return d, r.stdout


def test_metrics_jsonl_and_tensorboard(straight_run):
    d, out = straight_run
    rows = _metrics(d)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 4]
    with open(os.path.join(d, "eval.json")) as f:   # the final eval, as logged
        assert rows[-1] == {"step": 4, **{f"eval/{k}": v for k, v in json.load(f)["eval"].items()
                                          if v is None or isinstance(v, (int, float))}}
    before, rows = rows[0], rows[1:-1]   # step 0: the eval of the starting policy
    assert "eval/success_rate" in before and "loss" not in before
    assert "eval before" in out
    need = {"step", "loss", "reward_mean", "success_rate", "p_summary", "p_success_given_summary",
            "working_context_mean", "working_context_max", "summaries_mean", "tool_calls_mean",
            "overlong_rate", "generated_tokens_mean", "clip_fraction", "approx_kl", "entropy",
            "grad_norm", "summary_state_share"}
    assert need <= set(rows[0])
    assert any(r["updates"] > 0 and r["loss"] != 0.0 for r in rows)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(d, "tb")))
    assert "success_rate" in out and "logs:" in out
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["train"]["steps"] == 4
    assert os.path.isfile(os.path.join(d, "hf", "model.safetensors"))


def test_a_run_keeps_its_sft_warm_start_as_supo_jax_sft_rebuilds_it(straight_run, tmp_path):
    """run_dir/sft is the policy the run warm-started from: the same weights `supo-jax sft`
    saves for the same config, and not the trained policy of run_dir/hf."""
    from safetensors.numpy import load_file

    d, _ = straight_run
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "sft", "--config", CONFIG,
                        "--set", f"train.run_dir={tmp_path}", *[a for s in SETS for a in ("--set", s)]],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    kept, rebuilt, trained = (load_file(os.path.join(p, "model.safetensors")) for p in (
        os.path.join(d, "sft"), os.path.join(tmp_path, "sft"), os.path.join(d, "hf")))
    assert kept.keys() == rebuilt.keys() == trained.keys()
    assert all(np.array_equal(kept[k], rebuilt[k]) for k in kept)
    assert not all(np.array_equal(kept[k], trained[k]) for k in kept)


def test_sigterm_in_the_sft_warm_start_stops_there_and_the_rerun_goes_on(tmp_path,
                                                                          monkeypatch):
    """A SIGTERM during the SFT warm start (here: the preemption flag agreed after SFT step 3
    of 8) stops the run after that SFT step with its progress saved; the rerun goes on from
    step 3 and warm-starts the same weights as an SFT never stopped."""
    from safetensors.numpy import load_file

    from supo_jax.config import load_config
    from supo_jax.rl import trainer

    sets = ["sft.steps=8", "train.steps=1", "train.eval_before=false", "env.eval_tasks=1",
            "train.expert_ceiling=0"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    cfg = load_config(CONFIG, sets + [f"train.run_dir={run}"])
    asked = []

    def agreed(self):
        asked.append(1)
        return len(asked) == 3
    monkeypatch.setattr(trainer._Preemption, "agreed", agreed)
    with pytest.raises(trainer.Preempted, match="stopped after SFT step 3 of 8"):
        trainer.train(cfg)
    assert (run / "sft_progress").is_dir() and not (run / "checkpoints" / "0").exists()
    monkeypatch.setattr(trainer._Preemption, "agreed", lambda self: False)
    trainer.train(cfg)
    assert not (run / "sft_progress").exists() and (run / "hf" / "config.json").exists()
    trainer.open_run(load_config(CONFIG, sets + [f"train.run_dir={ref}"])).ckpts.close()
    resumed, straight = (load_file(str(d / "sft" / "model.safetensors")) for d in (run, ref))
    assert resumed.keys() == straight.keys()
    assert all(np.array_equal(resumed[k], straight[k]) for k in resumed)


def test_metrics_rows_are_strict_json_and_read_back(tmp_path):
    """A metric without a value (nan) is written as null, so strict JSON parsers read the file;
    a resume and the sweep's reader give nan back."""
    from supo_jax.rl.metrics import MetricsLog
    from supo_jax.sweep import read_metrics

    log = MetricsLog(str(tmp_path), resume_step=0)
    log.write({"step": 0, "eval/success_rate": 0.5})
    log.write({"step": 1, "loss": 0.1, "summary_state_share": float("nan")})
    log.close()

    def strict(c):
        raise ValueError(f"not JSON: {c}")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1], parse_constant=strict)["summary_state_share"] is None
    assert math.isnan(read_metrics(str(tmp_path))[1]["summary_state_share"])
    kept = MetricsLog(str(tmp_path), resume_step=1).kept
    assert kept[0] == {"step": 0, "eval/success_rate": 0.5} and math.isnan(kept[1]["summary_state_share"])


@pytest.fixture(scope="module")
def bucket_env():
    """A GCS API server (tests/gcs.py) and the trainer subprocesses' environment pointing
    at it by STORAGE_EMULATOR_HOST alone; this process reads the bucket the same way."""
    from tests import gcs

    server, host = gcs.start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = host
    env = {k: v for k, v in ENV.items() if k != "TENSORSTORE_GCS_HTTP_URL"}
    yield {**env, "STORAGE_EMULATOR_HOST": host}, f"gs://{gcs.BUCKET}"
    server.stop()
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old


def test_a_run_in_a_bucket_killed_and_rerun_resumes_exactly_and_exports_there(straight_run,
                                                                              bucket_env):
    """train.run_dir=gs://...: checkpoints, metrics.jsonl, TensorBoard events, config and the
    HF export go to the bucket; kill -9 after a checkpoint and rerun: the straight run's
    metrics, and its exported policy, loaded back from the bucket; `supo-jax eval` on the
    bucket's run evaluates its last checkpoint and writes there."""
    from supo_jax import storage
    from supo_jax.model.policy import load_policy

    ref, _ = straight_run
    env, bucket = bucket_env
    d = storage.join(bucket, "killed")
    p = subprocess.Popen(_cmd(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    t0 = time.time()
    while time.time() - t0 < 300:
        if storage.isdir(storage.join(d, "checkpoints", "2")) or p.poll() is not None:
            break
        time.sleep(0.2)
    assert p.poll() is None, "the run finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = subprocess.run(_cmd(d), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and f"HF export: {d}/hf" in r.stdout
    rows = [json.loads(x) for x in storage.read_text(storage.join(d, "metrics.jsonl")).splitlines()]
    same_run([{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in rows],
             _metrics(ref))
    assert any(f.startswith("events.out.tfevents") for f in storage.listdir(storage.join(d, "tb")))
    assert json.loads(storage.read_text(storage.join(d, "config.json")))["train"]["run_dir"] == d
    got, want = (load_policy(x).split()[1] for x in (storage.join(d, "hf"), os.path.join(ref, "hf")))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "eval", "--set",
                        f"train.run_dir={d}"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"policy: {d}/checkpoints step 4" in r.stdout and f"saved {d}/eval_scaling.json" in r.stdout
    assert storage.isfile(storage.join(d, "eval_scaling.json"))


def test_demonstrations_and_a_starting_policy_read_from_a_bucket(bucket_env):
    """`rollout --out gs://...` writes demonstrations to the bucket, `sft` reads them from
    there (sft.demos) and saves its policy there, and `train` starts from that policy in the
    bucket (train.init_from)."""
    from supo_jax import storage

    env, bucket = bucket_env

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "supo_jax.cli", *args], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    demos = storage.join(bucket, "demos", "pages.jsonl")
    cli("rollout", "--config", CONFIG, "--env", "fncall/pages", "--policy", "scripted",
        "--num", "4", "--set", "env.knobs.size=6", "--out", demos)
    assert len(storage.read_text(demos).splitlines()) == 4
    warm = storage.join(bucket, "from_demos")
    out = cli("sft", "--config", CONFIG, "--set", f"train.run_dir={warm}", "--set",
              f"sft.demos={demos}", "--set", "sft.steps=2")
    assert f"saved {warm}/sft" in out
    run = storage.join(bucket, "from_init")
    out = cli("train", "--config", CONFIG, "--set", f"train.run_dir={run}", "--set",
              f"train.init_from={warm}/sft", "--set", "train.steps=1")
    assert f"HF export: {run}/hf" in out
    assert [json.loads(x)["step"] for x in storage.read_text(
        storage.join(run, "metrics.jsonl")).splitlines()] == [0, 1, 1]


def test_a_bucket_that_refuses_writes_stops_the_run_in_one_line(bucket_env):
    from tests import gcs

    env, bucket = bucket_env
    with gcs.refusing():
        r = subprocess.run(_cmd(f"{bucket}/refused"), env=env, capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if "supo-jax train" in ln]
    assert err == [f"supo-jax train: error: train.run_dir {bucket}/refused: cannot write there "
                   f"(OSError: Forbidden: {err[0].split('Forbidden: ', 1)[-1]}"], r.stderr[-2000:]
    assert "saved" not in r.stdout and "export" not in r.stdout


def test_corrupt_latest_checkpoint_falls_back(tmp_path):
    ck = RunCheckpoints(str(tmp_path / "ck"), keep=3, async_save=False)
    tree = {"w": jax.numpy.arange(6.0), "b": jax.numpy.ones(3)}
    for step in (1, 2, 3):
        ck.save(step, jax.tree.map(lambda x: x * step, tree), {"n": jax.numpy.array(step)},
                {"step": step})
    ck.wait()
    # truncate every data file of the newest step
    for root, _, files in os.walk(tmp_path / "ck" / "3"):
        for f in files:
            fn = os.path.join(root, f)
            with open(fn, "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(fn) // 3))
    with pytest.warns(UserWarning, match="step 3 .* cannot be restored"):
        step, params, opt, meta = ck.restore_latest(tree, {"n": jax.numpy.array(0)})
    assert step == 2 and meta == {"step": 2} and int(opt["n"]) == 2
    np.testing.assert_allclose(params["w"], np.arange(6.0) * 2)
    ck.save(3, tree, {"n": jax.numpy.array(3)}, {"step": 3})   # the replayed step overwrites it
    ck.wait()
    assert ck.restore_latest(tree, {"n": jax.numpy.array(0)})[0] == 3
    ck.close()


def test_a_checkpoint_holds_its_record_as_it_was_at_save(tmp_path, monkeypatch):
    """The JSON record (the partial rollouts' carry) is written on Orbax's background thread
    after save() returns (here 0.3 s after, as on a busy host); the trainer changes the carry
    in the next step: the checkpoint holds the record as it was when saved."""
    import asyncio

    from orbax.checkpoint._src.handlers.json_checkpoint_handler import JsonCheckpointHandler

    dump = JsonCheckpointHandler._save_fn

    async def late(self, x, directory):
        await asyncio.sleep(0.3)
        return await dump(self, x, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", late)
    ck = RunCheckpoints(str(tmp_path / "ck"), async_save=True)
    tree = {"w": jax.numpy.arange(4.0)}
    carry = {"task_position": 8, "suspended": [{"task": {"id": 1}, "tokens": [1, 2]}]}
    ck.save(1, tree, {"n": jax.numpy.array(1)}, {"step": 1, "carry": carry})
    carry["task_position"] = 16                  # the next step, at once
    carry["suspended"][0]["tokens"].append(3)
    carry["suspended"].append({"task": {"id": 2}})
    ck.wait()
    assert ck.read_meta(1) == {"step": 1, "carry": {
        "task_position": 8, "suspended": [{"task": {"id": 1}, "tokens": [1, 2]}]}}
    ck.close()


def test_config_typo_fails_at_start_naming_the_key(tmp_path):
    r = subprocess.run(_cmd(str(tmp_path), "context.workin_context=100"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "context.workin_context" in err[0]
    r = subprocess.run(_cmd(str(tmp_path), "context.working_context=300"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "working_context" in r.stderr


def test_run_dir_of_a_different_model_is_refused(straight_run):
    d, _ = straight_run
    r = subprocess.run(_cmd(d, "model.tiny_hidden=48"), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "different model" in r.stderr


def test_eval_cli_test_time_scaling_table(straight_run):
    d, _ = straight_run
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "eval",   # the run's own settings
                        "--set", f"train.run_dir={d}", "--max-summaries", "0,2"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 4" in r.stdout   # the run's latest checkpoint was evaluated
    assert "config.json (the run's settings)" in r.stdout
    with open(os.path.join(d, "eval_scaling.json")) as f:
        rows = json.load(f)
    assert [x["max_summaries"] for x in rows] == [0, 2]
    assert all(x["summaries_mean"] <= x["max_summaries"] for x in rows)


def test_reeval_scores_saved_policies_on_identical_tasks(straight_run, tmp_path):
    """experiments/reeval.py: a run's HF export scored on more held-out tasks than the run's
    own eval, under the run's config (its eval sampling); a rerun reuses --out."""
    d, _ = straight_run
    out = tmp_path / "reeval.json"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "reeval.py"), "--config", d,
           "--tasks", "3", "--out", str(out), os.path.join(d, "hf")]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (res,) = json.loads(out.read_text()).values()
    with open(os.path.join(d, "config.json")) as f:
        t = json.load(f)["train"]
    samples = t["eval_samples"] if t["eval_temperature"] > 0 else 1
    assert res["rollouts"] == 3 * samples
    solved = res["success_rate"] * res["rollouts"]      # a count of solved rollouts
    assert abs(solved - round(solved)) < 1e-9, res
    assert f"success {res['success_rate']:.3f} over {res['rollouts']} rollouts" in r.stdout
    out.write_text(json.dumps({k: dict(v, success_rate=0.5) for k, v in
                               json.loads(out.read_text()).items()}))   # reused, not rerun
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "success 0.500 over" in r.stdout, r.stderr[-2000:]


def test_sft_cli_on_a_jsonl_of_conversations(tmp_path):
    demo = {"messages": [{"role": "user", "content": "Read page 1 and report its number."},
                         {"role": "assistant", "content": '<tool_call>\n{"name": "read_page", '
                                                          '"arguments": {"page": 1}}\n</tool_call>'},
                         {"role": "tool", "content": "Page 1 reads 7."},
                         {"role": "assistant", "content": "The number is 7."}]}
    path = tmp_path / "demos.jsonl"
    path.write_text("\n".join(json.dumps(demo) for _ in range(3)) + "\n")
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "sft", "--config", CONFIG,
                        "--set", f"train.run_dir={tmp_path / 'run'}", "--set", f"sft.demos={path}",
                        "--set", "sft.steps=4"], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sft_loss_last" in r.stdout
    rows = re.search(r"sft_row_tokens_mean=([\d.]+) sft_row_tokens_max=(\d+) "
                     r"summary_trigger_tokens=(\d+)", r.stdout)
    assert rows and 0 < float(rows[1]) <= int(rows[2]) and int(rows[3]) > 0, r.stdout
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "sft"))
    assert m.config.hidden_size == 32
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "sft", "--config", CONFIG,
                        "--set", f"train.run_dir={tmp_path / 'run2'}", "--set", f"sft.demos={bad}"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr


def test_kl_penalty_to_the_starting_policy_survives_a_resume(straight_run, tmp_path):
    """loss.kl_coef > 0: the starting policy is saved as run_dir/reference and reloaded on
    resume; kl_ref is 0 before the first update moves the policy and positive after; a run
    that started without the penalty cannot add it on resume."""
    d = str(tmp_path / "kl")
    r = subprocess.run(_cmd(d, "loss.kl_coef=0.5", "train.steps=2"), env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isfile(os.path.join(d, "reference", "model.safetensors"))
    r = subprocess.run(_cmd(d, "loss.kl_coef=0.5", "train.steps=3"), env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]
    kl = [row["kl_ref"] for row in _metrics(d) if "loss" in row]
    assert len(kl) == 3 and all(k >= 0 for k in kl) and kl[-1] > 0, kl
    ref, _ = straight_run
    r = subprocess.run(_cmd(ref, "loss.kl_coef=0.5", "train.accept_config_change=true"), env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "reference policy" in r.stderr.strip().splitlines()[-1]


def _fake_rollouts(calls):
    """A stand-in for trainer.rollout_batch: each task names its group's rewards."""
    from supo_jax.agent.rollout import Rollout

    def rollout_batch(policy, fmt, cfg, tasks, *, seed, progress=None):
        calls.append(([t["task_id"] for t in tasks], seed))
        return [Rollout(task_id=t["task_id"], group_id=g, sample=j, segments=[], reward=rw,
                        reason="answer", counters={},
                        transcript=[])
                for g, t in enumerate(tasks) for j, rw in enumerate(t["rewards"])]
    return rollout_batch


def test_placebo_permutations_are_fixed_by_seed_and_step_not_by_history():
    """advantage.permute_rewards: a step's permutation is the same in a resumed run (a fresh
    process at that step) as in the straight run, and differs between seeds and steps."""
    import types

    from supo_jax.agent.rollout import Rollout
    from supo_jax.config import apply_overrides, load_config
    from supo_jax.rl.trainer import run_advantages

    ro = [Rollout(task_id="t", group_id=0, sample=j, segments=[], reward=float(j),
                  reason="answer", counters={}, transcript=[]) for j in range(16)]

    def run(seed):
        cfg = apply_overrides(load_config(CONFIG), ["advantage.permute_rewards=true",
                                                    f"train.seed={seed}"])
        return types.SimpleNamespace(cfg=cfg)

    def perm(r, step, draw=0):
        return tuple(run_advantages(r, ro, step=step, draw=draw).advantages)

    straight = run(0)
    seen = [perm(straight, s) for s in range(6)] + [perm(straight, 5, draw=1)]
    assert perm(run(0), 5) == seen[5]             # resumed at step 5: the straight run's
    assert len(set(seen)) == len(seen)            # every step and round draws its own
    assert perm(run(1), 5) != seen[5]             # another seed, another permutation


def test_dynamic_sampling_keeps_the_groups_with_an_advantage_and_resamples(monkeypatch):
    import types

    from supo_jax import config as C
    from supo_jax.rl import trainer

    calls = []
    monkeypatch.setattr(trainer, "rollout_batch", _fake_rollouts(calls))
    # the step's own tasks: one group all solved (no advantage), one mixed; the pool: mixed
    # groups and all-failed ones
    step_tasks = [{"task_id": "same", "rewards": [1, 1]}, {"task_id": "mixed", "rewards": [1, 0]}]
    pool = [{"task_id": f"p{i}", "rewards": [0, 0] if i % 2 else [0, 1]} for i in range(50)]

    def run_with(k, tasks_per_step=2):
        cfg = C.apply_overrides(C.Config(), [f"rollout.dynamic_rounds={k}", "rollout.group_size=2",
                                             f"rollout.tasks_per_step={tasks_per_step}",
                                             "train.progress=false"])
        calls.clear()
        return trainer.step_rollouts(types.SimpleNamespace(cfg=cfg, policy=None, fmt=None), 3,
                                     step_tasks, pool)

    first, kept, m = run_with(0)           # off: the step's rollouts, all of them trained
    assert kept is first and len(first) == 4 and m == {} and len(calls) == 1

    first, kept, m = run_with(1)           # one round: the all-alike group is dropped
    assert [r.task_id for r in first] == ["same", "same", "mixed", "mixed"]
    assert [r.task_id for r in kept] == ["mixed", "mixed"] and m == {"rounds": 1,
                                                                     "groups_trained": 1}

    first, kept, m = run_with(4)           # more rounds until 2 groups carry an advantage
    rounds = list(calls)
    assert m["groups_trained"] == 2 and m["rounds"] == len(calls) >= 2
    assert [r.task_id for r in kept[:2]] == ["mixed"] * 2 and len(kept) == 4
    assert [r.group_id for r in kept] == [0, 0, 1, 1]
    second = kept[2].task_id
    assert second.startswith("p") and int(second[1:]) % 2 == 0
    assert len({s for _, s in calls}) == len(calls)       # a fresh sampler seed per round
    run_with(4)
    assert calls == rounds                                 # the same tasks and seeds: replayable
    _, kept, m = run_with(4, tasks_per_step=3)             # never more groups than asked for
    assert m["groups_trained"] == 3 and len(kept) == 6

    # every round all alike: the step trains nothing after k rounds
    step_tasks[1] = {"task_id": "same2", "rewards": [0, 0]}
    pool[:] = [{"task_id": f"q{i}", "rewards": [1, 1]} for i in range(50)]
    _, kept, m = run_with(3)
    assert kept == [] and m == {"rounds": 3, "groups_trained": 0} and len(calls) == 3


def test_a_step_that_trains_nothing_says_why_once(monkeypatch):
    from supo_jax.rl import trainer

    monkeypatch.setattr(trainer, "_REPORTED_UNTRAINED", [])
    said = []
    trainer.report_untrained({"step": 1, "updates": 4, "success_rate": 0.5}, said.append)
    assert said == []
    trainer.report_untrained({"step": 2, "updates": 0, "success_rate": 0.0}, said.append)
    trainer.report_untrained({"step": 3, "updates": 0, "success_rate": 0.5}, said.append)
    assert len(said) == 1 and said[0].startswith("step 2 trained nothing: no group of rollouts "
                                                 "carried an advantage, no rollout succeeded")
    monkeypatch.setattr(trainer, "_REPORTED_UNTRAINED", [])
    trainer.report_untrained({"step": 5, "updates": 0, "success_rate": 0.5}, said.append)
    assert "every rollout scored alike" in said[-1]


@pytest.mark.parametrize("family", ["smollm3"])
def test_new_model_families_train_and_export(family, tmp_path):
    """A tiny policy of a newly supported family (SmolLM3: its fourth layer without rotary
    embedding, the one new code path of the decoder) goes the whole way: SFT warm start, a
    SUPO step (KV-cache rollouts, the jitted loss), and an export that transformers loads
    with the trained weights' logits."""
    import torch
    import transformers

    from supo_jax import load_policy

    r = subprocess.run(_cmd(str(tmp_path), "train.steps=1", "train.eval_every=0",
                            f"model.tiny_family={family}", "model.tiny_layers=4"),
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [r for r in _metrics(str(tmp_path)) if r.get("loss") is not None]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"])
    hf = os.path.join(str(tmp_path), "hf")
    ours = load_policy(hf)
    assert ours.config.model_type == family
    assert (ours.config.rope_layers == (1, 1, 1, 0)) == (family == "smollm3")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = np.random.RandomState(0).randint(0, ours.config.vocab_size, (2, 24))
    with torch.no_grad():
        want = ref(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours.logits(ids)) - want).max() < 1e-4


def test_summary_caps_are_evaluated_once_a_distinct_context(monkeypatch):
    """eval_max_summaries under a manager that does not summarize is one evaluation (every
    cap is the same greedy run); under SUPO each distinct cap is one, and the configured cap
    reuses the evaluation already made."""
    import dataclasses

    from supo_jax.config import load_config
    from supo_jax.rl import trainer

    calls = []

    def fake(policy, fmt, cfg, *, max_summaries=None, seed=0, progress=True):
        calls.append(max_summaries)
        return {"success_rate": 0.5, "max_summaries": max_summaries}

    monkeypatch.setattr(trainer, "evaluate", fake)
    cfg = load_config(CONFIG)
    full = dataclasses.replace(cfg, context=dataclasses.replace(cfg.context, manager="full"))
    rows = trainer.evaluate_caps(None, None, full, [0, 7, 14, 28])
    assert len(calls) == 1 and [r["max_summaries"] for r in rows] == [0, 7, 14, 28]
    calls.clear()
    s = cfg.context.max_summaries
    rows = trainer.evaluate_caps(None, None, cfg, [0, s, 7, 0], made={"success_rate": 1.0})
    assert calls == [0, 7]
    assert [r["success_rate"] for r in rows] == [0.5, 1.0, 0.5, 0.5]


def test_sigterm_saves_the_step_and_a_rerun_resumes_exactly(straight_run, tmp_path):
    """SIGTERM (a preemption notice) mid-run: the process ends that step, saves it (off the
    train.save_every cycle), says so in one line and exits 143; the rerun resumes there and
    is killed (kill -9) once it has logged a step past that checkpoint; rerunning again
    resumes from the checkpoint with metrics identical to a straight run (the rows past it
    dropped)."""
    ref, _ = straight_run
    d = str(tmp_path / "term")
    cmd = _cmd(d, "train.save_every=100")     # no periodic checkpoint before the last step
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_while_running(p, lambda: os.path.isfile(os.path.join(d, "metrics.jsonl")) and any(
        r.get("step") == 1 and "loss" in r for r in _metrics(d)))
    assert p.poll() is None, "the run finished before it could be stopped"
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-2000:]
    line = err.strip().splitlines()[-1]
    m = re.search(r"stopped by SIGTERM after step (\d+) of 4", line)
    assert m and "rerun the same command to resume" in line, line
    saved = int(m.group(1))
    ck = RunCheckpoints(os.path.join(d, "checkpoints"), async_save=False)
    assert saved in ck.steps() and saved < 4
    ck.close()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_while_running(p, lambda: any(r.get("step", 0) > saved and "loss" in r
                                      for r in _metrics(d)))
    assert p.poll() is None, "the resumed run finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert any(r.get("step", 0) > saved for r in _metrics(d))
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout
    same_run(_metrics(d), _metrics(ref))


def test_partial_rollouts_complete_every_group_however_long_its_rollouts(monkeypatch):
    """rollout.budget_tokens with max_staleness 1 and a task whose rollouts span many phases
    (the scripted expert on a size-20 tallest: about 15 phases of 300 tokens shared by 4
    rows; a size-3 task beside it takes 2): a rollout
    restarted once runs to its end, so every group completes and trains, and the carry
    holds no more than the groups in flight, over 50 steps."""
    import types

    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, rollout_phase
    from supo_jax.config import load_config
    from supo_jax.envs import experts, make_env, make_tasks
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.rl import trainer

    cfg = load_config(None, ["rollout.budget_tokens=300", "rollout.max_staleness=1",
                             "rollout.dynamic_rounds=0", "rollout.tasks_per_step=2",
                             "rollout.group_size=2", "context.max_action_tokens=96",
                             "context.working_context=2048", "context.max_steps=60",
                             "optim.recompute_old_logprobs=true", "loss.behaviour_correction=tis"])
    fmt = ChatFormat(tiny_tokenizer())
    pool = [make_tasks("fncall/tallest", "train", 1, seed=s, size=n)[0]
            for s, n in ((1, 3), (2, 20))]

    def phase(policy, fmt_, cfg_, items, *, group_size, budget_tokens, version, envs, **_):
        return rollout_phase(ScriptedActor(experts.expert_for("fncall/tallest"), fmt_),
                             lambda: make_env("fncall/tallest"), items, fmt_, cfg_.context,
                             group_size=group_size, rows=4, budget_tokens=budget_tokens,
                             version=version, envs=envs)

    monkeypatch.setattr(trainer, "policy_rollouts", phase)
    run = types.SimpleNamespace(cfg=cfg, fmt=fmt, policy=None, envs={},
                                carry=trainer.Run.__dataclass_fields__["carry"].default_factory())
    trained, restarted, most = {}, 0, 0
    for step in range(50):
        _, got, m = trainer.partial_rollouts(run, step, pool)
        for x in got:
            trained[x.task_id] = trained.get(x.task_id, 0) + 1
        restarted += m["rollouts_restarted"]
        c = run.carry
        most = max(most, len(c["suspended"]) + len(c["ended"]), len(c.get("restarted", [])))
    long_task = pool[1]["task_id"]
    assert restarted > 0                                  # staleness 1 did restart rollouts
    assert trained.get(long_task, 0) >= 4, trained        # and the long task's groups trained
    assert most <= 2 * 2, most                            # tasks_per_step x group_size


def test_partial_rollouts_carry_across_steps_and_resume_to_the_bit(tmp_path):
    """rollout.budget_tokens: a step's rollout phase ends at the budget, the rollouts not
    ended go on in the next step (their staleness counted), groups train when complete; the
    suspended rollouts and unfinished groups are in the checkpoint, so a run killed (-9)
    after its step-1 checkpoint and rerun has the straight run's metrics, to the bit
    (rollout.reproducible: the rows' schedule depends on the tokens alone)."""
    budget = ("rollout.budget_tokens=300", "rollout.reproducible=true", "train.keep=5",
              "optim.recompute_old_logprobs=true", "loss.behaviour_correction=tis")
    ref, d = str(tmp_path / "straight"), str(tmp_path / "killed")
    r = subprocess.run(_cmd(ref, *budget), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for x in _metrics(ref) if "loss" in x]
    assert sum(x["rollouts_suspended"] for x in rows) > 0
    assert sum(x["rollouts_resumed"] for x in rows) > 0
    assert max(x["staleness_max"] for x in rows) >= 1
    assert any(x["updates"] > 0 for x in rows)
    ck = RunCheckpoints(os.path.join(ref, "checkpoints"), async_save=False)
    assert ck.read_meta(1)["carry"]["suspended"]        # step 1 left rollouts suspended
    ck.close()
    p = subprocess.Popen(_cmd(d, *budget), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    wait_while_running(p, lambda: os.path.isdir(os.path.join(d, "checkpoints", "1")))
    assert p.poll() is None, "the run finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = subprocess.run(_cmd(d, *budget), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout
    assert _metrics(d) == _metrics(ref)
