"""Device mesh and the one table of partitioning rules.

Every parameter has logical axis names (PARAM_AXES); LOGICAL_RULES maps each
logical axis to a mesh axis. A dimension whose size the mesh axis does not
divide is replicated instead, so any checkpoint runs on any mesh.
The same code runs on 1 CPU, 8 simulated CPU devices, a TPU host or a pod.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# parameter path (as in the Decoder) -> logical axes of each dimension
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "layers.ln1": ("layers", "norm"),
    "layers.ln2": ("layers", "norm"),
    "layers.wq": ("layers", "embed", "heads"),
    "layers.wk": ("layers", "embed", "kv_heads"),
    "layers.wv": ("layers", "embed", "kv_heads"),
    "layers.wo": ("layers", "heads", "embed"),
    "layers.bq": ("layers", "heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.w_gate": ("layers", "embed", "mlp"),
    "layers.w_up": ("layers", "embed", "mlp"),
    "layers.w_down": ("layers", "mlp", "embed"),
}

# logical axis -> mesh axis (None: replicated)
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "norm": None,
    "head_dim": None,
    "batch": ("data", "fsdp"),
}


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, tensor); one size may be -1 (use the rest)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not split into mesh sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh (data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]}) needs "
                         f"{math.prod(sizes)} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def _mesh_axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    if isinstance(axis, tuple):
        return math.prod(mesh.shape[a] for a in axis)
    return mesh.shape[axis]


def spec_for(logical: Sequence[str], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for a tensor, replicating dims the mesh axis does not divide."""
    out, used = [], set()
    for name, size in zip(logical, shape):
        axis = LOGICAL_RULES.get(name)
        n = _mesh_axis_size(mesh, axis)
        names = axis if isinstance(axis, tuple) else (axis,)
        if axis is None or n == 1 or size % n or used & set(names):
            out.append(None)
        else:
            out.append(axis)
            used |= set(names)
    return P(*out)


def param_axes(path: str) -> tuple:
    """The logical axes of a Decoder parameter path; a LoRA adapter (supo_jax.model.lora) of
    weight W [L, in, out] is A [L, in, r] / B [L, r, out], an int8 scale [L, 1, out]."""
    for suffix, keep in (("_lora_a", (0, 1)), ("_lora_b", (0, 2)), ("_scale", (0, 2))):
        if path.endswith(suffix) and path[: -len(suffix)] in PARAM_AXES:
            axes = PARAM_AXES[path[: -len(suffix)]]
            return tuple(a if i in keep else None for i, a in enumerate(axes))
    if path not in PARAM_AXES:
        raise KeyError(f"no partitioning rule for parameter {path!r}")
    return PARAM_AXES[path]


def param_sharding(path: str, shape: Sequence[int], mesh: Mesh | None):
    """NamedSharding for a Decoder parameter path (e.g. 'layers.wq'); None without a mesh."""
    if mesh is None:
        return None
    return NamedSharding(mesh, spec_for(param_axes(path), shape, mesh))


def batch_sharding(mesh: Mesh | None, shape: Sequence[int]):
    """Leading (batch) axis over data x fsdp when it divides evenly, the rest replicated."""
    if mesh is None:
        return None
    return NamedSharding(mesh, spec_for(("batch",) + (None,) * (len(shape) - 1), shape, mesh))


def put(x, sharding):
    """jax.device_put that also places a value (the same on every process) on a sharding that
    spans processes. Such a value goes through host memory: jax 0.10 treats a device array
    and a fully replicated multi-process sharding as the same sharding and copies the buffer
    as is, which yields a malformed array (its shards then fail on use)."""
    if sharding is not None and not sharding.is_fully_addressable:
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def replicated(mesh: Mesh | None):
    return None if mesh is None else NamedSharding(mesh, P())


def context_batch_axes() -> tuple[tuple[str, ...], int]:
    """The context mesh's axes that split a batch (data, fsdp: those of size > 1, not manual
    inside a shard_map) and their product; ((), 1) without such a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    manual = set(getattr(mesh, "manual_axes", ()))
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and mesh.shape[a] > 1
                 and a not in manual)
    return axes, math.prod(mesh.shape[a] for a in axes)


def mesh_scope(mesh: Mesh | None):
    """`with mesh_scope(mesh):` traces run with `mesh` as the context mesh (jax.set_mesh), so
    the kernels that must be partitioned by hand (splash attention under shard_map) see it; a
    no-op without a mesh."""
    import contextlib

    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
