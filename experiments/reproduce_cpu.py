"""Reproduce the SUPO paper's claims at CPU scale (docs/SUPO.md §6-§7), in one command:

    python experiments/reproduce_cpu.py --out runs/reproduce      # ~30 min on 2 CPU cores

1. warm-start a tiny policy by SFT on scripted demonstrations whose summaries are imperfect
   on purpose (sft.summary_drop), once; the same SFT again under `state` and under `fold`,
   whose replies need what SUPO's demonstrations never show (where the scripted expert
   cannot demonstrate the manager at this W, that method starts from the shared one, and
   results.md says so);
2. from that checkpoint, with the same seeds, train: SUPO at W; GRPO (`full`) at W; GRPO at
   W*(S+1); SUPO without overlong masking; SUPO with the trajectory-group advantage (Eq. 4);
   and the other context managers at W: per-turn state, context folding, tool-result
   clearing;
3. evaluate every policy on the held-out split before and after training, and the SUPO
   policy with the summary cap at 0, S, 2S and 4S;
4. write DIR/results.json, DIR/results.md (the layout of the paper's Table 1) and PNG plots.

The runs go through the sweep machinery (supo_jax.sweep): rerunning the command skips
finished runs and resumes unfinished ones. `--quick` is the miniature the tests run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from supo_jax.agent.context import OWN_DEMONSTRATIONS
from supo_jax.sweep import warm_start_once

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "cpu_reproduce.py")

# a few steps of everything, for the test that keeps this pipeline from rotting
QUICK = ["model.tiny_hidden=32", "model.tiny_layers=1", "model.tiny_heads=2",
         "model.tiny_kv_heads=1", "model.tiny_mlp=64", "model.tiny_vocab=512",
         "env.knobs.size=[5, 6]", "env.train_tasks=32", "env.eval_tasks=2", "sft.num_demos=4",
         "sft.steps=2", "train.steps=2", "train.save_every=2", "rollout.tasks_per_step=2",
         "rollout.group_size=2", "rollout.rows=4", "optim.minibatch_rows=4",
         "train.progress=false"]




def methods(W: int, S: int) -> list[tuple[str, str, dict]]:
    """(directory, label, overrides) of each trained method."""
    scaling = "(" + ", ".join(str(s) for s in (0, S, 2 * S, 4 * S)) + ",)"
    return [
        ("supo", f"SUPO (W={W}, S={S})", {"train.eval_max_summaries": scaling}),
        ("grpo_w", f"GRPO (W={W})", {"context.manager": "full"}),
        ("grpo_w_s1", f"GRPO (W={W * (S + 1)})",
         {"context.manager": "full", "context.working_context": str(W * (S + 1))}),
        ("supo_no_mask", "SUPO, no overlong masking", {"advantage.masked_reasons": "()"}),
        ("supo_eq4", "SUPO, trajectory-group advantage (Eq. 4)",
         {"advantage.estimator": "trajectory_group"}),
        # the other context managers at the same W, update and warm start (docs/SUPO.md §2)
        # a reply holds the state as well as the call: the state block gets what W leaves
        # beside the prompt, the call and an observation (context.max_state_tokens = 0)
        ("state", f"Per-turn state, MEM1-style (W={W})", {"context.manager": "state"}),
        ("fold", f"Context folding (W={W})", {"context.manager": "fold"}),
        ("clear", f"Tool-result clearing (W={W})",   # its replies carry a state block too
         {"context.manager": "clear"}),
    ]


def _fmt(v, pct=False):
    if v is None:
        return "-"
    m, s = v
    return f"{100 * m:.1f} ± {100 * s:.1f}" if pct else f"{m:.2f} ± {s:.2f}"


def results_markdown(rows, labels, W, S, scaling, sft, meta, warm_notes=None) -> str:
    lines = ["| method | working context | effective context | success before (%) | "
             "success after (%) | tool calls | summaries |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        d, lbl = r["name"], labels[r["name"]]
        work = W * (S + 1) if d == "grpo_w_s1" else W
        # the most tokens a rollout attends over in all: supo's S + 1 working contexts; full's
        # one; the managers that rewrite the context every turn or fold have no such cap
        eff = work if d.startswith("grpo") else W * (S + 1) if d.startswith("supo") else "-"
        lines.append(f"| {lbl} | {work} | {eff} | {_fmt(r['before_success'], True)} | "
                     f"{_fmt(r['success_rate'], True)} | {_fmt(r['tool_calls_mean'])} | "
                     f"{_fmt(r['summaries_mean'])} |")
    out = ["# CPU reproduction of SUPO's claims", "",
           f"Command: `{meta['command']}`; seeds {meta['seeds']}; {meta['minutes']:.1f} min wall "
           f"for this invocation, {meta['compute_minutes']:.1f} min of SFT and runs in all "
           f"(runs finished by an earlier invocation are reused), on {meta['machine']}.", "",
           f"Task: {meta['task']}. SFT warm start: {sft.get('sft_segments')} demonstration rows, "
           f"loss {sft.get('sft_loss_first', float('nan')):.2f} -> "
           f"{sft.get('sft_loss_last', float('nan')):.2f}.", "",
           f"Held-out success ({meta['eval']}), mean ± standard error over seeds; before = the SFT "
           "policy under each method's context manager.", "", *lines, "",
           *([f"Warm starts: the shared one, except "
              f"{'; '.join(f'{k}: {v}' for k, v in warm_notes.items())}.", ""]
             if warm_notes else []),
           "Test-time summary scaling (the SUPO policy, trained with S = "
           f"{S}):", "", "| max summaries at eval | success (%) |", "|---|---|"]
    out += [f"| {s} | {_fmt(v, True)} |" for s, v in scaling]
    out += ["", "![success vs step](success_vs_step.png)",
            "![working context](working_context.png)", "![summaries](summaries.png)",
            "![test-time scaling](test_time_scaling.png)",
            "![state-carrying summaries](summary_state_share.png)", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    from supo_jax import config as C
    from supo_jax import sweep
    from supo_jax.cli import int_list
    from supo_jax.utils import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--seeds", type=int_list, default="0", help="comma-separated, e.g. 0,1,2")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--quick", action="store_true", help="a miniature run (tests)")
    ap.add_argument("--methods", default="",
                    help="comma-separated subset of supo, grpo_w, grpo_w_s1, supo_no_mask, "
                         "supo_eq4, state, fold, clear (default: all)")
    args = ap.parse_args(argv)
    t0 = time.time()
    sets = (QUICK if args.quick else []) + args.set
    seeds = args.seeds
    os.makedirs(args.out, exist_ok=True)
    base = C.load_config(args.config, sets)
    W, S = base.context.working_context, base.context.max_summaries
    ms = methods(W, S)
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = sorted(set(wanted) - {m[0] for m in ms})
        if unknown:
            ap.error(f"--methods: unknown {', '.join(unknown)}; choose from "
                     + ", ".join(m[0] for m in ms))
        ms = [m for m in ms if m[0] in wanted]
    hf, sft = warm_start_once(base, args.out)
    common = [*sets, f"train.init_from={hf}", "train.sft_warm_start=false"]
    warm_notes = {}
    for d, _, point in ms:
        if point.get("context.manager") in OWN_DEMONSTRATIONS:   # (agent/context.py)
            own = C.load_config(args.config, [*sets, *(f"{k}={v}" for k, v in point.items())])
            try:
                point["train.init_from"] = warm_start_once(own, os.path.join(args.out, f"sft_{d}"))[0]
                warm_notes[d] = "own"
            except ValueError as e:   # the expert cannot demonstrate this manager at this W
                warm_notes[d] = f"shared ({str(e).split(';')[0]})"
                print(f"{d}: no warm start of its own, the shared one: {e}", flush=True)
    runs = sweep.plan(args.config, [m[2] for m in ms], seeds, os.path.join(args.out, "runs"),
                      overrides=common, names=[m[0] for m in ms])
    results = sweep.run_sweep(runs)
    rows = sweep.collect(runs)   # before_success: the SFT policy's step-0 eval
    # test-time scaling of the SUPO policy
    caps = {}
    for run in (r for r in runs if r.name == "supo"):
        with open(os.path.join(run.run_dir, "eval.json")) as f:
            for e in json.load(f)["eval_scaling"]:
                caps.setdefault(e["max_summaries"], []).append(e["success_rate"])
    scaling = [(s, sweep.mean_se(v)) for s, v in sorted(caps.items())]

    labels = {m[0]: m[1] for m in ms}
    series = {labels[n]: [r.run_dir for r in runs if r.name == n] for n in labels}
    smooth = 1 if args.quick else 3
    sweep.plot_curves(series, "success_rate", os.path.join(args.out, "success_vs_step.png"),
                      "training success rate", smooth)
    sweep.plot_curves(series, "working_context_mean", os.path.join(args.out, "working_context.png"),
                      "working context (tokens)", smooth)
    sweep.plot_curves(series, "summaries_mean", os.path.join(args.out, "summaries.png"),
                      "summaries per rollout", smooth)
    sweep.plot_curves({k: v for k, v in series.items() if k.startswith("SUPO")},
                      "summary_state_share", os.path.join(args.out, "summary_state_share.png"),
                      "summaries that carry the state", smooth)
    _plot_scaling(scaling, S, os.path.join(args.out, "test_time_scaling.png"))

    import platform
    meta = {"command": "python experiments/reproduce_cpu.py " + " ".join(argv or sys.argv[1:]),
            "seeds": seeds, "minutes": (time.time() - t0) / 60,
            "compute_minutes": (sft.get("seconds", 0) + sum(x.get("seconds", 0) for x in results)) / 60,
            "machine": f"{os.cpu_count()} CPU cores, {_cpu_model() or platform.machine()}",
            "eval": (f"{base.env.eval_tasks} tasks x {base.train.eval_samples} samples at "
                     f"temperature {base.train.eval_temperature}" if base.train.eval_temperature > 0
                     else f"{base.env.eval_tasks} tasks, greedy"),
            "task": f"{base.env.name} {base.env.knobs}, W={W}, S={S}, H={base.context.max_steps}, "
                    f"{base.rollout.tasks_per_step} tasks x G={base.rollout.group_size} per step, "
                    f"{base.train.steps} steps",
            **provenance()}   # commit (short hash of HEAD), dirty, date (UTC)
    md = results_markdown(rows, labels, W, S, scaling, sft, meta, warm_notes)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "sft": sft, "warm_starts": warm_notes, "methods": rows,
                   "labels": labels,
                   "test_time_scaling": scaling, "runs": results}, f, indent=2, default=str)
    print(md)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def _plot_scaling(scaling, S, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    if scaling:
        xs = [s for s, _ in scaling]
        ax.errorbar(xs, [100 * v[0] for _, v in scaling], yerr=[100 * v[1] for _, v in scaling],
                    marker="o", capsize=3)
        ax.axvline(S, color="gray", ls="--", lw=1, label=f"training cap S={S}")
        ax.legend(fontsize=7)
    ax.set_xlabel("max summaries at evaluation")
    ax.set_ylabel("held-out success (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
