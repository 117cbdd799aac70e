"""BFCL-style multi-turn accuracy of any HF model (or .gguf, or a run's hf/ or peft/): the share
of eval-split tasks that bfcl-eval's checker passes, per category, under `full` or `supo` at
a given working context, greedy.

    python experiments/bfcl_accuracy.py --model /ckpt/Qwen2.5-7B-Instruct --manager supo \\
        --working-context 8192 --out experiments/results/bfcl_eval_qwen7b
    python experiments/bfcl_accuracy.py --model runs/bfcl_supo/hf --categories long_context

The other settings are experiments/configs/bfcl_supo.py's (--set overrides them). Each
category's eval split is its 40 tasks with id number % 5 == 0 (--tasks N: the first N of
them; --offset K: N from the K-th on, to run the split in parts). Published multi-turn scores for reference (BFCL paper, ICML 2025): Qwen2.5-0.5B about
1%, Qwen2.5-1.5B 1.5-4%, Qwen2.5-7B 7-14.5%, GPT-4o 35-59% by category.
"""
from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "bfcl_supo.py")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF directory, .gguf, Hub id, run's hf/ or peft/")
    p.add_argument("--manager", default="supo", choices=("full", "supo"))
    p.add_argument("--working-context", type=int, default=8192)
    p.add_argument("--categories", default="base,long_context,miss_func,miss_param")
    p.add_argument("--tasks", type=int, default=40, help="tasks a category (eval split: 40)")
    p.add_argument("--offset", type=int, default=0,
                   help="skip the first OFFSET eval tasks of each category (a split run in parts)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="a folder for results.json and results.md")
    args = p.parse_args(argv)

    from supo_jax.agent.render import ChatFormat
    from supo_jax.config import load_config
    from supo_jax.envs.bfcl.environment import split_ids
    from supo_jax.rl.runs import build_policy
    from supo_jax.rl.trainer import evaluate
    from supo_jax.utils import provenance

    rows = {}
    policy = fmt = None
    prov = provenance()      # the code that runs: HEAD may move while a long run goes on
    for category in args.categories.split(","):
        cfg = load_config(CONFIG, [f"model.path={args.model}", f"env.name=bfcl/{category}",
                                   f"context.manager={args.manager}",
                                   f"context.working_context={args.working_context}"]
                          + args.set)
        if policy is None:
            policy = build_policy(cfg)
            fmt = ChatFormat(policy.tokenizer)
        tasks = [{"task_id": i, "family": f"bfcl/{category}", "category": category}
                 for i in split_ids(category, "eval")[args.offset:args.offset + args.tasks]]
        res = evaluate(policy, fmt, cfg, tasks=tasks, seed=0, progress=True)
        rows[category] = {"accuracy": res["success_rate"], "tasks": res["rollouts"],
                          "task_ids": [t["task_id"] for t in tasks],
                          "summaries_mean": res["summaries_mean"],
                          "reasons": res["reasons"]}
        print(category, json.dumps(rows[category]), flush=True)
        write(args, rows, prov)   # after every category: a long run keeps what it has


def write(args, rows, prov):
    overall = sum(r["accuracy"] for r in rows.values()) / len(rows)
    md = [f"{args.model}: {args.manager} at W = {args.working_context}, greedy", "",
          "| category | accuracy | tasks | summaries / rollout |", "|---|---|---|---|"]
    md += [f"| {c} | {r['accuracy']:.1%} | {r['tasks']} | {r['summaries_mean']:.2f} |"
           for c, r in rows.items()]
    md.append(f"| mean | {overall:.1%} | | |")
    print("\n".join(md), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"model": args.model, "manager": args.manager,
                       "working_context": args.working_context, "categories": rows,
                       "mean": overall, "provenance": prov}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
