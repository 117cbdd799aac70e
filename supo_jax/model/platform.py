"""The platform the programs being traced will run on.

Normally the running backend's (jax.default_backend()). `compiling_for("tpu", hbm)` declares
another one while programs are traced for ahead-of-time compilation on a machine without it
(supo_jax.plan compiles for a TPU slice on a CPU host): the choices the model makes by
platform (attention implementation, splash kernels compiled rather than interpreted, matmul
precision, remat by device memory, the sampler's layer loop) are then those of a run there.
"""
from __future__ import annotations

import contextlib

import jax

_TARGET: list[tuple[str, int]] = []   # (platform, bytes of one device's memory), innermost last


def backend() -> str:
    """The platform traced programs are for: the declared target, else jax.default_backend()."""
    return _TARGET[-1][0] if _TARGET else jax.default_backend()


def device_bytes() -> int | None:
    """One target device's memory while a target is declared; None otherwise."""
    return _TARGET[-1][1] if _TARGET else None


@contextlib.contextmanager
def compiling_for(platform: str, device_bytes: int):
    """Trace programs as for `platform` with devices of `device_bytes` memory. jax's caches of
    traced programs are cleared on entry and exit: a program traced for the other platform
    is never reused. The persistent compilation cache is off meanwhile (an executable
    compiled for devices this process does not have cannot be loaded back from it)."""
    jax.clear_caches()
    _TARGET.append((platform, int(device_bytes)))
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        _TARGET.pop()
        jax.clear_caches()
