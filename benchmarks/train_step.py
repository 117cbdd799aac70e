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
heads x head_dim per row and layer (QK^T and PV, forward + 2x backward) over the scores
the decoder computes: the full T x S matrix (masked) where attention runs as "xla", the
causal half where it runs blockwise (the CPU above 512 tokens). Norms, softmaxes, rope,
the loss and the optimizer are not counted.

Peak: a jitted jnp.dot of two --matmul-n x --matmul-n float32 matrices (2 n^3 FLOPs),
--matmul-calls calls right before every timed step, in the same process (XLA's CPU dot
uses every core from one device). This machine's speed drifts (a shared VM): each
step's fraction of peak is its model FLOP/s over the best matmul of the calls just
before it, and the fraction reported is the median of those.

Meshes (data x fsdp x tensor): each device count runs in a fresh subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=N (its compile-only meshes first), which
also gives each run its own peak host memory (ru_maxrss). Default: 1x1x1, and 2x2x2 on 8 simulated devices (the mesh of
tests/test_train_step.py); the default training mesh, 1x8x1 (fsdp = 8), is only
compiled, for XLA's memory estimate (compiled.memory_analysis(): temp + argument +
output - aliased buffers, per device, x devices): on a 23 GiB machine it does not fit
(a mesh whose estimate exceeds 90% of MemAvailable is never run). The step is compiled
ahead (lower().compile(), timed), then one step; on a mesh a second untimed step
compiles again (step 1 returns some optimizer-state leaves with other shardings than
train_step.init_opt_state placed them); then --repeats timed steps, the last one on
one device under jax.profiler, to report which XLA ops take the time (an op counts as
a matmul when its optimized-HLO instruction is a dot or a fusion that holds one).

    python benchmarks/train_step.py         # writes benchmarks/results/train_step.json
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import common

TARGET = 0.5


def flops_per_step(mc, rows: int, seq: int, attention: str = "xla") -> dict:
    """Model FLOPs of one step; attention as `attention` computes it: every T x S score
    ("xla"), or the causal half (blockwise attention skips the blocks past the diagonal)."""
    E, F, L, V = mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.vocab_size
    HD, KD = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    n_mm = L * (E * HD + 2 * E * KD + HD * E + 3 * E * F) + E * V
    tokens = rows * seq
    dense = 6 * n_mm * tokens
    attn = 3 * 4 * seq * seq * HD * L * rows // (1 if attention == "xla" else 2)
    return {"matmul_params": n_mm, "dense": dense, "attention": attn, "total": dense + attn}


def _attention(seq: int) -> str:
    """What model.attention "auto" runs on the CPU for rows of `seq` tokens."""
    import jax.numpy as jnp

    from supo_jax.model.attention import resolve
    return resolve("auto", jnp.float32, seq, "cpu")


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


def hlo_info(hlo: str) -> dict:
    """Per instruction of an optimized HLO module: output shape and the jax op it came from."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = (\S+) [^\n]*", hlo):
        src = re.search(r'op_name="([^"]*)"', m.group(0))
        out[m.group(1)] = (m.group(2).split("{")[0], src.group(1) if src else "")
    return out


def collectives(hlo: str) -> dict:
    return {k: len(re.findall(r"= \S+ " + k + r"(?:-start)?\(", hlo))
            for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                      "collective-permute")}


def dot_rows(hlo: str, tokens: int, devices: int) -> dict:
    """How many dot instructions of a (per-device) compiled step have a dimension equal to
    the whole batch's tokens vs the tokens of one device's share of the batch: on a mesh
    that splits the batch, the second (unless the first equals it on one device)."""
    shapes = [tuple(int(d) for d in m.group(1).split(",") if d)
              for m in re.finditer(r"= f32\[([\d,]*)\]\S* dot\(", hlo)]
    return {"dots": len(shapes), "with_all_tokens": sum(tokens in sh for sh in shapes),
            "with_tokens_per_device": sum(tokens // devices in sh for sh in shapes)}


def _short_source(op_name: str) -> str:
    """'jit(train_step)/while/body/closed_call/transpose(jvp())/.../dot_general' ->
    'backward: dot_general' (the scan / call nesting dropped)."""
    if not op_name:
        return ""
    where = "backward" if "transpose(" in op_name else "forward"
    last = [p for p in op_name.split("/") if p and not p.startswith(("while", "body", "closed_call"))]
    return f"{where}: {last[-1] if last else op_name}"


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
    return [2 * n ** 3 / t for t in common.warm_times(lambda: f(a, b).block_until_ready(), calls)]


def parse_mesh(label: str) -> tuple[int, int, int]:
    d, f, t = (int(x) for x in label.split("x"))
    return d, f, t


def worker(args) -> None:
    """One process per device count: its meshes one after another, compile-only ones first
    (their peak memory is small, so ru_maxrss after a run is the run's); results written
    to --worker-out after each mesh."""
    jobs = [(j.split(":")[0], j.endswith(":compile")) for j in args.worker.split(",")]
    done = {}
    for label, compile_only in sorted(jobs, key=lambda j: not j[1]):
        done[label] = one_mesh(args, label, compile_only)
        with open(args.worker_out, "w") as f:
            json.dump(done, f)


def one_mesh(args, label: str, compile_only: bool) -> dict:
    """One mesh: compile (+ XLA's memory estimate), matmul peak, timed steps (the last one
    profiled on one device). With compile_only, or when the compiled step needs more memory
    than the machine has available, it stops after compiling."""
    import jax
    import numpy as np

    from supo_jax.agent.context import Segment
    from supo_jax.model.policy import new_policy
    from supo_jax.model.sharding import batch_sharding, make_mesh
    from supo_jax.model.tiny import tiny_config
    from supo_jax.rl.batch import build_batch
    from supo_jax.rl.train_step import LossConfig, make_optimizer, train_step
    from supo_jax.rl.train_step import init_opt_state

    shape = parse_mesh(label)
    n = shape[0] * shape[1] * shape[2]
    assert jax.device_count() == n, (jax.device_count(), n)
    out = {"mesh": label, "devices": n, "jax_devices": jax.device_count()}
    mc = tiny_config("qwen2", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                     heads=args.heads, kv_heads=args.kv_heads, mlp=args.mlp, tie=True)
    mesh = make_mesh(*shape) if n > 1 else None
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
    batch = build_batch(segs, adv, max_len=args.seq, rows_multiple=n)
    assert batch.inputs.shape == (args.rows, args.seq), batch.inputs.shape
    if mesh is not None:
        batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape)), batch)
    tx = make_optimizer(1e-5)
    opt_state = init_opt_state(tx, params, mesh)   # as the trainer places it
    cfg = LossConfig()
    state = {"params": params, "opt": opt_state}

    t0 = time.perf_counter()
    compiled = train_step.lower(graphdef, params, opt_state, batch, tx=tx, cfg=cfg).compile()
    out["compile_s"] = time.perf_counter() - t0
    hlo = compiled.as_text()
    out["collectives"] = collectives(hlo)
    out["dot_rows"] = dot_rows(hlo, args.rows * args.seq, n)
    ma = compiled.memory_analysis()
    per = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
           for k in ("temp", "argument", "output", "alias")}
    need = (per["temp"] + per["argument"] + per["output"] - per["alias"]) * n
    avail = common.mem_available_bytes()
    out.update(xla_bytes_per_device=per, xla_bytes_all_devices=need, mem_available_bytes=avail)
    print(f"mesh {label}: compiled in {out['compile_s']:.1f} s; XLA's buffers "
          f"{need / 2 ** 30:.1f} GiB over {n} device(s) (available {(avail or 0) / 2 ** 30:.1f} GiB)",
          flush=True)
    if compile_only or (avail and need > 0.9 * avail):
        out["skipped"] = ("compiled only (--compile-only)" if compile_only else
                          f"not run: XLA's buffers ({need / 2 ** 30:.1f} GiB) exceed 90% of the "
                          f"available memory ({avail / 2 ** 30:.1f} GiB)")
        out["peak_rss_mb"] = common.peak_rss_mb()
        return out

    peaks = []   # matmul FLOP/s samples; a few right before every timed step (load hits both)

    def step():
        t0 = time.perf_counter()
        state["params"], state["opt"], m = train_step(graphdef, state["params"], state["opt"],
                                                      batch, tx=tx, cfg=cfg)
        jax.block_until_ready((state["params"], m))
        return time.perf_counter() - t0, m

    out["first_step_s"], m = step()
    msg = f"first step {out['first_step_s']:.1f} s"
    if n > 1:   # step 1 returns some optimizer-state leaves with other shardings: a recompile
        out["second_step_s"], _ = step()
        msg += f", second step {out['second_step_s']:.1f} s"
    print(f"mesh {label}: {msg}, loss {float(m['loss']):.4f}", flush=True)
    ts, fracs = [], []
    fl = flops_per_step(mc, args.rows, args.seq, _attention(args.seq))["total"]
    for i in range(args.repeats):
        peak = _matmul_peak(args.matmul_n, args.matmul_calls)
        peaks += peak
        if i == args.repeats - 1 and args.profile and n == 1:
            dots, info = dot_ops(hlo), hlo_info(hlo)
            total, count = common.op_profile(lambda: ts.append(step()[0]))
            all_us = sum(total.values())
            kinds = {}
            for name, us in total.items():
                k = _op_kind(name, dots)
                kinds[k] = kinds.get(k, 0) + us
            out["profile"] = {
                "op_time_s": all_us / 1e6, "wall_s": ts[-1],
                "by_kind": {k: v / all_us for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
                "top_ops": [{"op": o, "ms": us / 1e3, "calls": count[o], "share": us / all_us,
                             "kind": _op_kind(o, dots), "shape": info.get(o, ("", ""))[0],
                             "source": _short_source(info.get(o, ("", ""))[1])}
                            for o, us in total.most_common(args.top_ops)]}
            print("profile: op time by kind: " + ", ".join(
                f"{k} {v * 100:.0f}%" for k, v in out["profile"]["by_kind"].items()), flush=True)
        else:
            ts.append(step()[0])
        fracs.append(fl / ts[-1] / max(peak))
        print(f"mesh {label}: matmul peak {max(peak) / 1e9:.1f} GFLOP/s, step {ts[-1]:.2f} s "
              f"= {fracs[-1] * 100:.0f}% of it", flush=True)
    out["step_s"] = common.stats(ts)
    out["matmul_flops_per_s"] = common.stats(peaks)
    out["fraction_of_peak_per_step"] = common.stats(fracs)
    out["params"] = mc.num_params
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
    ap.add_argument("--meshes", default="1x1x1,2x2x2",
                    help="meshes (data x fsdp x tensor) to run, each in its own process")
    ap.add_argument("--compile-only", default="1x8x1",
                    help="meshes only compiled, for XLA's memory estimate ('' for none)")
    ap.add_argument("--matmul-n", type=int, default=4096)
    ap.add_argument("--matmul-calls", type=int, default=3, help="matmul calls before each timed step")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--top-ops", type=int, default=12)
    ap.add_argument("--worker", default="", help=argparse_hidden())
    ap.add_argument("--worker-out", default="", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.kv_heads, args.mlp = 32, 1, 4, 2, 64
        args.vocab, args.seq, args.matmul_n, args.matmul_calls = 256, 32, 256, 1
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.worker:
        worker(args)
        return
    run = common.Run("train_step", args, argv)
    passed = list(sys.argv[1:] if argv is None else argv)
    groups: dict[int, list[str]] = {}   # device count -> its meshes (":compile" = compile only)
    for spec, suffix in ((args.meshes, ""), (args.compile_only, ":compile")):
        for m in (x for x in spec.split(",") if x):
            groups.setdefault(math.prod(parse_mesh(m)), []).append(m + suffix)
    procs = {}
    for n, jobs in sorted(groups.items()):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            fn = f.name
        cmd = [sys.executable, os.path.abspath(__file__), *passed, "--worker", ",".join(jobs),
               "--worker-out", fn]
        rc = subprocess.run(cmd, env=_worker_env(n)).returncode
        with open(fn) as f:
            text = f.read()
        procs.update(json.loads(text) if text else {})
        os.unlink(fn)
        why = "killed (SIGKILL: out of memory?)" if rc == -9 else f"failed (exit status {rc})"
        for label in (j.split(":")[0] for j in jobs):
            if label not in procs:
                procs[label] = {"mesh": label, "devices": n, "skipped": why}
                print(f"mesh {label}: {why}", file=sys.stderr)
    procs = {j.split(":")[0]: procs[j.split(":")[0]] for n in sorted(groups) for j in groups[n]}

    from supo_jax.model.tiny import tiny_config
    mc = tiny_config("qwen2", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                     heads=args.heads, kv_heads=args.kv_heads, mlp=args.mlp, tie=True)
    fl = flops_per_step(mc, args.rows, args.seq, _attention(args.seq))
    tokens = args.rows * args.seq
    runs = {}
    for label, p in procs.items():
        runs[label] = dict(p)
        if "skipped" in p:
            continue
        s, peak = p["step_s"], p["matmul_flops_per_s"]["max"]   # this process's own peak
        runs[label].update(
            tokens_per_s={k: tokens / s[v] for k, v in (("min", "max"), ("median", "median"),
                                                        ("max", "min"))},
            matmul_peak_flops_per_s=peak, model_flops_per_s=fl["total"] / s["median"],
            fraction_of_peak=p["fraction_of_peak_per_step"]["median"])
        print(f"mesh {label}: {tokens / s['median']:.0f} tokens/s, "
              f"{fl['total'] / s['median'] / 1e9:.1f} GFLOP/s = "
              f"{runs[label]['fraction_of_peak'] * 100:.0f}% of the matmul peak (median over steps; "
              f"best matmul {peak / 1e9:.1f} GFLOP/s); peak RSS {p['peak_rss_mb']:.0f} MB", flush=True)
    results = {"flops_per_step": fl, "tokens_per_step": tokens, "runs": runs, "targets": []}
    one = runs.get("1x1x1")
    if one and "skipped" not in one:
        frac, per = one["fraction_of_peak"], one["fraction_of_peak_per_step"]
        met = frac >= TARGET
        results["targets"].append({
            "what": "train step achieved FLOP/s (1 device) / matmul peak",
            "target": f">= {TARGET * 100:.0f}%",
            "measured": f"{frac * 100:.0f}% (steps: {per['min'] * 100:.0f}-{per['max'] * 100:.0f}%)",
            "met": met and per["min"] >= TARGET,
            **({"note": "the median meets it, single steps do not"}
               if met and per["min"] < TARGET else {})})
        for label, r in runs.items():
            if label != "1x1x1" and "skipped" not in r:
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


def limits(res: dict) -> str:
    """What keeps the 1-device step below the target, from the profile (empty when met)."""
    r = res["results"]
    one = r["runs"].get("1x1x1", {})
    if (not one or "skipped" in one or "profile" not in one
            or one["fraction_of_peak_per_step"]["min"] >= TARGET):
        return ""
    prof, fl, peak = one["profile"], r["flops_per_step"]["total"], one["matmul_peak_flops_per_s"]
    kinds, wall = prof["by_kind"], prof["wall_s"]
    mm = kinds.get("matmul (dot fusions)", 0.0)
    rest = 1 - mm
    in_mm = fl / (mm * wall)
    cap = (fl / peak) / (fl / peak + rest * wall)
    frac = one["fraction_of_peak"]
    c = res["config"]
    m = c["model"]
    copies = [o for o in prof["top_ops"] if o["kind"] == "copy / transpose"]
    big_copies = ", ".join(f"`{o.get('shape', '')}` ({o.get('source', '')}, {o['share'] * 100:.0f}%)"
                           for o in copies[:2])
    per = one["fraction_of_peak_per_step"]
    verdict = (f"{(TARGET - frac) * 100:.0f} points short of {TARGET * 100:.0f}% ({frac / TARGET:.2f}x "
               "the target)" if frac < TARGET else
               f"at the target only by the median: single steps range {per['min'] * 100:.0f}-"
               f"{per['max'] * 100:.0f}%, so it has no margin")
    return (f"- **train_step** reaches {frac * 100:.0f}% of the matmul peak, {verdict}. The profile of a "
            f"1-device step ({wall:.1f} s; its ops run one after another, each on every core, so op "
            f"time shares are wall-time shares) splits it into matmul fusions, {mm * 100:.0f}%, and "
            f"memory-bound work, {rest * 100:.0f}%: "
            + ", ".join(f"{k} {v * 100:.0f}%" for k, v in kinds.items() if k != "matmul (dot fusions)")
            + f". (1) The matmuls themselves run at {in_mm / 1e9:.0f} GFLOP/s, {in_mm / peak * 100:.0f}% "
            f"of the square {c['matmul_n']}^2 peak: the step's dots are skinnier (k/v projections "
            f"with {m['kv_heads'] * m['hidden'] // m['heads']} outputs, per-head attention matmuls "
            f"contracting over the {m['hidden'] // m['heads']}-wide head dim) and XLA fuses some with "
            "reductions (the LM head with log-softmax's max). (2) Even with every "
            f"matmul at peak, the non-matmul time would cap the step at {cap * 100:.0f}% of peak. The "
            "largest single non-matmul ops are the backward's materialized transposes"
            + (f" ({big_copies})" if big_copies else "")
            + f"; then the softmaxes over the {c['seq']} x {c['seq']} attention scores, SiLU and RMS "
            f"norms, the loss's log-softmax plus the per-token entropy over the {m['vocab']}-token "
            "vocab (computed even when only reported), and the layer scan's dynamic slices and the "
            "embedding's scatter-add gradient. Closing the gap needs both: fewer transposes and "
            "elementwise passes (e.g. skipping the reported-only entropy) and better matmul "
            f"shapes; on {res['machine']['nproc']} CPU cores the step is compute-bound, not host-bound "
            "(host overhead: the 'other' share).\n")


def _mesh_notes(r: dict, cores: int) -> list[str]:
    """What the sharded runs show, from their figures (no text when a figure is missing)."""
    one, out = r["runs"].get("1x1x1"), []
    if not one or "skipped" in one:
        return out
    for label, x in r["runs"].items():
        if label == "1x1x1" or "xla_bytes_all_devices" not in x:
            continue
        dr = x.get("dot_rows", {})
        split = (f"; of its {dr['dots']} dots, {dr['with_tokens_per_device']} have a dimension of "
                 f"one device's share of the tokens ({r['tokens_per_step'] // x['devices']}) and "
                 f"{dr['with_all_tokens']} one of the whole batch's ({r['tokens_per_step']})"
                 if dr.get("dots") else "")
        mem = (f"its buffers take {_gib(x['xla_bytes_all_devices'])} GiB over {x['devices']} devices, "
               f"{x['xla_bytes_all_devices'] / one['xla_bytes_all_devices']:.1f}x the 1-device "
               f"step's {_gib(one['xla_bytes_all_devices'])} GiB")
        if "skipped" in x:
            out.append(f"- Mesh {label}: {x['skipped']}; {mem}{split}.")
        else:
            out.append(f"- Mesh {label}: {x['speed_vs_1_device']:.2f}x the 1-device speed (the "
                       f"{x['devices']} simulated devices share the same {cores} cores, so "
                       f"sharding adds no compute, only collectives and per-device copies); {mem}"
                       f"{split}.")
    return [""] + out if out else out


def _gib(b):
    return f"{b / 2 ** 30:.1f}"


def markdown(res: dict) -> str:
    c, r = res["config"], res["results"]
    m, fl = c["model"], r["flops_per_step"]
    lines = [f"""Model: random qwen2-family config, {m['params'] / 1e6:.1f}M parameters (hidden {m['hidden']},
{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads, MLP {m['mlp']}, vocab {m['vocab']},
tied embeddings), float32. Batch {c['rows']} x {c['seq']} tokens; loss {c['loss']}, AdamW, one
microbatch. Model FLOPs per step: 6 x {fl['matmul_params'] / 1e6:.1f}M matmul weights (layer
projections + LM head) x {r['tokens_per_step']} tokens = {fl['dense'] / 1e12:.2f} TFLOP, plus attention
(QK^T and PV over the full T x S scores, forward + backward) {fl['attention'] / 1e12:.2f} TFLOP:
{fl['total'] / 1e12:.2f} TFLOP per step. Matmul peak: a jitted {c['matmul_n']}^2 float32 `jnp.dot`,
{c['matmul_calls']} calls right before every timed step in the same process; the table gives the best
of all of them, and "fraction of peak" is the median over steps of each step's model FLOP/s
over the best matmul just before it (this shared VM's speed drifts by tens of percent).
Step: median (min-max) of {c['repeats']} steps after the compiling ones; each mesh (data x fsdp
x tensor) in its own process. XLA memory: the compiled step's buffers (temp + arguments +
outputs - aliased) per device x devices.

| mesh | devices | compile (s) | first step (s) | second step (s) | step (s) | tokens/s | model GFLOP/s | matmul peak (GFLOP/s) | fraction of peak | vs 1 device | XLA memory, all devices (GiB) | peak RSS (MB) |
|---|---|---|---|---|---|---|---|---|---|---|---|---|"""]
    for label, x in r["runs"].items():
        mem = _gib(x["xla_bytes_all_devices"]) if "xla_bytes_all_devices" in x else "-"
        head = f"| {label} | {x['devices']} | {x.get('compile_s', 0):.1f} |"
        if "skipped" in x:
            lines.append(f"{head} {x['skipped']} | | | | | | | | {mem} | "
                         f"{x.get('peak_rss_mb', 0):.0f} |")
            continue
        s, t = x["step_s"], x["tokens_per_s"]
        vs = f"{x['speed_vs_1_device']:.2f}x" if "speed_vs_1_device" in x else "1.00x"
        second = f"{x['second_step_s']:.1f}" if "second_step_s" in x else "-"
        lines.append(f"{head} {x['first_step_s']:.1f} | {second} | {s['median']:.2f} "
                     f"({s['min']:.2f}-{s['max']:.2f}) | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})"
                     f" | {x['model_flops_per_s'] / 1e9:.1f} | {x['matmul_peak_flops_per_s'] / 1e9:.1f} "
                     f"| {x['fraction_of_peak'] * 100:.0f}% | {vs} | {mem} | {x['peak_rss_mb']:.0f} |")
    prof = r["runs"].get("1x1x1", {}).get("profile")
    if prof:
        lines += ["", "Where one 1-device step's time goes (jax.profiler; XLA op time summed over "
                  f"threads: {prof['op_time_s']:.1f} s in a {prof['wall_s']:.1f} s step; an op is a "
                  "matmul when its optimized-HLO instruction is a dot or a fusion holding one): "
                  + ", ".join(f"{k} {v * 100:.0f}%" for k, v in prof["by_kind"].items())
                  + ". Top ops:", "",
                  "| XLA op | kind | output shape | from (jax op) | ms | calls | share |",
                  "|---|---|---|---|---|---|---|"]
        for o in prof["top_ops"]:
            lines.append(f"| `{o['op']}` | {o['kind']} | `{o.get('shape', '')}` | {o.get('source', '')} "
                         f"| {o['ms']:.0f} | {o['calls']} | {o['share'] * 100:.1f}% |")
    lines += ["", "Collectives in each mesh's compiled step (optimized HLO instructions): " + "; ".join(
        f"{label}: " + ", ".join(f"{k} {v}" for k, v in x["collectives"].items() if v)
        for label, x in r["runs"].items() if x.get("collectives") and any(x["collectives"].values()))
        + "."]
    lines += _mesh_notes(r, res["machine"]["nproc"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
