"""Tiny random transformers models saved to disk: the reference for parity tests."""
import math

import numpy as np
import torch
import transformers

from supo_jax.model.tiny import tiny_config

FAMILIES = {
    # name: (tiny family, overrides)
    "qwen2_bias_gqa": ("qwen2", dict(tie=False)),
    "qwen3_qknorm_tied": ("qwen3", dict(tie=True)),
    "llama3_ropescaling_tied": ("llama3", dict(tie=True)),
    "llama_mha_untied": ("smollm", dict(tie=False, kv_heads=4)),
    "mistral_headdim": ("mistral", dict(tie=False)),
    "seed_oss_qkvbias": ("seed_oss", dict(tie=False)),
    "smollm3_nope_tied": ("smollm3", dict(layers=4)),
    "qwen2_yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 1024})),
    "qwen3_linear_rope": ("qwen3", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def make_hf_model(name: str, out_dir: str, seed: int = 0, scale: float = 0.25, vocab: int = 528):
    """Save a random transformers model of the named family; weights scaled so logits are spread."""
    family, kw = FAMILIES[name]
    cfg = tiny_config(family, vocab_size=vocab, **kw)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, scale)
    model.save_pretrained(out_dir)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()


LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\n\nTools:\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


def llama3_style_tokenizer():
    """The tiny BPE with a Llama-3-style template (header tokens, <|eot_id|>, ipython role)."""
    from supo_jax.model.tiny import tiny_tokenizer
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def flat_params(pure: dict) -> dict:
    """A nested pure-dict of parameters as {'layers.wq': np.ndarray, ...}."""
    out = {}
    for k, v in pure.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in flat_params(v).items()})
        else:
            out[k] = np.asarray(v)
    return out


def same_run(a, b):
    """Two runs' metrics rows agree: the same steps, keys, counts and rates; float figures to
    rounding. Rows advance independently (rollout driver), so the batch in which a token's
    logprob is computed depends on when the tools return: the tokens do not (each rollout
    draws from its own stream), the last bits of its logprobs do (approx_kl ~1e-14 on the
    first update came out 4.83e-14 in one run and 4.88e-14 in another)."""
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            u, v = x[k], y[k]
            if isinstance(u, float) and isinstance(v, float):
                assert math.isclose(u, v, rel_tol=1e-5, abs_tol=1e-9), (x.get("step"), k, u, v)
            else:
                assert u == v, (x.get("step"), k, u, v)


def same_rollouts(a, b, path="rollouts"):
    """Two runs' rollouts (to_json()) agree: tokens, masks, counts and rewards exactly; float
    figures (logprobs) to rounding, for the reason same_run gives."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, a.keys(), b.keys())
        for k in a:
            same_rollouts(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (u, v) in enumerate(zip(a, b)):
            same_rollouts(u, v, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def wait_while_running(proc, done, timeout: float = 300) -> None:
    """Poll done() every 50 ms until it holds, `proc` (a Popen) exits, or `timeout` seconds
    pass; the caller asserts which of them happened."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None and not done():
        time.sleep(0.05)


def train_through_bridge(python: str, tmp_path, config: str, sets) -> tuple[str, list, str]:
    """`supo-jax train --config CONFIG` with `sets`, its external harness's bridge run by the
    harnesses' venv `python` (the run's working directory tmp_path, the bridge's log of
    sessions SUPO_JAX_VERIFIERS_LOG): (its stdout, its metrics rows, the log's path), the run
    checked to have taken 2 steps through the sessions, none rewritten."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "bridge.jsonl")
    cmd = [sys.executable, "-m", "supo_jax.cli", "train", "--config", config,
           "--set", f"env.harness_python={python}", "--set", f"train.run_dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, SUPO_JAX_VERIFIERS_LOG=log,
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(x) for x in f if x.strip()]
    rows = [x for x in metrics if "loss" in x]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(math.isfinite(x["loss"]) for x in rows)
    assert all(x["harness_requests"] > 0 and x["harness_rewritten"] == 0 for x in rows)
    return r.stdout, metrics, log
