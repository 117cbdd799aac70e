"""Causal grouped-query attention, one interface over four implementations.

    causal_attention(q, k, v, q_index, segment_ids=None, impl="auto", precision=None)

q [B, T, H, D]; k, v [B, K, S, D] (K key/value heads, H = G * K); q_index [B, T] int:
query t attends to key slot s iff s <= q_index[b, t] and (with segment ids
[B, T] = [B, S]) both carry the same id. Training rows pass q_index = arange(T) (packed
segments are kept apart by their ids; 0 marks padding, which attends only to padding);
prefill over a cache passes each new token's cache position. Returns [B, T, H, D].

Implementations (`impl`; "auto" picks per backend and row length, see `resolve`):
  xla        the plain computation: every [T, S] score is formed (and kept for the
             backward). Fastest for short rows; the reference the others are tested to.
  blockwise  flash attention in plain JAX (query and key blocks, online softmax, a
             custom VJP that recomputes the probabilities block by block from the saved
             log-sum-exp): memory linear in T, key blocks past a query block's last index
             are skipped. Runs on every backend; what CI tests.
  cudnn      cuDNN's fused attention (jax.nn.dot_product_attention) on NVIDIA GPUs, for
             bf16 / f16; rows that pack several segments go to `blockwise` (cuDNN's
             padding mask covers one sequence per row), decided per batch at run time.
  splash     the Pallas TPU splash-attention kernels that ship with jax (causal mask,
             segment ids, GQA as one MQA kernel per key/value head).
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from supo_jax.model import platform
from supo_jax.model.sharding import context_batch_axes

IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")
CPU_XLA_MAX = 512     # CPU rows up to this many tokens: every score at once (xla)
CPU_BLOCK = 64        # CPU: blockwise attention's query and key blocks
_NEG = -1e30          # finite: masked scores, and the running max before any key is seen


def resolve(impl: str, dtype, t: int, backend: str | None = None) -> str:
    """The implementation `impl` runs as for rows of t tokens in compute dtype `dtype`.

    auto: TPU -> splash; GPU -> cudnn in bf16 / f16, blockwise in float32 (cuDNN's fused
    kernels take no float32); CPU -> xla up to CPU_XLA_MAX tokens, blockwise (blocks of
    CPU_BLOCK) above. On one core, blockwise attention's forward and backward took a
    third of xla's time over 448-token rows and a fifth over 1024-token rows (xla's
    [T, T] scores and softmax outgrow the caches; small blocks also skip those past the
    diagonal). Up to 512 tokens xla stays: a run's rounding decides where the CPU recipe's
    SFT lands (blockwise at W = 446 took its held-out success after SFT from 0.53 to 0.94),
    and the recipe's committed figures were made with xla (experiments/LOG.md, 2026-12-06).
    """
    if impl not in IMPLS:
        raise ValueError(f"model.attention={impl!r} is not one of {', '.join(IMPLS)}")
    backend = backend or platform.backend()
    low = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "auto":
        if backend == "tpu":
            return "splash"
        if backend in ("gpu", "cuda", "rocm"):
            return "cudnn" if low and backend != "rocm" else "blockwise"
        return "xla" if t <= CPU_XLA_MAX else "blockwise"
    if impl == "cudnn" and not low:
        raise ValueError("model.attention=cudnn needs a bfloat16 / float16 compute dtype "
                         "(cuDNN's fused attention has no float32 kernels)")
    return impl


def causal_attention(q, k, v, q_index, segment_ids=None, *, impl: str = "auto", precision=None,
                     block_q: int | None = None, block_k: int | None = None):
    """block_q, block_k: blockwise attention's blocks (None: CPU_BLOCK on the CPU, else 512)."""
    impl = resolve(impl, q.dtype, q.shape[1])
    block = CPU_BLOCK if platform.backend() == "cpu" else 512
    block_q, block_k = block_q or block, block_k or block
    if impl == "xla":
        return xla_attention(q, k, v, _mask(q_index, k.shape[2], segment_ids), precision=precision)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, q_index, segment_ids, precision=precision,
                                   block_q=block_q, block_k=block_k)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, q_index, segment_ids, precision=precision)
    return splash_attention(q, k, v, segment_ids, interpret=platform.backend() != "tpu")


def _mask(q_index, s, segment_ids):
    """[B, T, S] bool: slot s visible to query t."""
    mask = jnp.arange(s)[None, None, :] <= q_index[:, :, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def xla_attention(q, k, v, mask, *, k_transposed: bool = False, precision=None):
    """Grouped-query attention over every score. q [B,T,H,D], k/v [B,K,S,D] (k [B,K,D,S]
    when k_transposed), mask [B,T,S] -> [B,T,H,D].

    The G = H/K query heads of each key/value head are folded into the rows of one
    [G*T, D] x [D, S] matmul per (batch, kv head): plain batched matmuls, which XLA's
    CPU backend runs ~1.6x faster than the equivalent 5-d einsum.
    """
    b, t, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    q = q.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    kt = k if k_transposed else k.swapaxes(-1, -2)
    scores = jnp.matmul(q, kt, preferred_element_type=jnp.float32, precision=precision)
    scores = scores.reshape(b, kh, g, t, -1) * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kh, g * t, -1)
    out = jnp.matmul(probs, v, precision=precision).reshape(b, kh, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d)


# --------------------------------------------------------------------------- blockwise

def blockwise_attention(q, k, v, q_index, segment_ids=None, *, precision=None,
                        block_q: int = 512, block_k: int = 512):
    """Flash attention in plain JAX; same contract as `causal_attention`."""
    b, t, h, d = q.shape
    kh, s = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    # [B, K, G, T, D]; padded queries see every real key, padded keys are seen by none
    qg = q.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4)
    qg = jnp.pad(qg, ((0, 0),) * 3 + ((0, tp - t), (0, 0)))
    qi = jnp.pad(q_index.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=s - 1)
    kp = jnp.pad(k, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
    if segment_ids is not None and s != t:
        raise ValueError("segment ids need keys = queries (training rows)")
    if segment_ids is None:
        qs = jnp.zeros((b, tp), jnp.int32)
        ks = jnp.zeros((b, sp), jnp.int32)
    else:
        qs = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
        ks = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, sp - s)), constant_values=-2)
    ks = jnp.where(jnp.arange(sp) < s, ks, -2)           # padded keys: a segment of none
    out = _flash(qg, kp, vp, qi, qs, ks, bq, bk, 1.0 / math.sqrt(d), precision)
    out = out[:, :, :, :t].transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d)


def _blocks(x, n, axis):
    """x with `axis` (length n * blk) cut into a new leading axis of n blocks."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _visible(qi, qs, ks, j, bk):
    """[B, 1, 1, bq, bk] bool: key block j's slots visible to a query block."""
    kidx = j * bk + jnp.arange(bk)
    vis = kidx[None, None, :] <= qi[:, :, None]
    vis = vis & (qs[:, :, None] == ks[:, None, :])
    return vis[:, None, None]


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, qi, qs, ks, bq, bk, scale, precision):
    return _flash_fwd(q, k, v, qi, qs, ks, bq, bk, scale, precision)[0]


def _flash_fwd(q, k, v, qi, qs, ks, bq, bk, scale, precision):
    """q [B,K,G,T,D], k/v [B,K,S,D] -> out [B,K,G,T,D] (q's dtype), lse [B,K,G,T] f32."""
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    qb, qib, qsb = _blocks(q, nq, 3), _blocks(qi, nq, 1), _blocks(qs, nq, 1)
    kb, vb, ksb = _blocks(k, nk, 2), _blocks(v, nk, 2), _blocks(ks, nk, 1)

    def one_q_block(args):
        qx, qix, qsx = args
        last = jnp.clip(jnp.max(qix) // bk + 1, 1, nk)   # key blocks past every index: skipped

        def body(j, carry):
            m, l, acc = carry
            sc = jnp.einsum("bkgqd,bkcd->bkgqc", qx, kb[j], precision=precision,
                            preferred_element_type=jnp.float32) * scale
            vis = _visible(qix, qsx, ksb[j], j, bk)
            sc = jnp.where(vis, sc, _NEG)
            m_new = jnp.maximum(m, sc.max(-1))
            p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + p.sum(-1)
            pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), vb[j], precision=precision,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        shape = qx.shape[:-1]
        init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(qx.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, last, body, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)

    out, lse = jax.lax.map(one_q_block, (qb, qib, qsb))
    out = jnp.moveaxis(out, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:-1])
    return out, (q, k, v, qi, qs, ks, out, lse)


def _flash_bwd(bq, bk, scale, precision, res, dout):
    q, k, v, qi, qs, ks, out, lse = res
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)   # [B,K,G,T]
    qb, qib, qsb = _blocks(q, nq, 3), _blocks(qi, nq, 1), _blocks(qs, nq, 1)
    dob, lseb, deltab = _blocks(dout, nq, 3), _blocks(lse, nq, 3), _blocks(delta, nq, 3)
    kb, vb, ksb = _blocks(k, nk, 2), _blocks(v, nk, 2), _blocks(ks, nk, 1)
    # the first query block that sees key block j (indices past j * bk somewhere in it)
    reach = jax.lax.cummax(jnp.max(qib, axis=(1, 2)))                       # [nq]

    def one_k_block(dq, j):
        kx, vx, ksx = kb[j], vb[j], ksb[j]
        first = jnp.searchsorted(reach, j * bk)

        def body(i, carry):
            dq, dk, dv = carry
            qx, dox = qb[i], dob[i]
            sc = jnp.einsum("bkgqd,bkcd->bkgqc", qx, kx, precision=precision,
                            preferred_element_type=jnp.float32) * scale
            vis = _visible(qib[i], qsb[i], ksx, j, bk)
            p = jnp.where(vis, jnp.exp(sc - lseb[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p.astype(dox.dtype), dox,
                                 precision=precision, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bkcd->bkgqc", dox, vx, precision=precision,
                            preferred_element_type=jnp.float32)
            ds = (p * (dp - deltab[i][..., None]) * scale).astype(qx.dtype)
            dq = dq.at[i].add(jnp.einsum("bkgqc,bkcd->bkgqd", ds, kx, precision=precision,
                                         preferred_element_type=jnp.float32))
            dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, qx, precision=precision,
                                 preferred_element_type=jnp.float32)
            return dq, dk, dv

        zeros = jnp.zeros(kx.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(first, nq, body, (dq, zeros, zeros))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_k_block, dq0, jnp.arange(nk))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape).astype(q.dtype)
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------- cudnn

def cudnn_attention(q, k, v, q_index, segment_ids=None, *, precision=None):
    """cuDNN fused attention for rows holding one causal sequence (then padding); a batch
    whose rows pack several segments, or whose query indices are not 0..T-1 (prefill
    into a cache), runs `blockwise` instead."""
    b, t = q.shape[:2]
    kt, vt = k.swapaxes(1, 2), v.swapaxes(1, 2)                  # [B, S, K, D]
    plain = jnp.all(q_index == jnp.arange(t)[None, :]) & (k.shape[2] == t)
    if segment_ids is None:
        lengths = jnp.full((b,), t, jnp.int32)
    else:
        lengths = jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)
        # one segment, id 1, then padding (id 0): what build_batch writes for unpacked rows
        plain = plain & jnp.all(segment_ids == jnp.where(
            jnp.arange(t)[None, :] < lengths[:, None], 1, 0))
    lengths = jnp.maximum(lengths, 1)

    def fused(q, kt, vt):
        return jax.nn.dot_product_attention(q, kt, vt, is_causal=True, query_seq_lengths=lengths,
                                            key_value_seq_lengths=lengths,
                                            implementation="cudnn")

    def fallback(q, kt, vt):
        return blockwise_attention(q, kt.swapaxes(1, 2), vt.swapaxes(1, 2), q_index,
                                   segment_ids, precision=precision)

    if k.shape[2] != t:           # a cache of another length: never one plain sequence
        return fallback(q, kt, vt)
    return jax.lax.cond(plain, fused, fallback, q, kt, vt)


# --------------------------------------------------------------------------- splash

def splash_attention(q, k, v, segment_ids=None, *, interpret: bool = False,
                     block: int = 512):
    """Pallas TPU splash attention, causal over training rows (q_index = arange(T), S = T).
    `interpret` runs the kernel in Pallas' interpreter (tests on CPU).

    The kernel's blocks are multiples of 128 tokens that divide the row: rows of another
    length (e.g. W = 446) are padded at the end to the next multiple of 128 (padded queries
    come after every real key, so causality keeps them out of the real rows; their outputs
    are dropped) and the block is the largest of `block`, 256, 128 that divides them."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t0, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    if k.shape[2] != t0:
        raise ValueError("splash attention covers training rows (keys = queries); "
                         "use model.attention=blockwise for prefill into a cache")
    t = -(-t0 // 128) * 128
    if t != t0:
        q = jnp.pad(q, ((0, 0), (0, t - t0), (0, 0), (0, 0)))
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, t - t0), (0, 0))) for a in (k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, t - t0)))
    blk = next(x for x in (min(block, t), 256, 128) if t % x == 0)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                          block_kv_dq=blk)
    mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * g)
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    qg = (q * (1.0 / math.sqrt(d))).astype(q.dtype)
    qg = qg.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4)        # [B, K, G, T, D]
    seg = segment_ids if segment_ids is not None else jnp.zeros((b, t), jnp.int32)

    def one(qx, kx, vx, sx):                  # qx [G, T, D], kx / vx [T, D], sx [T]
        return kernel(qx, kx, vx, segment_ids=sk.SegmentIds(q=sx, kv=sx))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))               # over kv heads
    out = _over_batch_shards(jax.vmap(per_head), qg, k, v, seg.astype(jnp.int32),
                             kernel=not interpret)                          # [B,K,G,T,D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)[:, :t0]


def _over_batch_shards(fn, *args, kernel: bool = True):
    """fn(*args) (arrays with the batch first), run per shard of the batch under shard_map
    where the context mesh (supo_jax.model.sharding.mesh_scope) splits it over data / fsdp:
    XLA cannot partition a Mosaic kernel itself. Without such a mesh, fn(*args). A batch the
    mesh's data x fsdp does not divide is a ValueError naming the settings when fn is a
    compiled `kernel` (XLA would refuse it; interpreted, it runs unpartitioned)."""
    from jax.sharding import PartitionSpec as P

    axes, n = context_batch_axes()
    if n > 1 and args[0].shape[0] % n and kernel:
        raise ValueError(
            f"splash attention runs per shard of the batch, and {args[0].shape[0]} rows a "
            f"micro-batch do not split over the mesh's data x fsdp = {n} devices: make "
            f"optim.minibatch_rows / optim.micro a multiple of {n} (fewer micro-batches), "
            "or move devices to mesh.tensor")
    if n == 1 or args[0].shape[0] % n:
        return fn(*args)
    spec = P(axes)
    return jax.shard_map(fn, in_specs=(spec,) * len(args), out_specs=spec,
                         check_vma=False)(*args)
