"""experiments/suite_compiles.py: the hook records each process's compiles by function, the
persistent cache's hits and writes, and the summary adds them up by kind of process."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import suite_compiles  # noqa: E402

PROGRAM = """
import jax, jax.numpy as jnp
f = jax.jit(lambda x: x * 2 + 1)
f(jnp.arange(5.0)); f(jnp.arange(5.0)); f(jnp.arange(6.0))
"""


def test_the_hook_counts_each_processs_compiles_and_cache_use(tmp_path):
    hook = os.path.dirname(suite_compiles.install(str(tmp_path / "hook")))
    log, cache = tmp_path / "log", tmp_path / "cache"
    env = dict(os.environ, SUPO_JAX_COMPILE_LOG=str(log), PYTHONPATH=hook, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    for _ in range(2):        # the second process finds the first one's programs in the cache
        subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True)
    subprocess.run([sys.executable, "-c", "print(1)"], env=dict(env, SUPO_JAX_COMPILE_LOG=""),
                   check=True)                     # unset: no record
    recs = [json.load(open(log / f)) for f in sorted(os.listdir(log))]
    assert len(recs) == 2
    for r in recs:
        lam = r["by_function"]["jit(<lambda>)"]
        assert lam[0] == 2 and lam[1] > 0          # two shapes, two compiles; the repeat none
        assert r["compiles"] >= 2 and r["compile_s"] > 0 and r["argv"][0] == "-c"
    assert sorted((r["hits"] > 0, r["writes"] > 0) for r in recs) == [(False, True), (True, False)]
    res = suite_compiles.summarize(str(log))
    assert res["total"]["processes"] == 2
    assert res["by_kind"]["python -c"]["compiles"] == sum(r["compiles"] for r in recs)
    assert res["by_function"]["jit(<lambda>)"]["compiles"] == 4
    assert "| 2 | python -c |" in suite_compiles.table(res)
    assert suite_compiles.main(["summarize", str(log), "--jsonl", str(tmp_path / "r.jsonl")]) == 0
    assert suite_compiles.summarize(str(tmp_path / "r.jsonl")) == res


def test_kinds_of_process():
    k = suite_compiles.kind
    assert k({"argv": ["-c"], "worker": "gw0", "pytest": True}) == "pytest worker"
    assert k({"argv": ["-c"], "worker": "gw0", "pytest": False}) == "python -c"   # its child
    assert k({"argv": ["/x/venv/bin/supo-jax", "train", "--set", "a=b"]}) == "supo-jax train"
    assert k({"argv": ["/r/supo_jax/cli.py", "eval", "--config", "c"]}) == "supo-jax eval"
    assert k({"argv": ["/r/benchmarks/rows.py", "--smoke"]}) == "benchmarks/rows"
    assert k({"argv": ["/v/ipykernel_launcher.py", "-f", "k.json"]}) == "notebook kernel"
