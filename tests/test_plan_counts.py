"""The planner's counts (supo_jax.plan over supo_jax.hlo_cost) against hand counts, on programs
compiled for TPU chips by libtpu (nothing runs): the train step's FLOPs against 6 N tokens
plus attention, the decode's against 2 N a generated token plus attention, every loop's trip
count, the serving layout's interconnect bytes a decode step against the training layout's,
and no figure beyond the chip's published peak or bandwidth."""
import importlib.util
import json
import os

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not installed: no TPU to compile for"),
    pytest.mark.xdist_group("tpu_compile"),
]


def _model_dir(tmp_path, name, **shape):
    from supo_jax.model.tiny import tiny_config

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_config("qwen2", tie=False, **shape)
                                                 .to_hf_dict()))
    return str(path)


def _cfg(*sets):
    from supo_jax.config import load_config
    # no remat (a recomputed forward is not model work), XLA attention (its dots are in the
    # HLO), bf16 compute (the MXU's peak)
    return load_config(None, ["model.remat=none", "model.attention=xla",
                              "model.compute_dtype=bfloat16", "train.sft_warm_start=false",
                              *sets])


def _no_figure_beyond_the_chip(rep):
    for name, p in rep["programs"].items():
        s = p["estimated_seconds"]
        assert p["flops_per_chip"] / s <= rep["peak_flops_per_chip"] * 1.0001, name
        assert p["hbm_bytes_per_chip"] / s <= rep["hbm_bandwidth_per_chip"] * 1.0001, name
        assert p["collective_bytes_per_chip"] / s <= rep["ici_bandwidth_per_chip"] / 2 * 1.0001
    e = rep["estimates"]
    assert 0 < e["train_mfu_no_overlap"] <= e["train_mfu_bound"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("shape,rows,T", [
    (dict(vocab_size=512, hidden=256, layers=4, heads=4, kv_heads=2, mlp=1024), 8, 256),
    (dict(vocab_size=1024, hidden=384, layers=3, heads=6, kv_heads=6, mlp=1536), 16, 128),
])
def test_train_step_flops_match_the_hand_count(tmp_path, shape, rows, T):
    """Counted FLOPs (both layer scans at their trip counts) within 10% of the hand count:
    6 N a token over the matmul parameters, the LM head's forward once more (its chunks are
    recomputed in the backward: 2 V E a token), and XLA attention's full score matrix
    (QK^T and AV over all T keys, x3 with the backward: 12 L H D T a token)."""
    from supo_jax.plan import matmul_params, plan, resolve_model_config

    cfg = _cfg(f"optim.minibatch_rows={rows}", "optim.micro=1", f"optim.max_row_len={T}")
    path = _model_dir(tmp_path, "m", **shape)
    mc = resolve_model_config(cfg, path)
    rep = plan(cfg, "v5litepod-4", model_config=path, programs=("train_step",))
    p = rep["programs"]["train_step"]
    assert {lp["trip_count"] for lp in p["loops"]} >= {mc.num_layers}
    hand = rows * T * (6 * matmul_params(mc) + 2 * mc.vocab_size * mc.hidden_size
                       + 12 * mc.num_layers * mc.num_heads * mc.head_dim * T) / rep["chips"]
    assert p["flops_per_chip"] == pytest.approx(hand, rel=0.10)
    # XLA's own count sees each layer scan's body once
    assert p["xla_cost_analysis"]["flops"] < 0.6 * p["flops_per_chip"]


@pytest.mark.slow
def test_decode_flops_loops_and_serving_collectives(tmp_path):
    """One decode chunk on v5litepod-4: FLOPs within 10% of 2 N a generated token plus
    attention over the W slots; the token loop counted at its bound (steps) and the layer
    scan inside it at its length (XLA's own count is `steps x layers` times smaller); on the
    serving layout (tensor groups of 2 chips) the interconnect bytes a token step are at
    most 2% of a chip's weights, where the training (FSDP) layout moves about all of them."""
    from supo_jax.plan import (_sampler_programs, _shard_bytes, abstract_policy, hlo_cost_of,
                               plan, resolve_model_config, serving_params)
    from supo_jax.model import platform
    from supo_jax.model.sharding import make_mesh
    from supo_jax.plan import CHIPS, tpu_devices

    # weights of 136 MiB a chip: more than the 128 MiB of VMEM a v5e chip could keep them in
    shape = dict(vocab_size=8192, hidden=1024, layers=8, heads=8, kv_heads=4, mlp=4096)
    path = _model_dir(tmp_path, "m", **shape)
    cfg = _cfg("rollout.tensor=2", "rollout.rows=32", "rollout.tasks_per_step=4",
               "rollout.group_size=8", "context.working_context=512")
    mc = resolve_model_config(cfg, path)
    rep = plan(cfg, "v5litepod-4", model_config=path, programs=("decode", "to_serving"))
    assert rep["serving"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
    s, d = rep["shapes"], rep["programs"]["decode"]
    steps, W, B = s["decode_steps"], s["cache_len"], s["sampler_rows"]
    assert W % 128 == 0            # the sampler's cache length, rounded up to the TPU's tile
    loops = sorted((lp["trip_count"], lp["multiplicity"]) for lp in d["loops"])
    assert (steps, 1) in loops and (mc.num_layers, steps) in loops
    hand = B * steps * (2 * (mc.num_params - mc.vocab_size * mc.hidden_size)
                        + 4 * mc.num_layers * mc.num_heads * mc.head_dim * W) / rep["chips"]
    assert d["flops_per_chip"] == pytest.approx(hand, rel=0.10)
    assert d["xla_cost_analysis"]["flops"] * steps * mc.num_layers / 2 < d["flops_per_chip"]
    weights = rep["serving"]["weight_bytes_per_chip"]
    # every step reads each chip's serving weights and its share of the cache, and little else
    hbm_step = d["hbm_bytes_per_chip"] / steps
    assert weights <= hbm_step <= 1.5 * (weights + s["cache_bytes"] / rep["chips"])
    per_step = d["collective_bytes_per_chip"] / steps
    assert 0 < per_step <= 0.02 * weights
    _no_figure_beyond_the_chip(dict(rep, estimates={"train_mfu_bound": 0.5,
                                                    "train_mfu_no_overlap": 0.3}))

    # the same decode on the training layout: every step gathers the weights
    devices = tpu_devices("v5litepod-4")
    mesh = make_mesh(1, -1, 1, devices=devices)
    with platform.compiling_for("tpu", CHIPS["v5e"]["hbm_bytes"]):
        graphdef, params, cdt = abstract_policy(mc, cfg.model, mesh)
        train_layout = serving_params(params, mesh, cdt)   # bf16, FSDP-sharded
        fn, args, kw = _sampler_programs(cfg, mc, graphdef, train_layout, mesh, B)[0]["decode"]
        cost = hlo_cost_of(fn, args, kw, mesh)
    fsdp_weights = _shard_bytes(train_layout) * rep["chips"]
    assert cost.collective_bytes / steps >= 0.5 * fsdp_weights * 3 / 4


@pytest.mark.slow
def test_plan_of_the_whole_run_names_bounds_and_fits_by_phase(tmp_path):
    """Every program of a small run: no figure beyond the chip; the phases' resident bytes
    are the training state plus the largest sampler program, and the train step."""
    from supo_jax.plan import plan

    path = _model_dir(tmp_path, "m", vocab_size=512, hidden=256, layers=2, heads=4,
                      kv_heads=2, mlp=512)
    rep = plan(_cfg("context.working_context=256", "optim.minibatch_rows=8"), "v5litepod-4",
               model_config=path)
    assert set(rep["programs"]) == {"train_step", "prefill", "decode", "to_serving"}
    _no_figure_beyond_the_chip(rep)
    ph = rep["phases"]
    state = rep["training_state_bytes_per_chip"]
    big = max(rep["programs"][n]["bytes_per_chip"]["total"] for n in ("prefill", "decode"))
    assert ph["rollout"]["bytes"] >= state + big
    assert ph["update"]["bytes"] == rep["programs"]["train_step"]["bytes_per_chip"]["total"]
    assert rep["fits"] == (ph["rollout"]["fits"] and ph["update"]["fits"])
    _rl_step_by_hand(rep, _cfg("context.working_context=256", "optim.minibatch_rows=8"))


def _rl_step_by_hand(rep, cfg):
    """The predicted RL step is the programs' times composed as a step runs them: the
    serving copy, waves of prefill calls and decode chunks, train steps over every segment's
    row; at the caps by default, at a given work when asked; bound <= no overlap."""
    from supo_jax.plan import format_plan, rl_step

    p, s, st = rep["programs"], rep["shapes"], rep["rl_step"]
    ctx, r = cfg.context, cfg.rollout
    S = ctx.max_summaries
    rollouts = r.tasks_per_step * r.group_size
    waves = -(-rollouts // s["sampler_rows"])
    gen = min(ctx.max_steps * ctx.action_tokens + S * ctx.max_summary_tokens,
              (S + 1) * s["row_len"])
    calls = -(-(S + 1) * s["row_len"] // s["prefill_len"])
    sec = lambda n: p[n]["estimated_seconds"]
    want = sec("to_serving") + waves * (calls * sec("prefill")
                                        + gen / s["decode_steps"] * sec("decode"))
    assert st["work"]["assumed"] == "caps" and st["work"]["generated_tokens"] == gen
    assert st["bound"]["rollout"] == pytest.approx(want)
    trains = cfg.optim.ppo_epochs * -(-rollouts * (S + 1) // s["minibatch_rows"])
    assert st["bound"]["update"] == pytest.approx(trains * sec("train_step"))
    assert st["bound"]["step"] <= st["no_overlap"]["step"]
    assert st["run_chip_hours"]["bound"] == pytest.approx(
        st["bound"]["step"] * cfg.train.steps * rep["chips"] / 3600)
    given = rl_step(rep, cfg, segments=1, generated_tokens=s["decode_steps"])
    assert given["work"]["assumed"] == "given"
    assert given["bound"]["rollout"] == pytest.approx(
        sec("to_serving") + waves * (-(-s["row_len"] // s["prefill_len"]) * sec("prefill")
                                     + sec("decode")))
    with pytest.raises(ValueError, match="segments must be at least 1"):
        rl_step(rep, cfg, segments=0)
    assert "RL step (bound" in format_plan(rep) and "chip-hours" in format_plan(rep)


def test_paper_config_without_a_model_is_one_line_error():
    from supo_jax.config import load_config
    from supo_jax.plan import plan

    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "experiments", "configs", "paper_fncall_supo.py"))
    with pytest.raises(ValueError, match="no model to plan") as e:
        plan(cfg, "v5litepod-16")
    assert "\n" not in str(e.value) and "--model-config tiny" in str(e.value)


def test_rl_step_counts_the_old_logprobs_forward_when_a_run_recomputes_them():
    """optim.recompute_old_logprobs (rollout.budget_tokens sets it): the update phase is the
    epochs' train steps plus one forward pass over every row, in minibatch programs; a plan
    without that program predicts no step. Composed by hand from a report's figures."""
    from supo_jax.plan import rl_step

    def rep(recompute_s):
        progs = {n: {"estimated_seconds": t, "no_overlap_seconds": 2 * t,
                     "calibrated_seconds": 3 * t}
                 for n, t in [("train_step", 1.0), ("prefill", 0.5), ("decode", 0.25),
                              ("to_serving", 0.125)]}
        if recompute_s:
            progs["recompute_logprobs"] = {"estimated_seconds": recompute_s,
                                           "no_overlap_seconds": 2 * recompute_s,
                                           "calibrated_seconds": 3 * recompute_s}
        return {"programs": progs, "chips": 8,
                "shapes": {"row_len": 256, "prefill_len": 256, "decode_steps": 32,
                           "sampler_rows": 16, "minibatch_rows": 8}}

    sets = ["context.max_summaries=1", "rollout.tasks_per_step=4", "rollout.group_size=4",
            "optim.ppo_epochs=2"]
    plain = rl_step(rep(0), _cfg(*sets))
    cfg = _cfg(*sets, "optim.recompute_old_logprobs=true")
    assert cfg.optim.recompute_old_logprobs
    got = rl_step(rep(0.375), cfg)
    # 16 rollouts x 2 segments = 32 rows: 4 minibatches of 8, 2 epochs of train steps, and
    # one forward pass over the 4
    assert got["work"]["train_steps"] == 8 and got["work"]["recompute_passes"] == 4
    assert plain["work"]["recompute_passes"] == 0
    for kind, f in [("bound", 1), ("no_overlap", 2), ("calibrated", 3)]:
        assert plain[kind]["update"] == pytest.approx(8 * 1.0 * f)
        assert got[kind]["update"] == pytest.approx(8 * 1.0 * f + 4 * 0.375 * f)
        assert got[kind]["rollout"] == pytest.approx(plain[kind]["rollout"])
    assert rl_step(rep(0), cfg) is None        # the forward's program did not compile


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_dump_writes_each_programs_hlo(tmp_path, where, monkeypatch):
    """--dump DIR, on a local disk or in a bucket (a GCS API server on a loopback port)."""
    from supo_jax import storage
    from supo_jax.plan import plan

    out = str(tmp_path / "hlo")
    if where == "bucket":
        from tests import gcs
        server, host = gcs.start()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        out = f"gs://{gcs.BUCKET}/hlo"
    try:
        rep = plan(_cfg(), "v5litepod-4", model_config="tiny", programs=("to_serving",),
                   dump=out)
        assert "to_serving" in rep["programs"]
        files = sorted(storage.listdir(out))          # one a parameter's call
        assert files and all(f.startswith("to_serving.") for f in files)
        assert "HloModule" in storage.read_text(storage.join(out, files[0]))
    finally:
        if where == "bucket":
            server.stop()


@pytest.mark.slow
def test_an_update_that_does_not_fit_gets_the_remat_policy_that_does(tmp_path, monkeypatch):
    """With 25 MiB a chip, 2 rows of 1024 tokens a chip under remat none (every layer's
    activations and XLA attention's scores kept: about 34 MiB) do not fit: the plan compiles
    the policies that keep less until one fits (dots: about 18 MiB), says which, and shows
    that one's figures. With no policy fitting (1 MiB) it says so."""
    from supo_jax import plan as P

    path = _model_dir(tmp_path, "m", vocab_size=256, hidden=128, layers=2, heads=2,
                      kv_heads=1, mlp=512)
    monkeypatch.setitem(P.CHIPS["v5e"], "hbm_bytes", 25 << 20)
    rep = P.plan(_cfg("optim.minibatch_rows=8", "optim.max_row_len=1024", "model.remat=none"),
                 "v5litepod-4", model_config=path, programs=("train_step",))
    rm = rep["remat"]
    assert rm["configured"] == "none" and rm["picked"] == "dots"
    assert rm["sets"] == ["model.remat=dots"]
    assert [t["remat"] for t in rm["tried"]] == ["none", "dots"]
    assert rm["tried"][0]["bytes"] > 25 << 20 > rm["tried"][1]["bytes"]
    ts = rep["programs"]["train_step"]
    assert ts["remat"] == "dots" and ts["fits"] and rep["fits"]
    assert ts["bytes_per_chip"]["total"] == rm["tried"][1]["bytes"]
    text = P.format_plan(rep)
    assert "the plan picked model.remat=dots" in text
    assert ("train_step: fits at model.remat=dots, not the configured model.remat=none, which "
            "does not fit" in text)
    monkeypatch.setitem(P.CHIPS["v5e"], "hbm_bytes", 1 << 20)      # nothing fits in 1 MiB
    dump = tmp_path / "hlo"
    rep = P.plan(_cfg("optim.minibatch_rows=8", "optim.max_row_len=249", "model.remat=offload"),
                 "v5litepod-4", model_config=path, programs=("train_step",), dump=str(dump))
    assert rep["remat"]["picked"] is None and not rep["fits"]
    # at offload (no policy keeps less) the head split over the vocabulary; no MLP chunks
    # divide the 249-token rows (the search's full order: the stubbed searches below)
    assert [t["sets"] for t in rep["remat"]["tried"]] == [
        [], ["model.remat=offload", "model.head_split=vocab"]]
    assert "nothing tried fits" in P.format_plan(rep)
    # the dumped train_step is the one reported (offload); each other try under its own name
    assert sorted(os.listdir(dump)) == ["train_step.hlo.txt",
                                        "train_step.remat-offload.head-split-vocab.hlo.txt"]
    assert "S(5)" in (dump / "train_step.hlo.txt").read_text()       # host offload
    # auto may resolve to any policy: every one that keeps less than none is tried (the
    # search alone, its compiles stubbed: each policy's program does not fit)
    monkeypatch.setattr(P, "_train_programs", lambda *a: ({"train_step": None},))
    got = P._pick_remat(_cfg("model.remat=auto"), None, None, {"fits": False},
                        lambda *a: {"fits": False})
    assert [t["remat"] for t in got["tried"]][:5] == ["auto", "dots", "full", "offload_qkvo",
                                                       "offload"]
    assert got["tried"][5]["sets"] == ["model.remat=offload", "model.head_split=vocab"]
    # then the MLP in the chunks that divide the rows (1024 tokens: 2, 4, 8)
    got = P._pick_remat(_cfg("model.remat=offload", "optim.max_row_len=1024"), None, None,
                        {"fits": False}, lambda *a: {"fits": False})
    assert [t["sets"][1:] for t in got["tried"][1:]] == [
        ["model.head_split=vocab"],
        *[["model.head_split=vocab", f"model.mlp_chunks={n}"] for n in (2, 4, 8)]]
    assert got["picked"] is None


def test_the_remat_search_wants_5_percent_of_hbm_to_spare(monkeypatch):
    """The search (compiles stubbed: each try's bytes a chip given) goes past a program that
    fits with under 5% of HBM to spare to one that leaves 5%; where no try does, it picks
    the first that fits at all, and the plan's text says none left 5%."""
    from supo_jax import plan as P

    monkeypatch.setattr(P, "_train_programs", lambda *a: ({"train_step": None},))

    def search(sizes):
        import itertools
        it = itertools.chain(sizes, itertools.repeat(96))

        def program(*a):
            b = next(it)
            return {"fits": b <= 100, "bytes_per_chip": {"total": b}}
        return P._pick_remat(_cfg("model.remat=none"), None, None, {"fits": False}, program,
                             hbm=100)
    got = search([99, 90, 50])                       # dots 99%, full 90%: full
    assert got["picked"] == "full" and [t["bytes"] for t in got["tried"]] == [None, 99, 90]
    got = search([99, 98, 97])                        # none within 95%: dots, the first fitting
    assert got["picked"] == "dots" and got["program"]["bytes_per_chip"]["total"] == 99
    assert [t["bytes"] for t in got["tried"]][-1] == 96        # every try was compiled
    assert "the plan picked model.remat=dots" in P.format_remat(got, got["program"], 100)
    assert "no try is within 95% of HBM" in P.format_remat(got, got["program"], 100)
    got = search([99, 90, 50])
    assert "no try is within" not in P.format_remat(got, got["program"], 100)
    # nothing left to try (offload with the head split already, no MLP chunks dividing)
    rm = {"configured": "offload", "picked": None, "sets": [],
          "tried": [{"sets": [], "bytes": None, "error": "RESOURCE_EXHAUSTED: over"}]}
    assert P.format_remat(rm, None, 100).startswith(
        "update at model.remat=offload does not fit (RESOURCE_EXHAUSTED: over): nothing tried")


@pytest.mark.slow
def test_rollouts_that_do_not_fit_get_the_sampler_rows_that_do(tmp_path, monkeypatch):
    """With 6 MiB a chip, 16 sampler rows of a 512-slot cache do not fit beside the training
    state (6.9 MB): the plan compiles the prefill and decode at fewer rows (8: 5.7 MB, then
    12: 6.2 MB, over 95%), picks 8, and shows those programs, at those rows."""
    from supo_jax import plan as P

    path = _model_dir(tmp_path, "m", vocab_size=256, hidden=128, layers=2, heads=2,
                      kv_heads=1, mlp=512)
    monkeypatch.setitem(P.CHIPS["v5e"], "hbm_bytes", 6 << 20)
    rep = P.plan(_cfg("rollout.rows=16", "rollout.tasks_per_step=16", "rollout.group_size=4"),
                 "v5litepod-4", model_config=path, programs=("prefill", "decode"),
                 host_copy=True, training_layout=True)
    rw = rep["rows"]
    assert rw["configured"] == 16 and rw["picked"] == 8 and rw["sets"] == ["rollout.rows=8"]
    assert [t["rows"] for t in rw["tried"]] == [16, 8, 12]
    assert rw["tried"][0]["bytes"] > 0.95 * (6 << 20) >= rw["tried"][1]["bytes"]
    assert rep["shapes"]["sampler_rows"] == 8 and rep["fits"]
    progs = rep["programs"]
    assert progs["prefill"]["rows"] == progs["decode"]["rows"] == 8
    assert rep["phases"]["rollout"]["bytes"] == rw["tried"][1]["bytes"] == (
        rep["training_state_bytes_per_chip"] + max(progs[n]["bytes_per_chip"]["total"]
                                                   for n in ("prefill", "decode")))
    # the decode's model FLOPs count the picked rows: 8 rows x 64 steps a decode call
    assert progs["decode"]["model_flops_per_chip"] == pytest.approx(
        8 * 64 * P.decode_model_flops(P.resolve_model_config(_cfg(), path), 512) / 4)
    # the comparisons are compiled at the rows shown (one host: its share is all 8)
    assert rep["host_sampler_rows"] == 8
    assert progs["decode_training_layout"]["model_flops_per_chip"] == pytest.approx(
        progs["decode"]["model_flops_per_chip"])
    text = P.format_plan(rep)
    assert "prefill: fits at rollout.rows=8, not the configured 16 sampler rows" in text
    assert "the plan picked rollout.rows=8 (--set rollout.rows=8)" in text


def test_the_rows_search_finds_the_most_sampler_rows_that_fit(monkeypatch):
    """Rollouts that do not fit at the configured sampler rows: a bisection over multiples
    of the serving layout's batch ways (4 here) finds the most rows whose prefill and decode
    leave the phase within 95% of HBM beside the training state (compiles stubbed: a
    program's bytes grow with its rows; prefill refused by XLA past 40 rows)."""
    import types

    from supo_jax import plan as P

    monkeypatch.setattr(P, "_sampler_programs", lambda *a: (
        {"prefill": a[-1], "decode": a[-1]}, {"sampler_rows": a[-1], "cache_bytes": a[-1]}))
    calls = []

    def program(name, m, rows, dump_as, s):
        calls.append((name, rows, dump_as, s["sampler_rows"]))
        if name == "prefill" and rows > 40:
            return {"fits": False, "error": "RESOURCE_EXHAUSTED: over HBM"}
        return {"fits": True, "bytes_per_chip": {"total": 10 + (2 if name == "decode" else 1)
                                                 * rows}}
    mesh = types.SimpleNamespace(shape={"data": 1, "fsdp": 4, "tensor": 2})
    first = {n: program(n, None, 64, n, {"sampler_rows": 64}) for n in P.SAMPLER_PROGRAMS}
    assert P._rollout_phase(first, 8, 100) == {"bytes": 8 + 10 + 128, "largest": "decode",
                                               "fits": False, "refused": ["prefill"]}
    calls.clear()
    # state 8: the phase is 18 + 2 x rows, within 95 at 36 rows (90), not at 40 (98)
    got = P._pick_rows(None, None, None, None, mesh, {"sampler_rows": 64, "row_len": 9},
                       first, program, 8, 100)
    assert got["picked"] == 36 and got["sets"] == ["rollout.rows=36"]
    assert [t["rows"] for t in got["tried"]] == [64, 32, 48, 40, 36]
    assert got["tried"][2]["refused"] == ["prefill"] and got["tried"][4]["bytes"] == 90
    assert got["shapes"] == {"sampler_rows": 36, "cache_bytes": 36}
    assert got["programs"]["decode"] == {"fits": True, "bytes_per_chip": {"total": 82},
                                         "rows": 36}
    # each try's programs compiled at its rows, under their own dump names and shapes
    assert ("decode", 36, "decode.rows-36", 36) in calls and len(calls) == 2 * 4
    text = P.format_rows(got, 100)
    assert text.startswith("rollouts at 64 sampler rows do not fit (prefill over HBM); 32 "
                           "rows: 0.0 GiB a chip (82%)")
    assert "the plan picked rollout.rows=36 (--set rollout.rows=36)" in text
    assert got["within"] and "no try is within" not in text
    # a training state of 80: 4 rows fit (98) but none leaves 5%: the most that fit at all
    got = P._pick_rows(None, None, None, None, mesh, {"sampler_rows": 64}, first, program,
                       80, 100)
    assert got["picked"] == 4 and not got["within"] and got["tried"][-1]["bytes"] == 98
    assert "no try is within 95% of HBM" in P.format_rows(got, 100)
    # of 91 not even 4 rows fit
    got = P._pick_rows(None, None, None, None, mesh, {"sampler_rows": 64}, first, program,
                       91, 100)
    assert got["picked"] is None and [t["rows"] for t in got["tried"]][-1] == 4
    assert "no fewer rows fit beside the training state" in P.format_rows(got, 100)
    # only the programs the plan compiles are tried; where the state beside the serving copy
    # is over 95% already, none (fewer rows cannot help)
    calls.clear()
    got = P._pick_rows(None, None, None, None, mesh, {"sampler_rows": 64},
                       {"decode": first["decode"]}, program, 8, 100)
    assert got["picked"] == 36 and {c[0] for c in calls} == {"decode"}
    assert set(got["programs"]) == {"decode"}
    serving = {"fits": True, "bytes_per_chip": {"total": 150, "argument": 50}}
    got = P._pick_rows(None, None, None, None, mesh, {"sampler_rows": 64},
                       {**first, "to_serving": serving}, program, 8, 100)
    assert got["picked"] is None and got["fixed"] == 108 and len(got["tried"]) == 1
    assert "serving copy alone needs" in P.format_rows(got, 100)


@pytest.mark.slow
def test_tpu_programs_compile_without_collective_matmul_unless_asked(tmp_path):
    """mesh.collective_matmul: the train-side programs compile for TPU as a run compiles them
    (supo_jax.rl.train_step.step_programs): by default without XLA's windowed einsum (no
    windowed loops in the HLO, MaxText's recipes' setting), with it when asked; the windowed
    form accumulates partial sums in HBM (more HBM bytes, the same FLOPs). A model wide enough
    for XLA to choose the windowed form (hidden 1024, 16 rows x 1024 tokens on v6e-8: 8% more
    HBM bytes with it; 8 x 1024 is too small for XLA to window)."""
    from supo_jax.plan import plan

    path = tmp_path / "wide"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 8192,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    got = {}
    for cm in (False, True):
        cfg = _cfg("optim.minibatch_rows=16", "optim.micro=1", "optim.max_row_len=1024",
                   "optim.recompute_old_logprobs=true", f"mesh.collective_matmul={cm}")
        dump = tmp_path / f"hlo_{cm}"
        rep = plan(cfg, "v6e-8", programs=("recompute_logprobs",), model_config=str(path),
                   dump=str(dump))
        got[cm] = (rep["programs"]["recompute_logprobs"],
                   "windowed_dot_general" in (dump / "recompute_logprobs.hlo.txt").read_text())
    assert got[False][1] is False and got[True][1] is True
    assert got[True][0]["hbm_bytes_per_chip"] > 1.05 * got[False][0]["hbm_bytes_per_chip"]
    assert got[True][0]["flops_per_chip"] == pytest.approx(got[False][0]["flops_per_chip"],
                                                           rel=0.02)
