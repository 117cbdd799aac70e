"""google-tunix's sampler on a supo_jax safetensors export: the tunix side of sampler.py.

Runs in its own virtual environment (benchmarks/.tunix-venv, built by sampler.py: tunix
pins an older safetensors than supo_jax), never in supo_jax's. It builds tunix's llama3
model (tunix.models.llama3) from the export's config.json, loads the export's safetensors
with tunix's own loader (numpy, no hub access), and times tunix's `Sampler`
(tunix.generate.sampler): greedy, no stop token, exactly --new-tokens new tokens per row,
the same prompt ids in every row. One measurement = one whole `Sampler.__call__` (KV cache
allocation + prefill + decode loop + tokens back on the host), timed here.

tunix 0.1.7's llama3 attention calls `apply_rope` without the config's `rope_theta`, so
every llama3 model gets RoPE base 1e6 (SmolLM2: 1e5, Llama 3: 5e5). By default the worker
binds the config's rope_theta to tunix's own `apply_rope` (a functools.partial, no tunix
code copied) before anything is traced; --no-rope-fix measures tunix as shipped.

Batch mode (prints one JSON object on stdout):

    .tunix-venv/bin/python benchmarks/tunix_worker.py EXPORT_DIR --prompt 1,2,3 \\
        --batches 1,8 --new-tokens 128 --repeats 3 --cache-size 256
    -> {"versions": {...}, "rope_fix": true, "runs": [{"batch": 1, "first_s": ..,
        "warm_s": [..], "tokens": [[..], ..]}, ...]}

Serve mode (--serve): prints {"ready": true, "versions": ...} once the model is loaded, then
answers each stdin line {"batch": B} with one line {"batch": B, "seconds": s, "tokens": [..]},
so sampler.py can alternate tunix calls with supo_jax and transformers calls.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402


class IdsTokenizer:
    """The tokenizer interface tunix's TokenizerAdapter accepts (encode, decode, bos_id,
    eos_id, pad_id): a "prompt string" is the prompt's token ids separated by spaces, so the
    sampler sees exactly the ids supo_jax and transformers get. No BOS is added (bos_id None).
    pad -1 never matches a real token (tunix masks every pad-id token in the buffer out of
    attention), and -1 as the eos never stops a row, so every row gets the full budget."""

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return ""

    def bos_id(self):
        return None

    def eos_id(self):
        return -1

    def pad_id(self):
        return -1


def versions() -> dict:
    from importlib import metadata

    out = {}
    for d in ("google-tunix", "jax", "jaxlib", "flax", "safetensors", "transformers", "numpy",
              "qwix"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def load_model(export_dir: str, rope_fix: bool):
    import jax.numpy as jnp
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params

    with open(os.path.join(export_dir, "config.json")) as f:
        hf = json.load(f)
    if hf.get("model_type") != "llama":
        raise SystemExit(f"tunix_worker: model_type {hf.get('model_type')!r} is not llama")
    heads = hf["num_attention_heads"]
    cfg = llama3.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"], num_heads=heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_kv_heads=hf.get("num_key_value_heads", heads), rope_theta=hf["rope_theta"],
        norm_eps=hf["rms_norm_eps"], weight_tying=bool(hf.get("tie_word_embeddings", False)))
    if rope_fix:
        # Attention.block looks `apply_rope` up in the module at trace time.
        llama3.apply_rope = functools.partial(llama3.apply_rope, rope_theta=cfg.rope_theta)
    model = llama3_params.create_model_from_safe_tensors(export_dir, cfg, mesh=None,
                                                         dtype=jnp.float32)
    return model, cfg


class Runner:
    def __init__(self, export_dir, prompt, new_tokens, cache_size, rope_fix):
        from tunix.generate import sampler as tunix_sampler

        self.model, cfg = load_model(export_dir, rope_fix)
        self.prompt_text = " ".join(str(t) for t in prompt)
        self.prompt_len, self.new_tokens = len(prompt), new_tokens
        if cache_size < self.prompt_len + new_tokens:
            raise SystemExit(f"tunix_worker: cache size {cache_size} < prompt + new tokens")
        self.sampler = tunix_sampler.Sampler(
            self.model, IdsTokenizer(),
            tunix_sampler.CacheConfig(cache_size=cache_size, num_layers=cfg.num_layers,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))

    def call(self, batch: int):
        """One whole generation call: (seconds, tokens [batch, new_tokens])."""
        t0 = time.perf_counter()
        out = self.sampler([self.prompt_text] * batch, max_generation_steps=self.new_tokens,
                           max_prompt_length=self.prompt_len, temperature=0.0,
                           eos_tokens=[-1])
        toks = np.stack([np.asarray(t) for t in out.tokens])
        dt = time.perf_counter() - t0
        assert toks.shape == (batch, self.new_tokens), toks.shape
        return dt, toks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", help="safetensors + config.json (supo_jax save_pretrained)")
    ap.add_argument("--prompt", required=True, help="prompt token ids, comma-separated")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-size", type=int, default=256,
                    help="tunix CacheConfig.cache_size (>= prompt + new tokens)")
    ap.add_argument("--no-rope-fix", action="store_true",
                    help="run tunix's llama3 as shipped (RoPE base 1e6 whatever the config says)")
    ap.add_argument("--serve", action="store_true",
                    help="answer {\"batch\": B} lines on stdin (see the module docstring)")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",")]
    t0 = time.perf_counter()
    runner = Runner(args.export_dir, prompt, args.new_tokens, args.cache_size,
                    rope_fix=not args.no_rope_fix)
    head = {"versions": versions(), "rope_fix": not args.no_rope_fix,
            "cache_size": args.cache_size, "load_s": time.perf_counter() - t0}
    if args.serve:
        print(json.dumps({"ready": True, **head}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            b = int(json.loads(line)["batch"])
            dt, toks = runner.call(b)
            print(json.dumps({"batch": b, "seconds": dt, "tokens": toks.tolist()}), flush=True)
        return
    runs = []
    for b in (int(x) for x in args.batches.split(",")):
        first, _ = runner.call(b)
        warm, toks = [], None
        for _ in range(args.repeats):
            dt, toks = runner.call(b)
            warm.append(dt)
        print(f"tunix batch {b}: first {first:.1f}s, warm {[round(x, 2) for x in warm]} s",
              file=sys.stderr, flush=True)
        runs.append({"batch": b, "first_s": first, "warm_s": warm,
                     "tokens": toks.tolist() if toks is not None else None})
    print(json.dumps({**head, "runs": runs}))


if __name__ == "__main__":
    main()
