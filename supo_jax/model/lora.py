"""LoRA adapters on the decoder's stacked layer weights, an int8 base (QLoRA), and PEFT export.

A small LoRA of our own: the decoder keeps each projection as one stacked [L, in, out]
parameter run under lax.scan (supo_jax.model.decoder.Layers), while flax.nnx.LoRA wraps
nnx.Linear modules and qwix's LoraProvider intercepts nnx.Linear / einsum calls of modules:
neither sees a weight sliced out of a stack inside a scan. Here each target projection W
gets two adapter weights, stacked like it:

    A [L, in, r] (PEFT's init: uniform(-1/sqrt(in), 1/sqrt(in)))   B [L, r, out] (zeros)
    y = x @ W + (alpha / r) * (x @ A) @ B

so the adapted model equals the base at initialisation. Adapters are `LoRAParam`s (a kind
of nnx.Param): with them present, only they are trained and carry optimizer state
(supo_jax.rl.train_step.split_trainable); the base is frozen, and the KL reference is the
same weights with the adapters' product off (no second copy). Training and prefill run the
low-rank product in the forward (the base is never rewritten). The decode on CPU and GPU
reads a per-layer copy of the weights that the sampler cuts once per rollout phase
(Decoder.layer_weights); the adapters are merged into that copy (merge_adapters), which
measured faster than the product (BENCHMARKS.md "LoRA") and costs no memory beyond the copy.
TPU's decode scans the stacked weights (no copy) and an int8 base stays int8: both keep the
product.

QLoRA: `model.lora_base_dtype=int8` stores each target's base weight as int8 with one
float32 scale per output channel ([L, 1, out]: symmetric, scale = max|W| / 127), dequantized
in the forward. bfloat16 stores the base in bfloat16; "" keeps model.dtype.

PEFT: `save_peft` writes adapter_config.json and adapter_model.safetensors with PEFT's names
(base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in], ...lora_B.weight
[out, r]); `load_peft` reads such a directory back into a policy's adapters.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# target name (model.lora_targets) -> the decoder's stacked weight
TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
           "down": "w_down"}
BASE_DTYPES = ("", "bfloat16", "int8")
# every per-layer name the adapters and the int8 base add to Layers
EXTRA_LAYER_PARAMS = tuple(f"{w}_{s}" for w in TARGETS.values()
                           for s in ("lora_a", "lora_b", "scale"))


class LoRAParam(nnx.Param):
    """An adapter weight: with adapters present, the only parameters trained."""


@dataclasses.dataclass(frozen=True)
class LoRA:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse(rank: int, alpha: float, targets, base_dtype: str = "") -> LoRA | None:
    """The adapters a model section asks for (None for rank 0); ValueError naming the setting."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"model.lora_base_dtype={base_dtype!r} is not one of "
                         f"{', '.join(repr(b) for b in BASE_DTYPES)}")
    if rank < 0:
        raise ValueError(f"model.lora_rank must be >= 0 (0 = off), got {rank}")
    if rank == 0:
        if base_dtype:
            raise ValueError("model.lora_base_dtype needs adapters: set model.lora_rank > 0")
        return None
    targets = tuple(targets.split(",")) if isinstance(targets, str) else tuple(targets)
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise ValueError(f"model.lora_targets: {bad[0] if bad else 'none given'!r} is not "
                         f"one of {', '.join(TARGETS)}")
    if alpha <= 0:
        raise ValueError(f"model.lora_alpha must be > 0, got {alpha}")
    return LoRA(int(rank), float(alpha), tuple(dict.fromkeys(targets)))


def add_adapters(model, lora: LoRA, *, base_dtype: str = "", seed: int = 0, mesh=None) -> None:
    """Give `model` (a Decoder) the adapters of `lora`, in float32 (A as PEFT initialises it,
    B zero), sharded like their weights; store the targets' base in `base_dtype`."""
    from supo_jax.model.sharding import param_sharding, put

    layers = model.layers
    key = jax.random.key(seed)
    for n, t in enumerate(lora.targets):
        name = TARGETS[t]
        w = getattr(layers, name)
        L, fan_in, fan_out = w.shape
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, n), (L, fan_in, lora.rank), jnp.float32,
                               -bound, bound)
        b = jnp.zeros((L, lora.rank, fan_out), jnp.float32)
        for suffix, x in (("lora_a", a), ("lora_b", b)):
            path = f"layers.{name}_{suffix}"
            setattr(layers, f"{name}_{suffix}",
                    LoRAParam(put(np.asarray(x), param_sharding(path, x.shape, mesh))
                              if mesh is not None else x))
        if base_dtype:
            quantize_base(model, name, base_dtype, mesh)
    model.lora = lora


def quantize_base(model, name: str, base_dtype: str, mesh=None) -> None:
    """Store stacked weight `name` in bfloat16, or in int8 with a float32 scale per output
    channel (`{name}_scale` [L, 1, out])."""
    from supo_jax.model.sharding import param_sharding

    layers = model.layers
    w = getattr(layers, name)[...]
    if base_dtype == "bfloat16":
        setattr(layers, name, nnx.Param(w.astype(jnp.bfloat16)))
        return
    sh = param_sharding(f"layers.{name}", w.shape, mesh)
    ssh = param_sharding(f"layers.{name}_scale", (w.shape[0], 1, w.shape[2]), mesh)
    q, scale = jax.jit(_int8, out_shardings=(sh, ssh) if mesh is not None else None)(w)
    setattr(layers, name, nnx.Param(q))
    setattr(layers, f"{name}_scale", nnx.Param(scale))


def _int8(w):
    w = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1, keepdims=True), 1e-12) / 127.0
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


def base_weight(lw: dict, name: str, dtype):
    """Layer weight `name` of a layer's dict, dequantized when stored in int8, in `dtype`."""
    w = lw[name]
    if w.dtype == jnp.int8:
        return (w.astype(jnp.float32) * lw[f"{name}_scale"]).astype(dtype)
    return w.astype(dtype)


def merge_adapters(lw: dict, scale: float, xp=jnp) -> dict:
    """Layer weights (one layer's or stacked) with each target's adapters merged into its
    weight, W + scale * A @ B in W's dtype, and their entries dropped. An int8 base keeps its
    adapters: merging would dequantize it. `xp`: jax.numpy (traced) or numpy (host arrays)."""
    out = dict(lw)
    for name in TARGETS.values():
        a = out.get(f"{name}_lora_a")
        if a is None or out[name].dtype == jnp.int8:
            continue
        b, w = out.pop(f"{name}_lora_b"), out[name]
        del out[f"{name}_lora_a"]
        delta = xp.matmul(a.astype(xp.float32), b.astype(xp.float32))
        out[name] = (w.astype(xp.float32) + scale * delta).astype(w.dtype)
    return out


def merged_layers(pure: dict, lora: LoRA | None) -> dict:
    """The pure layer parameters (nnx.to_pure_dict(...)["layers"], host arrays) with every
    target's weight dequantized and its adapters merged in (W + scale * A @ B, in float32),
    the adapter and scale entries dropped: the plain model a merged export writes."""
    out = {k: np.asarray(v) for k, v in pure.items() if not k.endswith("_scale")}
    for name in TARGETS.values():
        w = out[name]
        if w.dtype == np.int8:
            out[name] = w.astype(np.float32) * np.asarray(pure[f"{name}_scale"], np.float32)
        elif lora is not None and f"{name}_lora_a" in out:
            out[name] = w.astype(np.float32)
    if lora is not None:
        out = merge_adapters(out, lora.scale, np)
    return {k: v for k, v in out.items() if not k.endswith(("_lora_a", "_lora_b"))}


def peft_names(name: str, i: int) -> tuple[str, str]:
    """PEFT's tensor names of layer i's adapters on stacked weight `name`."""
    from supo_jax.model.weights import _LAYER_HF

    module = _LAYER_HF[name][0].format(i=i)[: -len(".weight")]
    return (f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight")


def save_peft(model, out_dir: str, base_model: str) -> None:
    """Write `model`'s adapters as a PEFT LoRA adapter (adapter_config.json,
    adapter_model.safetensors) for the base at `base_model` (its HF directory or hub id)."""
    from supo_jax.model.weights import _LAYER_HF, host_array, write_safetensors

    lora = model.lora
    if lora is None:
        raise ValueError("this policy has no adapters (model.lora_rank = 0)")
    pure = nnx.to_pure_dict(nnx.state(model, LoRAParam))["layers"]
    tensors = []
    for t in lora.targets:
        name = TARGETS[t]
        a, b = host_array(pure[f"{name}_lora_a"]), host_array(pure[f"{name}_lora_b"])
        for i in range(a.shape[0]):
            na, nb = peft_names(name, i)
            ai, bi = np.ascontiguousarray(a[i].T), np.ascontiguousarray(b[i].T)
            tensors.append((na, ai.shape, ai.dtype, lambda x=ai: x))
            tensors.append((nb, bi.shape, bi.dtype, lambda x=bi: x))
    if jax.process_index() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    modules = sorted({_LAYER_HF[TARGETS[t]][0].split(".")[-2] for t in lora.targets})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
              "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "init_lora_weights": True}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)


def read_peft_config(path: str) -> dict:
    """adapter_config.json of a PEFT LoRA directory; ValueError naming what is wrong."""
    fn = os.path.join(path, "adapter_config.json")
    try:
        with open(fn) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{fn}: not a readable PEFT adapter config ({e})") from None
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{fn}: peft_type {cfg.get('peft_type')!r}, only LORA adapters load")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("fan_in_fan_out"):
        raise ValueError(f"{fn}: DoRA / rsLoRA / fan_in_fan_out adapters are not supported")
    return cfg


def peft_lora(cfg: dict) -> LoRA:
    """The LoRA settings of a PEFT adapter config."""
    from supo_jax.model.weights import _LAYER_HF

    by_module = {_LAYER_HF[w][0].split(".")[-2]: t for t, w in TARGETS.items()}
    mods = cfg.get("target_modules") or []
    mods = [mods] if isinstance(mods, str) else mods
    bad = [m for m in mods if m not in by_module]
    if bad:
        raise ValueError(f"PEFT adapter targets module {bad[0]!r}; supported: "
                         f"{', '.join(by_module)}")
    return LoRA(int(cfg["r"]), float(cfg["lora_alpha"]), tuple(by_module[m] for m in mods))


def load_peft(model, path: str) -> None:
    """Set `model`'s adapters (already added with the same rank and targets) to those of the
    PEFT adapter directory `path`."""
    from supo_jax.model.weights import read_safetensors_header, safetensors_source

    lora = model.lora
    want = peft_lora(read_peft_config(path))
    if lora is None or (want.rank, set(want.targets)) != (lora.rank, set(lora.targets)):
        raise ValueError(f"{path}: adapter of rank {want.rank} on {','.join(want.targets)}; "
                         f"the model has {lora and lora.rank} on "
                         f"{lora and ','.join(lora.targets)}")
    source = safetensors_source(path, "adapter_model.safetensors")
    layers = model.layers
    for t in lora.targets:
        name = TARGETS[t]
        for suffix, k in (("lora_a", 0), ("lora_b", 1)):
            var = getattr(layers, f"{name}_{suffix}")
            names = [peft_names(name, i)[k] for i in range(var.shape[0])]
            missing = [n for n in names if n not in source]
            if missing:
                raise ValueError(f"{path}: adapter lacks tensor {missing[0]}")
            x = np.stack([np.asarray(source[n]()).T for n in names]).astype(np.float32)
            if x.shape != var.shape:
                raise ValueError(f"{path}: {names[0]} has shape {x.shape[1:][::-1]}, the "
                                 f"model expects {var.shape[1:][::-1]}")
            var[...] = jax.device_put(x, var[...].sharding)
