"""Train-step memory vs row length: XLA's compiled memory of one SUPO step on one long row.

Model: a random qwen2-family config, 4 layers, hidden 256, 4 / 2 heads, MLP 1024, vocab
32000, float32 (no weights are allocated: the step is lowered from abstract shapes and
compiled, and `compiled.memory_analysis()` gives its buffers). Batch: 1 row of T tokens.
For each T the training path with its defaults (model.attention / remat "auto", the LM
head in chunks of loss.logit_chunk tokens), the same with remat "full", and, up to
--plain-max, the plain path (every T x T score and the full [T, V] float32 logits, no
remat) are compiled. Reported per T: temp bytes (XLA's scratch: activations kept for the backward and
the largest intermediates), total = temp + arguments + outputs - aliased, the growth from
the previous T, and one [T, V] float32 tensor for scale.

    python benchmarks/train_memory.py          # T = 8K .. 64K; writes results/train_memory.json
"""
from __future__ import annotations

import time

import common

TARGET_GROWTH = 1.3      # memory(2T) <= 1.3 x 2 x memory(T)


MODES = {"auto": {}, "full": {"remat": "full"}, "plain": {"attention": "xla", "remat": "none"}}


def step_memory(t: int, mode: str = "auto", *, rows: int = 1, layers: int = 4, hidden: int = 256,
                vocab: int = 32000, chunk: int = 1024) -> dict:
    """Compiled memory of one train step on `rows` x t tokens (nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from supo_jax.model.decoder import Decoder
    from supo_jax.model.tiny import tiny_config
    from supo_jax.rl.batch import TrainBatch
    from supo_jax.rl.train_step import LossConfig, make_optimizer, train_step

    cfg = tiny_config("qwen2", vocab_size=vocab, hidden=hidden, layers=layers, heads=4,
                      kv_heads=2, mlp=4 * hidden)
    opts = MODES[mode]
    plain = mode == "plain"
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), **opts)))
    tx = make_optimizer(1e-5)
    opt_state = jax.eval_shape(tx.init, params)
    i32, f32 = jax.ShapeDtypeStruct((rows, t), jnp.int32), jax.ShapeDtypeStruct((rows, t), jnp.float32)
    batch = TrainBatch(i32, i32, i32, i32, f32, f32, f32)
    loss_cfg = LossConfig(logit_chunk=rows * t if plain else chunk)
    t0 = time.perf_counter()
    compiled = train_step.lower(graphdef, params, opt_state, batch, tx=tx, cfg=loss_cfg).compile()
    mem = compiled.memory_analysis()
    total = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)
    remat = Decoder(cfg, rngs=nnx.Rngs(0), **opts).remat_mode(rows * t)
    return {"tokens": t, "remat": remat, "temp_bytes": int(mem.temp_size_in_bytes), "total_bytes": int(total),
            "logits_bytes": rows * t * vocab * 4, "compile_s": time.perf_counter() - t0}


def growth(rows: list[dict], key: str = "total_bytes") -> list[float]:
    """memory(T_i) / memory(T_{i-1}) / (T_i / T_{i-1}): 1.0 = exactly linear."""
    return [(b[key] / a[key]) / (b["tokens"] / a["tokens"]) for a, b in zip(rows, rows[1:])]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--lengths", default="8192,16384,32768,65536")
    p.add_argument("--plain-max", type=int, default=16384,
                   help="longest T at which the plain path is compiled too")
    args = p.parse_args(argv)
    run = common.Run("train_memory", args, argv)
    lengths = [1024, 2048] if args.smoke else [int(x) for x in args.lengths.split(",")]
    size = {"layers": 1, "hidden": 64, "vocab": 4096} if args.smoke else {}   # compiles faster
    res = {m: [] for m in MODES}
    res["target_growth"] = TARGET_GROWTH
    for t in lengths:
        for mode in MODES:
            if mode == "plain" and t > args.plain_max:
                continue
            r = step_memory(t, mode, **size)
            res[mode].append(r)
            print(f"T={t:6d} {mode:5s} (remat {r['remat']:4s}): temp {r['temp_bytes'] / 2**30:6.2f} GiB, "
                  f"total {r['total_bytes'] / 2**30:6.2f} GiB ([T, V] f32: "
                  f"{r['logits_bytes'] / 2**30:.2f} GiB)", flush=True)
    res["growth"] = {m: growth(res[m]) for m in MODES}
    cur = [x for x in res["auto"] if x["tokens"] >= 16384]
    res["targets"] = []                  # judged from 16K tokens on (none at --smoke sizes)
    if len(cur) >= 2:
        g = growth(cur[:2])[0]
        res["targets"] = [
            {"what": f"train-step memory growth {cur[0]['tokens']} -> {cur[1]['tokens']} tokens "
                     "(over linear, defaults)", "target": f"<= {TARGET_GROWTH}x",
             "measured": f"{g:.2f}x", "met": g <= TARGET_GROWTH},
            {"what": f"train-step memory at {cur[1]['tokens']} tokens vs one [T, V] float32 tensor",
             "target": "below", "measured": f"{cur[1]['total_bytes'] / 2**30:.2f} vs "
             f"{cur[1]['logits_bytes'] / 2**30:.2f} GiB",
             "met": cur[1]["total_bytes"] < cur[1]["logits_bytes"]}]
    for m in MODES:
        print(f"{m}: memory growth per doubling of T over linear:",
              ", ".join(f"{g:.2f}" for g in res["growth"][m]))
    run.write(res)


def markdown(res: dict) -> str:
    r = res["results"]
    by_t = {m: {x["tokens"]: x for x in r[m]} for m in MODES}
    gib = lambda x: "-" if x is None else f"{x['total_bytes'] / 2**30:.2f}"
    out = [f"Target: memory(2T) <= {r['target_growth']} x 2 x memory(T), below one [T, V] float32 "
           "tensor (no logits held).", "",
           "| T | auto: remat | auto: total (GiB) | full remat: total (GiB) | plain path: total (GiB) "
           "| one [T, V] f32 (GiB) |", "|---|---|---|---|---|---|"]
    for t, x in by_t["auto"].items():
        out.append(f"| {t} | {x['remat']} | {gib(x)} | {gib(by_t['full'].get(t))} | "
                   f"{gib(by_t['plain'].get(t))} | {x['logits_bytes'] / 2**30:.2f} |")
    out.append("")
    out.append("Growth per doubling over linear: " + "; ".join(
        f"{m} {', '.join(f'{g:.2f}' for g in r['growth'][m])}" for m in MODES if r["growth"][m]))
    return "\n".join(out)


if __name__ == "__main__":
    main()
