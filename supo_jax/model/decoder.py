"""The decoder: one Flax NNX module for the Qwen2/2.5, Qwen3 and Llama 3.x families.

Read top to bottom: RMSNorm, rotary embedding (with llama3 scaling), grouped
query attention (optional q/k/v bias, optional q/k RMSNorm), SwiGLU MLP, and
the stack. Layer weights are stored stacked along a leading layer axis and the
stack runs as one `jax.lax.scan`, so compile time does not grow with depth.

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from supo_jax.model.config import ModelConfig


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

    def split_layers(self, span: int) -> "KVCache":
        """The first `span` slots of every layer as per-layer arrays: keys [B, K, D, span]
        (transposed), values [B, K, span, D]."""
        cut = lambda a: tuple(a[i, :, :, :span] for i in range(a.shape[0]))
        return KVCache(tuple(k.swapaxes(-1, -2) for k in cut(self.k)), cut(self.v), self.lengths)

    def merge_layers(self, part: "KVCache") -> "KVCache":
        """This stacked cache with its first slots replaced by `part`'s per-layer arrays.

        One in-place update per layer (stacking the parts first and writing the stack
        copies the span twice: 250 vs 85 ms at batch 32, SmolLM2-135M, 192 slots)."""
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
    """Rotary inverse frequencies [D/2] in float32, with llama3 frequency scaling."""
    d = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    if cfg.rope_llama3 is None:
        return inv
    factor, lo, hi, orig = cfg.rope_llama3
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > orig / lo, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions, inv_freq):
    """Rotary angles [..., D] at integer positions [...] (float32)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    return jnp.concatenate([freqs, freqs], axis=-1)


def apply_rope(x, cos, sin):
    """Rotate-half rotary embedding. x [B, T, N, D], cos / sin [B, T, 1, D]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def attention(q, k, v, mask, *, k_transposed: bool = False):
    """Grouped-query attention. q [B,T,H,D], k/v [B,K,S,D], mask [B,T,S] -> [B,T,H,D].

    k_transposed: k is [B,K,D,S].

    The G = H/K query heads of each key/value head are folded into the rows of one
    [G*T, D] x [D, S] matmul per (batch, kv head): plain batched matmuls, which XLA's
    CPU backend runs ~1.6x faster than the equivalent 5-d einsum.
    """
    b, t, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    q = q.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    kt = k if k_transposed else k.swapaxes(-1, -2)
    scores = jnp.matmul(q, kt, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kh, g, t, -1) * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kh, g * t, -1)
    out = jnp.matmul(probs, v).reshape(b, kh, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d)


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
    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, dtype=jnp.float32,
                 remat: bool = False, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.remat = remat
        E, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (V, E), param_dtype))
        self.layers = Layers(cfg, param_dtype, rngs)
        self.final_norm = nnx.Param(jnp.ones((E,), param_dtype))
        self.lm_head = (None if cfg.tie_embeddings else
                        nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (E, V), param_dtype)))

    def _stacked(self) -> dict:
        """Every layer parameter, stacked [L, ...] (None where the family has none)."""
        return {n: (p[...] if p is not None else None)
                for n, p in ((n, getattr(self.layers, n)) for n in LAYER_PARAMS)}

    def layer_weights(self) -> list[dict]:
        """The stacked layer weights cut into one dict of arrays per layer.

        For token-by-token decoding on CPU: cut once outside the decode loop and pass
        as `layer_weights=`. A scan over the stack slices (copies) every layer's
        weights out of it at every step, which XLA's CPU backend does not fuse into
        the matmuls; the cut arrays are read in place (SmolLM2-135M decode, same-process
        A/B: 105 -> 92 ms per step at batch 8, 231 -> 216 at 32). On TPU the scan's slices are cheap and the copy of the
        weights is not worth its memory.
        """
        stacked = self._stacked()
        return [{n: (w[i] if w is not None else None) for n, w in stacked.items()}
                for i in range(self.cfg.num_layers)]

    def rope_table(self, n: int) -> tuple:
        """(cos, sin) [n, D] of the rotary angles of positions 0..n-1, in the compute dtype.

        For token-by-token decoding: computed once outside the decode loop and passed as
        `rope_table=`. Computed inside each step, XLA fuses the cos / sin into every
        layer's rotation of q and k and evaluates them per head and per layer (SmolLM2-135M
        decode at batch 32: ~4.5 ms of a ~150 ms step)."""
        emb = rope_angles(jnp.arange(n), jnp.asarray(rope_inv_freq(self.cfg)))
        return jnp.cos(emb).astype(self.dtype), jnp.sin(emb).astype(self.dtype)

    def __call__(self, tokens, positions, *, segment_ids=None, cache: KVCache | None = None,
                 attend_len: int | None = None, layer_weights: list[dict] | None = None,
                 rope_table: tuple | None = None, logits_at=None):
        """tokens, positions [B, T] int32 -> (logits [B, T, V] float32, cache or None).

        With a cache, `attend_len` (static) limits attention to the first
        attend_len slots; every query must then have position < attend_len.
        With `layer_weights` (from `self.layer_weights()`), the layers run as an
        unrolled loop over those per-layer arrays instead of a scan over the stack; a
        cache must then be per-layer too (`KVCache.split_layers`).
        `rope_table` (from `self.rope_table(n)`): the rotary cos / sin of positions < n,
        looked up instead of computed (positions >= n read row n - 1: only for padding).
        `logits_at` [B] int: return only the logits at that index of each row,
        [B, 1, V] (prefill needs only the last new token's: the LM head's matmul over
        the other positions is skipped).
        """
        cfg, dt = self.cfg, self.dtype
        b, t = tokens.shape
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if rope_table is not None:     # rows of a precomputed table: no cos / sin here
            cos, sin = (jnp.take(a, positions, axis=0, mode="clip")[:, :, None, :]
                        for a in rope_table)
        else:
            emb = rope_angles(positions, jnp.asarray(rope_inv_freq(cfg)))[:, :, None, :]
            cos, sin = jnp.cos(emb).astype(dt), jnp.sin(emb).astype(dt)
        if cache is None:
            idx = jnp.arange(t)
            mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, t, t))
            if segment_ids is not None:
                mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
            cache_kv = None
        else:
            s = attend_len or cache.max_len
            mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]
            cache_kv = (cache.k, cache.v)
        # cache write indices [B, K, T]: row b, kv head h, slot positions[b, t]
        rows = jnp.arange(b)[:, None, None]
        heads = jnp.arange(cfg.num_kv_heads)[None, :, None]
        slots = positions[:, None, :]

        def block(x, lw, kv, i):
            """One transformer block. kv: this layer's caches (k [B, K, D, S], v [B, K, S, D])
            when i is None, else the stacked caches [L, ...] and i the layer's index
            (kv None: no cache)."""
            c = lambda a: a.astype(dt)
            h = rms_norm(x, lw["ln1"], cfg.rms_norm_eps)
            q, k, v = h @ c(lw["wq"]), h @ c(lw["wk"]), h @ c(lw["wv"])
            if cfg.qkv_bias:
                q, k, v = q + c(lw["bq"]), k + c(lw["bk"]), v + c(lw["bv"])
            q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)      # [B, K, T, D]
            if kv is not None:
                ck, cv = kv
                if i is None:       # per-layer arrays, keys transposed
                    ck = ck.at[rows, heads, :, slots].set(k.astype(ck.dtype), mode="drop")
                    cv = cv.at[rows, heads, slots].set(v.astype(cv.dtype), mode="drop")
                    s = attend_len or cv.shape[2]
                    k, v = ck[..., :s].astype(dt), cv[:, :, :s].astype(dt)
                else:
                    ck = ck.at[i, rows, heads, slots].set(k.astype(ck.dtype), mode="drop")
                    cv = cv.at[i, rows, heads, slots].set(v.astype(cv.dtype), mode="drop")
                    s = attend_len or ck.shape[3]
                    k = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False)[:, :, :s].astype(dt)
                    v = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False)[:, :, :s].astype(dt)
                kv = (ck, cv)
            o = attention(q, k, v, mask, k_transposed=kv is not None and i is None)
            o = o.reshape(b, t, cfg.num_heads * cfg.head_dim)
            x = x + o @ c(lw["wo"])
            h = rms_norm(x, lw["ln2"], cfg.rms_norm_eps)
            x = x + (jax.nn.silu(h @ c(lw["w_gate"])) * (h @ c(lw["w_up"]))) @ c(lw["w_down"])
            return x, kv

        per_layer = cache is not None and cache.per_layer
        if (layer_weights is not None) != per_layer and cache is not None:
            raise ValueError("per-layer weights (layer_weights=) go with a per-layer cache "
                             "(KVCache.split_layers), the layer scan with a stacked one")
        if layer_weights is not None:
            kvs = list(zip(cache.k, cache.v)) if per_layer else [None] * len(layer_weights)
            for i, lw in enumerate(layer_weights):
                x, kvs[i] = block(x, lw, kvs[i], None)
            if per_layer:
                cache_kv = (tuple(k for k, _ in kvs), tuple(v for _, v in kvs))
        else:
            def step(carry, lw):
                x, kv, i = carry
                x, kv = block(x, lw, kv, i)
                return (x, kv, i + 1), None

            if self.remat:
                step = jax.checkpoint(step)
            (x, cache_kv, _), _ = jax.lax.scan(step, (x, cache_kv, jnp.int32(0)), self._stacked())
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head.astype(dt), preferred_element_type=jnp.float32)
        if cache is None:
            return logits, None
        return logits, KVCache(cache_kv[0], cache_kv[1], cache.lengths)
