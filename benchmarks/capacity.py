"""Capacity: how large a task each context manager lets the scripted expert solve.

For every manager x fncall family, at a few working contexts W: the largest task size n (on
a ladder of sizes) at which the scripted expert solves at least 90% of `--tasks` tasks, with
its generated tokens and peak working context there. The expert plays each family's
canonical algorithm from the working context alone (supo_jax.envs.experts.for_context gives
it what each manager needs: state blocks under state and clear, branches under fold), so a
cell is the ideal agent's reach under that manager at that W: the upper bound an RL run on
that task can approach, not a measurement of learning. Everything else is the CPU recipe's
(S = 3, actions 48 tokens, summaries 48, state blocks sized from W, 30 steps) except
max_steps (200: sizes past 30 calls are the point) and, for W >= 1024, observations up to 256
tokens (reports' long pages). A size that fails ends its ladder (reach is read as monotone; the
next size is not tried).

    python benchmarks/capacity.py          # writes benchmarks/results/capacity.json + .png
"""
from __future__ import annotations

import os
import sys

import common

sys.path.insert(0, os.path.join(common.REPO, "experiments"))

FAMILIES = ("tallest", "pages", "chain", "count", "listing", "graph", "reports", "records",
            "sections")
from supo_jax.rl.trainer import SIZES as LADDER  # noqa: E402  (the expert-ceiling hint's)
WS = (446, 1024, 2048)
PASS = 0.9


def settings(w: int) -> list[str]:
    obs = 64 if w < 1024 else 256
    return [f"context.working_context={w}", f"context.max_observation_tokens={obs}",
            "context.max_steps=200"]


def reach(family: str, manager: str, w: int, tasks: int, ladder) -> dict:
    """The largest size on `ladder` with success >= PASS, and its figures (None: not even
    the smallest)."""
    from manager_reach import success

    from supo_jax.envs.fncall import FAMILY_ENVS

    lo, hi = FAMILY_ENVS[family].size_range
    best = {"size": None, "success": 0.0, "generated_tokens_mean": None,
            "working_context_max": None, "reasons_at_next": None}
    for n in (n for n in ladder if lo <= n <= hi):
        s = success(family, manager, n, tasks, settings(w))
        if s["success_rate"] < PASS:
            best["reasons_at_next"] = {k: v for k, v in s["reasons"].items() if v}
            best["failed_size"] = n
            break
        best.update(size=n, success=s["success_rate"],
                    generated_tokens_mean=s["generated_tokens_mean"],
                    working_context_max=s["working_context_max"])
    return best


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = res["results"]
    fams, mans, ws = r["families"], r["managers"], r["working_contexts"]
    fig, axes = plt.subplots(1, len(ws), figsize=(5 * len(ws), 4), sharey=True)
    for ax, w in zip(axes if len(ws) > 1 else [axes], ws):
        width = 0.8 / len(mans)
        for j, m in enumerate(mans):
            ys = [r["cells"][f"{f}|{m}|{w}"]["size"] or 0 for f in fams]
            ax.bar([i + j * width for i in range(len(fams))], ys, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(fams))])
        ax.set_xticklabels(fams, rotation=45, ha="right")
        ax.set_yscale("symlog", linthresh=4)
        ax.set_title(f"W = {w}")
    (axes[0] if len(ws) > 1 else axes).set_ylabel(f"largest size, expert >= {PASS:.0%}")
    (axes[-1] if len(ws) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    from supo_jax.agent.context import MANAGERS

    p = common.parser(__doc__)
    p.add_argument("--tasks", type=int, default=8)
    args = p.parse_args(argv)
    run = common.Run("capacity", args, argv)
    fams = ("tallest", "reports") if args.smoke else FAMILIES
    ws = (446,) if args.smoke else WS
    ladder = (2, 4) if args.smoke else LADDER
    tasks = 2 if args.smoke else args.tasks
    mans = [m for m in MANAGERS if m != "frozen_summarizer"]   # supo's reach, another summarizer
    cells = {}
    for w in ws:
        for f in fams:
            for m in mans:
                cells[f"{f}|{m}|{w}"] = c = reach(f, m, w, tasks, ladder)
                print(f"W={w} {f:9s} {m:9s} size {c['size']} (next: {c['reasons_at_next']})",
                      flush=True)
    res = {"families": list(fams), "managers": mans, "working_contexts": list(ws),
           "ladder": list(ladder), "tasks": tasks, "pass": PASS, "cells": cells}
    fn = run.write(res)
    import json
    plot(json.load(open(fn)), os.path.join(args.out_dir, "capacity.png"))


def markdown(res: dict) -> str:
    r = res["results"]
    out = [f"The largest task size at which the scripted expert solves >= {r['pass']:.0%} of "
           f"{r['tasks']} tasks, per manager (columns) and fncall family (rows), at each W; "
           "`-`: not even the smallest size. The CPU recipe's settings otherwise (S = 3, "
           "48-token actions and summaries, state blocks sized from W; max_steps 200; "
           "observations 256 tokens from W = 1024). An upper bound for RL on that task, not a learning "
           f"result. Sizes tried: {', '.join(map(str, r['ladder']))}. Plot: "
           "benchmarks/results/capacity.png.", ""]
    for w in r["working_contexts"]:
        out += [f"W = {w}:", "", "| family | " + " | ".join(r["managers"]) + " |",
                "|---" * (len(r["managers"]) + 1) + "|"]
        for f in r["families"]:
            cells = [r["cells"][f"{f}|{m}|{w}"] for m in r["managers"]]
            out.append(f"| {f} | " + " | ".join(
                "-" if c["size"] is None else
                f"{c['size']}{'+' if c.get('failed_size') is None else ''}" for c in cells) + " |")
        out.append("")
    out.append("`+`: the ladder's largest size (or the family's) passed: the reach is larger. "
               "`frozen_summarizer` has no column: with the expert writing the summaries a "
               "frozen one would, its reach is `supo`'s.")
    return "\n".join(out)


if __name__ == "__main__":
    main()
