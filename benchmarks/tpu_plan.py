"""The paper's setups planned for TPU slices by compilation (supo_jax.plan), on a CPU host.

For each setup: the config, the model's shapes (experiments/models/NAME/config.json, no
weights), and per TPU generation the slices to try, smallest first; the first slice on which
every program (train step, the serving copy, prefill, decode) compiles and both phases
(rollouts, the update) fit is the result: supo_jax.plan's report, the decode on the training
layout compiled beside it for comparison (before / after the serving layout). Estimates from
compiled programs, not measurements. Slower than the other benchmarks: each 32B-36B program
compiles for minutes on 2 CPU cores.

    python benchmarks/tpu_plan.py                      # every setup; writes results/tpu_plan.json
    python benchmarks/tpu_plan.py --only 7b,8b         # some of them (the others' rows are kept;
                                                       # each row records the commit it was made at)
    python benchmarks/tpu_plan.py --refresh            # compile nothing: the estimates and RL
                                                       # step of every row recomputed from its
                                                       # programs' figures (a new calibration)
"""
from __future__ import annotations

import json
import os

import common

MODELS = os.path.join(common.REPO, "experiments", "models")
CONFIGS = os.path.join(common.REPO, "experiments", "configs")
# 16 training rows x 4096 tokens an update; 8 tasks x 8 rollouts sampled together
ONE_CHIP_ROWS = ["optim.minibatch_rows=16", "optim.micro=1", "rollout.tasks_per_step=8",
                 "rollout.rows=64"]
# name -> (what, config file, model, overrides, {generation: slices to try, smallest first});
# each list starts at the smallest slice on which the setup fitted in the last full run
# (smaller ones did not: BENCHMARKS.md's history), to keep a run of every setup to an hour
SETUPS = {
    "codegym": ("CodeGym-style: Qwen2.5-32B-Instruct, W = 4096, S = 7, 128 tasks x 8",
                "paper_fncall_supo.py", "qwen2.5-32b-instruct", [],
                {"v5p": ["v5p-32", "v5p-64"], "v5e": ["v5litepod-128", "v5litepod-256"],
                 "v6e": ["v6e-64", "v6e-128"], "tpu7x": ["tpu7x-16", "tpu7x-32"]}),
    # 64K-token rows: remat full keeps 43 GB of layer inputs a chip; offload moves them to the
    # hosts' memory
    "browsecomp": ("BrowseComp-Plus-style: Seed-OSS-36B-Instruct, W = 65536, S = 2",
                   "paper_search_supo.py", "seed-oss-36b-instruct", ["model.remat=offload"],
                   {"v5p": ["v5p-64", "v5p-128"], "v6e": ["v6e-128", "v6e-256"],
                    "tpu7x": ["tpu7x-32", "tpu7x-64"]}),
    "7b": ("Qwen2.5-7B-Instruct, W = 4096, 16 rows a step", "paper_fncall_supo.py",
           "qwen2.5-7b-instruct", ONE_CHIP_ROWS, {"v5e": ["v5litepod-16"], "v6e": ["v6e-8"]}),
    "8b": ("Qwen3-8B, W = 4096, 16 rows a step", "paper_fncall_supo.py", "qwen3-8b",
           ONE_CHIP_ROWS, {"v5e": ["v5litepod-16"], "v6e": ["v6e-8"]}),
    "7b-lora": ("Qwen2.5-7B-Instruct, LoRA r = 16 on a bfloat16 base, W = 4096, 16 rows a step",
                "paper_fncall_supo.py", "qwen2.5-7b-instruct",
                ONE_CHIP_ROWS + ["model.lora_rank=16", "model.lora_alpha=32",
                                 "model.lora_base_dtype=bfloat16"],
                {"v5e": ["v5litepod-8"], "v6e": ["v6e-4"]}),
}


def fit_batch(cfg, chips: int) -> list[str]:
    """Overrides that let a minibatch's rows split over the chips: the config's optim.micro,
    lowered until a micro-batch holds a multiple of the mesh's data x fsdp rows (splash
    attention runs per batch shard); where the minibatch has fewer rows than chips, the
    rest of the chips go to mesh.tensor."""
    rows, micro = cfg.optim.minibatch_rows, cfg.optim.micro
    tensor = 1
    while rows % (chips // tensor) and chips % (2 * tensor) == 0 and chips // tensor > rows:
        tensor *= 2
    batch_axes = chips // tensor
    while micro > 1 and (rows % micro or (rows // micro) % batch_axes):
        micro -= 1
    return ([f"optim.micro={micro}"] if micro != cfg.optim.micro else []) + (
        [f"mesh.tensor={tensor}"] if tensor > 1 else [])


def plan_setup(name: str, smoke: bool = False, gens: list[str] | None = None) -> list[dict]:
    from supo_jax.config import load_config
    from supo_jax.plan import plan, tpu_devices

    what, config, model, sets, slices = SETUPS[name]
    rows = []
    for gen, tries in slices.items():
        if gens and gen not in gens:
            continue
        for topology in tries[:1] if smoke else tries:
            cfg = load_config(os.path.join(CONFIGS, config), sets)
            topo_sets = sets + fit_batch(cfg, len(tpu_devices(topology)))
            # without collective matmul first (the default); where the update does not fit,
            # the same slice with it (XLA's windowed einsum never holds a whole gathered
            # weight) before a larger slice
            for extra in ([], ["mesh.collective_matmul=true"]):
                cfg = load_config(os.path.join(CONFIGS, config), topo_sets + extra)
                # the setup's own sampler rows: a slice fits the rollouts at them or not
                rep = plan(cfg, topology, model_config=os.path.join(MODELS, model),
                           training_layout=True, search_rows=False)
                rows.append({"setup": name, "what": what, "generation": gen, **rep,
                             "overrides": topo_sets + extra})
                print(f"{name} {topology}{' ' + extra[0] if extra else ''}: "
                      f"{'fits' if rep['fits'] else 'does not fit'} "
                      + ", ".join(f"{k} {_gib(p)}" for k, p in rep["programs"].items()),
                      flush=True)
                if rep["fits"] or rep["programs"].get("train_step", {}).get("fits"):
                    break
            if rep["fits"]:
                break
    return rows


def _gib(p: dict) -> str:
    return p.get("error", "")[:60] or f"{p['bytes_per_chip']['total'] / 2**30:.2f} GiB"


def refresh(row: dict) -> bool:
    """Recompute a row's estimates and predicted RL step from its compiled programs' figures
    with the planner's current formulas and calibrations (supo_jax.plan._estimates, rl_step);
    False (the row as it was) where its programs predate the figures those need."""
    from supo_jax.config import load_config
    from supo_jax.plan import _estimates, calibrate, resolve_model_config, rl_step

    if any("estimated_seconds" in p and "no_overlap_seconds" not in p
           for p in row["programs"].values()):
        return False
    _, config, model, _, _ = SETUPS[row["setup"]]
    cfg = load_config(os.path.join(CONFIGS, config), row["overrides"])
    mc = resolve_model_config(cfg, os.path.join(MODELS, model))
    calibrate(row)
    row["estimates"] = _estimates(row, mc)
    row["rl_step"] = rl_step(row, cfg)
    return True


def main(argv=None):
    from supo_jax.utils import provenance

    p = common.parser(__doc__)
    p.add_argument("--only", default=",".join(SETUPS), help="setups, comma-separated; the "
                   "other setups' rows of an existing NAME.json are kept")
    p.add_argument("--generations", default="", help="chip generations, comma-separated "
                   "(default every one a setup names); the other generations' rows are kept")
    p.add_argument("--refresh", action="store_true", help="compile nothing: recompute every "
                   "row's estimates and RL step from its programs' figures")
    args = p.parse_args(argv)
    if args.refresh:
        fn = os.path.join(args.out_dir, "tpu_plan.json")
        with open(fn) as f:
            res = json.load(f)
        made = provenance()
        for r in res["results"]["rows"]:
            if refresh(r):
                r["refreshed"] = made
        res["results"]["targets"] = targets(res["results"]["rows"])
        with open(fn, "w") as f:
            json.dump(res, f, indent=1)
        print(f"refreshed {fn}: " + ", ".join(f"{r['setup']} {r['topology']}"
                                              for r in res["results"]["rows"] if "refreshed" in r))
        return
    run = common.Run("tpu_plan", args, argv)
    only = args.only.split(",")
    gens = [g for g in args.generations.split(",") if g]
    unknown = [n for n in only if n not in SETUPS]
    if unknown:
        p.error(f"unknown setup {unknown[0]!r}; one of {', '.join(SETUPS)}")
    kept, fn = [], os.path.join(args.out_dir, "tpu_plan.json")
    if os.path.exists(fn) and not args.smoke:
        with open(fn) as f:
            kept = [r for r in json.load(f)["results"]["rows"] if r["setup"] not in only
                    or gens and r["generation"] not in gens]
    rows = []
    made = provenance()    # the code this process runs: as it was at its start
    for name in only:
        rows += [dict(r, made=made) for r in plan_setup(name, smoke=args.smoke, gens=gens)]
        partial = os.path.join(args.out_dir, "tpu_plan.partial.json")
        os.makedirs(args.out_dir, exist_ok=True)
        with open(partial, "w") as f:     # what stands if a long compile is stopped
            json.dump(rows, f, indent=1)
    order = list(SETUPS)
    rows = sorted(kept + rows, key=lambda r: order.index(r["setup"]))
    run.write({"rows": rows, "targets": targets(rows)})


def targets(rows: list[dict]) -> list[dict]:
    """Planner estimates against the goals of issue 52: a 7-8B model on v5litepod-16 at
    W = 4K decodes within 1.5x of its HBM roofline and trains at an MFU of at least 40% with
    no overlap of compute, HBM and ICI (the perfect-overlap figure is an upper bound: a target
    it meets says nothing); the CodeGym-style 32B setup's rollouts and update both fit on
    some slice."""
    out = []
    for r in rows:
        e = r.get("estimates", {})
        if r["setup"] in ("7b", "8b") and r["topology"] == "v5litepod-16":
            name = r["what"].split(",")[0]
            if "decode_over_roofline" in e:
                out.append({"what": f"{name} on v5litepod-16, W = 4K: decode estimate over its HBM "
                            "roofline (planner)", "target": "<= 1.5x",
                            "measured": f"{e['decode_over_roofline']:.2f}x",
                            "met": e["decode_over_roofline"] <= 1.5})
            if "train_mfu_no_overlap" in e:
                mfu = e["train_mfu_no_overlap"]
                out.append({"what": f"{name} on v5litepod-16, W = 4K: train step MFU with no "
                            "overlap (planner)", "target": ">= 40%", "measured": f"{100 * mfu:.0f}%",
                            "met": mfu >= 0.40})
    code = [r for r in rows if r["setup"] == "codegym"]
    if code:
        fit = [r["topology"] for r in code if r["fits"]]
        out.append({"what": "CodeGym-style 32B: rollout and update phases both fit (planner)",
                    "target": "on a named slice", "measured": ", ".join(fit) if fit else
                    "none of " + ", ".join(r["topology"] for r in code), "met": bool(fit)})
    return out


def _floor(p: dict) -> str:
    """'*' where a program's compute time is its model-FLOPs floor (its kernels' FLOPs are
    not in the HLO): an MFU of 100% there is by construction, an upper bound."""
    return "*" if p.get("bound") == "compute" and p.get("model_flops_per_chip", 0) > p.get(
        "flops_per_chip", 0) else ""


def _mfu(e: dict) -> str:
    """The train step's MFU as "no overlap to bound" (results before the two figures: the
    bound alone, as "at most")."""
    if "train_mfu_calibrated" in e:
        return (f"{100 * e['train_mfu_no_overlap']:.0f}-{100 * e['train_mfu_bound']:.0f}% "
                f"(calibrated {100 * e['train_mfu_calibrated']:.0f}%)")
    if "train_mfu_bound" in e:
        return f"{100 * e['train_mfu_no_overlap']:.0f}-{100 * e['train_mfu_bound']:.0f}%"
    return f"at most {100 * e['train_mfu']:.0f}%" if "train_mfu" in e else ""


def _rl_step(st) -> str:
    """The predicted RL step: bound / no-overlap / calibrated seconds, and the run's
    chip-hours at the calibrated figure (else at no overlap)."""
    if not st:
        return "-"
    kinds = [k for k in ("bound", "no_overlap", "calibrated") if k in st]
    hours = st["run_chip_hours"].get("calibrated", st["run_chip_hours"]["no_overlap"])
    return " / ".join(f"{st[k]['step']:,.0f}" for k in kinds) + f" ({hours:,.0f})"


def markdown(res: dict) -> str:
    out = ["Estimates from programs compiled for each slice (libtpu describes the slice, XLA "
           "compiles the run's own programs on this CPU host): nothing ran on a TPU, no figure "
           "here is a measurement. Per chip, from the compiled HLO walked with every loop's "
           "trip count (supo_jax.hlo_cost): FLOPs, HBM bytes and bytes over the interconnect; a "
           "program's bound time is the largest of FLOPs / peak, HBM bytes / HBM bandwidth "
           "and ICI time (each collective at the rate of the links its group spans, "
           "supo_jax.plan.collective_rate; the published figures of the chip's system "
           "architecture page, supo_jax.plan.CHIPS), and its bound is which one; with no "
           "overlap the three add up; the calibrated figure is the no-overlap time times how much "
           "slower MaxText's published train steps (the train step, the prefill) and "
           "JetStream's published decode (the decode) run than the planner's no-overlap time "
           "for them (see the calibration section). "
           "Resident GiB a chip by phase: rollouts, the training state (parameters, AdamW state) "
           "beside the sampler's largest program (the serving copy being made, prefill or "
           "decode, each with the serving weights and the KV cache); the update, the train "
           "step. MFU: 6 N tokens (4 N with LoRA adapters: no gradient for the frozen base) "
           "plus causal attention over the train step's estimated time at the peak; * marks a "
           "compute time that is that model-FLOPs floor (the splash kernel's FLOPs are not in "
           "the HLO), where the MFU is 100% by construction, an upper bound. Rollout tokens/s a chip: the sampler rows' decode tokens over one "
           "decode chunk's estimated time, on the training (FSDP) layout (before) and the "
           "serving layout (after); roofline: the chunk's estimate over every chip reading its "
           "serving weights and its share of the KV cache once a step. Each setup is tried on "
           "a generation's slices (benchmarks/tpu_plan.py's lists) smallest first, until both "
           "phases fit (without collective matmul, then with it where the update did not fit); "
           "overrides are the settings changed to fit a slice (and those the planner's remat "
           "search picked where the update did not fit as configured). RL step: "
           "supo_jax.plan.rl_step at the config's caps (S + 1 segments a rollout, H actions and "
           "S summaries at their token budgets: an upper bound on the work), seconds as bound / "
           "no overlap / calibrated (each program's calibrated time; the serving copy at no "
           "overlap), and the whole run's chip-hours at the calibrated figure. On Ironwood (tpu7x) "
           "a chip's two TensorCores are two devices: its rows' per-chip figures are a "
           "device's, and its chip-hours count chips.", "",
           "| setup | slice | chips | serving layout | rollout phase GiB / chip | update phase "
           "GiB / chip | fits | train step: bound, est. MFU | decode, training layout: bound, "
           "tok/s/chip, ICI MiB a step | decode, serving layout: bound, tok/s/chip, ICI MiB a "
           "step | decode / HBM roofline | RL step s (run chip-hours) | overrides |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["results"]["rows"]:
        p, e, ph = r["programs"], r.get("estimates", {}), r.get("phases", {})

        def err(name):
            x = p.get(name, {})
            return ("no: " + x["error"][:60]) if "error" in x else None

        def phase(name):
            x = ph.get(name)
            return "-" if not x else f"{x['bytes'] / 2**30:.2f}" + ("" if x["fits"] else " (no)")

        def decode(name, rate, ici):
            if err(name):
                return err(name)
            x = p.get(name)
            if not x:
                return "-"
            cal = e.get(rate + "_calibrated")
            rate = rate + "_bound" if rate + "_bound" in e else rate   # (older results)
            return (f"{x['bound']}, {e[rate]:,.0f}" + (f" (calibrated {cal:,.0f})" if cal else "")
                    + f", {e[ici] / 2**20:,.1f}" if rate in e else x["bound"])
        ts = p.get("train_step", {})
        sv = r.get("serving", {})
        k = r.get("devices_per_chip", 1)      # Ironwood: 2 devices (TensorCores) a chip
        cells = [r["what"], r["topology"],
                 str(r["chips"]) if k == 1 else f"{r['chips']} devices ({r['chips'] // k} chips)",
                 f"{sv['mesh']['data']} x {sv['tensor']}" if sv else "-",
                 phase("rollout"), phase("update"), "yes" if r["fits"] else "**no**",
                 err("train_step") or (f"{ts['bound']}{_floor(ts)}, "
                                       f"{_mfu(e)}{_floor(ts)}" if _mfu(e) else "-"),
                 decode("decode_training_layout",
                        "training_layout_rollout_tokens_per_second_per_chip",
                        "training_layout_collective_bytes_per_step"),
                 decode("decode", "rollout_tokens_per_second_per_chip",
                        "decode_collective_bytes_per_step"),
                 f"{e['decode_over_roofline']:.2f}x" if "decode_over_roofline" in e else "-",
                 _rl_step(r.get("rl_step")),
                 " ".join([o for o in r.get("overrides", [])
                           if o not in SETUPS.get(r["setup"], ("",) * 4)[3]]
                          + [f"(the planner's search: "
                             f"{' '.join(rm.get('sets') or ['model.remat=' + rm['picked']])})"
                             for rm in [r.get("remat") or {}] if rm.get("picked")]) or "-"]
        out.append("| " + " | ".join(cells) + " |")
    made: dict[str, list[str]] = {}
    for r in res["results"]["rows"]:
        m = r.get("made") or {}
        key = f"{m.get('commit')}{' (dirty)' if m.get('dirty') else ''}, {m.get('date', '')[:10]}"
        if r["setup"] not in made.setdefault(key, []):
            made[key].append(r["setup"])
    out += ["", "Rows by the commit whose code made them: " + "; ".join(
        f"{', '.join(v)}: {k}" for k, v in made.items()) + "."]
    again = sorted({f"{r['refreshed'].get('commit')}" for r in res["results"]["rows"]
                    if r.get("refreshed")})
    if again:
        out[-1] += (" Estimates and RL steps recomputed from those programs' figures "
                    f"(--refresh) at {', '.join(again)}: " + ", ".join(
                        f"{r['setup']} {r['topology']}" for r in res["results"]["rows"]
                        if r.get("refreshed")) + ".")
    if res.get("note"):
        out += ["", f"Note: {res['note']}."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
