"""Multi-process helpers (jax.distributed: a TPU pod or several CPU processes): which process
is the main one, barriers, each process's share of a list, the run's mesh, a process-local copy
of a sharded policy, the exchange of rollouts, and placing a batch every process holds."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from supo_jax.config import Config
from supo_jax.agent.rollout import Rollout
from supo_jax.model.policy import Policy, shard_model
from supo_jax.model.sharding import batch_sharding, make_mesh, replicated
from supo_jax.rl.batch import TrainBatch


def is_main() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process reaches this point before any goes on (a no-op in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def share(items: Iterable) -> list:
    """This process's share of a list: items[process_index::process_count]."""
    return list(items)[jax.process_index()::jax.process_count()]


def make_run_mesh(cfg: Config) -> Mesh | None:
    """The mesh over every device of every process (None on a single device)."""
    if jax.device_count() == 1:
        return None
    return make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)


def process_local_policy(policy: Policy) -> Policy:
    """This process's full copy of a policy sharded over processes, on its own devices.

    The parameters are all-gathered over the global mesh (a jitted identity with
    replicated outputs); each process keeps the copy on its local devices, sharded over
    a mesh of them by the usual rules. A policy whose arrays all live on this process
    is returned as it is."""
    graphdef, params = policy.split()
    if policy.mesh is None or all(x.is_fully_addressable for x in jax.tree.leaves(params)):
        return policy
    from jax.sharding import NamedSharding, PartitionSpec as P

    full = jax.jit(lambda p: p, out_shardings=replicated(policy.mesh))(params)
    devices = jax.local_devices()
    mesh = make_mesh(1, -1, 1, devices=devices) if len(devices) > 1 else None

    def local(x):
        shards = [s.data for s in x.addressable_shards]
        if mesh is None:
            return shards[0]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, P()), shards)

    model = nnx.merge(graphdef, jax.tree.map(local, full))
    if mesh is not None:
        shard_model(model, mesh)
    return Policy(model, policy.tokenizer, mesh)


def allgather_json(obj: Any) -> list:
    """`obj` (JSON-serializable) from every process, in process order."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(every[p, :int(n)].tobytes()) for p, n in enumerate(sizes.reshape(-1))]


def exchange_rollouts(mine: list[Rollout]) -> list[Rollout]:
    """All processes' rollouts (each ran share(tasks)), in global (task, sample) order."""
    n = jax.process_count()
    out = []
    for p, rows in enumerate(allgather_json([ro.to_json() for ro in mine])):
        for d in rows:
            ro = Rollout.from_json(d)
            out.append(dataclasses.replace(ro, group_id=p + ro.group_id * n))  # local -> global
    return sorted(out, key=lambda ro: (ro.group_id, ro.sample))


def place_batch(batch: TrainBatch, mesh: Mesh | None) -> TrainBatch:
    """Multi-process: a batch every process holds in full, as global arrays sharded over the
    mesh's batch axes; each process transfers only the rows of its own devices."""
    if mesh is None or jax.process_count() == 1:
        return batch
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        x.shape, batch_sharding(mesh, x.shape), lambda idx: x[idx]), batch)
