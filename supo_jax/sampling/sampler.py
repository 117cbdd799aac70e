"""KV-cache generation: jitted prefill and decode over a preallocated cache.

Pure functions at the core:
  prefill(params, cache, tokens [B,T], num_new [B]) -> cache, last_logits [B,V]
      appends each row's first num_new[b] tokens at that row's current length
      (rows with num_new = 0 are untouched: this is the incremental, multi-turn
      prefill; a row's earlier tokens are never recomputed);
  prefill_rows(params, cache, rows [n], tokens [n,T], num_new [n]) -> cache, last_logits [n,V]
      the same on the listed rows alone (a freed row's next prompt costs one row's
      forward, not the batch's; decode(rows=...) likewise runs the rows still generating);
  decode(params, cache, last_logits, ...) -> cache, tokens [B,N], logprobs [B,N], counts [B]
      samples until every active row hit a stop token or its max new tokens, every row
      under one setting compiled in (the rollouts) or each row under its own temperature
      and top_p, passed as arrays (the server: requests with any settings share a call).
Every sampled token (stop tokens included) is written to the cache, so the next
turn's prefill continues exactly from what the policy saw.

Log-probability convention (the PPO ratio depends on it): the sampler returns the
log-probability of each token under the distribution it was drawn from:
log softmax(logits / T)[token] for temperature T > 0, renormalised over the tokens
top-k / top-p keep, and log softmax(logits)[token] for greedy (T = 0).
`token_logprobs` computes the untruncated quantity from a training forward pass, so RL
refuses top-k / top-p (config.validate): with them on, the ratio would not be the
behaviour policy's.

`Sampler` is the stateful host edge: it owns the cache for a fixed number of
rows, buckets shapes (prefill length and decode steps: powers of two; attention
span: 2^k or 3 * 2^(k-1)) so the number of compilations stays small, and logs each
new shape. A long generation runs as calls of `decode_chunk` steps, each attending
over the span its rows reach by the chunk's end (e.g. 64-token prompts + 128 new
tokens attend over 128 then 192 slots instead of 256 throughout; commit 1900d78 has the
timings).
"""
from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from supo_jax.model import platform
from supo_jax.model.decoder import KVCache
from supo_jax.model.policy import Policy, check_token_ids
from supo_jax.model.sharding import batch_sharding, put, replicated, spec_for
from supo_jax.model.weights import host_array

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def token_logprobs(logits, tokens, temperature: float = 1.0):
    """log p(token) under the sampler's convention. logits [..., V], tokens [...] -> [...]."""
    scaled = logits.astype(jnp.float32) / (temperature if temperature > 0 else 1.0)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _top_k_cut(logits, k: int):
    """logits [B, V] with every token below each row's k-th largest logit at -inf."""
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _top_p_cut(logits, top_p):
    """logits [B, V] with the tokens outside each row's nucleus at -inf: the smallest prefix
    of the tokens by probability whose mass reaches top_p (a float, or [B, 1] per row;
    always at least one token)."""
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    cutoff_idx = jnp.sum(cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx[:, None], axis=-1)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def _sample(keys, logits, sp: SamplingParams):
    """One token per row from logits [B, V] (row b drawn with keys[b]) under temperature /
    top-k / top-p, and its log-probability under the distribution it was drawn from (after
    truncation; greedy: log softmax(logits))."""
    logits = logits.astype(jnp.float32)
    if sp.temperature == 0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tok, token_logprobs(logits, tok, 0.0)
    logits = logits / sp.temperature
    if sp.top_k:
        logits = _top_k_cut(logits, sp.top_k)
    if sp.top_p < 1.0:
        logits = _top_p_cut(logits, sp.top_p)
    tok = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    return tok, token_logprobs(logits, tok, 1.0)


def _sample_rows(keys, logits, temperature, top_p, top_k: int):
    """`_sample` under each row's own settings: temperature [B] (0: that row is greedy),
    top_p [B] (1: off), top_k shared (static; 0: off). Rows with other settings share one
    decode program instead of one compiled program (and one decode call) per setting.

    A greedy row's token and log-probability are `_sample`'s at temperature 0 (argmax and
    log softmax of the same logits), whatever the rows beside it. A sampled row draws from
    softmax(top-k/top-p cut of logits / T) as `_sample` does, T a traced value rather than a
    constant. When no row samples, the drawing is skipped, and top_p's sort when no row
    truncates (lax.cond: a mix costs the sampling of one batch, not one per setting)."""
    logits = logits.astype(jnp.float32)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy_lp = token_logprobs(logits, greedy_tok, 0.0)
    hot = temperature > 0
    cut = top_p < 1.0

    def draw(_):
        scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
        if top_k:
            scaled = _top_k_cut(scaled, top_k)
        scaled = jax.lax.cond(
            jnp.any(cut & hot),
            lambda x: jnp.where(cut[:, None], _top_p_cut(x, top_p[:, None]), x),
            lambda x: x, scaled)
        tok = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return (jnp.where(hot, tok, greedy_tok),
                jnp.where(hot, token_logprobs(scaled, tok, 1.0), greedy_lp))

    return jax.lax.cond(jnp.any(hot), draw, lambda _: (greedy_tok, greedy_lp), None)


@partial(jax.jit, static_argnames=("graphdef", "attend_len"), donate_argnames=("cache",))
def prefill(graphdef, params, cache: KVCache, tokens, num_new, *, attend_len: int):
    """Append tokens[b, :num_new[b]] to each row. Returns (cache, logits at each row's last new token)."""
    return _prefill(graphdef, params, cache, tokens, num_new, attend_len)


@partial(jax.jit, static_argnames=("graphdef", "attend_len"), donate_argnames=("cache",))
def prefill_rows(graphdef, params, cache: KVCache, rows, tokens, num_new, *, attend_len: int):
    """`prefill` on the cache rows `rows` [n] (distinct) alone: tokens [n, T], num_new [n].
    The other rows are neither read nor computed, so a prompt for one new row costs one
    row's forward, not the whole batch's. Returns (cache, last logits [n, V])."""
    sub, last = _prefill(graphdef, params, cache.take_rows(rows, attend_len), tokens, num_new,
                         attend_len)
    return cache.put_rows(rows, sub), last


def _prefill(graphdef, params, cache: KVCache, tokens, num_new, attend_len: int):
    model = nnx.merge(graphdef, params)
    t = tokens.shape[1]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = jnp.where(offs < num_new[:, None], cache.lengths[:, None] + offs, cache.max_len)
    logits, cache = model(tokens, pos, cache=cache, attend_len=attend_len,
                          logits_at=jnp.maximum(num_new - 1, 0))
    last = logits[:, 0]
    return dataclasses.replace(cache, lengths=cache.lengths + num_new), last


@partial(jax.jit, static_argnames=("graphdef", "merge"))
def layer_weights(graphdef, params, merge: bool = True) -> list[dict]:
    """The policy's per-layer weights (Decoder.layer_weights): a copy of every layer's
    weights, float32 LoRA adapters merged in unless `merge` is False, for
    `decode(..., layers=)`."""
    return nnx.merge(graphdef, params).layer_weights(merge)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The decode loop's carry: the step, the cache, each row's last logits, the tokens and
    logprobs sampled so far [B, steps], which rows are done, and how many tokens each made."""
    step: jax.Array
    cache: KVCache
    logits: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    done: jax.Array
    counts: jax.Array


@partial(jax.jit, static_argnames=("graphdef", "steps", "attend_len", "sp", "unroll_layers"),
         donate_argnames=("cache",))
def decode(graphdef, params, cache: KVCache, last_logits, rng, active, max_new, stop_ids,
           streams, offsets, layers=None, rows=None, temperature=None, top_p=None, *,
           steps: int, attend_len: int, sp: SamplingParams, unroll_layers: bool = False):
    """Sample up to `steps` tokens for active rows.

    active [B] bool; max_new [B] int; stop_ids [B, K] int (-1 = unused).
    streams [B, 2] int, offsets [B] int: row b's token number offsets[b] + i of its
    generation is drawn with fold_in(fold_in(fold_in(rng, streams[b, 0]), streams[b, 1]),
    offsets[b] + i): a row's tokens depend on its own stream alone, not on which rows it
    decodes beside or how its generation is cut into calls.
    rows: None, or [n] distinct row indices holding every active row: the model then runs
    on those n rows alone (the others are neither read nor computed).
    temperature, top_p: None, every row sampled under `sp` (compiled in: the rollouts'
    path); or [B] float each, row b sampled under its own (`_sample_rows`; `sp` gives
    top_k alone), so rows with other settings share this call and its compiled program.
    unroll_layers: each step runs the layers unrolled over per-layer weights and per-layer
    caches of the attended span, both cut once per call (Decoder.layer_weights,
    KVCache.split_layers: faster on CPU, at the cost of a copy of that span of the cache
    while decode runs) instead of a scan over the stacked weights and cache.
    layers: `layer_weights(graphdef, params)`, when the caller keeps them across calls;
    else unroll_layers cuts them here, once per call.
    Returns (cache, last_logits, tokens [B, steps], logprobs [B, steps], counts [B]).
    """
    model = nnx.merge(graphdef, params)
    b = last_logits.shape[0]
    if not unroll_layers:
        layers = None
    elif layers is None:
        layers = model.layer_weights()                          # cut once, outside the loop
    rope = model.rope_table(attend_len)                         # once, outside the loop
    row_keys = jax.vmap(lambda a, c: jax.random.fold_in(jax.random.fold_in(rng, a), c))(
        streams[:, 0], streams[:, 1])
    full = cache
    if rows is not None:
        cache = cache.take_rows(rows, attend_len)               # the taking part rows' span
    base = cache
    if unroll_layers:
        cache = cache.split_layers(attend_len)                 # per-layer caches, once

    def cond(s: DecodeState):
        return (s.step < steps) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        keys = jax.vmap(jax.random.fold_in)(row_keys, offsets + s.counts)
        if temperature is None:
            tok, lp = _sample(keys, s.logits, sp)
        else:
            tok, lp = _sample_rows(keys, s.logits, temperature, top_p, sp.top_k)
        live = ~s.done
        counts = s.counts + live
        stop = jnp.any(tok[:, None] == stop_ids, axis=-1)
        run, ids = (live, tok) if rows is None else (live[rows], tok[rows])
        pos = jnp.where(run, s.cache.lengths, s.cache.max_len)[:, None]
        new_logits, cache = model(ids[:, None], pos, cache=s.cache, attend_len=attend_len,
                                  layer_weights=layers, rope_table=rope)
        new_logits = new_logits[:, 0]
        if rows is not None:     # rows outside `rows` are never live
            new_logits = s.logits.at[rows].set(new_logits)
        return DecodeState(
            step=s.step + 1,
            cache=dataclasses.replace(cache, lengths=cache.lengths + run),
            logits=jnp.where(live[:, None], new_logits, s.logits),
            tokens=s.tokens.at[:, s.step].set(jnp.where(live, tok, 0)),
            logprobs=s.logprobs.at[:, s.step].set(jnp.where(live, lp, 0.0)),
            done=s.done | stop | (counts >= max_new),
            counts=counts)

    init = DecodeState(step=jnp.int32(0), cache=cache, logits=last_logits.astype(jnp.float32),
                       tokens=jnp.zeros((b, steps), jnp.int32),
                       logprobs=jnp.zeros((b, steps), jnp.float32),
                       done=~active | (max_new <= 0), counts=jnp.zeros((b,), jnp.int32))
    s = jax.lax.while_loop(cond, body, init)
    cache, logits, toks, lps, counts = s.cache, s.logits, s.tokens, s.logprobs, s.counts
    if unroll_layers:
        cache = base.merge_layers(cache)
    if rows is not None:
        cache = full.put_rows(rows, cache)
    return cache, logits, toks, lps, counts


@partial(jax.jit, donate_argnames=("cache",))
def _copy_rows(cache: KVCache, src, dst, length):
    """Row dst gets row src's first `length` cache slots and length (prefix reuse)."""
    keep = (jnp.arange(cache.max_len) < length)[None, None, :, None]   # [L, K, S, D] per row
    k = cache.k.at[:, dst].set(jnp.where(keep, cache.k[:, src], cache.k[:, dst]))
    v = cache.v.at[:, dst].set(jnp.where(keep, cache.v[:, src], cache.v[:, dst]))
    return KVCache(k, v, cache.lengths.at[dst].set(length))


def bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """Smallest power of two >= n (at least `minimum`, at most `maximum`)."""
    b = max(minimum, 1 << max(0, int(n - 1).bit_length()))
    return min(b, maximum) if maximum is not None else b


def span_bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """Smallest 2^k or 3 * 2^(k-1) >= n (128, 192, 256, 384, ...; at least `minimum`, at
    most `maximum`): attention spans, where a power of two alone would attend over up to
    2x the slots needed."""
    p = bucket(n, 1)
    b = max(minimum, p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p)
    return min(b, maximum) if maximum is not None else b


# the cache's slots are a multiple of this (TPU tiles: a cache length that is not one makes
# XLA pad or copy the cache in the decode loop); rows still end at max_len
CACHE_MULTIPLE = 128


def cache_length(max_len: int) -> int:
    """The KV-cache slots a Sampler of `max_len` allocates: max_len rounded up to
    CACHE_MULTIPLE."""
    return -(-max_len // CACHE_MULTIPLE) * CACHE_MULTIPLE


# the most tokens a row prefills in one call: longer appends (a 64K-token context) run as
# several calls, so that a prefill's temporaries grow with this, not with the context
PREFILL_CHUNK = 4096
STOP_WIDTH = 4          # a decode row's stop ids, padded to a multiple of this


def row_settings(sampling: dict[int, SamplingParams], rows, batch: int
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """`decode`'s per-row settings from each of `rows`' SamplingParams: (temperature
    [batch], top_p [batch], top_k). Rows outside `rows` take no part: greedy, no top_p, so
    they never make the call draw or sort. top_k is one static value, so the rows must
    share it."""
    missing = sorted(set(rows) - set(sampling))
    if missing:
        raise ValueError(f"rows {missing} are generating without sampling settings")
    top_ks = {sampling[r].top_k for r in rows}
    if len(top_ks) > 1:
        raise ValueError(f"rows decoded together must share top_k, got {sorted(top_ks)}")
    temperature = np.zeros(batch, np.float32)
    top_p = np.ones(batch, np.float32)
    for r in rows:
        temperature[r], top_p[r] = sampling[r].temperature, sampling[r].top_p
    return temperature, top_p, top_ks.pop() if top_ks else 0


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]


class Sampler:
    """A fixed number of cache rows for one policy; rows persist across turns.

    rows: `batch` slots, each with its own cache and length. Typical multi-turn
    use: `append({row: prompt_ids})`, `generate([rows], ...)`, then
    `append({row: observation_ids})`, `generate(...)`, ...; `reset(row, n)` cuts
    a row back to its first n tokens (e.g. the initial prompt after a summary),
    `copy_prefix(src, dst, n)` starts a row from another row's cached prefix.
    """

    def __init__(self, policy: Policy, batch: int, max_len: int, *, cache_dtype=None,
                 min_prefill: int = 16, min_attend: int = 128, unroll_layers: bool | None = None,
                 decode_chunk: int = 64, prefill_chunk: int = PREFILL_CHUNK,
                 merge_adapters: bool = True, row_subsets: bool = True):
        if max_len <= 0 or batch <= 0:
            raise ValueError("batch and max_len must be positive")
        if decode_chunk and (decode_chunk < 8 or decode_chunk & (decode_chunk - 1)):
            raise ValueError(f"decode_chunk must be 0 (off) or a power of two >= 8, "
                             f"got {decode_chunk}")
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= 16, got {prefill_chunk}")
        self.decode_chunk, self.prefill_chunk = decode_chunk, prefill_chunk
        self.merge_adapters = merge_adapters   # float32 LoRA merged into the decode's copy
        # prefill and decode only the rows that take part when they are at most half the batch
        self.row_subsets = row_subsets
        self.policy = policy
        self.batch, self.max_len = batch, max_len
        slots = cache_length(max_len)
        self.min_prefill, self.min_attend = min_prefill, min_attend
        # decode's layers: unrolled over per-layer weights on CPU and GPU (Decoder.layer_weights:
        # the layer scan copies each layer's slice of the weights and cache at every step; see
        # BENCHMARKS.md); TPU keeps the scan (its slices are cheap, the weights' copy is not)
        self.unroll_layers = (platform.backend() in ("cpu", "gpu") if unroll_layers is None
                              else bool(unroll_layers))
        cfg = policy.config
        dt = cache_dtype or policy.model.dtype
        mesh = self.mesh = policy.mesh
        if mesh is None:
            cache = KVCache.zeros(cfg, batch, slots, dt)
            self.last_logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
        else:
            # made where it lives (a cache spanning processes is never on one host): rows
            # over the mesh's batch axes, kv heads over its tensor axis
            shape = (cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim)
            kv_sh = NamedSharding(mesh, spec_for(
                ("layers", "batch", "kv_heads", "cache_len", "head_dim"), shape, mesh))
            cache = jax.jit(partial(KVCache.zeros, cfg, batch, slots, dt), out_shardings=KVCache(
                kv_sh, kv_sh, batch_sharding(mesh, (batch,))))()
            self.last_logits = jax.jit(
                partial(jnp.zeros, (batch, cfg.vocab_size), jnp.float32),
                out_shardings=batch_sharding(mesh, (batch, cfg.vocab_size)))()
        self._cache, self._stale_lengths = cache, False
        self._layers = None        # (params leaves, their per-layer copy) for the unrolled decode
        self.lengths = np.zeros(batch, np.int64)  # host mirror of cache.lengths
        self.shapes_compiled: set[tuple] = set()
        # rows started and not yet ended: row -> (its tokens so far, budget left, stop ids,
        # its random stream)
        self.generating: dict[int, tuple[Generation, int, list[int], tuple[int, int]]] = {}
        self.slot_steps = self.live_steps = 0   # decode slot-steps run, and those of live rows

    @property
    def cache(self) -> KVCache:
        """The KV cache, its lengths brought up to date with the rows reset() cut back (one
        transfer for all of them, not an update op per reset)."""
        if self._stale_lengths:
            c = self._cache
            self._cache = dataclasses.replace(c, lengths=put(
                self.lengths.astype(np.int32), c.lengths.sharding))
            self._stale_lengths = False
        return self._cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self._cache = cache

    def _note_shape(self, key):
        if key not in self.shapes_compiled:
            self.shapes_compiled.add(key)
            log.info("sampler: new shape %s (%d compiled so far)", key, len(self.shapes_compiled))

    def _layer_weights(self, graphdef, params):
        """The unrolled decode's per-layer weights, cut once per version of the policy's
        weights (an update makes new arrays) rather than in every decode call. The copy
        lives as long as this sampler (the trainer makes a fresh one per rollout phase);
        float32 LoRA adapters are merged into it (merge_adapters=False keeps their product;
        bfloat16 always does: Decoder.layer_weights)."""
        if not self.unroll_layers:
            return None
        leaves = jax.tree.leaves(params)
        if self._layers is None or len(self._layers[0]) != len(leaves) or any(
                a is not b for a, b in zip(self._layers[0], leaves)):
            self._layers = None                        # free the old copy before cutting
            self._layers = (leaves, layer_weights(graphdef, params, self.merge_adapters))
        return self._layers[1]

    def _rows(self, x: np.ndarray):
        """A host array of one value per row (the same on every process) as a device array
        laid out like the cache's rows."""
        return jnp.asarray(x) if self.mesh is None else put(x, batch_sharding(self.mesh, x.shape))

    def _key(self, rng):
        """A PRNG key (the same on every process) placed on the whole mesh."""
        if self.mesh is None:
            return rng
        return jax.random.wrap_key_data(put(np.asarray(jax.random.key_data(rng)),
                                            replicated(self.mesh)))

    def _attend(self, need: int) -> int:
        return span_bucket(need, self.min_attend, self._cache.max_len)

    def append(self, new_tokens: dict[int, Sequence[int]]) -> None:
        """Prefill new tokens at the end of the given rows (incremental: earlier tokens are kept)."""
        new_tokens = {r: list(t) for r, t in new_tokens.items() if len(t)}
        if not new_tokens:
            return
        vocab = self.policy.config.vocab_size
        for r, toks in new_tokens.items():
            if not 0 <= r < self.batch:
                raise IndexError(f"row {r} outside [0, {self.batch})")
            check_token_ids(np.asarray(toks), vocab)
            if self.lengths[r] + len(toks) > self.max_len:
                raise ValueError(f"row {r}: {self.lengths[r]} cached + {len(toks)} new tokens "
                                 f"exceed the cache length {self.max_len}")
        longest = max(len(t) for t in new_tokens.values())
        for start in range(0, longest, self.prefill_chunk):
            self._prefill({r: t[start:start + self.prefill_chunk]
                           for r, t in new_tokens.items() if len(t) > start})

    def _subset(self, taking_part) -> np.ndarray | None:
        """The rows a prefill or decode call runs on when the rows taking part are at most
        half of the batch: those rows, their count bucketed to a power of two and padded
        with rows that take no part (distinct, so the scatter back is exact); None (the
        whole batch) otherwise, or on a sharded cache."""
        n = bucket(len(taking_part), 1)
        if not self.row_subsets or self.mesh is not None or 2 * n > self.batch:
            return None
        rows = sorted(taking_part)
        rows += [r for r in range(self.batch) if r not in taking_part][:n - len(rows)]
        return np.asarray(rows, np.int32)

    def _prefill(self, new_tokens: dict[int, list]) -> None:
        """One prefill call: each row's tokens (at most prefill_chunk) at its end. When
        the rows that have tokens fill at most half of the batch (a new task starting
        in a freed row while the others wait), only they are computed (`prefill_rows`,
        their count bucketed to a power of two; unsharded caches)."""
        longest = max(len(t) for t in new_tokens.values())
        t = bucket(longest, self.min_prefill, self._cache.max_len)
        sub = self._subset(new_tokens)
        rows = list(range(self.batch)) if sub is None else sub.tolist()
        arr = np.zeros((len(rows), t), np.int32)
        num = np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            toks = new_tokens.get(r, ())
            arr[i, :len(toks)] = toks
            num[i] = len(toks)
        idx = np.asarray(rows)
        attend = self._attend(int((self.lengths[idx] + num).max()))
        self._note_shape(("prefill", len(rows), t, attend))
        graphdef, params = self.policy.split()
        if len(rows) < self.batch:
            self.cache, last = prefill_rows(graphdef, params, self.cache, idx, arr, num,
                                            attend_len=attend)
            upd = jnp.asarray(num > 0)[:, None]
            self.last_logits = self.last_logits.at[idx].set(
                jnp.where(upd, last, self.last_logits[idx]))
        else:
            self.cache, last = prefill(graphdef, params, self.cache, self._rows(arr),
                                       self._rows(num), attend_len=attend)
            upd = self._rows(num > 0)[:, None]
            self.last_logits = jnp.where(upd, last, self.last_logits)
        self.lengths[idx] += num

    def generate(self, rows: Sequence[int], max_new_tokens, stop_tokens,
                 sampling: SamplingParams | dict[int, SamplingParams], rng,
                 streams: dict[int, tuple[int, int]] | None = None) -> dict[int, Generation]:
        """Sample continuations for `rows` (each must hold a non-empty context).

        max_new_tokens: int or {row: int}; stop_tokens: a set of ids or {row: set};
        sampling: as `advance` (one setting, or {row: SamplingParams}).
        Generation stops at a stop token (included in the output) or the budget.
        streams: as `start`. (`start`, then `advance` until every row has ended; no other
        row may be generating.)
        """
        if self.generating:
            raise RuntimeError(f"rows {sorted(self.generating)} are generating (start/advance)")
        self.start(rows, max_new_tokens, stop_tokens, streams)
        out = {}
        while self.generating:
            out.update(self.advance(sampling, rng))
        return {r: out[r] for r in rows}

    def start(self, rows: Sequence[int], max_new_tokens, stop_tokens,
              streams: dict[int, tuple[int, int]] | None = None) -> None:
        """Rows begin generating (each must hold a non-empty context): from the next
        `advance` on, they decode beside the rows already generating.
        max_new_tokens: int or {row: int}; stop_tokens: a set of ids or {row: set};
        streams: {row: (a, b)}, the random stream of each row's tokens (`decode`; default
        (row, 0)): two rows sampled at once need distinct streams."""
        rows = list(rows)
        mx = {r: int(max_new_tokens[r] if isinstance(max_new_tokens, dict) else max_new_tokens)
              for r in rows}
        for r in rows:
            if r in self.generating:
                raise ValueError(f"row {r} is already generating")
            if self.lengths[r] == 0:
                raise ValueError(f"row {r} has an empty context: append a prompt first")
            room = self.max_len - self.lengths[r]
            if mx[r] > room:
                raise ValueError(f"row {r}: {self.lengths[r]} cached + {mx[r]} new tokens "
                                 f"exceed the cache length {self.max_len}")
        for r in rows:
            stops = sorted(set(stop_tokens[r] if isinstance(stop_tokens, dict) else stop_tokens))
            self.generating[r] = (Generation([], []), mx[r], stops,
                                  tuple(streams[r]) if streams else (r, 0))

    def advance(self, sampling: SamplingParams | dict[int, SamplingParams], rng
                ) -> dict[int, Generation]:
        """One decode call over every generating row: up to decode_chunk steps (fewer when
        the rows need fewer), attending over the span its rows reach by the call's end;
        {row: Generation} of the rows that ended in it. Each row draws from its stream under
        `rng` (`decode`), whatever the calls its generation is cut into. Counts slot_steps
        (batch x the steps the call ran) and live_steps (the tokens it generated): the
        slots' utilisation.

        sampling: one SamplingParams for every row, compiled into the call (the rollouts'
        path: one program per setting); or {row: SamplingParams} for every generating row,
        passed as per-row arrays (`row_settings`: one program whatever the mix; the rows
        must share top_k). A greedy row's tokens are the same either way."""
        ended = {r: v[0] for r, v in self.generating.items() if v[1] <= 0}
        for r in ended:
            del self.generating[r]
        if not self.generating:
            return ended
        left = {r: v[1] for r, v in self.generating.items()}
        steps = bucket(max(left.values()), 8)
        if self.decode_chunk:
            steps = min(steps, self.decode_chunk)
        # stop ids padded (-1: none) to a multiple of STOP_WIDTH: rows whose stop sets differ
        # in size (a server's ignore_eos rows have none) share one decode program
        width = -(-max(1, max(len(v[2]) for v in self.generating.values())) // STOP_WIDTH
                  ) * STOP_WIDTH
        stop_ids = np.full((self.batch, width), -1, np.int32)
        active = np.zeros(self.batch, bool)
        max_new = np.zeros(self.batch, np.int32)
        streams = np.zeros((self.batch, 2), np.int32)
        offsets = np.zeros(self.batch, np.int32)
        for r, (g, n, st, stream) in self.generating.items():
            active[r], max_new[r] = True, min(n, steps)
            stop_ids[r, :len(st)] = st
            streams[r], offsets[r] = stream, len(g.tokens)
        attend = self._attend(int(max(self.lengths[r] + max_new[r] for r in left)))
        sub = self._subset(left)
        temperature = top_p = None
        if isinstance(sampling, dict):
            temperature, top_p, top_k = row_settings(sampling, left, self.batch)
            temperature, top_p = self._rows(temperature), self._rows(top_p)
            sampling = SamplingParams(top_k=top_k)
        self._note_shape(("decode", len(sub) if sub is not None else self.batch, steps,
                          attend, sampling if temperature is None else ("per row", top_k)))
        graphdef, params = self.policy.split()
        layers = self._layer_weights(graphdef, params)
        self.cache, self.last_logits, toks, lps, counts = decode(
            graphdef, params, self.cache, self.last_logits, self._key(rng), self._rows(active),
            self._rows(max_new), self._rows(stop_ids), self._rows(streams),
            self._rows(offsets), layers, sub, temperature, top_p,
            steps=steps, attend_len=attend, sp=sampling, unroll_layers=self.unroll_layers)
        toks, lps, counts = (host_array(x) for x in (toks, lps, counts))
        self.lengths += counts
        self.slot_steps += self.batch * int(counts.max())
        self.live_steps += int(counts.sum())
        for r in list(self.generating):
            g, n_left, st, stream = self.generating[r]
            n = int(counts[r])
            g.tokens += toks[r, :n].tolist()
            g.logprobs += lps[r, :n].tolist()
            n_left -= n
            if n_left == 0 or n < max_new[r] or (n and toks[r, n - 1] in st):
                ended[r] = g
                del self.generating[r]
            else:
                self.generating[r] = (g, n_left, st, stream)
        return ended

    def reset(self, row: int, length: int = 0) -> None:
        """Cut a row back to its first `length` cached tokens (e.g. the initial prompt)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens, cannot reset to {length}")
        self.lengths[row] = length
        self._stale_lengths = True
        # the next turn always appends before generating, which refreshes last_logits

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Start row dst from row src's first `length` cached tokens without recomputing them."""
        if not 0 < length <= self.lengths[src]:
            raise ValueError(f"row {src} holds {self.lengths[src]} tokens, cannot copy {length}")
        self.cache = _copy_rows(self.cache, src, dst, length)
        self.lengths[dst] = length


def generate(policy: Policy, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
             sampling: SamplingParams = SamplingParams(temperature=0.0), stop_tokens=None,
             seed: int = 0, max_len: int | None = None) -> list[Generation]:
    """One-shot batched generation for ragged prompts (token id lists). A generation ends at a
    stop token (included) or after max_new_tokens; stop_tokens=None stops at the model's
    end-of-sequence ids (its config's eos_token_id and its tokenizer's eos token), () never."""
    if not prompts:
        return []
    if stop_tokens is None:
        stop_tokens = policy.eos_ids
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    need = max(len(p) for p in prompts) + max_new_tokens
    max_len = max_len or bucket(need, 128)
    if need > max_len:
        raise ValueError(f"prompt of {need - max_new_tokens} tokens + {max_new_tokens} new "
                         f"tokens exceed max_len {max_len}")
    s = Sampler(policy, len(prompts), max_len)
    s.append({i: p for i, p in enumerate(prompts)})
    out = s.generate(range(len(prompts)), max_new_tokens, set(stop_tokens), sampling,
                     jax.random.key(seed))
    return [out[i] for i in range(len(prompts))]
