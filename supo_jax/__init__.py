"""supo_jax: JAX/TPU-native SUPO (summarization-augmented policy optimization) for LLM agents.

The names below load with their modules on first use (PEP 562), so that the JAX-free parts
(supo_jax.envs, supo_jax.text) import without JAX: a verifiers environment runs our
environments in a virtual environment of its own (supo_jax/harnesses/verifiers_fncall.py)."""
import importlib

from supo_jax.utils import cpu_compile_level, skip_absent_tpu

skip_absent_tpu()   # libtpu installed without a TPU: no TPU start-up (and its warnings)
cpu_compile_level()   # the CPU alone: XLA's CPU programs at LLVM level 1 (compiles faster)

__version__ = "0.1.0"
_LAZY = {"ModelConfig": "supo_jax.model.config", "Decoder": "supo_jax.model.decoder",
         "KVCache": "supo_jax.model.decoder", "Policy": "supo_jax.model.policy",
         "load_policy": "supo_jax.model.policy", "load_tokenizer": "supo_jax.model.policy",
         "new_policy": "supo_jax.model.policy", "make_mesh": "supo_jax.model.sharding"}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'supo_jax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
