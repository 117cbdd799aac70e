"""The serving layout: the sampler's own sharding of the training devices.

Training shards every weight over the chips (FSDP): an update over thousands of tokens
amortises gathering each layer's weights. A decode step reads every weight for one token a
row, so on that layout every generated token all-gathers the whole policy over the
interconnect. For rollouts the same devices form another mesh,

    (data = n / T, fsdp = 1, tensor = T)        T = rollout.tensor

on which the one table of rules (supo_jax.model.sharding) splits each weight over the T
chips of a tensor group (heads, kv heads, mlp and vocab over `tensor`) and keeps a copy in
each of the n / T groups; the sampler's rows and their KV cache go over the groups. Per
token step the chips of a group exchange activations only (an all-reduce of [rows, hidden]
after each layer's attention output and MLP, and the logits): no weight moves.

`to_serving` makes that copy from the trained parameters once per rollout phase, resharded
and cast to the compute dtype (one jitted call a parameter, so that one parameter's
temporaries are alive at a time); it is freed with the sampler before the
update. Every model matmul already casts its weights to the compute dtype, so the cast copy
samples exactly what the training layout samples (up to the order of float sums).
"""
from __future__ import annotations

import math
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from supo_jax.model.sharding import MESH_AXES, param_sharding

# a fitting serving layout leaves this share of a device's memory to decode's temporaries
_MARGIN = 0.9


def valid_tensor_sizes(cfg, n_devices: int) -> list[int]:
    """The tensor-group sizes T a model can serve with on n devices: T divides the device
    count, the model's heads and its KV heads (a head is never split over chips)."""
    return [t for t in range(1, n_devices + 1)
            if n_devices % t == 0 and cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0]


def check_tensor(tensor: int, cfg, n_devices: int) -> None:
    """ValueError (one line) for a rollout.tensor the devices or the model cannot take."""
    ok = valid_tensor_sizes(cfg, n_devices)
    if tensor not in ok:
        raise ValueError(f"rollout.tensor={tensor}: a tensor group must divide the {n_devices} "
                         f"devices, the model's {cfg.num_heads} heads and its "
                         f"{cfg.num_kv_heads} kv heads; one of {', '.join(map(str, ok))} "
                         "(0: the largest of them)")


def auto_tensor(cfg, n_devices: int) -> int:
    """rollout.tensor = 0: the largest valid group. A decode step reads every weight once a
    group, so n / T copies are read a step over the slice: the larger the group, the fewer
    weight bytes each chip reads a token step (and holds); what grows, an all-reduce of
    [rows, hidden] a layer, is small beside them (supo_jax.plan counts both)."""
    return valid_tensor_sizes(cfg, n_devices)[-1]


def serving_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The training mesh's devices as (data = n / tensor, fsdp = 1, tensor): groups of
    `tensor` consecutive devices (neighbours in the training mesh's order, and on one host
    where the host's device count is a multiple of `tensor`)."""
    devices = np.asarray(mesh.devices).reshape(-1)
    if devices.size % tensor:
        raise ValueError(f"rollout.tensor={tensor} does not divide {devices.size} devices")
    return Mesh(devices.reshape(devices.size // tensor, 1, tensor), MESH_AXES)


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _casts(name: str, have, want) -> bool:
    """Whether the serving copy casts parameter `name`: floating weights wider than the
    compute dtype, not an int8 base's float32 scales (dequantization reads them in float32)."""
    return (want is not None and jax.numpy.issubdtype(have, jax.numpy.floating)
            and np.dtype(have).itemsize > np.dtype(want).itemsize and not name.endswith("_scale"))


def _via(train: Mesh, target: NamedSharding, shape) -> NamedSharding | None:
    """The step between a weight's training and serving shardings: on the training mesh,
    the dimension the serving layout splits over `tensor` split over every device. Getting
    there moves shards between chips (an all-to-all); the serving layout is then an
    all-gather within each group, of weight / T a chip. Straight from FSDP, XLA would
    gather the whole weight on every chip first ("involuntary full rematerialization")."""
    spec = tuple(target.spec) + (None,) * (len(shape) - len(target.spec))
    axes = tuple(a for a in train.axis_names if train.shape[a] > 1)
    if "tensor" not in spec or not axes:
        return None
    d = spec.index("tensor")
    if shape[d] % math.prod(train.shape[a] for a in axes):
        return None
    return NamedSharding(train, P(*(axes if i == d else None for i in range(len(shape)))))


@partial(jax.jit, static_argnames=("dtype", "via", "target"))
def reshard_one(x, *, dtype, via, target):
    """One parameter cast to `dtype` (None: kept) and moved to its serving sharding `target`
    (through `via`, see _via). One call a parameter, not one for all: XLA would move every
    parameter at once and hold each gathered weight until the end (6.7 GiB of temporaries a
    chip for a 7B model on 16 v5e chips); a call's temporaries are gone when it returns."""
    x = x.astype(dtype) if dtype is not None else x
    if via is not None:
        x = jax.lax.with_sharding_constraint(x, via)
    return jax.lax.with_sharding_constraint(x, target)


def reshard_calls(pure, train_mesh: Mesh, mesh: Mesh, dtype):
    """[(path, leaf, kwargs of reshard_one)] making the serving copy of the pure parameter
    dict `pure` (training layout on `train_mesh`) on the serving `mesh`."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(pure)[0]:
        name = _name(path)
        target = param_sharding(name, x.shape, mesh)
        out.append((path, x, dict(dtype=dtype if _casts(name, x.dtype, dtype) else None,
                                  via=_via(train_mesh, target, x.shape), target=target)))
    return out


def to_serving(policy, tensor: int):
    """A Policy over the serving mesh of `policy`'s devices with tensor groups of `tensor`
    chips: its parameters resharded and cast to the compute dtype (a jitted call each). A
    policy without a mesh (one device) is returned as it is."""
    from supo_jax.model.policy import Policy

    if policy.mesh is None:
        return policy
    n = math.prod(policy.mesh.devices.shape)
    check_tensor(tensor, policy.config, n)
    mesh = serving_mesh(policy.mesh, tensor)
    graphdef, state = nnx.split(policy.model)
    pure = nnx.to_pure_dict(state)
    calls = reshard_calls(pure, policy.mesh, mesh, policy.model.dtype)
    new = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pure),
                                       [reshard_one(x, **kw) for _, x, kw in calls])
    nnx.replace_by_pure_dict(state, new)
    return Policy(nnx.merge(graphdef, state), policy.tokenizer, mesh)
