"""Small process-level helpers."""
import math
import os


def json_safe(obj):
    """obj for strict JSON: every non-finite float (a figure without a value, e.g. nan) as
    None, in nested dicts, lists and tuples too."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def enable_compile_cache(path: str | None = None) -> str:
    """Persistent XLA compilation cache (SUPO_JAX_COMPILE_CACHE, default ~/.cache/supo_jax/jax).

    Rollouts compile a handful of bucketed shapes; caching them across runs saves
    most of a short run's start-up time.
    """
    import jax

    path = path or os.environ.get("SUPO_JAX_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    # every compile, however short: a process pays ~30 ms for each of the ~100 small
    # programs (eager ops, bucketed shapes) it would otherwise compile again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def maybe_init_distributed() -> bool:
    """jax.distributed.initialize() for multi-host runs.

    On a TPU slice launched by launch_tpu.sh (SUPO_JAX_MULTIHOST=1) the runtime supplies
    the coordinator; elsewhere set SUPO_JAX_COORDINATOR=host:port, SUPO_JAX_NUM_PROCESSES
    and SUPO_JAX_PROCESS_ID (e.g. several CPU processes on one machine).
    """
    import jax

    coord = os.environ.get("SUPO_JAX_COORDINATOR")
    if coord:
        # cross-process collectives of the CPU backend (jax's default, set for clarity:
        # without an implementation CPU processes cannot share a mesh)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord,
                                   num_processes=int(os.environ["SUPO_JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["SUPO_JAX_PROCESS_ID"]))
        return True
    if os.environ.get("SUPO_JAX_MULTIHOST") == "1":
        jax.distributed.initialize()
        return True
    return False
