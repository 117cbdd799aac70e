"""How far each context manager lets the scripted expert go: its success on fncall families at a
few sizes, under every manager, at the CPU recipe's settings and at larger W (tests/test_managers.py
runs a cell the same way). One line a (W, family, size), one column a manager:

    python experiments/manager_reach.py --families reports sections --sizes 4 8 16 --tasks 8
    python experiments/manager_reach.py --set context.working_context=2048 \
        --set context.max_observation_tokens=256 --families reports --sizes 8 16 24
"""
from __future__ import annotations

import argparse

from supo_jax.agent.context import MANAGERS


def success(family: str, manager: str, size: int, tasks: int, sets=()) -> dict:
    """summarize() of the expert's rollouts on `tasks` tasks of fncall/<family> at `size`."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts, summarize
    from supo_jax.config import load_config
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for, for_context
    from supo_jax.rl.runs import env_tokenizer

    cfg = load_config(None, [f"env.name=fncall/{family}", f"context.manager={manager}",
                             f"env.knobs.size={size}", "train.sft_warm_start=false", *sets])
    fmt = ChatFormat(env_tokenizer(cfg))
    items = make_tasks(cfg.env.name, "train", tasks, seed=cfg.env.seed, **cfg.env.knobs)
    ro = run_rollouts(ScriptedActor(for_context(expert_for(cfg.env.name), cfg.context), fmt),
                      lambda: make_env(cfg.env.name), items, fmt, cfg.context, rows=tasks)
    return summarize(ro)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["reports", "sections"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--managers", nargs="+", default=[m for m in MANAGERS
                                                      if m != "frozen_summarizer"])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="a config override")
    a = ap.parse_args(argv)
    print(f"settings: the CPU recipe {' '.join(a.set)}; {a.tasks} tasks a cell; success "
          "(reasons other than answer)")
    print("family size | " + " | ".join(a.managers))
    for fam in a.families:
        for n in a.sizes:
            cells = []
            for m in a.managers:
                s = success(fam, m, n, a.tasks, a.set)
                other = {k: v for k, v in s["reasons"].items() if k != "answer"}
                cells.append(f"{s['success_rate']:.2f}" + (f" {other}" if other else ""))
            print(f"{fam} {n} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
