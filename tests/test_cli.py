"""The supo-jax command line: real commands on a tiny model, one-line errors on bad input."""
import subprocess
import sys

import numpy as np

import supo_jax
from supo_jax.cli import main
from supo_jax.model.tiny import tiny_tokenizer
from tests.helpers import make_hf_model


def test_generate_and_export(tmp_path):
    src = tmp_path / "m"
    make_hf_model("qwen2_bias_gqa", str(src))
    tiny_tokenizer(str(src))
    assert main(["generate", "--model", str(src), "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out")]) == 0
    a, b = supo_jax.load_policy(str(src)), supo_jax.load_policy(str(tmp_path / "out"))
    assert b.tokenizer is not None
    ids = np.arange(10)[None]
    np.testing.assert_allclose(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)), atol=1e-6)


def test_missing_model_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "export", "--model",
                        str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and lines[0].startswith("supo-jax export: error:")
