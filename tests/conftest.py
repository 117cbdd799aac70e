"""Test set-up: 8 simulated CPU devices (sharding tests) and a persistent compile cache."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

os.environ.setdefault("SUPO_JAX_COMPILE_CACHE",
                      os.path.join(tempfile.gettempdir(), "supo_jax_compile_cache"))
from supo_jax.utils import enable_compile_cache  # noqa: E402

enable_compile_cache()
