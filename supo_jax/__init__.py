"""supo_jax: JAX/TPU-native SUPO (summarization-augmented policy optimization) for LLM agents."""
from supo_jax.utils import skip_absent_tpu

skip_absent_tpu()   # libtpu installed without a TPU: no TPU start-up (and its warnings)

from supo_jax.model.config import ModelConfig
from supo_jax.model.decoder import Decoder, KVCache
from supo_jax.model.policy import Policy, load_policy, load_tokenizer, new_policy
from supo_jax.model.sharding import make_mesh

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Decoder", "KVCache", "Policy", "load_policy", "load_tokenizer",
           "new_policy", "make_mesh"]
