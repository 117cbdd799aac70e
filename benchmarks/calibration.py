"""The planner's train-step and decode times beside published measurements of the same
models on the same chips: MaxText's step logs in AI-Hypercomputer/tpu-recipes
(training/trillium, v6e; training/ironwood, TPU7x: its README's table) and JetStream's decode
throughput.

For each published point the train step of the same shapes (its rows a chip of its tokens,
one micro-batch, FSDP over the slice: `supo-jax plan --config paper_fncall_supo.py` with
optim.minibatch_rows / micro / max_row_len set) is compiled for that slice on this CPU host
(supo_jax.plan, libtpu's description of the slice; verified by compilation, nothing runs on a
TPU), with the recipe's collective-matmul setting (mesh.collective_matmul). Its
perfect-overlap bound t_b (max of compute, HBM, ICI time) and its no-overlap time t_n (their
sum) are set beside the measured step time t. The calibration is one number a generation:
how much slower the published steps run than the planner's no-overlap time, r_k = t / t_n, r
their mean (supo_jax.plan.fit_calibration; the planner's `_calibrated` figures are t_n x r),
shared by every generation but those of OWN_FIT, which get their own (Ironwood, whose
SparseCores run the collectives beside the compute, runs nearer t_n than v6e). Every
published v6e point is slower than t_n (a chip overlapping nothing, at the published peak and
bandwidths), so there r is a factor on the band's slow end, not a place inside the band.
Leave-one-out: r fitted without point k predicts k's step time; the miss is predicted /
measured - 1. The calibration assumes our programs run as far beyond the planner's figures
as MaxText's do: it is not a measurement of ours. MaxText's programs are not ours (its remat
policy offloads more, its flash attention blocks differ): the fit absorbs that difference.

The decode: JetStream's published serving throughput (AI-Hypercomputer/jetstream-pytorch,
benchmarks/summary.md) beside the decode chunk of the same shapes on the same slice; its
calibration is of the same form, a step's measured time over the planner's no-overlap time.

    python benchmarks/calibration.py                 # every point; writes results/calibration.json
    python benchmarks/calibration.py --only NAME,... # some points (the others' rows are kept)
    python benchmarks/calibration.py --refit         # refit from the file's rows, no compile
"""
from __future__ import annotations

import json
import os

import common

MODELS = os.path.join(common.REPO, "experiments", "models")
CONFIG = os.path.join(common.REPO, "experiments", "configs", "paper_fncall_supo.py")
TRILLIUM = "AI-Hypercomputer/tpu-recipes training/trillium/"
# name -> the published point: model shapes (experiments/models/NAME), slice, rows a chip,
# tokens a row, measured step seconds and tokens/s a chip (the recipe's logged step line)
POINTS = {
    "llama3.1-8b_v6e-8": dict(
        model="llama3.1-8b", topology="v6e-8", rows_per_chip=3, seq=8192, seconds=3.443,
        tokens_per_second_per_chip=7138.890,
        source=TRILLIUM + "Llama3.1-8B-MaxText/v6e-8/README.md",
        log="completed step: 14, seconds: 3.443, TFLOP/s/device: 413.433, "
            "Tokens/s/device: 7138.890, total_weights: 196608"),
    "llama3.1-8b_v6e-16": dict(
        model="llama3.1-8b", topology="v6e-16", rows_per_chip=3, seq=8192, seconds=3.393,
        tokens_per_second_per_chip=7243.378,
        source=TRILLIUM + "Llama3.1-8B-MaxText/v6e-16/README.md",
        log="completed step: 14, seconds: 3.393, TFLOP/s/device: 419.485, "
            "Tokens/s/device: 7243.378, total_weights: 393216"),
    # 49,152 tokens a chip: our MLP's backward over whole rows needs 32.9 GiB of a 32 GiB
    # chip; in 4 token chunks it fits (experiments/LOG.md, 2026-12-06)
    "mistral-7b_v6e-8": dict(
        model="mistral-7b", topology="v6e-8", rows_per_chip=6, seq=8192, seconds=6.320,
        tokens_per_second_per_chip=7776.813, sets=["model.mlp_chunks=4"],
        source=TRILLIUM + "Mistral-7B-MaxText/README.md",
        log="completed step: 6, seconds: 6.320, TFLOP/s/device: 431.981, "
            "Tokens/s/device: 7776.813, total_weights: 393216"),
    # the one recipe here that leaves XLA's collective matmul on (its flags lack
    # DISABLE_COLLECTIVE_MATMUL, which the others carry: our default)
    "llama3.1-8b_v6e-256": dict(
        model="llama3.1-8b", topology="v6e-256", rows_per_chip=4, seq=8192, seconds=4.546,
        tokens_per_second_per_chip=7207.336, sets=["mesh.collective_matmul=true"],
        source=TRILLIUM + "Llama3.1-8B-MaxText/v6e-256/README.md",
        log="completed step: 14, seconds: 4.546, TFLOP/s/device: 417.397, "
            "Tokens/s/device: 7207.336, total_weights: 8388608"),
    # MaxText's recipe keeps this model's weights in bfloat16 (weight_dtype); the LM head
    # split over the vocabulary: gathered whole (2 GiB, and its gradient) the step needs
    # 35.7 GB of a 34.4 GB chip (experiments/LOG.md, 2026-12-07)
    "llama3.1-70b_v6e-32": dict(
        model="llama3.1-70b", topology="v6e-32", rows_per_chip=2, seq=8192, seconds=17.790,
        tokens_per_second_per_chip=920.965,
        sets=["model.dtype=bfloat16", "model.mlp_chunks=4", "model.head_split=vocab"],
        source=TRILLIUM + "Llama3.1-70B-MaxText/v6e-32/README.md",
        log="completed step: 34, seconds: 17.790, TFLOP/s/device: 443.385, "
            "Tokens/s/device: 920.965, total_weights: 524288"),
}

JETSTREAM = "AI-Hypercomputer/jetstream-pytorch benchmarks/summary.md"
# name -> a published decode throughput: model shapes, slice, rows (batch size), cache slots,
# the slice's generated tokens a second (its summary's row: date | device | dtype | batch |
# cache length | max input | max output | throughput), the model sharded over the slice's
# chips (model parallel: rollout.tensor = chips)
# Ironwood (TPU7x): rows a chip here are rows a device (a TensorCore), as the recipe's
# per_device_batch_size counts them (2 x 128 devices = its global batch of 256); tokens/s a
# chip are the README's, a whole chip's. The recipe keeps each layer's input and its q, k, v
# projections and attention output on device and recomputes the rest (remat_policy custom, no
# offload); the nearest of our policies is full remat (dots would keep the MLP's outputs too)
IRONWOOD = "AI-Hypercomputer/tpu-recipes training/ironwood/"
POINTS.update({
    "llama3.1-70b_tpu7x-128": dict(
        model="llama3.1-70b", topology="tpu7x-128", rows_per_chip=2, seq=8192, seconds=12.20,
        tokens_per_second_per_chip=2686.98, sets=["model.remat=full"],
        source=IRONWOOD + "README.md (llama3.1-70b/8k-bf16-tpu7x-4x4x4)",
        log="llama3.1-70b | 64 chips | GBS 256 | 8192 | bf16 | 12.20 s | 1,207.05 TFLOP/s/chip "
            "| 2,686.98 tokens/s/chip"),
    "llama3.1-70b_tpu7x-512": dict(
        model="llama3.1-70b", topology="tpu7x-512", rows_per_chip=2, seq=8192, seconds=12.27,
        tokens_per_second_per_chip=2670.55, sets=["model.remat=full"],
        source=IRONWOOD + "README.md (llama3.1-70b/8k-bf16-tpu7x-4x8x8)",
        log="llama3.1-70b | 256 chips | GBS 1024 | 8192 | bf16 | 12.27 s | 1,199.67 "
            "TFLOP/s/chip | 2,670.55 tokens/s/chip"),
})

# what each recipe does for memory (its README's workload details: remat_policy custom and
# the tensors it names, weight_dtype, the splash blocks), beside our settings in the table
_OFFLOAD5 = ("remat custom: the layer input and the q, k, v, out projections offloaded to the "
             "host, the rest recomputed; float32 weights; splash blocks 2048, fused backward")
MAXTEXT_MEMORY = {
    "llama3.1-8b_v6e-8": _OFFLOAD5, "llama3.1-8b_v6e-16": _OFFLOAD5,
    "mistral-7b_v6e-8": _OFFLOAD5, "llama3.1-8b_v6e-256": _OFFLOAD5,
    "llama3.1-70b_v6e-32": "remat custom: the layer input and the q, k, v projections offloaded "
                           "to the host, the rest recomputed; bfloat16 weights; splash blocks "
                           "2048, fused backward",
    "llama3.1-70b_tpu7x-128": "remat custom: the layer input, attention's context and the q, k, "
                              "v projections kept on device, the rest recomputed; float32 "
                              "weights, bfloat16 Adam first moment; splash blocks 2048, fused "
                              "backward",
}
MAXTEXT_MEMORY["llama3.1-70b_tpu7x-512"] = MAXTEXT_MEMORY["llama3.1-70b_tpu7x-128"]

DECODE_POINTS = {
    "llama3-8b_v5e-8_decode": dict(
        model="llama3-8b", topology="v5litepod-8", rows=128, cache_len=2048,
        tokens_per_second=8249.0, source=JETSTREAM,
        log="2024-04-24 | TPU v5e-8 | bfloat16 | 128 | 2048 | 1024 | 1024 | 8249"),
    "llama2-7b_v5e-8_decode": dict(
        model="llama2-7b", topology="v5litepod-8", rows=96, cache_len=2048,
        tokens_per_second=3663.0, source=JETSTREAM,
        log="2024-03-28 | TPU v5e-8 | bfloat16 | 96 | 2048 | 1024 | 1024 | 3663"),
}

# MaxText's recipes (MaxText@tpu-recipes-v0.1.2 / v0.1.4, their READMEs' workload details)
# keep each layer's input in the hosts' memory (remat_policy custom,
# decoder_layer_input offload); the nearest of our policies is remat offload (at full remat
# the 6-row Mistral step needs 36 GiB of temporaries and XLA refuses it on a 32 GiB chip)
REMAT = ["model.remat=offload"]


def plan_point(name: str, smoke: bool = False) -> dict:
    """The compiled train step of a published point's shapes: its bound, no-overlap time and
    their parts, memory, and the measured figures beside them. --smoke: the config's tiny
    model, 2 rows of 256 tokens a chip (checks that the script runs; the measured figures
    beside it mean nothing)."""
    from supo_jax.config import load_config
    from supo_jax.plan import TINY, plan, tpu_devices

    pt = POINTS[name]
    chips = len(tpu_devices(pt["topology"]))
    rows, seq = (2, 256) if smoke else (pt["rows_per_chip"], pt["seq"])
    sets = [f"optim.minibatch_rows={rows * chips}", "optim.micro=1",
            f"optim.max_row_len={seq}", *REMAT, *pt.get("sets", [])]
    cfg = load_config(CONFIG, sets)
    rep = plan(cfg, pt["topology"], programs=("train_step",),
               model_config=TINY if smoke else os.path.join(MODELS, pt["model"]))
    p = rep["programs"]["train_step"]
    if "estimated_seconds" not in p:
        print(f"{name}: the train step did not compile: {p.get('error')}", flush=True)
        return {"point": name, **pt, "chips": chips, "overrides": sets, "smoke": smoke,
                "error": p.get("error"), "compile_seconds": p["compile_seconds"],
                "versions": rep["versions"]}
    e = rep["estimates"]
    row = {"point": name, **pt, "chips": chips, "overrides": sets, "smoke": smoke,
           "bound_seconds": p["estimated_seconds"], "bound": p["bound"],
           "no_overlap_seconds": p["no_overlap_seconds"], "parts_seconds": p["seconds"],
           "bytes_per_chip": p["bytes_per_chip"], "fits": p["fits"],
           "collective_bytes_per_chip": p["collective_bytes_per_chip"],
           "largest_collectives": p["largest_collectives"],
           "train_mfu_bound": e["train_mfu_bound"], "train_mfu_no_overlap": e["train_mfu_no_overlap"],
           "compile_seconds": p["compile_seconds"], "versions": rep["versions"]}
    print(f"{name}: bound {row['bound_seconds']:.3f} s ({row['bound']}), no overlap "
          f"{row['no_overlap_seconds']:.3f} s, measured {pt['seconds']:.3f} s", flush=True)
    return row


def plan_decode_point(name: str, smoke: bool = False) -> dict:
    """The compiled decode chunk of a published decode point's shapes on its slice (the
    serving layout, the model sharded over every chip, a cache of its slots attended whole):
    its bound and no-overlap time a step beside the measured step, rows / throughput. --smoke:
    the config's tiny model, 8 rows of 256 slots."""
    from supo_jax.config import load_config
    from supo_jax.plan import TINY, plan, tpu_devices

    pt = DECODE_POINTS[name]
    chips = len(tpu_devices(pt["topology"]))
    rows, cache = (8, 256) if smoke else (pt["rows"], pt["cache_len"])
    # a manager without summaries: the cache is W slots; the default sampling (temperature 1,
    # no top-k / top-p): no sort of the vocabulary a step
    sets = ["context.manager=full", f"context.working_context={cache}", f"rollout.rows={rows}"]
    sets += [] if smoke else [f"rollout.tensor={chips}"]
    cfg = load_config(CONFIG, sets)
    rep = plan(cfg, pt["topology"], programs=("decode",), search_rows=False,  # its rows
               model_config=TINY if smoke else os.path.join(MODELS, pt["model"]))
    d, s = rep["programs"]["decode"], rep["shapes"]
    base = {"point": name, **pt, "chips": chips, "overrides": sets, "smoke": smoke,
            "seconds": pt["rows"] / pt["tokens_per_second"], "compile_seconds": d["compile_seconds"],
            "versions": rep["versions"]}
    if "estimated_seconds" not in d:
        print(f"{name}: the decode did not compile: {d.get('error')}", flush=True)
        return {**base, "error": d.get("error")}
    steps = s["decode_steps"]
    row = {**base, "sampler_rows": s["sampler_rows"], "cache_slots": s["cache_len"],
           "decode_steps": steps, "serving_mesh": rep["serving"]["mesh"],
           "bound_seconds": d["estimated_seconds"] / steps, "bound": d["bound"],
           "no_overlap_seconds": d["no_overlap_seconds"] / steps,
           "parts_seconds": {k: v / steps for k, v in d["seconds"].items()},
           "hbm_roofline_seconds": rep["estimates"]["decode_hbm_roofline_seconds"] / steps,
           "bytes_per_chip": d["bytes_per_chip"], "fits": d["fits"]}
    print(f"{name}: a step: bound {1e3 * row['bound_seconds']:.2f} ms ({row['bound']}), no overlap "
          f"{1e3 * row['no_overlap_seconds']:.2f} ms, measured {1e3 * row['seconds']:.2f} ms",
          flush=True)
    return row


# generations whose train points get a fit of their own (supo_jax.plan.TRAIN_CALIBRATIONS):
# Ironwood's measured steps run nearer the planner's no-overlap time (its SparseCores run the
# collectives beside the TensorCores' compute; 1.07x at fb06924) than v6e's (1.23-1.31x): one
# shared factor misses them by 18%
OWN_FIT = ("tpu7x",)


def _generation(row: dict) -> str:
    from supo_jax.plan import generation
    return generation(row["topology"])


def _fits(rows: list[dict]) -> tuple[dict, dict, dict]:
    """The shared train calibration of the compiled train points (those of OWN_FIT
    generations left out), the decode's, and each OWN_FIT generation's own. A program that
    does not fit its chip is left out of every fit: it is not the program a chip would run
    (the table reports it beside the others)."""
    from supo_jax.plan import fit_calibration

    ok = [r for r in rows if "error" not in r and r.get("fits", True)]
    train = [r for r in ok if r["point"] in POINTS]
    own = {g: fit_calibration([r for r in train if _generation(r) == g]) for g in OWN_FIT
           if any(_generation(r) == g for r in train)}
    return (fit_calibration([r for r in train if _generation(r) not in OWN_FIT]),
            fit_calibration([r for r in ok if r["point"] in DECODE_POINTS]), own)


def main(argv=None):
    from supo_jax.utils import provenance

    names = list(POINTS) + list(DECODE_POINTS)
    p = common.parser(__doc__)
    p.add_argument("--only", default=",".join(names), help="points, comma-separated")
    p.add_argument("--refit", action="store_true", help="compile nothing: refit and rewrite "
                   "the targets from the rows of the existing calibration.json")
    args = p.parse_args(argv)
    if args.refit:
        fn = os.path.join(args.out_dir, "calibration.json")
        with open(fn) as f:
            res = json.load(f)
        rows = res["results"]["rows"]
        fit, decode_fit, own = _fits(rows)
        res["results"].update(fit=fit, decode_fit=decode_fit, generation_fits=own,
                              targets=targets(rows, fit, decode_fit, own))
        with open(fn, "w") as f:
            json.dump(res, f, indent=1)
        print(f"refitted {fn}: train {fit['factor']:.3f}x, decode {decode_fit['factor']:.3f}x "
              "the no-overlap time")
        return
    run = common.Run("calibration", args, argv)
    only = args.only.split(",")
    unknown = [n for n in only if n not in names]
    if unknown:
        p.error(f"unknown point {unknown[0]!r}; one of {', '.join(names)}")
    if args.smoke:    # the first train point and the first decode point
        only = [n for n in names if n in only][:1] + [n for n in DECODE_POINTS if n in only][:1]
    kept, fn = [], os.path.join(args.out_dir, "calibration.json")
    if os.path.exists(fn) and not args.smoke:
        with open(fn) as f:
            kept = [r for r in json.load(f)["results"]["rows"] if r["point"] not in only]
    made = provenance()
    rows = kept + [dict((plan_point if n in POINTS else plan_decode_point)(n, args.smoke),
                        made=made) for n in only]
    rows.sort(key=lambda r: names.index(r["point"]))
    fit, decode_fit, own = _fits(rows)
    run.write({"rows": rows, "fit": fit, "decode_fit": decode_fit, "generation_fits": own,
               "targets": targets(rows, fit, decode_fit, own)})


def fsdp_minimum_bytes(row: dict) -> float:
    """The bytes a chip must send in a train step under FSDP over all its chips with full
    remat, at the least: every matmul weight all-gathered twice (the forward, and again for
    the backward's recomputed forward) and every gradient reduce-scattered once, all in
    bfloat16 (the compute dtype), a ring's (n - 1) / n of each."""
    from supo_jax.model.config import ModelConfig
    from supo_jax.plan import matmul_params

    mc = ModelConfig.from_pretrained(os.path.join(MODELS, row["model"]))
    n = row["chips"]
    return (n - 1) / n * 2 * (2 * matmul_params(mc) + mc.num_params)


# issue 74: a point's program fits with 5% of the chip's HBM to spare (XLA's total counts
# neither the runtime's own allocations nor fragmentation)
FIT_SHARE = 0.95


def hbm_share(row: dict) -> float:
    """A compiled point's bytes a chip over its chip's HBM (a device's, on Ironwood)."""
    from supo_jax.plan import CHIPS, device_figures, generation
    return row["bytes_per_chip"]["total"] / device_figures(
        CHIPS[generation(row["topology"])])["hbm_bytes"]


def targets(rows: list[dict], fit: dict, decode_fit: dict | None = None,
            own: dict | None = None) -> list[dict]:
    """Issue 64's targets for the planner at MaxText's Llama-3.1-8B setting on v6e-8 (3 rows
    of 8192 tokens a chip): the no-overlap MFU >= 40%, ICI bytes within 1.5x of the FSDP
    minimum, the update fits; and the calibrations' leave-one-out misses within 25%."""
    out = []
    for r in rows:
        if r["point"] != "llama3.1-8b_v6e-8" or r.get("smoke") or "error" in r:
            continue
        mfu = r["train_mfu_no_overlap"]
        out.append({"what": "Llama-3.1-8B shapes, v6e-8, 3 x 8192 a chip: train step MFU with no "
                    "overlap (planner)", "target": ">= 40%", "measured": f"{100 * mfu:.1f}%",
                    "met": mfu >= 0.40})
        ratio = r["collective_bytes_per_chip"] / fsdp_minimum_bytes(r)
        out.append({"what": "Llama-3.1-8B shapes, v6e-8: train step ICI bytes over the FSDP "
                    "minimum (planner)", "target": "<= 1.5x", "measured": f"{ratio:.2f}x",
                    "met": ratio <= 1.5})
        gib = r["bytes_per_chip"]["total"] / 2**30
        out.append({"what": "Llama-3.1-8B shapes, v6e-8: the update fits a chip (planner)",
                    "target": "<= 32 GiB", "measured": f"{gib:.1f} GiB", "met": r["fits"]})
    train = [r for r in rows if r["point"] in POINTS and "error" not in r and not r.get("smoke")]
    if train:
        share = {r["point"]: hbm_share(r) for r in train}
        over = [p for p, x in share.items() if x > FIT_SHARE]
        out.append({"what": "MaxText's train points: our program fits the chip at the "
                    f"published rows a chip, within {100 * FIT_SHARE:.0f}% of its HBM (planner)",
                    "target": "every point", "measured": f"{len(train) - len(over)} of "
                    f"{len(train)}, the largest {100 * max(share.values()):.1f}% of HBM"
                    + (f" (not: {', '.join(over)})" if over else ""), "met": not over})
    loo = fit.get("leave_one_out", []) + [x for f in (own or {}).values()
                                          for x in f.get("leave_one_out", [])]
    if loo:
        worst = max(abs(x["miss"]) for x in loo)
        out.append({"what": "planner calibration: leave-one-out miss on MaxText's train steps "
                    "(each point by its generation's fit)", "target": "<= 25%",
                    "measured": f"{100 * worst:.1f}% (worst of {len(loo)})",
                    "met": worst <= 0.25})
    if decode_fit and decode_fit.get("leave_one_out"):
        worst = max(abs(x["miss"]) for x in decode_fit["leave_one_out"])
        out.append({"what": "planner decode calibration: leave-one-out miss on JetStream's "
                    "decode throughput", "target": "<= 25%", "measured": f"{100 * worst:.1f}% "
                    f"(worst of {len(decode_fit['leave_one_out'])})", "met": worst <= 0.25})
    return out


def markdown(res: dict) -> str:
    r = res["results"]
    fit = r["fit"]
    loo = {x["point"]: x for f in [fit, *(r.get("generation_fits") or {}).values()]
           for x in f.get("leave_one_out", [])}
    lines = ["Published train steps (MaxText on TPU v6e and Ironwood, tpu-recipes) beside the "
             "planner's band "
             "for the same shapes (the recipe's remat and collective-matmul settings): the "
             "perfect-overlap bound, the no-overlap time, and the measured step over the "
             "no-overlap time (r). The planner's programs are compiled for the slice on a CPU "
             "host (verified by compilation); the measured times are MaxText's, not ours. On "
             "Ironwood (tpu7x) the rows are a device's (a TensorCore, half a chip: the recipe's "
             "per_device_batch_size) and the tokens/s a whole chip's.", "",
             "| point | rows a chip x tokens | measured s (tok/s a chip) | bound s (what) | "
             "no overlap s | r | left out: predicted s (miss) | fits | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in (x for x in r["rows"] if x["point"] in POINTS):
        if "error" in x:
            lines.append(f"| {x['point']} | {x['rows_per_chip']} x {x['seq']} | "
                         f"{x['seconds']:.3f} ({x['tokens_per_second_per_chip']:,.0f}) | did not "
                         f"compile: {x['error'][:90]} | - | - | - | - | {x['source']} |")
            continue
        lo = loo.get(x["point"])
        lines.append(
            f"| {x['point']} | {x['rows_per_chip']} x {x['seq']} | {x['seconds']:.3f} "
            f"({x['tokens_per_second_per_chip']:,.0f}) | {x['bound_seconds']:.3f} ({x['bound']}) | "
            f"{x['no_overlap_seconds']:.3f} | {x['seconds'] / x['no_overlap_seconds']:.2f} | "
            + (f"{lo['predicted_seconds']:.3f} ({100 * lo['miss']:+.1f}%)" if lo else
               "not in the fit: its program does not fit" if not x["fits"] else "-")
            + f" | {'yes' if x['fits'] else 'no'} ({x['bytes_per_chip']['total'] / 2**30:.1f} "
            f"GiB) | {x['source']} |")
    lines += ["", "Memory at the published settings: MaxText's (its recipe) beside ours (the "
              "settings the point compiles with), and the train step's bytes a chip (XLA's "
              "total: arguments, outputs less aliased, temporaries, code) against the chip's HBM "
              "(a device's on Ironwood); host: the layer inputs offloaded to the hosts' memory.",
              "", "| point | MaxText's memory settings | ours | GiB a chip (% of HBM) | host GiB a "
              "chip |", "|---|---|---|---|---|"]
    for x in (x for x in r["rows"] if x["point"] in POINTS and "error" not in x):
        b = x["bytes_per_chip"]
        sets = dict(o.split("=", 1) for o in x.get("overrides", [])
                    if o.startswith(("model.", "mesh.")))           # the last of a key holds
        ours = ", ".join(f"{k}={v}" for k, v in sets.items())
        lines.append(f"| {x['point']} | {MAXTEXT_MEMORY.get(x['point'], '-')} | {ours or '-'} | "
                     f"{b['total'] / 2**30:.1f} ({100 * hbm_share(x):.1f}%) | "
                     f"{b.get('host_temp', 0) / 2**30:.1f} |")
    own = r.get("generation_fits") or {}
    lines += ["", f"Fit: r = {fit['factor']:.3f}, the mean of the "
              + (f"points' other than {', '.join(own)}'s, which have a fit of their own: "
                 + ", ".join(f"{g} r = {f['factor']:.3f} (`TRAIN_CALIBRATIONS['{g}']`)"
                             for g, f in own.items()) + "; the shared factor would miss "
                 + ", ".join(f"{g}'s steps by {100 * (fit['factor'] / f['factor'] - 1):+.0f}%"
                             for g, f in own.items())
                 + " (Ironwood's SparseCores run the collectives beside the compute). Each "
                 "point is left out of its own generation's fit. The shared r is "
                 if own else "points' ")
              + "(supo_jax.plan.fit_calibration; `TRAIN_CALIBRATION` in supo_jax/plan.py, "
              "checked against this file by a test). Every published v6e step is slower than "
              "the planner's no-overlap time (a chip overlapping nothing at its published peak "
              "and bandwidths): the planner's `train_*_calibrated` figures are the no-overlap "
              "time x r, a factor on the band's slow end there. This assumes our programs run as far "
              "beyond the planner's figures as MaxText's do; it is not a measurement of ours. "
              "Rows by commit: " + "; ".join(sorted({
                  f"{x['point']} {x['made'].get('commit', '?')}" for x in r["rows"]})) + "."]
    dec = [x for x in r["rows"] if x["point"] in DECODE_POINTS]
    dfit = r.get("decode_fit") or {}
    if dec and dfit.get("factor") is not None:
        dloo = {x["point"]: x for x in dfit.get("leave_one_out", [])}
        lines += ["", "Published decode throughput (JetStream on TPU v5e-8, the model sharded "
                  "over the 8 chips, serving ShareGPT prompts) beside the planner's decode "
                  "step for the same shapes: rows, cache slots (attended whole), a step's time "
                  "measured (rows / throughput), bound, no overlap, and the measured step over "
                  "the no-overlap time (r).", "",
                  "| point | rows x cache slots | measured ms a step (tok/s, slice) | bound ms "
                  "(what) | no overlap ms | r | left out: predicted ms (miss) | source |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in dec:
            if "error" in x:
                lines.append(f"| {x['point']} | {x['rows']} x {x['cache_len']} | "
                             f"{1e3 * x['seconds']:.2f} ({x['tokens_per_second']:,.0f}) | did "
                             f"not compile: {x['error'][:90]} | - | - | - | {x['source']} |")
                continue
            lo = dloo.get(x["point"])
            lines.append(
                f"| {x['point']} | {x['rows']} x {x['cache_len']} | {1e3 * x['seconds']:.2f} "
                f"({x['tokens_per_second']:,.0f}) | {1e3 * x['bound_seconds']:.2f} ({x['bound']})"
                f" | {1e3 * x['no_overlap_seconds']:.2f} | "
                f"{x['seconds'] / x['no_overlap_seconds']:.2f} | "
                + (f"{1e3 * lo['predicted_seconds']:.2f} ({100 * lo['miss']:+.1f}%)" if lo
                   else "-") + f" | {x['source']} |")
        lines += ["", f"Fit: r = {dfit['factor']:.3f}, the mean of the points' "
                  "(supo_jax.plan.fit_calibration; `DECODE_CALIBRATION` in "
                  "supo_jax/plan.py, checked against this file by a test). Both measured steps "
                  "lie beyond the planner's band, slower than its no-overlap time: what a "
                  "serving loop adds (the prompts' prefills between steps, idle rows, the "
                  "host). The planner's `rollout_*_calibrated` figures are the decode's "
                  "no-overlap time x r. (The two points fit a constant time a step beyond the "
                  "bound as well, about 8 ms, but carried to a small model's step that "
                  "constant would dominate it; a factor does not.) This assumes our sampler "
                  "sits as far beyond its band as JetStream's serving loop does (our prefills "
                  "are counted apart in the RL step, so it errs slow); it is not a measurement "
                  "of ours."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
