"""Rows that advance independently vs turn-synchronous rounds, on a long tail of rollouts.

The rollout phase of a step ends when its longest rollout ends, and in turn-synchronous
rounds (run_rollouts(..., rounds=True): every round generates one action for every active
row, then waits for all their tool calls) each round also waits for its longest action and
its slowest tool. With independent rows (the default), a row whose action has ended leaves
the decode batch for its tool call at the next decode-call boundary and rejoins when its
observation is back, while the others keep decoding.

Workload: a random tiny policy (qwen2 family, float32, temperature 1) acting in "tail", an
environment defined here: each task ends after k tool steps, k heavy-tailed (1 + a Pareto
draw, shape 1, capped at --max-turns), and each step takes a random 0..--latency seconds
(a sleep, as a remote tool would; the same draw for a task's step in every variant), with
context manager `full` at a W no rollout reaches. Per variant (rounds / independent) x
rollouts per sampler row (--ratios) x tool latency (0 and --latency), one run_rollouts call:
- slot utilisation: decode slot-steps that generated a live row's token over all decode
  slot-steps (the sampler's rows x the steps each decode call ran);
- trained tokens/s of wall: the rollouts' generated tokens (every rollout ends with an
  answer here, so every token trains) over the call's wall time;
- identical rollouts: the independent rows' tokens equal the rounds' (each rollout draws
  from its own random stream, so who decodes beside whom does not change them; float
  rounding of another batch could flip a near-tie).
The first call of each shape compiles: one untimed run of each variant (tools at once) on
each task set first.

    python benchmarks/rows.py            # writes benchmarks/results/rows.json
"""
from __future__ import annotations

import dataclasses
import time

import common


def _tail_env(latency: float, max_turns: int):
    """The benchmark's environment class: task {"task_id", "turns", "seed"}."""
    import numpy as np

    from supo_jax.envs.base import Reset, StepResult, ToolSpec

    tools = [ToolSpec("step", "take one step", {"type": "object", "properties": {}})]

    class Tail:
        def reset(self, task):
            self.task, self.t = task, 0
            return Reset(f"Take {task['turns']} steps.", tools)

        def act(self, text):
            rng = np.random.default_rng([self.task["seed"], self.t])
            time.sleep(latency * rng.random())
            self.t += 1
            if self.t >= self.task["turns"]:
                return StepResult("", done=True, reward=1.0)
            return StepResult(f"step {self.t} done")

    return Tail


def tail_tasks(n: int, max_turns: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"task_id": f"t{i}", "seed": seed * 100_003 + i,
             "turns": int(min(max_turns, 1 + np.floor(rng.pareto(1.0))))} for i in range(n)]


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="sampler rows")
    ap.add_argument("--ratios", default="1,4", help="rollouts per sampler row, comma-separated")
    ap.add_argument("--latency", type=float, default=1.0, help="most seconds a tool step takes")
    ap.add_argument("--max-turns", type=int, default=16)
    ap.add_argument("--action-tokens", type=int, default=32)
    ap.add_argument("--decode-chunk", type=int, default=16)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.rows, args.ratios = 32, 1, 2, "1"
        args.latency, args.max_turns = 0.05, 4
    ratios = [int(x) for x in args.ratios.split(",")]
    run = common.Run("rows", args, argv)

    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import PolicyActor, run_rollouts
    from supo_jax.sampling.sampler import SamplingParams

    policy, _ = common.tiny_policy(args.hidden, args.layers, smoke=args.smoke)
    fmt = ChatFormat(policy.tokenizer)
    W = 512 + args.max_turns * (args.action_tokens + 64)
    ctx = ContextConfig("full", W, max_steps=args.max_turns + 1,
                        max_action_tokens=args.action_tokens)
    mc = policy.config
    print(f"policy: {mc.num_params / 1e6:.2f}M parameters; {args.rows} sampler rows, decode "
          f"calls of {args.decode_chunk} steps, actions of at most {args.action_tokens} tokens",
          flush=True)

    def once(rounds, tasks, latency):
        actor = PolicyActor(policy, fmt, rows=args.rows, max_len=ctx.row_bound(fmt),
                            sampling=SamplingParams(1.0), seed=0)
        actor.sampler.decode_chunk = args.decode_chunk
        t0 = time.perf_counter()
        ro = run_rollouts(actor, _tail_env(latency, args.max_turns), tasks, fmt, ctx,
                          rows=args.rows, rounds=rounds)
        dt = time.perf_counter() - t0
        s = actor.sampler
        return {"s": dt, "trained_tokens": sum(r.counters["generated_tokens"] for r in ro
                                               if r.answered),
                "utilisation": s.live_steps / max(1, s.slot_steps),
                "reasons": sorted({r.reason for r in ro}),
                "tokens": [[seg.tokens for seg in r.segments] for r in ro]}

    table = []
    for ratio in ratios:
        tasks = tail_tasks(ratio * args.rows, args.max_turns, seed=ratio)
        for rounds in (True, False):     # compiles the shapes these tasks reach
            once(rounds, tasks, 0.0)
        turns = [t["turns"] for t in tasks]
        for latency in (0.0, args.latency):
            got = {rounds: once(rounds, tasks, latency) for rounds in (True, False)}
            a, b = got[True], got[False]
            row = {"rollouts_per_row": ratio, "rollouts": len(tasks), "latency_s": latency,
                   "turns": {"mean": sum(turns) / len(turns), "max": max(turns)},
                   "identical_rollouts": a["tokens"] == b["tokens"]}
            for name, r in (("rounds", a), ("independent", b)):
                row[name] = {"wall_s": r["s"], "utilisation": r["utilisation"],
                             "trained_tokens_per_s": r["trained_tokens"] / r["s"],
                             "trained_tokens": r["trained_tokens"], "reasons": r["reasons"]}
            row["speedup"] = (row["independent"]["trained_tokens_per_s"]
                              / row["rounds"]["trained_tokens_per_s"])
            table.append(row)
            print(f"{ratio} rollouts a row, tools 0-{latency:g} s: rounds "
                  f"{row['rounds']['utilisation']:.0%} of slot-steps live, "
                  f"{row['rounds']['trained_tokens_per_s']:.0f} trained tok/s; independent "
                  f"{row['independent']['utilisation']:.0%}, "
                  f"{row['independent']['trained_tokens_per_s']:.0f} tok/s: "
                  f"{row['speedup']:.2f}x; identical rollouts: {row['identical_rollouts']}",
                  flush=True)
    config = {"rows": args.rows, "decode_chunk": args.decode_chunk,
              "action_tokens": args.action_tokens, "max_turns": args.max_turns,
              "latency_s": args.latency, "working_context": W, "sampling": "temperature 1",
              "model": {"params": mc.num_params, "hidden": mc.hidden_size,
                        "layers": mc.num_layers, "dtype": "float32"}}
    run.write({"table": table}, config=config)


if __name__ == "__main__":
    main()
