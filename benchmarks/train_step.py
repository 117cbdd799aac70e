"""Train step: tokens/s and achieved FLOP/s of one SUPO (PPO) step on a ~100M model, as a
fraction of the float32 matmul peak measured in the same run; 8 simulated devices vs 1.

Model: a random qwen2-family config (supo_jax.model.tiny.tiny_config): hidden 768, 12
layers, 12 heads / 4 kv heads, MLP 2048, vocab 32000, tied embeddings, float32 (100M
parameters). Batch: 8 rows x 512 tokens built by supo_jax.rl.batch.build_batch from
random segments (the first 32 tokens of each are prompt, mask 0; the rest are trained,
with advantages +-1). Step: supo_jax.rl.train_step.train_step with LossConfig() (the
SUPO clipped-PPO loss; its forward also computes the per-token entropy over the vocab,
which is reported), AdamW with global-norm clipping, one microbatch.

FLOPs counted per step (stated as "model FLOPs"): 6 x N x tokens for the matmul
weights, N = layer projections (q, k, v, o, gate, up, down) + the LM head (vocab x
hidden; the embedding lookup is a gather, not counted), plus attention 3 x 4 x T x S x
heads x head_dim per row and layer (QK^T and PV, forward + 2x backward) over the full T x
S score matrix the decoder computes (masked, not causal-halved). Norms, softmaxes, rope,
the loss and the optimizer are not counted.

Peak: a jitted jnp.dot of two --matmul-n x --matmul-n float32 matrices (2 n^3 FLOPs),
the best of several calls, measured in each process right before its model (on one
device: XLA's CPU dot uses every core from one device).

Each device count runs in a fresh subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=N;
the 8-device run uses the default training mesh, fsdp = 8: parameters sharded, batch
split one row per device), which also gives each its own peak host memory (ru_maxrss).
The first step (XLA compilation + one step) and the second (on a mesh it compiles again:
step 1 returns some optimizer-state leaves with other shardings than tx.init gave them)
are reported apart; then --repeats steps.
The 1-device process also profiles one step with jax.profiler and reports which XLA
ops take the time.

    python benchmarks/train_step.py         # writes benchmarks/results/train_step.json
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import common

TARGET = 0.5


def flops_per_step(mc, rows: int, seq: int) -> dict:
    E, F, L, V = mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.vocab_size
    HD, KD = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    n_mm = L * (E * HD + 2 * E * KD + HD * E + 3 * E * F) + E * V
    tokens = rows * seq
    dense = 6 * n_mm * tokens
    attn = 3 * 4 * seq * seq * HD * L * rows
    return {"matmul_params": n_mm, "dense": dense, "attention": attn, "total": dense + attn}


def dot_ops(hlo: str) -> set[str]:
    """Names of the instructions of an optimized HLO module that run a matmul: dots and
    convolutions, and fusions (XLA CPU's ynn_fusion, ...) whose computation holds one."""
    with_dot = set()
    for block in re.split(r"\n\s*\n", hlo):
        m = re.match(r"\s*(?:ENTRY\s+)?%([\w.\-]+)\s", block)
        if m and re.search(r"= [^\n=]*?\b(dot|convolution)\(", block):
            with_dot.add(m.group(1))
    ops = {m.group(1) for m in re.finditer(r"%([\w.\-]+) = [^\n=]*?\b(dot|convolution)\(", hlo)}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?\bfusion\([^\n]*?calls=%([\w.\-]+)", hlo):
        if m.group(2) in with_dot:
            ops.add(m.group(1))
    return ops


def _op_kind(name: str, dots: set[str]) -> str:
    n = name.lower()
    if name in dots:
        return "matmul (dot fusions)"
    if "copy" in n or "transpose" in n:
        return "copy / transpose"
    if "scatter" in n or "gather" in n or "dynamic" in n or "slice" in n:
        return "gather / scatter / slices"
    if "fusion" in n or "reduce" in n or n.startswith(("wrapped_", "exp", "add", "mul")):
        return "elementwise / reduce fusions"
    return "other (runtime, parameters, ...)"


def _matmul_peak(n: int, calls: int):
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return [2 * n ** 3 / t for t in ts]


def worker(args) -> dict:
    """One process, one device count: matmul peak, compile, timed steps (, profile)."""
    import jax
    import numpy as np

    from supo_jax.agent.context import Segment
    from supo_jax.model.policy import new_policy
    from supo_jax.model.sharding import batch_sharding, make_mesh
    from supo_jax.model.tiny import tiny_config
    from supo_jax.rl.batch import build_batch
    from supo_jax.rl.train_step import LossConfig, make_optimizer, train_step
    from supo_jax.rl.trainer import init_opt_state

    assert jax.device_count() == args.devices, (jax.device_count(), args.devices)
    out = {"devices": args.devices, "jax_devices": jax.device_count()}
    peak = _matmul_peak(args.matmul_n, args.matmul_calls)
    out["matmul_flops_per_s"] = common.stats(peak)
    print(f"matmul peak ({args.matmul_n}^2 float32): {max(peak) / 1e9:.1f} GFLOP/s", flush=True)
    mc = tiny_config("qwen2", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                     heads=args.heads, kv_heads=args.kv_heads, mlp=args.mlp, tie=True)
    mesh = make_mesh(1, -1, 1) if args.devices > 1 else None
    policy = new_policy(mc, dtype="float32", seed=0, mesh=mesh)
    graphdef, params = policy.split()
    rs = np.random.RandomState(0)
    segs, adv = [], []
    for i in range(args.rows):
        toks = rs.randint(0, args.vocab, args.seq + 1)
        mask = (np.arange(args.seq + 1) >= 32).astype(int)
        segs.append(Segment(tuple(toks.tolist()), tuple(mask.tolist()),
                            tuple((-np.log(args.vocab) * mask).tolist())))
        adv.append(1.0 if i % 2 else -1.0)
    batch = build_batch(segs, adv, max_len=args.seq, rows_multiple=args.devices)
    assert batch.inputs.shape == (args.rows, args.seq), batch.inputs.shape
    if mesh is not None:
        batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape)), batch)
    tx = make_optimizer(1e-5)
    opt_state = init_opt_state(tx, params, mesh)   # as the trainer places it
    cfg = LossConfig()
    state = {"params": params, "opt": opt_state}

    def step():
        state["params"], state["opt"], m = train_step(graphdef, state["params"], state["opt"],
                                                      batch, tx=tx, cfg=cfg)
        jax.block_until_ready((state["params"], m))
        return m

    t0 = time.perf_counter()
    m = step()
    out["first_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()   # on a mesh, step 1 returns optimizer-state leaves with other shardings: a recompile
    out["second_step_s"] = time.perf_counter() - t0
    print(f"{args.devices} device(s): compile + first step {out['first_step_s']:.1f} s, "
          f"second step {out['second_step_s']:.1f} s, loss {float(m['loss']):.4f}", flush=True)
    ts = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
        print(f"{args.devices} device(s): step {ts[-1]:.2f} s", flush=True)
    out["step_s"] = common.stats(ts)
    out["params"] = mc.num_params
    if args.profile and args.devices == 1:
        hlo = train_step.lower(graphdef, state["params"], state["opt"], batch, tx=tx,
                               cfg=cfg).compile().as_text()   # the cached executable's
        dots = dot_ops(hlo)
        t0 = time.perf_counter()
        total, count = common.op_profile(step)
        wall = time.perf_counter() - t0
        all_us = sum(total.values())
        kinds = {}
        for name, us in total.items():
            k = _op_kind(name, dots)
            kinds[k] = kinds.get(k, 0) + us
        out["profile"] = {
            "op_time_s": all_us / 1e6, "wall_s": wall,
            "by_kind": {k: v / all_us for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
            "top_ops": [{"op": n, "ms": us / 1e3, "calls": count[n], "share": us / all_us,
                         "kind": _op_kind(n, dots)}
                        for n, us in total.most_common(args.top_ops)]}
        print("profile: op time by kind: " + ", ".join(
            f"{k} {v * 100:.0f}%" for k, v in out["profile"]["by_kind"].items()), flush=True)
    out["peak_rss_mb"] = common.peak_rss_mb()
    return out


def _worker_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    if devices > 1:
        flags += f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = flags.strip()
    return env


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--devices", default="1,8", help="device counts, each in its own process")
    ap.add_argument("--matmul-n", type=int, default=4096)
    ap.add_argument("--matmul-calls", type=int, default=5)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--top-ops", type=int, default=12)
    ap.add_argument("--worker", type=int, default=0, help=argparse_hidden())
    ap.add_argument("--worker-out", default="", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.kv_heads, args.mlp = 32, 1, 4, 2, 64
        args.vocab, args.seq, args.matmul_n, args.matmul_calls = 256, 32, 256, 2
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.worker:
        args.devices = args.worker
        with open(args.worker_out, "w") as f:
            json.dump(worker(args), f)
        return
    run = common.Run("train_step", args, argv)
    passed = [a for a in (sys.argv[1:] if argv is None else argv)]
    procs = {}
    for d in [int(x) for x in args.devices.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            fn = f.name
        cmd = [sys.executable, os.path.abspath(__file__), *passed, "--worker", str(d),
               "--worker-out", fn]
        subprocess.run(cmd, env=_worker_env(d), check=True)
        with open(fn) as f:
            procs[d] = json.load(f)
        os.unlink(fn)

    from supo_jax.model.tiny import tiny_config
    mc = tiny_config("qwen2", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                     heads=args.heads, kv_heads=args.kv_heads, mlp=args.mlp, tie=True)
    fl = flops_per_step(mc, args.rows, args.seq)
    tokens = args.rows * args.seq
    runs = {}
    for d, p in procs.items():
        s = p["step_s"]
        peak = p["matmul_flops_per_s"]["max"]   # this process's own
        runs[str(d)] = dict(p, tokens_per_s={k: tokens / s[v] for k, v in
                                             (("min", "max"), ("median", "median"), ("max", "min"))},
                            matmul_peak_flops_per_s=peak, model_flops_per_s=fl["total"] / s["median"],
                            fraction_of_peak=fl["total"] / s["median"] / peak)
        print(f"{d} device(s): {tokens / s['median']:.0f} tokens/s, "
              f"{fl['total'] / s['median'] / 1e9:.1f} GFLOP/s = "
              f"{runs[str(d)]['fraction_of_peak'] * 100:.0f}% of its matmul peak "
              f"{peak / 1e9:.1f} GFLOP/s; peak RSS {p['peak_rss_mb']:.0f} MB", flush=True)
    one = runs.get("1")
    results = {"flops_per_step": fl, "tokens_per_step": tokens, "runs": runs, "targets": []}
    if one:
        frac = one["fraction_of_peak"]
        results["targets"].append({"what": "train step achieved FLOP/s (1 device) / matmul peak",
                                   "target": f">= {TARGET * 100:.0f}%",
                                   "measured": f"{frac * 100:.0f}%", "met": frac >= TARGET})
        for d, r in runs.items():
            if d != "1":
                r["speed_vs_1_device"] = one["step_s"]["median"] / r["step_s"]["median"]
    config = {"model": {"family": "qwen2", "params": mc.num_params, "hidden": mc.hidden_size,
                        "layers": mc.num_layers, "heads": mc.num_heads,
                        "kv_heads": mc.num_kv_heads, "mlp": mc.intermediate_size,
                        "vocab": mc.vocab_size, "tied": True, "dtype": "float32"},
              "rows": args.rows, "seq": args.seq, "loss": "ppo (LossConfig())", "micro": 1,
              "matmul_n": args.matmul_n, "matmul_calls": args.matmul_calls,
              "repeats": args.repeats}
    run.write(results, config=config)


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


def markdown(res: dict) -> str:
    c, r = res["config"], res["results"]
    m, fl = c["model"], r["flops_per_step"]
    lines = [f"""Model: random qwen2-family config, {m['params'] / 1e6:.1f}M parameters (hidden {m['hidden']},
{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads, MLP {m['mlp']}, vocab {m['vocab']},
tied embeddings), float32. Batch {c['rows']} x {c['seq']} tokens; loss {c['loss']}, AdamW, one
microbatch. Model FLOPs per step: 6 x {fl['matmul_params'] / 1e6:.1f}M matmul weights x
{r['tokens_per_step']} tokens = {fl['dense'] / 1e12:.2f} TFLOP, plus attention (QK^T and PV over
the full T x S scores, forward + backward) {fl['attention'] / 1e12:.2f} TFLOP: {fl['total'] / 1e12:.2f}
TFLOP. Matmul peak: best of {c.get('matmul_calls', 5)} calls of a jitted {c['matmul_n']}^2 float32 `jnp.dot`,
measured in each process right before its model. Step times: median (min-max) of
{c['repeats']} steps after two untimed ones (the first compiles; on the mesh the second compiles
again, see below); each device count in its own process.

| devices | compile + first step (s) | second step (s) | step (s) | tokens/s | model GFLOP/s | matmul peak (GFLOP/s) | fraction of peak | vs 1 device | peak RSS (MB) |
|---|---|---|---|---|---|---|---|---|---|"""]
    for d, x in r["runs"].items():
        s, t = x["step_s"], x["tokens_per_s"]
        vs = f"{x['speed_vs_1_device']:.2f}x" if "speed_vs_1_device" in x else "1.00x"
        lines.append(f"| {d} | {x['first_step_s']:.1f} | {x['second_step_s']:.1f} | {s['median']:.2f} "
                     f"({s['min']:.2f}-{s['max']:.2f}) | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})"
                     f" | {x['model_flops_per_s'] / 1e9:.1f} | {x['matmul_peak_flops_per_s'] / 1e9:.1f} "
                     f"| {x['fraction_of_peak'] * 100:.0f}% | {vs} | {x['peak_rss_mb']:.0f} |")
    prof = r["runs"].get("1", {}).get("profile")
    if prof:
        lines += ["", "Where one 1-device step's time goes (jax.profiler; XLA op time summed over "
                  f"threads: {prof['op_time_s']:.1f} s in a {prof['wall_s']:.1f} s profiled step; an op "
                  "is a matmul when its optimized-HLO instruction is a dot or a fusion holding one): "
                  + ", ".join(f"{k} {v * 100:.0f}%" for k, v in prof["by_kind"].items())
                  + ". Top ops:", "", "| XLA op | kind | ms | calls | share |", "|---|---|---|---|---|"]
        for o in prof["top_ops"]:
            lines.append(f"| `{o['op']}` | {o.get('kind', '')} | {o['ms']:.0f} | {o['calls']} "
                         f"| {o['share'] * 100:.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
