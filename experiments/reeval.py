"""Re-evaluate saved policies on many more held-out tasks than a run's own evals use.

A run's evals (16 tasks x 4 samples, or 32 x 2) have about 6 points of standard error each,
as large as most effects of a recipe change on a tiny policy. This scores any number of saved
policies (a run's HF export `RUN/hf`, an SFT checkpoint `RUN/sft`, any HF directory) on the
same N held-out tasks, under one run's config (its environment, context manager, W, S and eval
sampling), with one sampling seed for all, so policies are compared on identical tasks:

    python experiments/reeval.py --config runs/count/supo/seed0 --tasks 256 --out reeval.json \
        runs/count/sft runs/count/supo/seed0/hf runs/count/supo/seed1/hf

It prints one line per policy (success, rollouts at the cap, state-carrying summaries) and
keeps every result in --out (a JSON object keyed by the policy's path and N, each result with
the commit, dirty flag and UTC date it was scored at), so a rerun skips what is there. The SFT
policy a run warm-started from in memory is rebuilt by supo-jax sft --config RUN --set
train.run_dir=DIR (the same seed, demonstrations and steps), which saves it to DIR/sft.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a run directory or config file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tasks", type=int, default=256, help="held-out tasks (each sampled as "
                    "train.eval_samples rollouts at train.eval_temperature)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed, the same for all")
    ap.add_argument("--out", required=True, help="JSON file of results (kept across reruns)")
    ap.add_argument("policies", nargs="+", help="HF policy directories")
    args = ap.parse_args(argv)

    from supo_jax.agent.render import ChatFormat
    from supo_jax.config import load_config
    from supo_jax.model.policy import load_policy
    from supo_jax.rl.trainer import evaluate
    from supo_jax.utils import provenance

    # validates the config, which imports env.imports from the working directory
    cfg = load_config(args.config, [*args.set, f"env.eval_tasks={args.tasks}"])
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    for path in args.policies:
        key = f"{os.path.abspath(path)}|{args.tasks}"
        if key not in results:
            t0 = time.time()
            policy = load_policy(path)
            r = evaluate(policy, ChatFormat(policy.tokenizer), cfg, seed=args.seed, progress=False)
            results[key] = {k: r[k] for k in ("success_rate", "overlong_rate",
                                              "summary_state_share", "rollouts")}
            results[key]["seconds"] = round(time.time() - t0, 1)
            results[key].update(provenance())   # commit, dirty, date: each score its own
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        r = results[key]
        print(f"{path}: success {r['success_rate']:.3f} over {r['rollouts']} rollouts, "
              f"at the cap {r['overlong_rate']:.3f}, state share {r['summary_state_share']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
