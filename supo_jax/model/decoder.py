"""The decoder: one Flax NNX module for the Qwen2/2.5, Qwen3, Llama 3.x, Mistral, Seed-OSS
and SmolLM3 families (supo_jax.model.config).

Read top to bottom: the KV cache (write / read one layer's slots), RMSNorm, rotary
embedding (with llama3 / yarn / linear scaling), the block as plain functions (project_qkv: grouped
query projections with optional q/k/v bias and q/k RMSNorm; attend; block: attention
plus SwiGLU MLP) over a Frame of what all blocks of one forward share, and the stack.
Layer weights are stored stacked along a leading layer axis and the stack runs as one
`jax.lax.scan`, so compile time does not grow with depth.

Shapes: B batch, T new tokens, S cache length, E hidden, H query heads,
K key/value heads, D head dim, F MLP width, V vocab, L layers.

Two ways to call it:
  * training / scoring: `model(tokens, positions, segment_ids=...)`, causal
    within each row and, when segment ids are given, within each packed segment;
  * generation: `model(tokens, positions, cache=cache)` writes the new keys and
    values into the cache at `positions` (per row, so ragged rows need no
    padding tricks; an index >= S is dropped, which is how padding is ignored)
    and attends to every cache slot <= the query's position.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from supo_jax.model import platform
from supo_jax.model.attention import causal_attention, resolve, xla_attention
from supo_jax.model.config import ModelConfig
from supo_jax.model.lora import EXTRA_LAYER_PARAMS, base_weight, merge_adapters
from supo_jax.model.sharding import context_batch_axes

REMAT = ("auto", "none", "full", "dots", "offload", "offload_qkvo")
# the training LM head on a mesh (chunked_logprobs): "rows", each device its own rows' logits
# against the head gathered whole; "vocab", each device every row's logits over its slice of
# the vocabulary (the head never gathered; each chunk's activations are)
HEAD_SPLITS = ("rows", "vocab")
# remat "offload": each layer's input (named in the scan) kept in host memory, all else
# recomputed (MaxText's offloaded remat does the same for the decoder layer's input)
OFFLOAD_LAYER_INPUTS = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["decoder_layer_input"],
    offload_src="device", offload_dst="pinned_host")
PRECISIONS = ("auto", "default", "high", "highest")
# remat "offload_qkvo": as "offload", and each layer's q, k, v and attention-output projections
# kept in host memory too (MaxText's recipes' custom remat: decoder_layer_input, query_proj,
# key_proj, value_proj, out_proj offloaded); the backward recomputes less of each layer
OFFLOAD_QKVO = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[
        "decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"],
    offload_src="device", offload_dst="pinned_host")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys/values [L, B, K, S, D] and the number of valid tokens per row [B].

    Each (row, kv head) holds its keys as one contiguous [S, D] block: attention
    multiplies the cache as stored, with no per-step transpose of the whole cache.

    `k` and `v` may instead be tuples of L per-layer arrays (`split_layers`), keys
    transposed [B, K, D, S] and values [B, K, S, D]: the form the unrolled CPU decode
    loop carries. Each layer writes and reads its own arrays in place instead of
    slicing them out of the stack, and the scores are a plain [G, D] x [D, S] matmul
    per (row, kv head) (XLA's CPU backend runs q @ k^T against [S, D] keys ~2x slower).
    """
    k: jax.Array | tuple
    v: jax.Array | tuple
    lengths: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2] if self.per_layer else self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0] if self.per_layer else self.k.shape[1]

    def write(self, i, k, v, positions) -> "KVCache":
        """This cache with layer i's new keys and values k, v [B, K, T, D] stored at the slots
        `positions` [B, T] (per row; a slot >= S is dropped: how padding is ignored).
        i: a (traced) index into a stacked cache, a Python int into a per-layer one."""
        b, nk = k.shape[:2]
        rows, heads = jnp.arange(b)[:, None, None], jnp.arange(nk)[None, :, None]
        slots = positions[:, None, :]
        if self.per_layer:     # keys stored transposed [B, K, D, S]
            ks, vs = list(self.k), list(self.v)
            ks[i] = ks[i].at[rows, heads, :, slots].set(k.astype(ks[i].dtype), mode="drop")
            vs[i] = vs[i].at[rows, heads, slots].set(v.astype(vs[i].dtype), mode="drop")
            return KVCache(tuple(ks), tuple(vs), self.lengths)
        return KVCache(self.k.at[i, rows, heads, slots].set(k.astype(self.k.dtype), mode="drop"),
                       self.v.at[i, rows, heads, slots].set(v.astype(self.v.dtype), mode="drop"),
                       self.lengths)

    def read(self, i, span: int, dtype) -> tuple:
        """Layer i's first `span` slots in `dtype`: (keys, values). Values [B, K, span, D];
        keys the same from a stacked cache, transposed [B, K, D, span] from a per-layer one."""
        if self.per_layer:
            return self.k[i][..., :span].astype(dtype), self.v[i][:, :, :span].astype(dtype)
        layer = lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)[:, :, :span]
        return layer(self.k).astype(dtype), layer(self.v).astype(dtype)

    def split_layers(self, span: int) -> "KVCache":
        """The first `span` slots of every layer as per-layer arrays: keys [B, K, D, span]
        (transposed), values [B, K, span, D]."""
        cut = lambda a: tuple(a[i, :, :, :span] for i in range(a.shape[0]))
        return KVCache(tuple(k.swapaxes(-1, -2) for k in cut(self.k)), cut(self.v), self.lengths)

    def take_rows(self, rows, span: int) -> "KVCache":
        """Rows `rows` [n] (distinct) and their first `span` slots, as a stacked cache of n
        rows and `span` slots (what decode runs on when few rows take part)."""
        return KVCache(self.k[:, rows, :, :span], self.v[:, rows, :, :span], self.lengths[rows])

    def put_rows(self, rows, part: "KVCache") -> "KVCache":
        """This stacked cache with `part` (take_rows' result, updated) written back."""
        span = part.max_len
        return KVCache(self.k.at[:, rows, :, :span].set(part.k),
                       self.v.at[:, rows, :, :span].set(part.v),
                       self.lengths.at[rows].set(part.lengths))

    def merge_layers(self, part: "KVCache") -> "KVCache":
        """This stacked cache with its first slots replaced by `part`'s per-layer arrays.

        One in-place update per layer (stacking the parts first and writing the stack would
        copy the span twice: commit b493a2c has the measurement)."""
        span = part.max_len
        k, v = self.k, self.v
        for i, (pk, pv) in enumerate(zip(part.k, part.v)):
            k = k.at[i, :, :, :span].set(pk.swapaxes(-1, -2))
            v = v.at[i, :, :, :span].set(pv)
        return KVCache(k, v, part.lengths)


def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 like transformers."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x.astype(dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [D/2] in float32, with the config's frequency scaling
    (llama3: per-wavelength; yarn: NTK-by-parts between interpolation and extrapolation;
    linear: all divided by the factor)."""
    d, sc = cfg.head_dim, cfg.rope_scaling
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    if sc is None:
        return inv
    if sc.kind == "linear":
        return (inv / np.float32(sc.factor)).astype(np.float32)
    if sc.kind == "yarn":
        # dimension that makes `rotations` turns over the original context, per YaRN
        dim_at = lambda rotations: d * math.log(sc.original_max_position_embeddings
                                                / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        lo, hi = dim_at(sc.beta_fast), dim_at(sc.beta_slow)
        if sc.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - lo) / ((hi - lo) or 0.001), 0, 1)
        keep = 1 - ramp        # 1: high-frequency dims keep their frequency (extrapolate)
        return (inv / np.float32(sc.factor) * (1 - keep) + inv * keep).astype(np.float32)
    factor, lo, hi, orig = (sc.factor, sc.low_freq_factor, sc.high_freq_factor,
                            sc.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > orig / lo, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(emb, cfg: ModelConfig, dtype) -> tuple:
    """cos and sin of rotary angles `emb`, times YaRN's attention factor, in `dtype`."""
    scale = cfg.rope_scaling.attention_factor if cfg.rope_scaling is not None else 1.0
    if scale == 1.0:
        return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def rope_angles(positions, inv_freq):
    """Rotary angles [..., D] at integer positions [...] (float32)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    return jnp.concatenate([freqs, freqs], axis=-1)


def apply_rope(x, cos, sin):
    """Rotate-half rotary embedding. x [B, T, N, D], cos / sin [B, T, 1, D]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


@dataclasses.dataclass(frozen=True)
class Frame:
    """What every block of one forward shares: the rotary cos / sin [B, T, 1, D] of the
    new tokens, their positions [B, T] (= cache slots), the packed rows' segment ids, and
    with a cache the slots attended (`span`) and their mask [B, T, span] (slot <= position)."""
    cos: jax.Array
    sin: jax.Array
    positions: jax.Array
    segment_ids: jax.Array | None
    span: int
    mask: jax.Array | None
    impl: str                  # attention implementation (supo_jax.model.attention)
    precision: object          # lax.Precision of every matmul, None = the backend's default
    dtype: object              # compute dtype
    lora_scale: float = 0.0    # alpha / r of the adapters (supo_jax.model.lora); 0 = none
    mlp_chunks: int = 1        # the training path's MLP over the tokens in this many chunks

    def mm(self, a, w):
        return jnp.matmul(a, w.astype(self.dtype), precision=self.precision)

    def proj(self, h, lw: dict, name: str):
        """h @ layer weight `name` (dequantized if stored in int8), plus its adapters' low-rank
        product (alpha / r) (h @ A) @ B where it has them (supo_jax.model.lora)."""
        y = jnp.matmul(h, base_weight(lw, name, self.dtype), precision=self.precision)
        a = lw.get(f"{name}_lora_a")
        if a is not None and self.lora_scale:
            y = y + self.mm(self.mm(h, a), lw[f"{name}_lora_b"]) * self.lora_scale
        return y


def project_qkv(cfg: ModelConfig, f: Frame, h, lw: dict, i=0):
    """Queries [B, T, H, D] and keys, values [B, K, T, D] of the normed input h [B, T, E]
    of layer i, with bias and q / k norm where the family has them, rotated (unless layer
    i is one of SmolLM3's layers without position encoding)."""
    b, t = h.shape[:2]
    q, k, v = (checkpoint_name(f.proj(h, lw, w), name) for w, name in (
        ("wq", "query_proj"), ("wk", "key_proj"), ("wv", "value_proj")))  # remat offload_qkvo
    if cfg.qkv_bias:
        q, k, v = (a + lw[n].astype(f.dtype) for a, n in ((q, "bq"), (k, "bk"), (v, "bv")))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
    if cfg.rope_layers is None:
        q, k = apply_rope(q, f.cos, f.sin), apply_rope(k, f.cos, f.sin)
    else:   # i is traced inside the layer scan: select rather than branch
        rotate = jnp.asarray(cfg.rope_layers, bool)[i]
        q = jnp.where(rotate, apply_rope(q, f.cos, f.sin), q)
        k = jnp.where(rotate, apply_rope(k, f.cos, f.sin), k)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def attend(f: Frame, q, k, v, cache: KVCache | None, i):
    """q [B, T, H, D] over the new keys / values k, v [B, K, T, D] -> ([B, T, H, D], cache).

    Without a cache: causal within each row (and segment). With one: k, v are written into
    layer i's slots first and q attends over the first `f.span` slots, each query to the
    slots <= its position (every score for decode and short prefills, key blocks else)."""
    if cache is None:
        b, t = q.shape[:2]
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return causal_attention(q, k, v, q_index, f.segment_ids, impl=f.impl,
                                precision=f.precision), None
    cache = cache.write(i, k, v, f.positions)
    k, v = cache.read(i, f.span, f.dtype)
    if cache.per_layer or q.shape[1] * f.span <= 1024 * 1024:
        o = xla_attention(q, k, v, f.mask, k_transposed=cache.per_layer, precision=f.precision)
    else:
        o = causal_attention(q, k, v, f.positions, impl="blockwise", precision=f.precision)
    return o, cache


def block(cfg: ModelConfig, f: Frame, x, lw: dict, cache: KVCache | None = None, i=0):
    """One transformer block on x [B, T, E] with layer weights lw -> (x, cache)."""
    q, k, v = project_qkv(cfg, f, rms_norm(x, lw["ln1"], cfg.rms_norm_eps), lw, i)
    o, cache = attend(f, q, k, v, cache, i)
    x = x + checkpoint_name(f.proj(o.reshape(*x.shape[:2], cfg.num_heads * cfg.head_dim), lw,
                                   "wo"), "out_proj")
    h = rms_norm(x, lw["ln2"], cfg.rms_norm_eps)
    if f.mlp_chunks > 1 and cache is None:
        return x + chunked_mlp(f, h, lw, f.mlp_chunks), cache
    return x + mlp(f, h, lw), cache


def mlp(f: Frame, h, lw: dict):
    """The gated MLP of the normed input h [B, T, E]."""
    return f.proj(jax.nn.silu(f.proj(h, lw, "w_gate")) * f.proj(h, lw, "w_up"), lw, "w_down")


# an MLP weight gathered over the batch axes (fsdp), still split over tensor
_GATHERED = {"w_gate": P(None, "tensor"), "w_up": P(None, "tensor"), "w_down": P("tensor", None)}


def chunked_mlp(f: Frame, h, lw: dict, n: int):
    """mlp over the tokens in n chunks, each recomputed in the backward on its own: one
    chunk's intermediates ([B, T / n, F] each) live at a time, not the whole row's (on a chip
    holding 49,152 tokens the backward of one layer's MLP kept twelve [6, 8192, 14336] bf16
    buffers: experiments/LOG.md, 2026-12-06). The layer's weights are gathered once, before
    the chunks (else each chunk's backward gathers them again). Rows of T tokens, T % n == 0
    (a ValueError otherwise, when traced)."""
    b, t, e = h.shape
    if t % n:
        raise ValueError(f"model.mlp_chunks={n} must divide the row length ({t} tokens)")
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and "fsdp" in mesh.axis_names and "tensor" in mesh.axis_names:
        lw = {k: (jax.lax.with_sharding_constraint(w, _GATHERED[k])
                  if k in _GATHERED and w.dtype != jnp.int8 else w) for k, w in lw.items()}
    chunks = h.reshape(b, n, t // n, e).swapaxes(0, 1)            # [n, B, T / n, E]
    out = jax.lax.map(jax.checkpoint(lambda c: mlp(f, c, lw)), chunks)
    return out.swapaxes(0, 1).reshape(b, t, -1)


class Layers(nnx.Module):
    """All transformer blocks' weights, stacked on a leading layer axis [L, ...]."""

    def __init__(self, cfg: ModelConfig, param_dtype, rngs: nnx.Rngs):
        L, E, F, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        HD, KD = cfg.num_heads * D, cfg.num_kv_heads * D
        init = nnx.initializers.normal(0.02)

        def w(*shape):
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        def ones(*shape):
            return nnx.Param(jnp.ones(shape, param_dtype))

        def zeros(*shape):
            return nnx.Param(jnp.zeros(shape, param_dtype))

        self.ln1, self.ln2 = ones(L, E), ones(L, E)
        self.wq, self.wk, self.wv, self.wo = w(L, E, HD), w(L, E, KD), w(L, E, KD), w(L, HD, E)
        self.bq = zeros(L, HD) if cfg.qkv_bias else None
        self.bk = zeros(L, KD) if cfg.qkv_bias else None
        self.bv = zeros(L, KD) if cfg.qkv_bias else None
        self.q_norm = ones(L, D) if cfg.qk_norm else None
        self.k_norm = ones(L, D) if cfg.qk_norm else None
        self.w_gate, self.w_up, self.w_down = w(L, E, F), w(L, E, F), w(L, F, E)


LAYER_PARAMS = ("ln1", "ln2", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm",
                "w_gate", "w_up", "w_down")


class Decoder(nnx.Module):
    """The causal LM. Options beyond the weights (all static, part of the graph):

    remat: what the backward keeps of each layer's forward (the training path's scan):
      "none" everything, "full" only the layer's input (the rest is recomputed),
      "dots" the matmul outputs without batch dimensions (the projections; not the
      attention), "offload" as full with each layer's input kept in the host's memory
      (pinned_host) instead of the device's (TPU), "offload_qkvo" as offload with the q,
      k, v and attention-output projections kept there too (MaxText's recipes' policy:
      less recomputed), "auto" by the activations' size (`remat_mode`). A bool means
      full / none.
    attention: "auto" | "xla" | "blockwise" | "cudnn" | "splash" (supo_jax.model.attention).
    precision: matmul precision. "auto" = "highest" (true float32) when the compute dtype
      is float32 on an accelerator (XLA's default there is TF32 / one bf16 pass, which
      moves logits by ~1e-2), the backend's default otherwise; bf16 compute keeps 8
      mantissa bits per activation (logits differ from float32 by ~1e-2 .. 1e-1).
    """

    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, dtype=jnp.float32,
                 remat="auto", attention: str = "auto", precision: str = "auto",
                 mlp_chunks: int = 1, head_split: str = "rows", rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        if isinstance(remat, bool):
            remat = "full" if remat else "none"
        if remat not in REMAT:
            raise ValueError(f"model.remat={remat!r} is not one of {', '.join(REMAT)}")
        resolve(attention, dtype, 1, "cpu")           # validates the name
        if precision not in PRECISIONS:
            raise ValueError(f"model.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        self.remat, self.attention, self.precision = remat, attention, precision
        if int(mlp_chunks) < 1:
            raise ValueError(f"model.mlp_chunks={mlp_chunks} must be at least 1")
        self.mlp_chunks = int(mlp_chunks)
        if head_split not in HEAD_SPLITS:
            raise ValueError(f"model.head_split={head_split!r} is not one of "
                             f"{', '.join(HEAD_SPLITS)}")
        self.head_split = head_split
        self.lora = None           # supo_jax.model.lora.LoRA once adapters are added
        E, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (V, E), param_dtype))
        self.layers = Layers(cfg, param_dtype, rngs)
        self.final_norm = nnx.Param(jnp.ones((E,), param_dtype))
        self.lm_head = (None if cfg.tie_embeddings else
                        nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (E, V), param_dtype)))

    def _stacked(self) -> dict:
        """Every layer parameter, stacked [L, ...] (None where the family has none), and the
        adapters and int8 scales where present (supo_jax.model.lora)."""
        out = {n: (p[...] if p is not None else None)
               for n, p in ((n, getattr(self.layers, n)) for n in LAYER_PARAMS)}
        out.update({n: getattr(self.layers, n)[...] for n in EXTRA_LAYER_PARAMS
                    if getattr(self.layers, n, None) is not None})
        return out

    def layer_weights(self, merge: bool = True) -> list[dict]:
        """The stacked layer weights cut into one dict of arrays per layer, with the LoRA
        adapters merged into their weights where both the weights and the compute are
        float32 (supo_jax.model.lora.merge_adapters: the copy is made anyway) and `merge`
        is True. Elsewhere the copy keeps the adapters and the forward their low-rank
        product, as training computes it: cast to bfloat16, W + scale * A @ B would lose
        most of a small update.

        For token-by-token decoding on CPU: cut once outside the decode loop and pass
        as `layer_weights=`. A scan over the stack slices (copies) every layer's
        weights out of it at every step, which XLA's CPU backend does not fuse into
        the matmuls; the cut arrays are read in place. On TPU the scan's slices are
        cheap and the copy of the weights is not worth its memory.
        """
        stacked = self._stacked()
        if merge and self.lora is not None and jnp.dtype(self.dtype) == jnp.float32:
            stacked = merge_adapters(stacked, self.lora.scale)
        return [{n: (w[i] if w is not None else None) for n, w in stacked.items()}
                for i in range(self.cfg.num_layers)]

    def rope_table(self, n: int) -> tuple:
        """(cos, sin) [n, D] of the rotary angles of positions 0..n-1, in the compute dtype.

        For token-by-token decoding: computed once outside the decode loop and passed as
        `rope_table=`. Computed inside each step, XLA fuses the cos / sin into every
        layer's rotation of q and k and evaluates them per head and per layer."""
        emb = rope_angles(jnp.arange(n), jnp.asarray(rope_inv_freq(self.cfg)))
        return rope_cos_sin(emb, self.cfg, self.dtype)

    def matmul_precision(self):
        """The lax.Precision of every matmul (see the class docstring), None = default."""
        p = self.precision
        if p == "auto":
            f32 = jnp.dtype(self.dtype) == jnp.dtype(jnp.float32)
            p = "highest" if f32 and platform.backend() != "cpu" else "default"
        return None if p == "default" else jax.lax.Precision[p.upper()]

    def remat_mode(self, tokens: int) -> str:
        """The remat mode for a forward of `tokens` (batch x row length) tokens.

        auto: "none" while every layer's saved activations (about (6E + 2HD + 2KD + 4F)
        values per token, in the compute dtype) fit in an eighth of the device's memory
        (the host's RAM on CPU), "dots" while the matmul outputs alone ((2E + HD + 2KD +
        2F) per token) fit in a third, else "full", or on TPU "offload" when the layers'
        inputs a device keeps under full (E per token of its batch shard) exceed a quarter
        of its memory."""
        if self.remat != "auto":
            return self.remat
        c = self.cfg
        HD, KD = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        item = jnp.dtype(self.dtype).itemsize * tokens * c.num_layers
        every = (6 * c.hidden_size + 2 * HD + 2 * KD + 4 * c.intermediate_size) * item
        dots = (2 * c.hidden_size + HD + 2 * KD + 2 * c.intermediate_size) * item
        mem = _device_bytes()
        if every <= mem // 8:
            return "none"
        if dots <= mem // 3:
            return "dots"
        # full keeps each layer's input: offload it to the host when that alone would take a
        # quarter of a TPU's memory (per device: the batch is split over data x fsdp)
        mesh = jax.sharding.get_abstract_mesh()
        shards = 1 if mesh.empty else int(np.prod([mesh.shape[a] for a in ("data", "fsdp")
                                                   if a in mesh.axis_names]))
        inputs = c.hidden_size * item // shards
        return "offload" if platform.backend() == "tpu" and inputs > mem // 4 else "full"

    def head(self):
        """The LM head [E, V] in the compute dtype."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head.astype(self.dtype)

    def __call__(self, tokens, positions, *, segment_ids=None, cache: KVCache | None = None,
                 attend_len: int | None = None, layer_weights: list[dict] | None = None,
                 rope_table: tuple | None = None, logits_at=None):
        """tokens, positions [B, T] int32 -> (logits [B, T, V] float32, cache or None).

        Every argument as in `hidden`; `logits_at` [B] int: return only the logits at
        that index of each row, [B, 1, V] (prefill needs only the last new token's: the
        LM head's matmul over the other positions is skipped).
        """
        x, cache = self.hidden(tokens, positions, segment_ids=segment_ids, cache=cache,
                               attend_len=attend_len, layer_weights=layer_weights,
                               rope_table=rope_table)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        logits = jnp.dot(x, self.head(), preferred_element_type=jnp.float32,
                         precision=self.matmul_precision())
        return logits, cache

    def score(self, tokens, positions, targets, *, segment_ids=None, temperature: float = 1.0,
              chunk: int = 1024, entropy_grad: bool = False):
        """The training forward: (log p(targets) [B, T], entropy [B, T]), both float32, under
        the sampler's convention (log softmax(logits / T); T = 0 means 1). The LM head runs
        over `chunk` tokens at a time and is recomputed in the backward: no [B, T, V]
        tensor is ever held. The entropy comes out of the same pass (no gradient unless
        `entropy_grad`)."""
        x, _ = self.hidden(tokens, positions, segment_ids=segment_ids)
        return chunked_logprobs(x, self.head(), targets, temperature, chunk=chunk,
                                entropy_grad=entropy_grad, precision=self.matmul_precision(),
                                vocab_split=getattr(self, "head_split", "rows") == "vocab")

    def hidden(self, tokens, positions, *, segment_ids=None, cache: KVCache | None = None,
               attend_len: int | None = None, layer_weights: list[dict] | None = None,
               rope_table: tuple | None = None):
        """tokens, positions [B, T] int32 -> (final-normed hidden states [B, T, E], cache or None).

        With a cache, `attend_len` (static) limits attention to the first
        attend_len slots; every query must then have position < attend_len.
        With `layer_weights` (from `self.layer_weights()`), the layers run as an
        unrolled loop over those per-layer arrays instead of a scan over the stack; a
        cache must then be per-layer too (`KVCache.split_layers`).
        `rope_table` (from `self.rope_table(n)`): the rotary cos / sin of positions < n,
        looked up instead of computed (positions >= n read row n - 1: only for padding).
        """
        if cache is not None and (layer_weights is not None) != cache.per_layer:
            raise ValueError("per-layer weights (layer_weights=) go with a per-layer cache "
                             "(KVCache.split_layers), the layer scan with a stacked one")
        cfg = self.cfg
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        f = self.frame(positions, segment_ids, cache, attend_len, rope_table)
        if layer_weights is not None:      # unrolled over per-layer arrays
            for i, lw in enumerate(layer_weights):
                x, cache = block(cfg, f, x, lw, cache, i)
        else:                              # a scan over the stacked layers
            def step(carry, lw):
                x, cache, i = carry
                x = checkpoint_name(x, "decoder_layer_input")   # remat "offload" moves it
                x, cache = block(cfg, f, x, lw, cache, i)
                return (x, cache, i + 1), None

            mode = self.remat_mode(tokens.size) if cache is None else "none"
            if mode == "full":
                step = jax.checkpoint(step)
            elif mode == "offload":
                step = jax.checkpoint(step, policy=OFFLOAD_LAYER_INPUTS)
            elif mode == "offload_qkvo":
                step = jax.checkpoint(step, policy=OFFLOAD_QKVO)
            elif mode == "dots":
                step = jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            (x, cache, _), _ = jax.lax.scan(step, (x, cache, jnp.int32(0)), self._stacked())
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), cache

    def frame(self, positions, segment_ids=None, cache: KVCache | None = None,
              attend_len: int | None = None, rope_table: tuple | None = None) -> Frame:
        """The Frame of a forward over new tokens at `positions` [B, T] (see `hidden`)."""
        dt = self.dtype
        if rope_table is not None:     # rows of a precomputed table: no cos / sin here
            cos, sin = (jnp.take(a, positions, axis=0, mode="clip")[:, :, None, :]
                        for a in rope_table)
        else:
            emb = rope_angles(positions, jnp.asarray(rope_inv_freq(self.cfg)))[:, :, None, :]
            cos, sin = rope_cos_sin(emb, self.cfg, dt)
        span, mask = 0, None
        if cache is not None:
            span = attend_len or cache.max_len
            mask = jnp.arange(span)[None, None, :] <= positions[:, :, None]
        return Frame(cos, sin, positions, segment_ids, span, mask, self.attention,
                     self.matmul_precision(), dt,
                     self.lora.scale if self.lora is not None else 0.0,
                     getattr(self, "mlp_chunks", 1))


def _device_bytes() -> int:
    """Memory of one device: its allocator's limit on an accelerator, the host's RAM on CPU
    (a declared target's, supo_jax.model.platform, while programs are traced for one)."""
    if platform.device_bytes() is not None:
        return platform.device_bytes()
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:      # backends without memory stats
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


LOGIT_CHUNK_BYTES = 1 << 28     # a device's float32 logits of one chunk: at most 256 MiB


def chunked_logprobs(x, head, targets, temperature: float = 1.0, *, chunk: int = 1024,
                     entropy_grad: bool = False, precision=None,
                     chunk_bytes: int = LOGIT_CHUNK_BYTES, vocab_split: bool = False):
    """log softmax(x @ head / T)[targets] and the entropy of that distribution, `chunk`
    tokens at a time. x [B, T, E], head [E, V], targets [B, T] -> two float32 [B, T].
    A chunk is also cut to `chunk_bytes` of float32 logits on a device (its tokens times
    the vocabulary it holds): 8192 tokens of a 128K vocabulary are 4 GiB, and the backward
    holds two such chunks (a 16 GiB v5e chip cannot).

    Each chunk's logits are formed, reduced (log-sum-exp, the target's logit, sum p * logit)
    and dropped; the backward recomputes them (jax.checkpoint), so memory holds one chunk's
    logits, never [B, T, V]. Entropy = lse - sum_v p_v z_v comes from the same logits;
    without `entropy_grad` it is stop-gradient (reported only).

    Under a context mesh that splits the rows over data x fsdp, each chunk keeps them split
    (every device takes `chunk` tokens of its own rows) and the head is gathered whole over
    those axes (FSDP's weight gather; its gradient is reduce-scattered), its vocabulary
    split over `tensor` only: the vocabulary reductions are all-reduces of per-token scalars
    over `tensor`. A chunk of flattened tokens would instead be one row's, on every device,
    against a head split over its embedding dimension: XLA then all-reduces the whole
    [tokens, V] logits of every chunk across the mesh.

    `vocab_split` (model.head_split=vocab): the head stays split over its vocabulary on the
    tensor x fsdp devices (never gathered); each chunk's activations are gathered over fsdp
    instead, each device forms those rows' logits of its slice of the vocabulary, and the
    log-sum-exp, the target's logit and the entropy are all-reduces of per-token scalars.
    A 128K vocabulary's head is 2 GiB in bfloat16 at hidden 8192, gathered and its gradient
    held whole on every device; a chunk's activations are far smaller."""
    b, t, e = x.shape
    inv_t = 1.0 / (temperature if temperature > 0 else 1.0)
    axes, n = context_batch_axes()
    if b % n:                            # rows the mesh does not split: flattened chunks
        axes, n = (), 1
    mesh = jax.sharding.get_abstract_mesh()
    tensor = ("tensor" if n > 1 and "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1
              else None)
    manual = set(getattr(mesh, "manual_axes", ()))
    # vocab_split: the vocabulary over tensor x fsdp (tensor major: each device's slice lies in
    # the one its tensor index stores, so the head moves by an all-to-all over fsdp), each
    # chunk's rows gathered over fsdp and left split over data
    every = (tuple(a for a in ("tensor", "fsdp") if a in mesh.axis_names
                   and mesh.shape[a] > 1 and a not in manual)
             if vocab_split and not mesh.empty else ())
    kept = tuple(a for a in axes if a not in every)      # data, where it splits the rows

    @jax.checkpoint
    def one(xc, yc):
        if every:
            xc, yc = (jax.lax.with_sharding_constraint(a, P(kept or None)) for a in (xc, yc))
        z = jnp.dot(xc, head, preferred_element_type=jnp.float32, precision=precision) * inv_t
        if every:
            z = jax.lax.with_sharding_constraint(z, P(kept or None, None, every))
        lse = jax.nn.logsumexp(z, axis=-1)
        if tensor or every:   # the target's logit as a masked sum (exact: one term), which
            # a vocabulary split over devices reduces locally, where a gather would collect z
            vocab = jnp.arange(head.shape[1], dtype=jnp.int32)
            picked = jnp.sum(jnp.where(vocab == yc[..., None], z, 0.0), axis=-1)
        else:
            picked = jnp.take_along_axis(z, yc[..., None], axis=-1)[..., 0]
        logp = picked - lse
        zs = z if entropy_grad else jax.lax.stop_gradient(z)
        ls = lse if entropy_grad else jax.lax.stop_gradient(lse)
        ent = ls - jnp.sum(jnp.exp(zs - ls[..., None]) * zs, axis=-1)
        return logp, ent

    if every or n > 1:    # chunks within each row: `chunk` tokens a device a chunk, at most
        # chunk_bytes of float32 logits on a device (its rows x the chunk x its vocabulary)
        if every:
            split = every
            v = -(-head.shape[1] // math.prod(mesh.shape[a] for a in every))
            r = b // math.prod(mesh.shape[a] for a in kept)
        else:
            split, v, r = tensor, head.shape[1] // (mesh.shape[tensor] if tensor else 1), b // n
        c = max(1, min(t, chunk * n // b, chunk_bytes // (4 * v * r)))
        pad = -t % c
        xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, c, e).transpose(1, 0, 2, 3)
        ys = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad))).reshape(b, -1, c)
        ys = ys.transpose(1, 0, 2)
        if n > 1:
            xs = jax.lax.with_sharding_constraint(xs, P(None, axes))
            ys = jax.lax.with_sharding_constraint(ys, P(None, axes))
        head = jax.lax.with_sharding_constraint(head, P(None, split))
        logp, ent = jax.lax.map(lambda a: one(*a), (xs, ys))
        if every and n > 1:
            logp, ent = (jax.lax.with_sharding_constraint(a, P(None, axes)) for a in (logp, ent))
        back = lambda z: z.transpose(1, 0, 2).reshape(b, -1)[:, :t]   # noqa: E731
        return back(logp), back(ent)
    v = head.shape[1]
    n = b * t
    c = max(1, min(chunk, n, chunk_bytes // (4 * v)))
    pad = -n % c
    xs = jnp.pad(x.reshape(n, e), ((0, pad), (0, 0))).reshape(-1, c, e)
    ys = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad)).reshape(-1, c)
    logp, ent = jax.lax.map(lambda a: one(*a), (xs, ys))
    return logp.reshape(-1)[:n].reshape(b, t), ent.reshape(-1)[:n].reshape(b, t)

