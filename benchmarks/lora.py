"""LoRA adapters vs full training: train-step memory and time, and decode with the adapters'
low-rank product vs merged weights, at the same shapes (supo_jax.model.lora).

Model: a random qwen2-family config (hidden 512, 4 layers, 8 / 4 heads, MLP 1536, vocab
8192, float32). Train step: 4 rows x 512 tokens, AdamW, for every parameter trained
("full"), rank-16 adapters on all seven projections ("lora") and the same on an int8 base
("qlora"): XLA's compiled memory (arguments + outputs - aliased + temporaries), the
optimizer state's bytes, the trained parameters, and the median time of a step. Decode:
8 rows, 64-token prompts, 64 new tokens (greedy) from the adapted policy, with the low-rank
product in every projection of every step against the adapters merged into the sampler's
per-layer copy of the weights (what it does by default): the time of a generation (sampler
set-up included) and the ratio.

    python benchmarks/lora.py                 # writes results/lora.json
"""
from __future__ import annotations

import time

import common


def build(mode: str, smoke: bool):
    import jax.numpy as jnp

    from supo_jax.model.lora import LoRA, add_adapters
    from supo_jax.model.policy import new_policy
    from supo_jax.model.tiny import tiny_config

    hidden, layers = (128, 2) if smoke else (512, 4)
    mc = tiny_config("qwen2", vocab_size=8192, hidden=hidden, layers=layers, heads=8, kv_heads=4,
                     mlp=3 * hidden)
    policy = new_policy(mc, seed=0)
    if mode != "full":
        add_adapters(policy.model, LoRA(16, 32.0, ("q", "k", "v", "o", "gate", "up", "down")),
                     base_dtype="int8" if mode == "qlora" else "", seed=1)
        for name in ("wq", "wv", "w_up"):       # non-zero adapters (B starts at zero)
            b = getattr(policy.model.layers, f"{name}_lora_b")
            b[...] = jnp.full(b.shape, 0.01, jnp.float32)
    return policy


def train_figures(mode: str, rows: int, t: int, repeats: int, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from supo_jax.rl.batch import TrainBatch
    from supo_jax.rl.configs import LossConfig
    from supo_jax.rl.train_step import make_optimizer, train_step, trainable

    policy = build(mode, smoke)
    graphdef, params = policy.split()
    tx = make_optimizer(1e-4)
    opt_state = tx.init(trainable(params))
    rng = np.random.RandomState(0)
    toks = jnp.asarray(rng.randint(0, policy.config.vocab_size, (rows, t)), jnp.int32)
    f = jnp.ones((rows, t), jnp.float32)
    batch = TrainBatch(inputs=toks, targets=toks, positions=jnp.tile(jnp.arange(t), (rows, 1)),
                       segment_ids=jnp.ones((rows, t), jnp.int32), mask=f, old_logp=-5 * f,
                       advantages=f)
    cfg = LossConfig()
    compiled = train_step.lower(graphdef, params, opt_state, batch, tx=tx, cfg=cfg).compile()
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    state = {"params": params, "opt": opt_state}

    def step():
        p, o, m = train_step(graphdef, state["params"], state["opt"], batch, tx=tx, cfg=cfg)
        jax.block_until_ready(m["loss"])
        state["params"], state["opt"] = p, o

    times = common.warm_times(step, repeats)
    nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
    return {"mode": mode, "params": int(sum(x.size for x in jax.tree.leaves(params))),
            "trained_params": int(sum(x.size for x in jax.tree.leaves(trainable(params)))),
            "param_bytes": nbytes(params), "opt_state_bytes": nbytes(opt_state),
            "compiled_total_bytes": int(total), "temp_bytes": int(mem.temp_size_in_bytes),
            "step_seconds": common.stats(times)}


def decode_figures(repeats: int, smoke: bool) -> dict:
    """Generation time of the adapted policy with the adapters' product in the decode vs
    merged into the decode's per-layer copy of the weights (Sampler(merge_adapters=))."""
    import jax
    import numpy as np

    from supo_jax.sampling.sampler import Sampler, SamplingParams

    policy = build("lora", smoke)
    prompts = np.random.RandomState(0).randint(0, policy.config.vocab_size, (8, 64)).tolist()
    out = {}
    for name, merge in (("adapters", False), ("merged", True)):
        res = {}

        def gen():
            s = Sampler(policy, len(prompts), 128, unroll_layers=True, merge_adapters=merge)
            s.append(dict(enumerate(prompts)))
            g = s.generate(range(len(prompts)), 64, set(), SamplingParams(0.0),
                           jax.random.key(0))
            res["tokens"] = [g[i].tokens for i in range(len(prompts))]

        out[name] = common.stats(common.warm_times(gen, repeats))
        out[name + "_tokens"] = res["tokens"]
    out["same_tokens"] = out.pop("adapters_tokens") == out.pop("merged_tokens")
    out["ratio_adapters_over_merged"] = out["adapters"]["median"] / out["merged"]["median"]
    return out


def main(argv=None):
    p = common.parser(__doc__)
    args = p.parse_args(argv)
    run = common.Run("lora", args, argv)
    repeats = args.repeats or (1 if args.smoke else 5)
    rows, t = (2, 64) if args.smoke else (4, 512)
    train = []
    for mode in ("full", "lora", "qlora"):
        t0 = time.perf_counter()
        train.append(train_figures(mode, rows, t, repeats, args.smoke))
        x = train[-1]
        print(f"{mode}: trained {x['trained_params'] / 1e6:.2f}M of {x['params'] / 1e6:.2f}M, "
              f"compiled {x['compiled_total_bytes'] / 2**20:.0f} MiB, opt state "
              f"{x['opt_state_bytes'] / 2**20:.1f} MiB, step {x['step_seconds']['median']:.3f} s "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    dec = decode_figures(repeats, args.smoke)
    print(f"decode: adapters {dec['adapters']['median']:.3f} s, merged "
          f"{dec['merged']['median']:.3f} s (ratio {dec['ratio_adapters_over_merged']:.2f}; same "
          f"tokens: {dec['same_tokens']})", flush=True)
    run.write({"rows": rows, "tokens": t, "train": train, "decode": dec, "targets": []})


def markdown(res: dict) -> str:
    r = res["results"]
    mib = lambda b: f"{b / 2**20:.1f}"
    out = [f"One train step on {r['rows']} x {r['tokens']} tokens (CPU, float32 master weights; "
           "rank-16 adapters, alpha 32, on all seven projections):", "",
           "| trained | parameters trained | all parameters (MiB) | optimizer state (MiB) | "
           "compiled step (MiB) | step (s, median) |", "|---|---|---|---|---|---|"]
    names = {"full": "every parameter", "lora": "LoRA adapters", "qlora": "LoRA, int8 base"}
    for x in r["train"]:
        out.append(f"| {names[x['mode']]} | {x['trained_params'] / 1e6:.2f}M of "
                   f"{x['params'] / 1e6:.2f}M | {mib(x['param_bytes'])} | "
                   f"{mib(x['opt_state_bytes'])} | {mib(x['compiled_total_bytes'])} | "
                   f"{x['step_seconds']['median']:.3f} |")
    d = r["decode"]
    out += ["", f"Decode (8 rows, 64 new tokens): with the adapters' low-rank product "
            f"{d['adapters']['median']:.3f} s, with them merged into the weights "
            f"{d['merged']['median']:.3f} s (ratio {d['ratio_adapters_over_merged']:.2f}; the "
            f"same tokens: {d['same_tokens']}). The sampler merges them where weights and "
            "compute are float32 (as here): the unrolled decode (CPU, GPU) cuts a per-layer copy "
            "of the weights once per rollout phase anyway, and the adapters are merged into it; "
            "bfloat16 (the merge would round small updates away), an int8 base and TPU's "
            "scanned decode (no copy) keep the product."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
