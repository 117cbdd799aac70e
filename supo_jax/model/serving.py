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
and cast to the compute dtype in one jitted call; it is freed with the sampler before the
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
                         "(0 = chosen by memory)")


def serving_bytes(params, dtype) -> int:
    """Bytes of the serving copy of `params` (floating parameters in the compute dtype)."""
    def one(path, x):
        keep = not _casts(_name(path), x.dtype, dtype)
        return x.size * (x.dtype.itemsize if keep else np.dtype(dtype).itemsize)
    return sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(one, _pure(params))))


def auto_tensor(cfg, n_devices: int, *, weight_bytes: int, other_bytes: int,
                hbm_bytes: int) -> int:
    """The smallest tensor-group size whose weights (weight_bytes / T a chip) fit beside
    `other_bytes` a chip (the training state, the KV cache) in 90% of `hbm_bytes`: fewer
    chips a group means less traffic a token and more rows a group; the largest valid
    size when none fits (the plan then says what does not fit)."""
    ok = valid_tensor_sizes(cfg, n_devices)
    for t in ok:
        if weight_bytes / t + other_bytes <= _MARGIN * hbm_bytes:
            return t
    return ok[-1]


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


def _pure(state):
    return nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state


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


@partial(jax.jit, static_argnames=("dtype", "steps"))
def _reshard(pure, *, dtype, steps):
    flat, tree = jax.tree_util.tree_flatten_with_path(pure)
    out = []
    for (path, x), (via, target) in zip(flat, steps.value):
        x = x.astype(dtype) if _casts(_name(path), x.dtype, dtype) else x
        if via is not None:
            x = jax.lax.with_sharding_constraint(x, via)
        out.append(jax.lax.with_sharding_constraint(x, target))
    return jax.tree_util.tree_unflatten(tree, out)


class _Static:
    """A hashable box for the shardings (a static argument of jit)."""
    def __init__(self, value):
        self.value = tuple(value)

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value


def to_serving(policy, tensor: int):
    """A Policy over the serving mesh of `policy`'s devices with tensor groups of `tensor`
    chips: its parameters resharded and cast to the compute dtype in one jitted call. A
    policy without a mesh (one device) is returned as it is."""
    from supo_jax.model.policy import Policy

    if policy.mesh is None:
        return policy
    n = math.prod(policy.mesh.devices.shape)
    check_tensor(tensor, policy.config, n)
    mesh = serving_mesh(policy.mesh, tensor)
    graphdef, state = nnx.split(policy.model)
    pure = nnx.to_pure_dict(state)
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    targets = [param_sharding(_name(p), x.shape, mesh) for p, x in flat]
    steps = _Static((_via(policy.mesh, t, x.shape), t) for (_, x), t in zip(flat, targets))
    new = _reshard(pure, dtype=policy.model.dtype, steps=steps)
    nnx.replace_by_pure_dict(state, new)
    return Policy(nnx.merge(graphdef, state), policy.tokenizer, mesh)
