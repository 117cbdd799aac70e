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
Then partial rollouts (rollout.budget_tokens; agent.rollout.rollout_phase), over --phases
consecutive phases (a trainer's steps, the weights unchanged, a new sampler each phase as the
trainer makes), independent rows both ways, as many rollouts kept in flight as a phase starts
without a budget: off, every phase runs its rollouts to their end; on, a phase ends once its
generations hold --budget-share of the tokens an unbudgeted phase generates, and the
rollouts not ended go on first in the next (the rest of the slots get new tasks). Trained
tokens/s: the tokens of the rollouts that ended, over the phases' wall (compiling excluded);
the rollouts still suspended after the last phase do not count.
The first call of each shape compiles, and independent rows reach more shapes (prefill and
decode calls over varying sets of rows, in an order that changes from run to run): a run's
wall time excludes the seconds jax reports tracing and compiling (jax.monitoring, reported
apart); each pair of runs (rounds, independent) is repeated --repeats times after WARM
untimed pairs; figures are medians over the repeats.

    python benchmarks/rows.py            # writes benchmarks/results/rows.json
"""
from __future__ import annotations

import dataclasses
import time

import common

WARM = 1


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
    ap.add_argument("--phases", type=int, default=8, help="phases of the budget comparison")
    ap.add_argument("--budget-share", type=float, default=0.5,
                    help="the budget: this share of an unbudgeted phase's generated tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.rows, args.ratios = 32, 1, 2, "1"
        args.latency, args.max_turns, args.phases = 0.05, 4, 2
    ratios = [int(x) for x in args.ratios.split(",")]
    repeats = args.repeats or (1 if args.smoke else 2)
    run = common.Run("rows", args, argv)

    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import PolicyActor, Suspended, rollout_phase, run_rollouts
    from supo_jax.sampling.sampler import SamplingParams

    common.count_compiles()
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
        t0, c0 = time.perf_counter(), common.COMPILE_S[0]
        ro = run_rollouts(actor, _tail_env(latency, args.max_turns), tasks, fmt, ctx,
                          rows=args.rows, rounds=rounds)
        compiling = common.COMPILE_S[0] - c0
        dt = time.perf_counter() - t0 - compiling
        s = actor.sampler
        return {"s": dt, "trained_tokens": sum(r.counters["generated_tokens"] for r in ro
                                               if r.answered),
                "utilisation": s.live_steps / max(1, s.slot_steps),
                "reasons": sorted({r.reason for r in ro}), "shapes": len(s.shapes_compiled),
                "compile_s": compiling,
                "tokens": [[seg.tokens for seg in r.segments] for r in ro]}

    table = []
    for ratio in ratios:
        tasks = tail_tasks(ratio * args.rows, args.max_turns, seed=ratio)
        turns = [t["turns"] for t in tasks]
        for latency in (0.0, args.latency):
            runs = {True: [], False: []}
            for _ in range(WARM + repeats):   # the first pairs compile the shapes they reach
                for rounds in (True, False):
                    runs[rounds].append(once(rounds, tasks, latency))
            row = {"rollouts_per_row": ratio, "rollouts": len(tasks), "latency_s": latency,
                   "turns": {"mean": sum(turns) / len(turns), "max": max(turns)},
                   "identical_rollouts": all(r["tokens"] == runs[True][0]["tokens"]
                                             for r in runs[True] + runs[False])}
            for name, rs in (("rounds", runs[True][WARM:]), ("independent", runs[False][WARM:])):
                row[name] = {"wall_s": common.stats(r["s"] for r in rs),
                             "utilisation": common.stats(r["utilisation"] for r in rs),
                             "trained_tokens_per_s": common.stats(
                                 r["trained_tokens"] / r["s"] for r in rs),
                             "trained_tokens": rs[-1]["trained_tokens"],
                             "sampler_shapes": rs[-1]["shapes"],
                             "compile_s": common.stats(r["compile_s"] for r in rs),
                             "reasons": rs[-1]["reasons"]}
            row["speedup"] = common.stats(
                (b["trained_tokens"] / b["s"]) / (a["trained_tokens"] / a["s"])
                for a, b in zip(runs[True][WARM:], runs[False][WARM:]))
            table.append(row)
            med = lambda name, k: row[name][k]["median"]
            print(f"{ratio} rollouts a row, tools 0-{latency:g} s: rounds "
                  f"{med('rounds', 'utilisation'):.0%} of slot-steps live, "
                  f"{med('rounds', 'trained_tokens_per_s'):.0f} trained tok/s; independent "
                  f"{med('independent', 'utilisation'):.0%}, "
                  f"{med('independent', 'trained_tokens_per_s'):.0f} tok/s: "
                  f"{row['speedup']['median']:.2f}x; identical rollouts: "
                  f"{row['identical_rollouts']}", flush=True)
    def phases(budget, ratio, latency):
        """--phases phases keeping ratio x rows rollouts in flight (task i: group i)."""
        n = ratio * args.rows
        stream = tail_tasks(n * (args.phases + 1), args.max_turns, seed=100 + ratio)
        items, pos, envs, out = [], 0, {}, {"s": 0.0, "trained_tokens": 0, "live": 0, "slots": 0,
                                  "generated": 0, "suspended": [], "compile_s": 0.0}
        for k in range(args.phases):
            while len(items) < n:
                items.append(Suspended(stream[pos], pos, 0))
                pos += 1
            actor = PolicyActor(policy, fmt, rows=args.rows, max_len=ctx.row_bound(fmt),
                                sampling=SamplingParams(1.0), seed=k)
            actor.sampler.decode_chunk = args.decode_chunk
            t0, c0 = time.perf_counter(), common.COMPILE_S[0]
            done, items, st = rollout_phase(actor, _tail_env(latency, args.max_turns), items,
                                            fmt, ctx, group_size=1, rows=args.rows,
                                            budget_tokens=budget, version=k, envs=envs)
            compiling = common.COMPILE_S[0] - c0
            out["s"] += time.perf_counter() - t0 - compiling
            out["compile_s"] += compiling
            out["trained_tokens"] += sum(r.counters["generated_tokens"] for r in done.values()
                                         if r.answered)
            out["generated"] += st["generated_tokens"]
            out["live"] += actor.sampler.live_steps
            out["slots"] += actor.sampler.slot_steps
            out["suspended"].append(len(items))
        return out

    budget_table = []
    for ratio in ratios:
        for latency in (0.0, args.latency):
            phases(0, ratio, latency)                  # compiles the shapes (untimed)
            offs, ons = [], []
            for _ in range(repeats):
                off = phases(0, ratio, latency)
                budget = max(1, int(args.budget_share * off["generated"] / args.phases))
                offs.append(off)
                ons.append(phases(budget, ratio, latency))
            row = {"rollouts_per_row": ratio, "latency_s": latency, "budget_tokens": budget,
                   "phases": args.phases,
                   "suspended_share": sum(sum(o["suspended"]) for o in ons)
                   / (len(ons) * args.phases * ratio * args.rows)}
            for name, rs in (("off", offs), ("on", ons)):
                row[name] = {"trained_tokens_per_s": common.stats(
                                 r["trained_tokens"] / r["s"] for r in rs),
                             "utilisation": common.stats(r["live"] / max(1, r["slots"])
                                                         for r in rs),
                             "trained_tokens": rs[-1]["trained_tokens"],
                             "compile_s": common.stats(r["compile_s"] for r in rs)}
            row["speedup"] = common.stats((b["trained_tokens"] / b["s"])
                                          / (a["trained_tokens"] / a["s"])
                                          for a, b in zip(offs, ons))
            budget_table.append(row)
            print(f"budget: {ratio} rollouts a row, tools 0-{latency:g} s: off "
                  f"{row['off']['trained_tokens_per_s']['median']:.0f} trained tok/s, on "
                  f"(budget {budget}) {row['on']['trained_tokens_per_s']['median']:.0f}: "
                  f"{row['speedup']['median']:.2f}x", flush=True)

    config = {"rows": args.rows, "decode_chunk": args.decode_chunk,
              "action_tokens": args.action_tokens, "max_turns": args.max_turns,
              "latency_s": args.latency, "working_context": W, "sampling": "temperature 1",
              "phases": args.phases, "budget_share": args.budget_share,
              "repeats": repeats,
              "model": {"params": mc.num_params, "hidden": mc.hidden_size,
                        "layers": mc.num_layers, "dtype": "float32"}}
    slow = [r for r in table if r["latency_s"] > 0]
    targets = [{"what": f"trained tokens/s, independent rows vs rounds, {r['rollouts_per_row']} "
                        f"rollouts a row, tools 0-{r['latency_s']:g} s",
                "target": "> 1x", "measured": f"{r['speedup']['median']:.2f}x",
                "met": r["speedup"]["median"] > 1.0} for r in slow]
    targets += [{"what": f"trained tokens/s, token budget on vs off, {r['rollouts_per_row']} "
                         f"rollouts a row, tools 0-{r['latency_s']:g} s",
                 "target": "> 1x", "measured": f"{r['speedup']['median']:.2f}x",
                 "met": r["speedup"]["median"] > 1.0} for r in budget_table]
    run.write({"table": table, "budget": budget_table, "targets": targets}, config=config)


def markdown(res: dict) -> str:
    c, r = res["config"], res["results"]
    m = c["model"]
    lines = [f"""Policy: random tiny qwen2 ({m['params'] / 1e6:.2f}M parameters, hidden {m['hidden']},
{m['layers']} layers), float32, temperature 1, {c['rows']} sampler rows, decode calls of
{c['decode_chunk']} steps, actions of at most {c['action_tokens']} tokens. Env `tail` (defined in
the script): k tool steps a task, k = 1 + a Pareto(1) draw capped at {c['max_turns']}; each step
sleeps a random 0..latency s. rounds: the turn-synchronous schedule (`run_rollouts(...,
rounds=True)`); independent: the default. Utilisation: live decode slot-steps / all decode
slot-steps (rounds decode nothing while their tools run, so this flatters them; trained
tokens/s of wall is the measure, the wall without the seconds spent compiling: independent
rows reach more shapes, which a long run compiles once). Median (min-max) of
{c['repeats']} runs after an untimed one.

| rollouts a row | tools (s) | turns mean / max | rounds: utilisation, trained tok/s | independent: utilisation, trained tok/s | speedup | compiling s, rounds / independent | identical rollouts |
|---|---|---|---|---|---|---|---|"""]
    for x in r["table"]:
        a, b, sp = x["rounds"], x["independent"], x["speedup"]
        lines.append(
            f"| {x['rollouts_per_row']} | 0-{x['latency_s']:g} | {x['turns']['mean']:.1f} / "
            f"{x['turns']['max']} | {a['utilisation']['median']:.0%}, "
            f"{a['trained_tokens_per_s']['median']:,.0f} | {b['utilisation']['median']:.0%}, "
            f"{b['trained_tokens_per_s']['median']:,.0f} | {sp['median']:.2f}x "
            f"({sp['min']:.2f}-{sp['max']:.2f}) | {a['compile_s']['median']:.1f} / "
            f"{b['compile_s']['median']:.1f} | {'yes' if x['identical_rollouts'] else 'no'} |")
    lines.append("")
    lines.append("With tools that answer at once, independent rows make more and smaller prefill "
                 "and decode calls (rows rejoin at different boundaries) and reach more "
                 "compiled shapes; with slow tools no round waits for its slowest one.")
    if "budget" in r:
        lines.append(f"""
Partial rollouts (`rollout.budget_tokens`): {c['phases']} consecutive phases, independent rows,
a new sampler each phase, the same number of rollouts in flight; on: a phase ends at
{c['budget_share']:g} of the tokens an unbudgeted phase generates and the rollouts not ended
go on first in the next. Trained tokens/s: tokens of the rollouts that ended over the phases'
wall (compiling excluded; those still suspended at the end do not count). Suspended share:
rollouts suspended at a phase's end over those in flight.

| rollouts a row | tools (s) | budget (tokens) | off: utilisation, trained tok/s | on: utilisation, trained tok/s | speedup | suspended share |
|---|---|---|---|---|---|---|""")
        for x in r["budget"]:
            a, b, sp = x["off"], x["on"], x["speedup"]
            lines.append(
                f"| {x['rollouts_per_row']} | 0-{x['latency_s']:g} | {x['budget_tokens']:,} | "
                f"{a['utilisation']['median']:.0%}, {a['trained_tokens_per_s']['median']:,.0f} | "
                f"{b['utilisation']['median']:.0%}, {b['trained_tokens_per_s']['median']:,.0f} | "
                f"{sp['median']:.2f}x ({sp['min']:.2f}-{sp['max']:.2f}) | "
                f"{x['suspended_share']:.0%} |")
        lines.append("")
        lines.append("The budget raises utilisation in every row; trained tokens/s rises only "
                     "with slow tools (no phase waits for its slowest rollout's tools). With "
                     "tools that answer at once, phases last a fraction of a second here and "
                     "each starts a new sampler and prefills its resumed contexts again (costs "
                     "not measured apart), and the budget loses.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
