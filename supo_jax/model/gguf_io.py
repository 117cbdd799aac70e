"""GGUF checkpoints (llama.cpp format): architecture, tensors and tokenizer.

Supports llama-architecture files (SmolLM2, Llama 3.x) and qwen2/qwen3 files,
with F32/F16/BF16/Q8_0/Q4_0/Q4_1/... tensors dequantized by the `gguf` package.
llama.cpp's converter permutes the rows of Q and K in llama files (to its
interleaved rotary layout); `_unpermute` undoes that so the weights match the
rotate-half convention of transformers and of our decoder.
"""
from __future__ import annotations

import os

import numpy as np

from supo_jax.model.weights import CheckpointError, TensorSource

_ARCH_TO_HF = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "qwen3": ("qwen3", "Qwen3ForCausalLM")}

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (interleaved -> rotate-half)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def open_gguf(fn: str):
    """(HF-style config dict, TensorSource in HF names and layout) for a .gguf file."""
    import gguf

    if not os.path.isfile(fn):
        raise FileNotFoundError(f"GGUF file {fn!r} does not exist")
    try:
        reader = gguf.GGUFReader(fn)
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise CheckpointError(f"{fn}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_HF:
        raise CheckpointError(f"{fn}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(_ARCH_TO_HF)})")
    tensors = {t.name: t for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    model_type, arch_name = _ARCH_TO_HF[arch]
    hf = {
        "architectures": [arch_name], "model_type": model_type, "hidden_act": "silu",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if model_type == "llama":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{fn}: GGUF rope scaling is not supported")

    cache: dict[str, np.ndarray] = {}

    def read(gname: str, permute_heads: int | None):
        if gname in cache:
            return cache[gname]
        t = tensors[gname]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if permute_heads:
            w = _unpermute(w, permute_heads)
        cache.clear()  # keep one tensor: shards of the same tensor are read back to back
        cache[gname] = w
        return w

    source: TensorSource = {}
    for gname in tensors:
        if gname in _TENSOR_NAMES:
            hf_name, perm = _TENSOR_NAMES[gname], None
        elif gname.startswith("blk."):
            _, i, rest = gname.split(".", 2)
            if rest not in _BLOCK_NAMES:
                raise CheckpointError(f"{fn}: unexpected GGUF tensor {gname}")
            hf_name = f"model.layers.{i}.{_BLOCK_NAMES[rest]}"
            perm = None
            if model_type == "llama" and rest.startswith("attn_q."):
                perm = heads
            elif model_type == "llama" and rest.startswith("attn_k."):
                perm = kv_heads
        else:
            continue  # e.g. rope_freqs: derived from the config
        source[hf_name] = lambda g=gname, p=perm: read(g, p)
    return hf, source


def gguf_tokenizer(fn: str):
    """A transformers tokenizer built from the GGUF metadata (vocab, merges, chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(fn)),
                                         gguf_file=os.path.basename(fn))
