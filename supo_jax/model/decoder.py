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
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from supo_jax.model.attention import causal_attention, resolve, xla_attention
from supo_jax.model.config import ModelConfig

REMAT = ("auto", "none", "full", "dots")
PRECISIONS = ("auto", "default", "high", "highest")


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
      attention), "auto" by the activations' size (`remat_mode`). A bool means full / none.
    attention: "auto" | "xla" | "blockwise" | "cudnn" | "splash" (supo_jax.model.attention).
    precision: matmul precision. "auto" = "highest" (true float32) when the compute dtype
      is float32 on an accelerator (XLA's default there is TF32 / one bf16 pass, which
      moves logits by ~1e-2), the backend's default otherwise; bf16 compute keeps 8
      mantissa bits per activation (logits differ from float32 by ~1e-2 .. 1e-1).
    """

    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, dtype=jnp.float32,
                 remat="auto", attention: str = "auto", precision: str = "auto",
                 rngs: nnx.Rngs | None = None):
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
        the matmuls; the cut arrays are read in place. On TPU the scan's slices are
        cheap and the copy of the weights is not worth its memory.
        """
        stacked = self._stacked()
        return [{n: (w[i] if w is not None else None) for n, w in stacked.items()}
                for i in range(self.cfg.num_layers)]

    def rope_table(self, n: int) -> tuple:
        """(cos, sin) [n, D] of the rotary angles of positions 0..n-1, in the compute dtype.

        For token-by-token decoding: computed once outside the decode loop and passed as
        `rope_table=`. Computed inside each step, XLA fuses the cos / sin into every
        layer's rotation of q and k and evaluates them per head and per layer."""
        emb = rope_angles(jnp.arange(n), jnp.asarray(rope_inv_freq(self.cfg)))
        return jnp.cos(emb).astype(self.dtype), jnp.sin(emb).astype(self.dtype)

    def matmul_precision(self):
        """The lax.Precision of every matmul (see the class docstring), None = default."""
        p = self.precision
        if p == "auto":
            f32 = jnp.dtype(self.dtype) == jnp.dtype(jnp.float32)
            p = "highest" if f32 and jax.default_backend() != "cpu" else "default"
        return None if p == "default" else jax.lax.Precision[p.upper()]

    def remat_mode(self, tokens: int) -> str:
        """The remat mode for a forward of `tokens` (batch x row length) tokens.

        auto: "none" while every layer's saved activations (about (6E + 2HD + 2KD + 4F)
        values per token, in the compute dtype) fit in an eighth of the device's memory
        (the host's RAM on CPU), "dots" while the matmul outputs alone ((2E + HD + 2KD +
        2F) per token) fit in a third, else "full"."""
        if self.remat != "auto":
            return self.remat
        c = self.cfg
        HD, KD = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        item = jnp.dtype(self.dtype).itemsize * tokens * c.num_layers
        every = (6 * c.hidden_size + 2 * HD + 2 * KD + 4 * c.intermediate_size) * item
        dots = (2 * c.hidden_size + HD + 2 * KD + 2 * c.intermediate_size) * item
        mem = _device_bytes()
        return "none" if every <= mem // 8 else "dots" if dots <= mem // 3 else "full"

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
                                entropy_grad=entropy_grad, precision=self.matmul_precision())

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
        cfg, dt = self.cfg, self.dtype
        prec = self.matmul_precision()
        b, t = tokens.shape
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        if rope_table is not None:     # rows of a precomputed table: no cos / sin here
            cos, sin = (jnp.take(a, positions, axis=0, mode="clip")[:, :, None, :]
                        for a in rope_table)
        else:
            emb = rope_angles(positions, jnp.asarray(rope_inv_freq(cfg)))[:, :, None, :]
            cos, sin = jnp.cos(emb).astype(dt), jnp.sin(emb).astype(dt)
        if cache is None:
            q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            cache_kv = None
        else:
            s = attend_len or cache.max_len
            cache_kv = (cache.k, cache.v)
            mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]
        # cache write indices [B, K, T]: row b, kv head h, slot positions[b, t]
        rows = jnp.arange(b)[:, None, None]
        heads = jnp.arange(cfg.num_kv_heads)[None, :, None]
        slots = positions[:, None, :]
        mm = lambda a, w: jnp.matmul(a, w.astype(dt), precision=prec)

        def block(x, lw, kv, i):
            """One transformer block. kv: this layer's caches (k [B, K, D, S], v [B, K, S, D])
            when i is None, else the stacked caches [L, ...] and i the layer's index
            (kv None: no cache)."""
            h = rms_norm(x, lw["ln1"], cfg.rms_norm_eps)
            q, k, v = mm(h, lw["wq"]), mm(h, lw["wk"]), mm(h, lw["wv"])
            if cfg.qkv_bias:
                q, k, v = (a + lw[n].astype(dt) for a, n in ((q, "bq"), (k, "bk"), (v, "bv")))
            q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)      # [B, K, T, D]
            if kv is None:
                o = causal_attention(q, k, v, q_index, segment_ids, impl=self.attention,
                                     precision=prec)
            else:
                ck, cv = kv
                if i is None:       # per-layer arrays, keys transposed
                    ck = ck.at[rows, heads, :, slots].set(k.astype(ck.dtype), mode="drop")
                    cv = cv.at[rows, heads, slots].set(v.astype(cv.dtype), mode="drop")
                    k, v = ck[..., :s].astype(dt), cv[:, :, :s].astype(dt)
                else:
                    ck = ck.at[i, rows, heads, slots].set(k.astype(ck.dtype), mode="drop")
                    cv = cv.at[i, rows, heads, slots].set(v.astype(cv.dtype), mode="drop")
                    k = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False)[:, :, :s].astype(dt)
                    v = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False)[:, :, :s].astype(dt)
                kv = (ck, cv)
                if i is None or t * s <= 1024 * 1024:   # decode, short prefill: every score
                    o = xla_attention(q, k, v, mask, k_transposed=i is None, precision=prec)
                else:                                   # long prefill: key blocks
                    o = causal_attention(q, k, v, positions, impl="blockwise", precision=prec)
            o = o.reshape(b, t, cfg.num_heads * cfg.head_dim)
            x = x + mm(o, lw["wo"])
            h = rms_norm(x, lw["ln2"], cfg.rms_norm_eps)
            x = x + mm(jax.nn.silu(mm(h, lw["w_gate"])) * mm(h, lw["w_up"]), lw["w_down"])
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

            mode = self.remat_mode(b * t) if cache is None else "none"
            if mode == "full":
                step = jax.checkpoint(step)
            elif mode == "dots":
                step = jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            (x, cache_kv, _), _ = jax.lax.scan(step, (x, cache_kv, jnp.int32(0)), self._stacked())
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        if cache is None:
            return x, None
        return x, KVCache(cache_kv[0], cache_kv[1], cache.lengths)


def _device_bytes() -> int:
    """Memory of one device: its allocator's limit on an accelerator, the host's RAM on CPU."""
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


def chunked_logprobs(x, head, targets, temperature: float = 1.0, *, chunk: int = 1024,
                     entropy_grad: bool = False, precision=None):
    """log softmax(x @ head / T)[targets] and the entropy of that distribution, `chunk`
    tokens at a time. x [B, T, E], head [E, V], targets [B, T] -> two float32 [B, T].

    Each chunk's logits [chunk, V] are formed, reduced (log-sum-exp, the target's logit,
    sum p * logit) and dropped; the backward recomputes them (jax.checkpoint), so memory
    holds one chunk's logits, never [B, T, V]. Entropy = lse - sum_v p_v z_v comes from
    the same logits; without `entropy_grad` it is stop-gradient (reported only)."""
    b, t, e = x.shape
    n = b * t
    c = max(1, min(chunk, n))
    pad = -n % c
    xs = jnp.pad(x.reshape(n, e), ((0, pad), (0, 0))).reshape(-1, c, e)
    ys = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad)).reshape(-1, c)
    inv_t = 1.0 / (temperature if temperature > 0 else 1.0)

    @jax.checkpoint
    def one(xc, yc):
        z = jnp.dot(xc, head, preferred_element_type=jnp.float32, precision=precision) * inv_t
        lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, yc[:, None], axis=-1)[:, 0] - lse
        zs = z if entropy_grad else jax.lax.stop_gradient(z)
        ls = lse if entropy_grad else jax.lax.stop_gradient(lse)
        ent = ls - jnp.sum(jnp.exp(zs - ls[:, None]) * zs, axis=-1)
        return logp, ent

    logp, ent = jax.lax.map(lambda a: one(*a), (xs, ys))
    return logp.reshape(-1)[:n].reshape(b, t), ent.reshape(-1)[:n].reshape(b, t)
