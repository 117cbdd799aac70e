"""Small process-level helpers."""
import os


def enable_compile_cache(path: str | None = None) -> str:
    """Persistent XLA compilation cache (SUPO_JAX_COMPILE_CACHE, default ~/.cache/supo_jax/jax).

    Rollouts compile a handful of bucketed shapes; caching them across runs saves
    most of a short run's start-up time.
    """
    import jax

    path = path or os.environ.get("SUPO_JAX_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
