"""Horizon scaling: seconds per generated token and KV-cache bytes at horizon h, 2h, 4h, 8h,
under the supo context manager at a fixed W and under `full` (W large enough for the
whole history).

Task family: fncall/tallest with n = h, 2h, 4h, 8h people (a solution takes n - 1
compare calls, one per turn, and the history grows ~40 tokens per turn).

Method. A random policy cannot solve the task, and the rollout's length must come from
the task, so the rollouts follow the scripted expert (supo_jax.envs.experts.expert_for
behind ScriptedActor: it decides every action and summary, and the env and context
manager run as in training) while the model sampler does the work a policy would:
every turn, a PolicyActor on a random tiny policy (qwen2 family, float32, default hidden
256, 4 layers) prefills the request's new tokens into its row (keeping the KV cache
across turns, restarting from the cached prompt after a summary) and then greedily
decodes exactly as many tokens as the expert's action (no stop tokens). The decoded
tokens are discarded; the expert's tokens go into the context, so the next turn's
prefill also covers the expert's action (teacher forcing, one action per turn of extra
prefill, the same at every horizon). Seconds per generated token = time inside the
sampler calls (prefill + decode + tokens back on the host) / tokens decoded; env steps,
the expert and the context manager are not counted (their wall time is reported apart).

KV-cache bytes: the Sampler's cache allocated for the rollout, rows x max_len x layers
x 2 (k, v) x kv_heads x head_dim x 4 bytes, where max_len is the row bound of the
context config (ContextConfig.row_bound: fixed by W under supo; under full, W is sized
to the longest history of each horizon, so it grows with h);
also the longest context actually reached (tokens) and the bytes that context needs in
every row.

Each (manager, horizon) runs once to compile, then --repeats rounds (all configurations
alternating) give the median and min/max.

    python benchmarks/horizon.py            # writes benchmarks/results/horizon.json
"""
from __future__ import annotations

import dataclasses
import math
import time
import types

import common

ENV = "fncall/tallest"


class ReplayActor:
    """The scripted expert decides; a PolicyActor decodes as many tokens as the expert's action
    (greedy, no stop tokens) on the same contexts, timed."""

    def __init__(self, policy, fmt, expert, rows: int, max_len: int):
        from supo_jax.agent.rollout import PolicyActor, ScriptedActor
        from supo_jax.sampling.sampler import SamplingParams

        self.expert = ScriptedActor(expert, fmt)
        no_stop = types.SimpleNamespace(stop_ids=())   # PolicyActor reads only fmt.stop_ids
        self.model = PolicyActor(policy, no_stop, rows, max_len, SamplingParams(temperature=0.0))
        self.seconds, self.generated = 0.0, 0

    def act(self, requests):
        gens = self.expert.act(requests)
        forced = [dataclasses.replace(r, max_new=len(g.tokens)) for r, g in zip(requests, gens)]
        t0 = time.perf_counter()
        out = self.model.act(forced)
        self.seconds += time.perf_counter() - t0
        self.generated += sum(len(g.tokens) for g in out)
        return gens


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--h", type=int, default=4, help="the base horizon (people); runs h, 2h, 4h, 8h")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=4, help="rollouts per horizon, in one batch")
    ap.add_argument("--working-context", type=int, default=512, help="W under supo (tokens)")
    ap.add_argument("--factors", default="1,2,4,8", help="horizons as multiples of h")
    args = ap.parse_args(argv)
    if args.smoke:
        args.h, args.hidden, args.layers, args.tasks, args.factors = 2, 32, 1, 1, "1,2"
    repeats = args.repeats or (1 if args.smoke else 3)
    run = common.Run("horizon", args, argv)

    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for

    policy, cfg = common.tiny_policy(args.hidden, args.layers)  # the expert needs its tokenizer
    fmt = ChatFormat(policy.tokenizer)
    mc = policy.config
    horizons = [args.h * int(k) for k in args.factors.split(",")]
    tasks = {h: make_tasks(ENV, "train", args.tasks, seed=0, size=h) for h in horizons}
    # bounds far above what the expert needs (n - 1 calls + summaries): they only stop a runaway
    base = dataclasses.replace(cfg.context, max_steps=4 * max(horizons) + 20,
                               max_summaries=max(horizons))
    supo = dataclasses.replace(base, manager="supo", working_context=args.working_context)

    def scripted(ctx, h):
        return run_rollouts(ScriptedActor(expert_for(ENV), fmt), lambda: make_env(ENV), tasks[h],
                            fmt, ctx, rows=args.tasks)

    # full: W just large enough for the longest history of each horizon (a scripted dry run)
    ctxs = {}
    for h in horizons:
        longest = max(r.counters["max_context"]
                      for r in scripted(dataclasses.replace(base, manager="full",
                                                            working_context=10 ** 7), h))
        w = math.ceil((longest + 1) / base.trigger_ratio / 128) * 128
        ctxs[("full", h)] = dataclasses.replace(base, manager="full", working_context=w)
        ctxs[("supo", h)] = supo
    if args.smoke:   # one W for every full run: they share compiled shapes (half the compiles)
        for h in horizons:
            ctxs[("full", h)] = ctxs[("full", horizons[-1])]

    def once(key):
        ctx = ctxs[key]
        actor = ReplayActor(policy, fmt, expert_for(ENV), args.tasks, ctx.row_bound(fmt))
        t0 = time.perf_counter()
        ro = run_rollouts(actor, lambda: make_env(ENV), tasks[key[1]], fmt, ctx, rows=args.tasks)
        wall = time.perf_counter() - t0
        assert all(r.reason == "answer" and r.reward == 1.0 for r in ro), \
            [(r.reason, r.reward) for r in ro]
        return {"sampler_s": actor.seconds, "wall_s": wall, "generated": actor.generated,
                "max_len": actor.model.sampler.max_len,
                "max_context": max(r.counters["max_context"] for r in ro),
                "steps": sum(r.counters["steps"] for r in ro) / len(ro),
                "summaries": sum(r.counters["summaries"] for r in ro) / len(ro)}

    keys = [(m, h) for m in ("supo", "full") for h in horizons]
    first = {k: once(k) for k in keys}
    timed = {k: [] for k in keys}
    for i in range(repeats):
        for k in keys:
            r = once(k)
            timed[k].append(r)
            print(f"round {i + 1}: {k[0]:4s} n={k[1]:3d}: {r['sampler_s']:.2f} s in the sampler, "
                  f"{r['generated']} tokens -> {r['sampler_s'] / r['generated'] * 1e3:.2f} ms/token; "
                  f"cache {r['max_len']} slots, longest context {r['max_context']}", flush=True)

    rows = {"supo": [], "full": []}
    for (m, h), rs in timed.items():
        last = rs[-1]
        rows[m].append({
            "horizon": h, "working_context": ctxs[(m, h)].working_context,
            "first_run_sampler_s": first[(m, h)]["sampler_s"],
            "s_per_token": common.stats(r["sampler_s"] / r["generated"] for r in rs),
            "wall_s": common.stats(r["wall_s"] for r in rs),
            "generated_tokens": last["generated"], "steps_mean": last["steps"],
            "summaries_mean": last["summaries"], "cache_slots_per_row": last["max_len"],
            "kv_cache_bytes": common.kv_bytes(mc, args.tasks, last["max_len"]),
            "longest_context": last["max_context"],
            "longest_context_kv_bytes": common.kv_bytes(mc, args.tasks, last["max_context"])})
    ratios = {}
    for m, rs in rows.items():
        a, b = rs[0], rs[-1]
        ratios[m] = {"s_per_token": b["s_per_token"]["median"] / a["s_per_token"]["median"],
                     "kv_cache_bytes": b["kv_cache_bytes"] / a["kv_cache_bytes"],
                     "longest_context": b["longest_context"] / a["longest_context"]}
        print(f"{m}: {b['horizon']} / {a['horizon']}: s per token {ratios[m]['s_per_token']:.2f}x, KV cache "
              f"{ratios[m]['kv_cache_bytes']:.2f}x, longest context {ratios[m]['longest_context']:.2f}x")
    flat = 1.25   # "flat": within 25% from h to 8h
    results = {"managers": rows, "ratio_8h_vs_h": ratios, "targets": [
        {"what": "supo, seconds per generated token flat from h to 8h",
         "target": f"8h / h <= {flat:g}x", "measured": f"{ratios['supo']['s_per_token']:.2f}x",
         "met": ratios["supo"]["s_per_token"] <= flat},
        {"what": "supo, KV-cache bytes flat from h to 8h",
         "target": f"8h / h <= {flat:g}x", "measured": f"{ratios['supo']['kv_cache_bytes']:.2f}x",
         "met": ratios["supo"]["kv_cache_bytes"] <= flat}]}
    config = {"env": ENV, "horizons": horizons, "rollouts": args.tasks, "rows": args.tasks,
              "supo_working_context": supo.working_context, "supo_trigger": supo.trigger,
              "max_action_tokens": base.max_action_tokens,
              "max_summary_tokens": base.max_summary_tokens,
              "max_observation_tokens": base.max_observation_tokens, "repeats": repeats,
              "model": {"params": mc.num_params, "hidden": mc.hidden_size,
                        "layers": mc.num_layers, "heads": mc.num_heads,
                        "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                        "mlp": mc.intermediate_size, "vocab": mc.vocab_size, "dtype": "float32"}}
    run.write(results, config=config)


def limits(res: dict) -> str:
    """Which supo figure is not flat (empty when both are)."""
    r = res["results"]
    missed = [t for t in r["targets"] if not t["met"]]
    if not missed:
        return ""
    return "".join(f"- **horizon**: {t['what']}: {t['measured']} (target {t['target']}). Under supo "
                   "the cache and the attention span are fixed by W; what grows with the horizon "
                   "is the number of summaries, whose restart turns are prefilled again.\n"
                   for t in missed)


def _mib(b):
    return f"{b / 2 ** 20:.1f}"


def markdown(res: dict) -> str:
    c, r = res["config"], res["results"]
    m = c["model"]
    lines = [f"""Policy: random tiny qwen2 ({m['params'] / 1e6:.2f}M parameters: hidden {m['hidden']},
{m['layers']} layers, {m['kv_heads']} kv heads x head dim {m['head_dim']}), float32, greedy; the scripted
expert decides the actions (see the method in `benchmarks/horizon.py`). Env: `{c['env']}` with
n = {', '.join(map(str, c['horizons']))} people, {c['rollouts']} rollouts per horizon in one batch;
supo at W = {c['supo_working_context']} (L = {c['supo_trigger']}); full at the smallest W (multiple of
128) that holds the horizon's whole history. Seconds per generated token: time inside the
sampler / tokens decoded, median (min-max) of {c['repeats']} rounds after one compiling run.
KV cache: allocated = rows x cache slots x layers x 2 x kv heads x head dim x 4 bytes.

| manager | n (horizon) | W | steps / summaries per rollout | ms per generated token | cache slots per row | KV cache allocated (MiB) | longest context (tokens) | its KV bytes, all rows (MiB) |
|---|---|---|---|---|---|---|---|---|"""]
    for mgr in ("supo", "full"):
        for x in r["managers"][mgr]:
            s = x["s_per_token"]
            lines.append(
                f"| {mgr} | {x['horizon']} | {x['working_context']} | {x['steps_mean']:.0f} / "
                f"{x['summaries_mean']:.0f} | {s['median'] * 1e3:.2f} ({s['min'] * 1e3:.2f}-"
                f"{s['max'] * 1e3:.2f}) | {x['cache_slots_per_row']} | {_mib(x['kv_cache_bytes'])} "
                f"| {x['longest_context']} | {_mib(x['longest_context_kv_bytes'])} |")
    hs = c["horizons"]
    lines.append("")
    lines.append(f"Ratio of the largest to the smallest horizon (n = {hs[-1]} vs {hs[0]}):")
    lines.append("")
    lines.append("| manager | seconds per generated token | KV cache allocated | longest context |")
    lines.append("|---|---|---|---|")
    for mgr in ("supo", "full"):
        q = r["ratio_8h_vs_h"][mgr]
        lines.append(f"| {mgr} | {q['s_per_token']:.2f}x | {q['kv_cache_bytes']:.2f}x "
                     f"| {q['longest_context']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
