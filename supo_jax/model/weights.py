"""Checkpoint I/O: HF safetensors (single or index-sharded) and GGUF in, HF safetensors out.

Tensors are read lazily (memory-mapped) and every device shard is built from
just the slices it needs (`jax.make_array_from_callback`), so loading never
holds the whole checkpoint in host memory. GGUF tensors are dequantized with
the `gguf` package, one tensor at a time.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from supo_jax.model.config import ModelConfig
from supo_jax.model.sharding import param_sharding

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}

# Decoder parameter -> (HF tensor name, HF stores it as [out, in] and we as [in, out])
_LAYER_HF = {
    "ln1": ("model.layers.{i}.input_layernorm.weight", False),
    "ln2": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
_TOP_HF = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}

# A tensor source maps HF tensor names to zero-argument readers returning an
# array-like in HF layout (numpy memmaps slice lazily).
TensorSource = dict[str, Callable[[], np.ndarray]]


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or does not match the architecture."""


def read_safetensors_header(fn: str) -> tuple[dict, int]:
    size = os.path.getsize(fn)
    with open(fn, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{fn}: not a safetensors file (too short)")
        n = struct.unpack("<Q", raw)[0]
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{fn}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{fn}: corrupt safetensors header: {e}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{fn}: truncated ({size} bytes, header promises {8 + n + end})")
    return header, 8 + n


def safetensors_source(model_dir: str, file: str | None = None) -> TensorSource:
    """Lazy readers for every tensor of an HF model directory (or of its one `file`)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if file is not None:
        if not os.path.isfile(os.path.join(model_dir, file)):
            raise FileNotFoundError(f"no {file} in {model_dir!r}")
        files = [file]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}")
    source: TensorSource = {}
    for name in files:
        fn = os.path.join(model_dir, name)
        if not os.path.isfile(fn):
            raise FileNotFoundError(f"checkpoint shard {fn!r} listed in the index is missing")
        header, base = read_safetensors_header(fn)
        mm = np.memmap(fn, dtype=np.uint8, mode="r")
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{fn}: tensor {key} has unsupported dtype {info['dtype']}")
            s, e = info["data_offsets"]
            dt, shape = _ST_DTYPES[info["dtype"]], tuple(info["shape"])
            source[key] = (lambda mm=mm, base=base, s=s, e=e, dt=dt, shape=shape:
                           mm[base + s: base + e].view(dt).reshape(shape))
    return source


def _param_reader(cfg: ModelConfig, path: str, source: TensorSource):
    """(shape, read(index) -> np.ndarray) for one Decoder parameter, in our layout."""
    if path.startswith("layers."):
        template, transpose = _LAYER_HF[path.split(".", 1)[1]]
        names = [template.format(i=i) for i in range(cfg.num_layers)]
    else:
        template, transpose = _TOP_HF[path]
        names = [template]
    missing = [n for n in names if n not in source]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensor {missing[0]} (needed for {path})")
    first = source[names[0]]()
    inner = first.shape[::-1] if transpose else first.shape
    stacked = path.startswith("layers.")
    shape = ((cfg.num_layers,) if stacked else ()) + tuple(inner)

    def read_one(name, idx):
        t = source[name]()
        if transpose:
            return np.asarray(t[idx[::-1]]).T if idx else np.asarray(t).T
        return np.asarray(t[idx] if idx else t)

    def read(index):
        index = tuple(index)
        if not stacked:
            return read_one(names[0], index)
        layers = range(cfg.num_layers)[index[0]] if index else range(cfg.num_layers)
        return np.stack([read_one(names[i], index[1:]) for i in layers])

    return shape, read


def build_params(cfg: ModelConfig, abstract_state, source: TensorSource, dtype, mesh=None):
    """Fill an abstract nnx.State (from nnx.eval_shape) with checkpoint tensors.

    Each parameter is created directly with its mesh sharding, reading only the
    slices each device holds.
    """
    from flax import nnx

    def fill(path, leaf):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        shape, read = _param_reader(cfg, name, source)
        if tuple(shape) != tuple(leaf.shape):
            raise CheckpointError(f"tensor for {name} has shape {shape}, architecture expects {leaf.shape}")
        sharding = param_sharding(name, shape, mesh) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        np_dtype = np.dtype(jnp.dtype(dtype))
        return jax.make_array_from_callback(shape, sharding, lambda idx: read(idx).astype(np_dtype))

    pure = nnx.to_pure_dict(abstract_state)
    _check_all_used(cfg, pure, source)
    filled = jax.tree_util.tree_map_with_path(fill, pure)
    nnx.replace_by_pure_dict(abstract_state, filled)
    return abstract_state


def _check_all_used(cfg: ModelConfig, pure: dict, source: TensorSource) -> None:
    """A layer tensor the architecture would not read (e.g. an o_proj bias, an MLP bias) is an
    error: dropping it silently gives other logits than the model's."""
    used = {template.format(i=i) for p, (template, _) in _LAYER_HF.items()
            if pure["layers"].get(p) is not None for i in range(cfg.num_layers)}
    extra = sorted(n for n in source if n.startswith("model.layers.") and n not in used
                   and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"checkpoint holds {len(extra)} layer tensor(s) that "
                              f"model_type={cfg.model_type!r} as configured does not use, e.g. "
                              f"{extra[0]} (check config.json's bias / architecture fields)")


def host_array(x) -> np.ndarray:
    """The whole value of an array on this host (gathered across processes if it spans them)."""
    if jax.process_count() > 1 and isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def hf_tensors(cfg: ModelConfig, pure_params: dict):
    """Yield (HF name, getter -> np.ndarray in HF layout) for every tensor, lazily."""
    for path, (name, transpose) in _TOP_HF.items():
        if path == "lm_head" and cfg.tie_embeddings:
            continue
        arr = pure_params[path]
        yield name, arr.shape[::-1] if transpose else arr.shape, arr.dtype, (
            lambda arr=arr, t=transpose: host_array(arr).T if t else host_array(arr))
    layers = pure_params["layers"]
    for i in range(cfg.num_layers):
        for p, (template, transpose) in _LAYER_HF.items():
            if layers.get(p) is None:
                continue
            arr = layers[p]
            shape = arr.shape[1:][::-1] if transpose else arr.shape[1:]
            yield template.format(i=i), shape, arr.dtype, (
                lambda arr=arr, i=i, t=transpose: host_array(arr[i]).T if t else host_array(arr[i]))


def write_safetensors(fn: str, tensors, metadata: dict | None = None) -> None:
    """Stream tensors (name, shape, dtype, getter) into one safetensors file."""
    tensors = list(tensors)
    header, offset = {}, 0
    for name, shape, dtype, _ in tensors:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        header[name] = {"dtype": _ST_NAMES[dt], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = fn + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, get in tensors:
            a = np.ascontiguousarray(get(), dtype=np.dtype(dtype))
            if a.shape != tuple(shape):
                raise AssertionError(f"{name}: shape {a.shape} != {tuple(shape)}")
            f.write(a.tobytes())
    os.replace(tmp, fn)
