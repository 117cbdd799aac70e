"""CPU attention: xla against blockwise (blocks of 32-512), forward and backward, one core.

The shapes of the CPU recipe's training rows (8 rows, 4 query / 2 key-value heads of 16
dimensions) at row lengths T; each program compiled first, then the best of --repeats
calls. What supo_jax.model.attention.resolve's CPU threshold and block rest on.

    taskset -c 0 python experiments/cpu_attention.py --out experiments/results/cpu_attention_2026-12-06
"""
import argparse
import json
import os
import time


def best_ms(fn, args, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="128,256,448,1024,2048")
    p.add_argument("--blocks", default="32,64,128,512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from supo_jax.model.attention import causal_attention

    B, H, K, D = 8, 4, 2, 16
    rng = np.random.default_rng(0)
    rows = []
    for t in (int(x) for x in args.lengths.split(",")):
        q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((B, K, t, D)), jnp.float32) for _ in range(2))
        qi = jnp.tile(jnp.arange(t), (B, 1))
        seg = jnp.ones((B, t), jnp.int32)
        row = {"tokens": t}
        for name, impl, block in [("xla", "xla", None)] + [
                (f"blockwise_{b}", "blockwise", int(b)) for b in args.blocks.split(",")]:
            loss = (lambda impl, block: lambda q, k, v: causal_attention(
                q, k, v, qi, seg, impl=impl, block_q=block, block_k=block).sum())(impl, block)
            row[name] = {"forward_ms": best_ms(jax.jit(loss), (q, k, v), args.repeats),
                         "forward_backward_ms": best_ms(
                             jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), args.repeats)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"shape": {"rows": B, "heads": H, "kv_heads": K, "head_dim": D},
                   "repeats": args.repeats, "cpus": len(os.sched_getaffinity(0)),
                   "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
