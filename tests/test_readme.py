"""The README's Public API code blocks run as written, in order, on a tiny random policy
(tests/test_byo_env.py runs the environment example and its train command; test_reproduce.py
keeps the Results block; test_cli.py the commands' flags)."""
import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
API = README.split("## Public API", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", API, re.S)


def test_public_api_blocks_run_as_written(tmp_path, monkeypatch):
    from supo_jax.model.policy import new_policy
    from supo_jax.model.tiny import tiny_config, tiny_tokenizer

    assert len(BLOCKS) == 2
    tok = tiny_tokenizer()
    path = str(tmp_path / "tiny")
    new_policy(tiny_config("qwen2", vocab_size=len(tok)), seed=0, tokenizer=tok).save_pretrained(path)
    # what the blocks leave to the reader: a checkpoint, token ids
    ns = {"path": path, "input_ids": np.array([[1, 2, 3, 4]], np.int32),
          "ids_a": [5, 6, 7], "ids_b": [8, 9], "out_dir": str(tmp_path / "export")}
    monkeypatch.chdir(tmp_path)      # runs/ and out/ go here; the config path is the repo's
    os.symlink(os.path.join(ROOT, "experiments"), tmp_path / "experiments")
    exec(compile(BLOCKS[0], "README public API", "exec"), ns)
    assert ns["logits"].shape == (1, 4, len(tok)) and ns["logits"].dtype == np.float32
    assert len(ns["outs"]) == 2 and len(ns["outs"][0].tokens) == len(ns["outs"][0].logprobs) <= 32
    assert os.path.isfile(os.path.join(ns["out_dir"], "config.json"))
    exec(compile(BLOCKS[1], "README rollouts and training", "exec"), ns)
    assert len(ns["rollouts"]) == 16 and all(r.reason for r in ns["rollouts"])
    assert "success_rate" in ns["result"]["eval"]
    assert os.path.isfile(os.path.join(tmp_path, "runs", "x", "metrics.jsonl"))
    assert os.path.isfile(os.path.join(tmp_path, "out", "config.json"))
