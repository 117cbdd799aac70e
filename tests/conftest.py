"""Test set-up: 8 simulated CPU devices (sharding tests) and a persistent compile cache."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("SUPO_JAX_COMPILE_CACHE",
                                 os.path.join(tempfile.gettempdir(), "supo_jax_compile_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
