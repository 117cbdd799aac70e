"""Orbax checkpoints of a run: params, optimizer state, and a JSON record
(step, RNG seed/state, task-stream position, model fingerprint).

Async save, keep-last-N, automatic resume from the latest step. If the latest
checkpoint cannot be restored (truncated or corrupt files), a warning names it
and the previous one is used. Multi-host: every process calls save/restore;
Orbax writes collectively.
"""
from __future__ import annotations

import contextlib
import json
import logging
import warnings

import jax
import orbax.checkpoint as ocp

from supo_jax import storage


@contextlib.contextmanager
def _quiet_loggers(names=("absl", "orbax", "orbax.checkpoint", "jax._src")):
    """Errors only from the named loggers while the block runs."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _abstract(tree):
    """Shape / dtype / sharding stand-ins of a pytree of arrays (what a restore fills)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


class RunCheckpoints:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        storage.configure()   # tensorstore's endpoint from STORAGE_EMULATOR_HOST
        self.directory = storage.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=async_save))
        self.bad_steps: set[int] = set()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        if step in self.bad_steps:  # an unreadable leftover of an interrupted run
            self.manager.delete(step)
            self.bad_steps.discard(step)
        # a copy of the record: Orbax writes it on a background thread after save() returns,
        # and the caller's dicts (the rollout carry) change in the next step
        meta = json.loads(json.dumps(meta))
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_params(self, step: int, params_like):
        """The parameters saved at `step` (no optimizer state), restored into the structure,
        dtypes and shardings of params_like."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params_like)))
        return self.manager.restore(step, args=args)["params"]

    def restore_latest(self, params_like, opt_state_like):
        """(step, params, opt_state, meta) of the newest restorable checkpoint, or None.

        params_like / opt_state_like: pytrees of arrays giving the structure, dtypes and
        shardings to restore into. A step that fails to restore is skipped with a warning
        (it stays on disk until the replayed run saves that step again).
        """
        args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params_like)),
                                  opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                                  meta=ocp.args.JsonRestore())
        for step in reversed(self.steps()):
            try:
                with _quiet_loggers():   # Orbax logs a failed read at length: our line says it
                    out = self.manager.restore(step, args=args)
                return step, out["params"], out["opt_state"], out["meta"]
            except Exception as e:  # noqa: BLE001 - any failure to read means "unusable"
                self.bad_steps.add(step)
                warnings.warn(f"checkpoint step {step} in {self.directory} cannot be restored "
                              f"({type(e).__name__}: {str(e)[:200]}); falling back to an "
                              "earlier one", stacklevel=2)
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
