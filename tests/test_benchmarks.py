"""Each benchmark script runs at its --smoke size and writes the JSON run_all.py assembles.

Not a timing test: the figures of a smoke run mean nothing; only the fields are checked.
The scripts run in separate processes, as many at once as the test has cores.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

# its module fixtures are built on one worker; its tests are scheduled first
pytestmark = [pytest.mark.xdist_group("test_benchmarks"), pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
NAMES = ("rollout", "rows", "horizon", "train_step", "train_memory", "lora", "serve", "harness")


def _stats(d):
    assert set(d) >= {"min", "median", "max"} and d["min"] <= d["median"] <= d["max"], d


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)   # one host device unless a script asks for more (train_step does)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", ""))
    # on the CPU, also where the default platform is a GPU: train_step.py's 2x2x2 mesh runs
    # on 8 simulated host devices (a GPU machine has 1 GPU), and scripts running side by
    # side on one GPU would only contend for it
    env["JAX_PLATFORMS"] = "cpu"
    # as many at once as this process has cores: six XLA processes on the one core of a
    # pinned pytest-xdist worker took 256 s side by side and 183 s one after another
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for wave in (NAMES[i:i + cores] for i in range(0, len(NAMES), cores or 1)):
        procs = {n: subprocess.Popen([sys.executable, os.path.join(BENCH, f"{n}.py"), "--smoke",
                                      "--out-dir", str(out)], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for n in wave}
        for n, p in procs.items():
            log, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"{n}.py --smoke failed:\n{log[-3000:]}"
    return out, {n: json.loads((out / f"{n}.json").read_text()) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_common_fields(results, name):
    res = results[1][name]
    assert res["name"] == name and res["smoke"] is True
    assert res["command"] == f"python benchmarks/{name}.py --smoke"
    assert res["machine"]["nproc"] >= 1 and res["machine"]["cpu"]
    assert all(res["versions"][k] for k in ("jax", "flax", "transformers"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", res["date"])
    assert res["peak_rss_mb"] > 50 and res["wall_s"] > 0
    assert 0.0 <= res["machine"]["steal"] <= 1.0      # /proc/stat exists on Linux
    for t in res["results"]["targets"]:
        assert set(t) == {"what", "target", "measured", "met"}


def test_rows_fields(results):
    r = results[1]["rows"]["results"]
    assert {x["latency_s"] > 0 for x in r["table"]} == {False, True}
    for x in r["table"]:
        for v in ("rounds", "independent"):
            _stats(x[v]["trained_tokens_per_s"])
            assert 0 < x[v]["utilisation"]["median"] <= 1 and x[v]["trained_tokens"] > 0
        _stats(x["speedup"])
        assert x["identical_rollouts"] is True   # each rollout samples its own stream
    assert {x["latency_s"] > 0 for x in r["budget"]} == {False, True}
    for x in r["budget"]:
        for v in ("off", "on"):
            _stats(x[v]["trained_tokens_per_s"])
            assert 0 < x[v]["utilisation"]["median"] <= 1
        assert x["budget_tokens"] > 0 and 0 <= x["suspended_share"] <= 1


def test_rollout_fields(results):
    r = results[1]["rollout"]["results"]
    for v in ("kept", "reprefill"):
        x = r["variants"][v]
        _stats(x["tokens_per_s"])
        assert x["generated_tokens"] > 0 and x["prefill_per_generated"] > 0
    _stats(r["speedup"])
    assert r["identical_rollouts"] is True
    # the kept cache prefills less than re-prefilling every whole request
    assert r["variants"]["kept"]["prefilled_tokens"] < r["variants"]["reprefill"]["prefilled_tokens"]
    # one row taking part (a freed row's prompt, the last row generating): that row alone
    # computed, the same logits and tokens as the whole batch's
    for k in ("prefill", "decode"):
        _stats(r["refill"][k]["speedup"])
    assert r["refill"]["rows"] == 2 and r["refill"]["max_logit_diff"] < 1e-3
    assert r["refill"]["same_tokens"] is True


def test_horizon_fields(results):
    res = results[1]["horizon"]
    r, hs = res["results"], res["config"]["horizons"]
    for m in ("supo", "full"):
        assert [x["horizon"] for x in r["managers"][m]] == hs
        for x in r["managers"][m]:
            _stats(x["s_per_token"])
            assert x["kv_cache_bytes"] > 0 and x["longest_context"] > 0
        assert set(r["ratio_8h_vs_h"][m]) == {"s_per_token", "kv_cache_bytes", "longest_context"}
    assert r["ratio_8h_vs_h"]["supo"]["kv_cache_bytes"] == 1.0   # fixed by W


def test_train_step_fields(results):
    r = results[1]["train_step"]["results"]
    assert set(r["runs"]) == {"1x1x1", "2x2x2", "1x8x1"}   # run, run, compiled only
    for label, x in r["runs"].items():
        assert x["jax_devices"] == x["devices"] == (1 if label == "1x1x1" else 8)
        assert x["xla_bytes_all_devices"] > 0 and x["peak_rss_mb"] > 50
        if label == "1x8x1":
            assert "compiled only" in x["skipped"]
            continue
        _stats(x["step_s"])
        _stats(x["matmul_flops_per_s"])
        _stats(x["fraction_of_peak_per_step"])
        assert x["fraction_of_peak"] > 0 and x["tokens_per_s"]["median"] > 0
    assert r["runs"]["2x2x2"]["speed_vs_1_device"] > 0
    assert r["runs"]["2x2x2"]["collectives"]["all-reduce"] > 0
    assert r["flops_per_step"]["total"] > r["flops_per_step"]["dense"] > 0
    top = r["runs"]["1x1x1"]["profile"]["top_ops"]
    assert top and any(o["kind"].startswith("matmul") for o in top)


def test_train_memory_fields(results):
    r = results[1]["train_memory"]["results"]
    for mode in ("auto", "full", "plain"):
        assert [x["tokens"] for x in r[mode]] == [1024, 2048]
        assert all(x["total_bytes"] > 0 and x["remat"] in ("none", "dots", "full") for x in r[mode])
    assert len(r["growth"]["full"]) == 1 and r["plain"][-1]["total_bytes"] > r["full"][-1]["total_bytes"]


def test_lora_fields(results):
    r = results[1]["lora"]["results"]
    full, lora, qlora = r["train"]
    assert [x["mode"] for x in r["train"]] == ["full", "lora", "qlora"]
    assert full["trained_params"] == full["params"] > 10 * lora["trained_params"] > 0
    assert lora["opt_state_bytes"] < full["opt_state_bytes"] / 10
    assert qlora["param_bytes"] < lora["param_bytes"]          # the int8 base
    for x in r["train"]:
        _stats(x["step_seconds"])
    assert r["decode"]["same_tokens"] is True and r["decode"]["ratio_adapters_over_merged"] > 0


def test_serve_fields(results):
    r = results[1]["serve"]["results"]
    assert [x["clients"] for x in r["throughput"]] == [1, 4] and set(r["ttft"]) == {"1", "4"}
    for x in r["throughput"]:
        for k in ("endpoint_tokens_per_s", "sampler_tokens_per_s", "ratio", "ttft_s"):
            _stats(x[k])
        assert x["same_tokens"] is True and x["tokens"] > 0    # greedy: the sampler's tokens
    c = r["conversation"]
    assert c["reuse"]["prefilled_tokens"] < c["reprefill"]["prefilled_tokens"]
    assert c["reprefill"]["reused_tokens"] == 0 and c["prefill_ratio"] > 1
    assert c["same_tokens"] is True
    _stats(c["time_ratio"])


def test_run_all_assembles_benchmarks_md(results, tmp_path):
    out_dir = results[0]
    md = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--assemble",
                    "--results-dir", str(out_dir), "--out", str(md)], check=True, cwd=REPO,
                   capture_output=True)
    text = md.read_text()
    for title in ("## Targets", "## Multi-turn rollout", "## Horizon scaling", "## Train step",
                  "## Train-step memory", "## Peak host memory", "## Sampler decode throughput"):
        assert title in text
    assert text.count("python benchmarks/") >= 4 and "(--smoke run" in text


def test_a_smoke_run_never_writes_over_the_committed_results(tmp_path):
    committed = {p: os.path.getmtime(p) for p in (os.path.join(REPO, "BENCHMARKS.md"),
                                                   os.path.join(BENCH, "results"))}
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--smoke",
                        "--assemble"], cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    scratch = tmp_path / "supo_jax_benchmarks_smoke"
    assert f"wrote {scratch / 'BENCHMARKS.md'}" in r.stdout and (scratch / "BENCHMARKS.md").exists()
    assert committed == {p: os.path.getmtime(p) for p in committed}


def _sampler_module():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import sampler
    return sampler


def test_sampler_table_tunix_columns():
    """sampler.py's table: tunix columns only when some row has them ('-' where one lacks them).
    No benchmark runs here and tunix's environment is not built."""
    sampler = _sampler_module()
    st = {"first": 1.0, "tps": 10.0, "tps_lo": 9.0, "tps_hi": 11.0}
    row = {"batch": 1, "supo": st, "prefill_s": 0.1, "step_ms": 50.0, "hf": st, "agree": 1.0}
    plain = sampler.table([row])
    assert "tunix" not in plain and plain.splitlines()[2].count("|") == 10
    with_tunix = sampler.table([{**row, "tunix": {**st, "tps": 5.0}, "tunix_agree": 0.5},
                                {**row, "batch": 8}])
    lines = with_tunix.splitlines()
    assert all(ln.count("|") == 14 for ln in lines)
    assert "| 2.00x | 50% |" in lines[2] and lines[3].endswith("| - | - | - | - |")
    assert "google-tunix was not run: no venv" in sampler.tunix_note({"skipped": "no venv"})
    # targets at batch 8/32 only; the what-limits note quotes the matmul floor
    row8 = {**row, "batch": 8, "hf": {**st, "median_s": 1.0},
            "floor": {"jax_ms": 20.0, "torch_ms": 25.0, "matmul_gflop": 2.0, "attn_ms": 12.0,
                      "spans": "128/192", "kv_mb": 94.0}}
    t = sampler.targets([row, row8])
    assert [x["measured"] for x in t] == ["1.00x"] and not t[0]["met"]
    note = sampler.limits({"results": {"rows": [row8], "targets": t}, "config": {"new_tokens": 8}})
    assert "20 ms in XLA and 25 ms in torch" in note and "at most 3.8x transformers" in note
    assert ("attention alone (over 128/192 slots, reading 94 MB of cache per step on average) "
            "takes 12 ms") in note
    assert "matmuls + attention = 32 of the 50 ms step (a step of just these two would give at " \
        "most 2.8x transformers)" in note   # 1.0 s / (0.1 + 8 x 32 ms)
    at_floor = {**row8, "step_ms": 30.0}
    note = sampler.limits({"results": {"rows": [at_floor], "targets": t}, "config": {"new_tokens": 8}})
    assert "matmuls + attention alone take 32 ms, as long as the whole 30 ms step (the step " \
        "runs at that floor; a step of just these two would give at most 2.8x transformers)" in note
    # the attention floor is timed at the spans the default Sampler's decode calls attend
    assert sampler.decode_spans(64, 128, 256) == [(64, 128), (64, 192)]
    assert sampler.decode_spans(64, 100, 1024) == [(64, 128), (36, 192)]
    assert sampler.decode_spans(200, 8, 256) == [(8, 256)]


def test_steal_share_from_proc_stat_readings():
    """The share of CPU time the hypervisor stole between two /proc/stat readings."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import common
    assert common.steal_share((10, 1000), (40, 1300)) == 0.1
    assert common.steal_share(None, (40, 1300)) is None
    assert common.steal_share((10, 1000), (10, 1000)) is None
    now = common.cpu_times()
    assert now is None or (0 <= now[0] <= now[1])


def test_sampler_start_tunix_never_raises(monkeypatch):
    """When tunix's environment cannot be had, start_tunix says why and returns no worker."""
    sampler = _sampler_module()

    def fail(*a, **k):
        raise sampler.TunixUnavailable("pip install failed")

    monkeypatch.setattr(sampler, "tunix_python", fail)
    worker, info = sampler.start_tunix("/nonexistent", [1, 2], 4, 128, True)
    assert worker is None and info["skipped"] == "pip install failed"


def test_capacity_smoke_tells_the_managers_apart(tmp_path):
    """benchmarks/capacity.py --smoke (W = 446, tallest and reports, sizes 2 and 4, 2 tasks):
    every manager x family cell, its plot and its BENCHMARKS.md table; the reports family
    (long results) is within supo's reach at size 4 and not within full's."""
    sys.path.insert(0, BENCH)
    import capacity

    r = subprocess.run([sys.executable, os.path.join(BENCH, "capacity.py"), "--smoke",
                        "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "capacity.json").read_text())
    cells = res["results"]["cells"]
    assert len(cells) == 2 * len(res["results"]["managers"])
    assert cells["reports|supo|446"]["size"] == 4 and cells["tallest|supo|446"]["size"] == 4
    assert (cells["reports|full|446"]["size"] or 0) < 4
    assert (tmp_path / "capacity.png").stat().st_size > 1000
    md = capacity.markdown(res)
    assert "| reports | " in md and "W = 446:" in md


def test_gpu_smoke_fields(tmp_path):
    """benchmarks/gpu.py --smoke (a tiny model; on a CPU transformers is skipped and no
    fraction of peak is given) writes the fields its BENCHMARKS.md section reads, and
    run_all.py --assemble adds that section when gpu.json exists."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", ""))
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--smoke", "--out", str(out)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"gpu.py --smoke failed:\n{(p.stdout + p.stderr)[-3000:]}"
    res = json.loads(out.read_text())
    assert res["name"] == "gpu" and res["smoke"] is True
    assert res["command"] == "python benchmarks/gpu.py --smoke"
    r = res["results"]
    dev = r["device"]
    assert dev["device_kind"] and dev["count"] >= 1
    cpu = dev["platform"] == "cpu"
    assert [(x["rows"], x["seq"]) for x in r["train"]] == [(2, 128), (1, 256)]
    for x in r["train"]:
        assert x["status"] == "ok", x
        _stats(x["step_s"])
        assert x["tokens_per_s"] > 0 and x["compile_s"] > 0 and x["xla_bytes"]["argument"] > 0
        f = x["flops_per_step"]
        assert f["total"] == f["dense"] + f["attention"] and 0 < f["attention"] < f["dense"]
        assert (x["fraction_of_peak"] is None) if cpu else x["fraction_of_peak"] is None or \
            x["fraction_of_peak"] > 0
    (row,) = r["decode"]["rows"]
    s = row["supo"]
    assert row["batch"] == 2 and s["status"] == "ok"
    assert s["tokens_per_s"] > 0 and s["decode_ms_per_step"] > 0 and s["prefill_s"] > 0
    if cpu:
        assert "no CUDA device" in r["decode"]["transformers"]["skipped"]
    mm = r["mismatch"]["variants"]
    assert set(mm) == {"bfloat16", "float32"}
    for v in mm.values():
        assert v["status"] == "ok" and v["tokens"] == 4 * 16
        assert 0 <= v["p50"] <= v["p99"] <= v["max"] and v["mean"] >= 0
    assert mm["float32"]["mean"] < mm["bfloat16"]["mean"]
    md = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), "--assemble",
                    "--results-dir", str(tmp_path), "--out", str(md)], check=True, cwd=REPO,
                   capture_output=True)
    text = md.read_text()
    for title in ("## GPU", "### Train step", "### Decode", "### Sampler vs trainer"):
        assert title in text
    assert "python benchmarks/gpu.py --smoke" in text and "| 2 x 128 |" in text


def test_sampler_matmul_floor_runs_on_a_tiny_model():
    """The decode floor (matmuls alone, attention alone) runs against the model code as it is:
    it once imported a decoder function that no longer existed."""
    from supo_jax.model.tiny import tiny_config
    floor = _sampler_module().matmul_floor(tiny_config("qwen2", vocab_size=97), 2, [(3, 16)],
                                           repeats=1)
    assert floor["jax_ms"] > 0 and floor["attn_ms"] > 0 and floor["spans"] == "16"
    assert floor["kv_mb"] > 0 and floor["matmul_gflop"] > 0


def test_planner_calibration_is_the_committed_fit():
    """supo_jax.plan.TRAIN_CALIBRATION is the fit of benchmarks/results/calibration.json's
    compiled points (what `python benchmarks/calibration.py` wrote), and the file's
    leave-one-out figures are that fit's."""
    from supo_jax.plan import (DECODE_CALIBRATION, TRAIN_CALIBRATION, TRAIN_CALIBRATIONS,
                               fit_calibration, generation)
    sys.path.insert(0, BENCH)
    import calibration

    res = json.load(open(os.path.join(BENCH, "results", "calibration.json")))["results"]
    # (a program that does not fit its chip is in no fit)
    ok = [r for r in res["rows"] if "error" not in r and not r.get("smoke") and r["fits"]]
    rows = [r for r in ok if r["point"] in calibration.POINTS
            and generation(r["topology"]) not in calibration.OWN_FIT]
    fit = fit_calibration(rows)
    assert len(rows) >= 2 and TRAIN_CALIBRATION == pytest.approx(fit["factor"], abs=5e-3)
    # a generation with a fit of its own: its points' (the committed file's, and the planner's)
    assert set(TRAIN_CALIBRATIONS) == set(res["generation_fits"]) == set(calibration.OWN_FIT)
    for gen, factor in TRAIN_CALIBRATIONS.items():
        own = fit_calibration([r for r in ok if r["point"] in calibration.POINTS
                               and generation(r["topology"]) == gen])
        assert len(own["factors"]) >= 2 and factor == pytest.approx(own["factor"], abs=5e-3)
        assert res["generation_fits"][gen]["factor"] == pytest.approx(own["factor"])
    for name, f in (("fit", fit), ("decode_fit", fit_calibration(
            [r for r in ok if r["point"] in calibration.DECODE_POINTS]))):
        assert [x["point"] for x in res[name]["leave_one_out"]] == [
            x["point"] for x in f["leave_one_out"]]
        assert [x["miss"] for x in res[name]["leave_one_out"]] == pytest.approx(
            [x["miss"] for x in f["leave_one_out"]])
    dec = fit_calibration([r for r in ok if r["point"] in calibration.DECODE_POINTS])
    assert len(dec["factors"]) >= 2
    assert DECODE_CALIBRATION == pytest.approx(dec["factor"], abs=5e-3)
    # a measured step is rows / the published throughput
    for r in ok:
        if r["point"] in calibration.DECODE_POINTS:
            assert r["seconds"] == pytest.approx(r["rows"] / r["tokens_per_second"])


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_calibration_smoke_writes_a_row_and_its_table(tmp_path):
    """benchmarks/calibration.py --smoke compiles the tiny model's train step for v6e-8 and
    its decode for v5e-8 and writes a row each with its band beside the published figures;
    the tables render."""
    sys.path.insert(0, BENCH)
    import calibration

    r = subprocess.run([sys.executable, os.path.join(BENCH, "calibration.py"), "--smoke",
                        "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "calibration.json").read_text())
    rows = res["results"]["rows"]
    assert [r["point"] for r in rows] == ["llama3.1-8b_v6e-8", "llama3-8b_v5e-8_decode"]
    for row in rows:
        assert row["smoke"] and 0 < row["bound_seconds"] <= row["no_overlap_seconds"]
        assert set(row["parts_seconds"]) == {"compute", "hbm", "ici"}
    assert rows[1]["decode_steps"] >= 1 and rows[1]["cache_slots"] == 256
    md = calibration.markdown(res)
    assert "| llama3.1-8b_v6e-8 | 3 x 8192 |" in md and "| llama3-8b_v5e-8_decode | 128 x 2048 |" in md


def test_tpu_plan_rows_are_what_the_planner_computes_from_their_programs():
    """benchmarks/results/tpu_plan.json: every row with the current figures (refreshed or made
    since) holds the estimates and RL step that supo_jax.plan computes from its compiled
    programs' figures now (tpu_plan.refresh), at the committed calibration factors."""
    import copy
    sys.path.insert(0, BENCH)
    import tpu_plan

    rows = json.load(open(os.path.join(BENCH, "results", "tpu_plan.json")))["results"]["rows"]
    checked = 0
    for r in rows:
        again = copy.deepcopy(r)
        if not tpu_plan.refresh(again):
            continue
        checked += 1
        for k in ("estimates", "rl_step"):       # the same arithmetic on the same inputs
            assert json.loads(json.dumps(again[k])) == r[k], (r["setup"], k)
    assert checked >= 4
