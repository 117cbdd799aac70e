"""Multi-process helpers (jax.distributed: a TPU pod or several CPU processes): which process
is the main one, barriers, the run's mesh, the processes as rollout peers (each steps its own
rows' environments; all sample on one serving layout of the mesh's devices), and placing a batch every process
holds."""
from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from supo_jax.config import Config
from supo_jax.model.sharding import batch_sharding, make_mesh
from supo_jax.rl.batch import TrainBatch


def is_main() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process reaches this point before any goes on (a no-op in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def make_run_mesh(cfg: Config) -> Mesh | None:
    """The mesh over every device of every process (None on a single device)."""
    if jax.device_count() == 1:
        return None
    return make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)


def exchange_size(n: int) -> int:
    """The buffer an exchange of n bytes travels in: the next power of two from 1 KiB, so that
    exchanges of any sizes compile a handful of all-gather programs (one a size otherwise)."""
    return max(1024, 1 << max(0, n - 1).bit_length())


def allgather_json(obj: Any) -> list:
    """`obj` (JSON-serializable) from every process, in process order."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    buf = np.zeros(exchange_size(int(sizes.max())), np.uint8)
    buf[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(every[p, :int(n)].tobytes()) for p, n in enumerate(sizes.reshape(-1))]


class ProcessPeers:
    """The processes of a multi-process run as rollout peers (agent.rollout.Peers): every
    process runs the same rollout driver over the global sampler rows, on the serving layout
    of the run's devices; process p owns (resets and steps the environments of) the
    slots s with s % P == p, and each step's outcomes are exchanged as JSON (text and a
    few numbers a row: small next to a decode step)."""

    def owns(self, slot: int) -> bool:
        return slot % jax.process_count() == jax.process_index()

    def merge(self, mine: dict[int, Any]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for part in allgather_json(sorted(mine.items())):
            out.update({int(k): v for k, v in part})
        return out


def place_batch(batch: TrainBatch, mesh: Mesh | None) -> TrainBatch:
    """Multi-process: a batch every process holds in full, as global arrays sharded over the
    mesh's batch axes; each process transfers only the rows of its own devices."""
    if mesh is None or jax.process_count() == 1:
        return batch
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        x.shape, batch_sharding(mesh, x.shape), lambda idx: x[idx]), batch)
