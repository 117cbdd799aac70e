"""How far supo_jax's chunked entropy and the direct sum are from a float64 reference, at the
LLVM level XLA_FLAGS sets (tests/test_attention.py's shapes). Appends a line to
entropy_check.jsonl beside it:

XLA_FLAGS=--xla_backend_optimization_level=1 python .../entropy_check.py
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from supo_jax.model.decoder import chunked_logprobs

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(ks[0], (3, 7, 8))
    head = jax.random.normal(ks[1], (8, 50))
    y = jax.random.randint(ks[2], (3, 7), 0, 50)
    ent = np.asarray(chunked_logprobs(x, head, y, 0.7, chunk=4, entropy_grad=True)[1])
    lp32 = jax.nn.log_softmax(x @ head / 0.7, -1)
    direct = np.asarray(-jnp.sum(jnp.exp(lp32) * lp32, -1))
    z = np.asarray(x, np.float64) @ np.asarray(head, np.float64) / 0.7
    lp = z - z.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    ref = -(np.exp(lp) * lp).sum(-1)
    row = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
           "chunked_max_abs_err": float(np.abs(ent - ref).max()),
           "direct_max_abs_err": float(np.abs(direct - ref).max())}
    with open(os.path.join(HERE, "entropy_check.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


if __name__ == "__main__":
    main()
