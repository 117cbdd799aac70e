"""Memory guard: the TPU programs' bytes a chip at a committed setup, scaled to compile in
seconds, so that a change of the program that grows its memory is seen in the suite
(tests/test_memory_guard.py), not months later at a real model's shapes.

Each guard is a committed plan setup (benchmarks/tpu_plan.py's) with a narrow, shallow model
of the same vocabulary and the config's own rows, row length and cache: what grows with the
program's structure (logits chunks, gathered weights, the update's buffers, the KV cache)
grows here too. `plan()` compiles each program for the slice (libtpu on the CPU, no TPU) and
XLA's buffer assignment gives its bytes a chip.

    python benchmarks/memory_guard.py            # compile and compare with the committed figures
    python benchmarks/memory_guard.py --update   # write benchmarks/results/memory_guard.json

A program whose total grows by more than TOLERANCE over the committed figure fails the test;
a change that means it (a new buffer on purpose) updates the figures in the same commit.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "memory_guard.json")
TOLERANCE = 0.05
PROGRAMS = ("train_step", "prefill", "decode")

# name -> (config, topology, the scaled model: Llama-3.1-8B's vocabulary, 2 narrow layers)
GUARDS = {
    "paper-8b_v5litepod-16": (
        "experiments/configs/paper_fncall_supo.py", "v5litepod-16",
        dict(family="llama3", vocab_size=128256, hidden=256, layers=2, heads=4, kv_heads=2,
             mlp=896)),
}


def measure(name: str) -> dict:
    """{program: total bytes a chip} of one guard, compiled now."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from supo_jax.config import load_config
    from supo_jax.model.tiny import tiny_config
    from supo_jax.plan import plan

    config, topology, shape = GUARDS[name]
    shape = dict(shape)
    family = shape.pop("family")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(tiny_config(family, tie=False, **shape).to_hf_dict(), f)
        rep = plan(load_config(os.path.join(REPO, config), []), topology, model_config=d,
                   programs=PROGRAMS, search_rows=False)   # the config's own rows, always
    out = {}
    for p in PROGRAMS:
        prog = rep["programs"][p]
        if "error" in prog:
            raise RuntimeError(f"{name}: {p} does not compile: {prog['error']}")
        out[p] = int(prog["bytes_per_chip"]["total"])
    return out


def committed() -> dict:
    with open(RESULTS) as f:
        return json.load(f)["guards"]


def grown(name: str, now: dict, then: dict) -> list[str]:
    """One line for each program of `name` whose bytes grew past TOLERANCE."""
    return [f"{name}: {p} needs {now[p] / 2**20:.1f} MiB a chip, {now[p] / then[p] - 1:+.1%} "
            f"over the committed {then[p] / 2**20:.1f} MiB (if meant: python "
            f"benchmarks/memory_guard.py --update)"
            for p in PROGRAMS if now[p] > then[p] * (1 + TOLERANCE)]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true", help="write the figures measured now")
    args = ap.parse_args(argv)
    now = {name: measure(name) for name in GUARDS}
    for name, progs in now.items():
        print(name, ", ".join(f"{p} {b / 2**20:.1f} MiB" for p, b in progs.items()), flush=True)
    if args.update:
        with open(RESULTS, "w") as f:
            json.dump({"tolerance": TOLERANCE, "guards": now}, f, indent=1)
            f.write("\n")
        print(f"wrote {RESULTS}")
        return 0
    bad = [line for name in GUARDS for line in grown(name, now[name], committed()[name])]
    print("\n".join(bad) or "no program grew past the tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
