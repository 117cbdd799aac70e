"""Does the decode's HBM traffic depend on whether the KV cache's length is a multiple of the
TPU's tile? One setup of benchmarks/tpu_plan.py, its decode program alone compiled for one
slice (verified by compilation, no TPU) at cache lengths of the row bound as it is, and
rounded up to multiples of 128 and 512 (supo_jax.plan.row_bound patched for the run).

    python experiments/cache_alignment.py --setup 8b --topology v6e-8 \\
        --out experiments/results/decode_cache_alignment/8b_v6e-8.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default="8b", help="a setup of benchmarks/tpu_plan.py")
    ap.add_argument("--topology", default="v6e-8")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import tpu_plan as T

    import supo_jax.plan as P
    import supo_jax.sampling.sampler as sampler
    from supo_jax.config import load_config
    from supo_jax.utils import provenance

    what, config, model, sets, _ = T.SETUPS[args.setup]
    cfg = load_config(os.path.join(T.CONFIGS, config), sets)
    sets = sets + T.fit_batch(cfg, len(P.tpu_devices(args.topology)))
    cfg = load_config(os.path.join(T.CONFIGS, config), sets)
    bound, row_bound = P.row_bound(cfg), P.row_bound
    rounding = sampler.cache_length
    out = {"setup": what, "topology": args.topology, "overrides": sets, "row_bound": bound,
           "provenance": provenance(), "cache_lengths": {}}
    try:
        sampler.cache_length = lambda n: n          # the cache exactly as long as asked
        for length in (bound, -(-bound // 128) * 128, -(-bound // 512) * 512):
            P.row_bound = lambda c, n=length: n
            rep = P.plan(cfg, args.topology, model_config=os.path.join(T.MODELS, model),
                         programs=("decode",), search_rows=False)
            d, s = rep["programs"]["decode"], rep["shapes"]
            out["cache_lengths"][length] = {
                "hbm_bytes_per_chip": d["hbm_bytes_per_chip"], "bound": d["bound"],
                "estimated_seconds": d["estimated_seconds"], "steps": s["decode_steps"],
                "cache_bytes": s["cache_bytes"],
                "over_hbm_roofline": rep["estimates"]["decode_over_roofline"]}
            print(length, out["cache_lengths"][length], flush=True)
    finally:
        P.row_bound, sampler.cache_length = row_bound, rounding
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
