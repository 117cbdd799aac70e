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
adapters as the RL run started (supo_jax.rl.trainer.reference_params: a copy of the
adapters, not of the base). Training and prefill run the low-rank product in the forward
(the base is never rewritten). The decode on CPU and GPU reads a per-layer copy of the
weights that the sampler cuts once per rollout phase (Decoder.layer_weights); with float32
weights and compute the adapters are merged into that copy (merge_adapters: 3% faster than
the product on CPU, BENCHMARKS.md "LoRA"). Every other decode keeps the product, so that the
sampler computes the trainer's function: in bfloat16, W + scale * A @ B rounds away an
update below half of W's last place, and an int8 base stays int8. TPU's decode scans the
stacked weights (no copy) and keeps the product too.

QLoRA: `model.lora_base_dtype=int8` stores each target's base weight as int8 with one
float32 scale per output channel ([L, 1, out]: symmetric, scale = max|W| / 127), dequantized
in the forward. bfloat16 stores the base in bfloat16; "" keeps model.dtype.

PEFT: `save_peft` writes adapter_config.json and adapter_model.safetensors with PEFT's names
(base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in], ...lora_B.weight
[out, r]); `load_peft` reads such a directory back into a policy's adapters, an alpha_pattern
folded into B, and refuses (read_peft_config) what these adapters cannot hold: a bias, whole
modules, other ranks, DoRA, ... (UNSUPPORTED_PEFT).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from supo_jax import storage

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
    """Layer weights (one layer's or stacked) with each float32 target's adapters merged into
    its weight, W + scale * A @ B in float32, and their entries dropped. Any other base keeps
    its adapters: rounding W + scale * A @ B to bfloat16 erases an update smaller than half of
    W's last place (most of the adapters' contribution while |B| < 1e-3), and merging would
    dequantize an int8 one. `xp`: jax.numpy (traced) or numpy (host arrays)."""
    out = dict(lw)
    for name in TARGETS.values():
        a = out.get(f"{name}_lora_a")
        if a is None or out[name].dtype != xp.float32:
            continue
        b, w = out.pop(f"{name}_lora_b"), out[name]
        del out[f"{name}_lora_a"]
        delta = xp.matmul(a.astype(xp.float32), b.astype(xp.float32))
        out[name] = w + scale * delta
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
    from supo_jax.model.weights import host_array

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
    with storage.staged_dir(out_dir) as d:
        _write_peft(d, lora, base_model, tensors)


def _write_peft(out_dir: str, lora, base_model, tensors) -> None:
    from supo_jax.model.weights import _LAYER_HF, write_safetensors

    modules = sorted({_LAYER_HF[TARGETS[t]][0].split(".")[-2] for t in lora.targets})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
              "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "init_lora_weights": True}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)


# PEFT LoraConfig fields that change what an adapter computes and that these adapters do
# not hold (a bias, whole modules, per-layer ranks, ...): refused by name, never dropped
UNSUPPORTED_PEFT = ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "modules_to_save",
                    "layers_to_transform", "layer_replication", "trainable_token_indices",
                    "target_parameters", "alora_invocation_tokens", "use_qalora")


def _unset(v) -> bool:
    return v is None or v is False or (isinstance(v, (list, tuple, dict, str)) and not v)


def read_peft_config(path: str) -> dict:
    """adapter_config.json of a PEFT LoRA directory; ValueError naming what is wrong or what
    it sets that these adapters cannot reproduce (UNSUPPORTED_PEFT, a bias, a rank_pattern
    rank other than r). alpha_pattern loads (load_peft)."""
    fn = storage.join(path, "adapter_config.json")
    try:
        cfg = json.loads(storage.read_text(fn))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{fn}: not a readable PEFT adapter config ({e})") from None
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{fn}: peft_type {cfg.get('peft_type')!r}, only LORA adapters load")
    bad = [k for k in UNSUPPORTED_PEFT if not _unset(cfg.get(k))]
    if cfg.get("bias", "none") not in (None, "none"):
        bad.append("bias")
    if any(r != cfg.get("r") for r in (cfg.get("rank_pattern") or {}).values()):
        bad.append("rank_pattern")
    if bad:
        raise ValueError(f"{fn}: {bad[0]}={cfg[bad[0]]!r} is not supported (supo_jax loads "
                         "LoRA A and B on the decoder's projections, one rank)")
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


def peft_alphas(cfg: dict, name: str, layers: int) -> np.ndarray:
    """The alpha of each layer's adapter on stacked weight `name` [L]: alpha_pattern's first
    key that matches the end of the module's name at dot boundaries (PEFT's rule: "q_proj",
    "layers.3.self_attn.q_proj" or a regex), else lora_alpha."""
    from supo_jax.model.weights import _LAYER_HF

    pattern = cfg.get("alpha_pattern") or {}
    out = np.full(layers, float(cfg["lora_alpha"]), np.float32)
    for i in range(layers):
        module = _LAYER_HF[name][0].format(i=i)[: -len(".weight")]
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)
        if key is not None:
            out[i] = pattern[key]
    return out


def peft_adapters(path: str, lora: LoRA, shapes: dict) -> dict:
    """The stacked float32 adapter weights of the PEFT adapter directory `path` for adapters
    `lora` ({"wq_lora_a": [L, in, r], ...}; `shapes` the expected shape of each). Each
    layer's alpha_pattern alpha is folded into its B (B * alpha_i / lora.alpha): the same
    product under one scale."""
    from supo_jax.model.weights import safetensors_source

    cfg = read_peft_config(path)
    want = peft_lora(cfg)
    if (want.rank, set(want.targets)) != (lora.rank, set(lora.targets)):
        raise ValueError(f"{path}: adapter of rank {want.rank} on {','.join(want.targets)}; "
                         f"the model has {lora.rank} on {','.join(lora.targets)}")
    with storage.local_copy(storage.join(path, "adapter_model.safetensors")) as fn:
        source = safetensors_source(os.path.dirname(fn), os.path.basename(fn))
        return _stacked_adapters(path, source, cfg, lora, shapes)


def _stacked_adapters(path, source, cfg, lora, shapes) -> dict:
    out = {}
    for t in lora.targets:
        name = TARGETS[t]
        for suffix, k in (("lora_a", 0), ("lora_b", 1)):
            shape = tuple(shapes[f"{name}_{suffix}"])
            names = [peft_names(name, i)[k] for i in range(shape[0])]
            missing = [n for n in names if n not in source]
            if missing:
                raise ValueError(f"{path}: adapter lacks tensor {missing[0]}")
            x = np.stack([np.asarray(source[n]()).T for n in names]).astype(np.float32)
            if x.shape != shape:
                raise ValueError(f"{path}: {names[0]} has shape {x.shape[1:][::-1]}, the "
                                 f"model expects {shape[1:][::-1]}")
            out[f"{name}_{suffix}"] = x
        fold = peft_alphas(cfg, name, shape[0]) / np.float32(lora.alpha)
        if np.any(fold != 1):
            out[f"{name}_lora_b"] *= fold[:, None, None]
    return out


def load_peft(model, path: str) -> None:
    """Set `model`'s adapters (already added with the same rank and targets) to those of the
    PEFT adapter directory `path` (peft_adapters)."""
    lora = model.lora
    if lora is None:
        raise ValueError(f"{path}: a PEFT adapter, and the model has no adapters")
    layers = model.layers
    names = [f"{TARGETS[t]}_{s}" for t in lora.targets for s in ("lora_a", "lora_b")]
    for name, x in peft_adapters(path, lora, {n: getattr(layers, n).shape for n in names}).items():
        var = getattr(layers, name)
        var[...] = jax.device_put(x, var[...].sharding)


def peft_state(adapters: nnx.State, lora: LoRA, path: str) -> nnx.State:
    """A copy of `adapters` (the LoRAParam state, supo_jax.rl.train_step.trainable) holding
    the PEFT adapter at `path`, each array placed like the one it replaces."""
    pure = nnx.to_pure_dict(adapters)
    got = peft_adapters(path, lora, {n: v.shape for n, v in pure["layers"].items()})
    pure["layers"] = {n: jax.device_put(got[n], v.sharding) for n, v in pure["layers"].items()}
    out = jax.tree.map(lambda x: x, adapters)
    nnx.replace_by_pure_dict(out, pure)
    return out
