"""Attention implementations, the chunked LM head and remat against the plain computation:
values and gradients, with causal masking, packed segments, GQA and padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from supo_jax.model.attention import (_mask, blockwise_attention, causal_attention, resolve,
                                      splash_attention, xla_attention)
from supo_jax.model.decoder import Decoder, chunked_logprobs
from supo_jax.model.tiny import tiny_config
from flax import nnx


@pytest.fixture(autouse=True)
def _true_float32():
    """Reference comparisons in float32: XLA's default on GPU (TF32) and TPU (one bf16 pass)
    would differ from the plain computation by ~1e-3, whatever the implementation."""
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(b, t, h, kh, d, s=None, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    s = s or t
    return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, kh, s, d)),
            jax.random.normal(ks[2], (b, kh, s, d)), jax.random.normal(ks[3], (b, t, h, d)))


def _packed_segments(b, t):
    """Row 0: two segments then padding (0); row 1: one segment then padding."""
    seg = np.ones((b, t), np.int32)
    seg[0, t // 3: 2 * t // 3] = 2
    seg[0, 2 * t // 3 + 5:] = 0
    seg[1, t - 9:] = 0
    return jnp.asarray(seg)


def _value_and_grads(fn, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    return fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("heads,kv_heads,segments,bq,bk", [
    (4, 2, True, 64, 32),      # GQA, packed segments + padding, blocks not dividing T
    (4, 4, False, 48, 64),     # MHA, plain causal
    (6, 1, True, 200, 200),    # MQA, one block
])
def test_blockwise_equals_plain_values_and_grads(heads, kv_heads, segments, bq, bk):
    b, t, d = 2, 200, 16
    q, k, v, w = _inputs(b, t, heads, kv_heads, d)
    qi = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = _packed_segments(b, t) if segments else None
    ref_o, ref_g = _value_and_grads(lambda q, k, v: xla_attention(q, k, v, _mask(qi, t, seg)),
                                    q, k, v, w)
    out, g = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, qi, seg, block_q=bq,
                                                                  block_k=bk), q, k, v, w)
    np.testing.assert_allclose(out, ref_o, atol=2e-6)
    for a, r in zip(g, ref_g):
        np.testing.assert_allclose(a, r, atol=2e-5 * float(jnp.abs(r).max()))


def test_blockwise_prefill_into_longer_cache():
    """Queries at cache positions (ragged rows) over a longer cache, as prefill calls it."""
    b, t, s = 2, 100, 300
    q, k, v, _ = _inputs(b, t, 4, 2, 16, s=s)
    pos = jnp.stack([jnp.arange(t) + 50, jnp.arange(t) + 3])
    np.testing.assert_allclose(blockwise_attention(q, k, v, pos, block_q=32, block_k=64),
                               xla_attention(q, k, v, _mask(pos, s, None)), atol=2e-6)


def test_blockwise_bfloat16_close_to_float32():
    b, t = 1, 256
    q, k, v, _ = _inputs(b, t, 4, 2, 32)
    qi = jnp.broadcast_to(jnp.arange(t), (b, t))
    ref = xla_attention(q, k, v, _mask(qi, t, None))
    low = blockwise_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)), qi, block_q=64,
                              block_k=64)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), ref, atol=0.05)


@pytest.mark.slow
def test_splash_interpreted_equals_plain():
    """The TPU splash kernel (Pallas interpreter on CPU) through the same interface:
    packed segments, GQA; values and gradients."""
    b, t = 2, 128
    q, k, v, w = _inputs(b, t, 4, 2, 16)
    qi = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = _packed_segments(b, t)
    ref_o, ref_g = _value_and_grads(lambda q, k, v: xla_attention(q, k, v, _mask(qi, t, seg)),
                                    q, k, v, w)
    out, g = _value_and_grads(lambda q, k, v: splash_attention(q, k, v, seg, interpret=True,
                                                               block=128), q, k, v, w)
    np.testing.assert_allclose(out, ref_o, atol=2e-5)
    for a, r in zip(g, ref_g):
        np.testing.assert_allclose(a, r, atol=2e-4 * float(jnp.abs(r).max()))


def test_resolve_by_backend_and_errors():
    assert resolve("auto", jnp.float32, 512, "cpu") == "xla"
    assert resolve("auto", jnp.float32, 513, "cpu") == "blockwise"
    assert resolve("auto", jnp.float32, 4096, "cpu") == "blockwise"
    assert resolve("auto", jnp.bfloat16, 4096, "gpu") == "cudnn"
    assert resolve("auto", jnp.float32, 4096, "gpu") == "blockwise"
    assert resolve("auto", jnp.bfloat16, 64, "tpu") == "splash"
    with pytest.raises(ValueError, match="cudnn needs a bfloat16"):
        resolve("cudnn", jnp.float32, 64, "gpu")
    with pytest.raises(ValueError, match="model.attention='flash'"):
        resolve("flash", jnp.float32, 64)


def _logits_case(b, t, e, vocab, seed):
    """Activations x [b, t, e], a head [e, vocab], targets y and the full softmax's (log p(y),
    entropy) at temperature 0.7, as a function of (x, head)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (b, t, e))
    head = jax.random.normal(ks[1], (e, vocab))
    y = jax.random.randint(ks[2], (b, t), 0, vocab)

    def full(x, head):
        lp = jax.nn.log_softmax(x @ head / 0.7, -1)
        return (jnp.take_along_axis(lp, y[..., None], -1)[..., 0],
                -jnp.sum(jnp.exp(lp) * lp, -1))
    return x, head, y, full


def test_chunked_logprobs_equal_full_softmax():
    """Chunks that do not divide B*T, temperature, and the gradients of logp and entropy."""
    x, head, y, full = _logits_case(3, 7, 8, 50, 1)

    logp, ent = chunked_logprobs(x, head, y, 0.7, chunk=4, entropy_grad=True)
    rlogp, rent = full(x, head)
    np.testing.assert_allclose(logp, rlogp, atol=1e-5)
    # the chunked entropy is log Z - E[z], which cancels: 7e-6 from a float64 reference where
    # XLA's CPU code is LLVM level 3 and 1.2e-5 at level 1 (supo_jax.utils.cpu_compile_level),
    # the direct sum 4e-7 (experiments/results/cpu_llvm_level_2026-12-07/entropy_check.jsonl);
    # and a wrong temperature moves every entry by far more than the tolerance
    np.testing.assert_allclose(ent, rent, atol=3e-5)
    assert np.abs(chunked_logprobs(x, head, y, 0.75, chunk=4)[1] - rent).min() > 1e-2
    for which in (0, 1):
        g = jax.grad(lambda x, h: chunked_logprobs(x, h, y, 0.7, chunk=4, entropy_grad=True)
                     [which].sum(), (0, 1))(x, head)
        rg = jax.grad(lambda x, h: full(x, h)[which].sum(), (0, 1))(x, head)
        for a, r in zip(g, rg):
            np.testing.assert_allclose(a, r, atol=1e-4)
    # reported entropy carries no gradient
    g = jax.grad(lambda h: chunked_logprobs(x, h, y, 0.7, chunk=4)[1].sum())(head)
    assert float(jnp.abs(g).max()) == 0.0


def test_chunked_logprobs_on_a_mesh_keep_rows_split_and_the_values():
    """Under a mesh that splits the rows (data 2 x fsdp 2, the vocabulary over tensor 2):
    the same log-probabilities, entropies and gradients as the full softmax; under FSDP the
    compiled program all-reduces no [tokens, V] logits."""
    import re

    from supo_jax.model.sharding import make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them on the CPU)")
    mesh = make_mesh(2, 2, 2, devices=jax.devices()[:8])
    b, t, e, vocab = 8, 12, 16, 64
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    x = jax.random.normal(ks[0], (b, t, e))
    head = jax.random.normal(ks[1], (e, vocab))
    y = jax.random.randint(ks[2], (b, t), 0, vocab)
    full = jax.nn.log_softmax(x @ head / 0.7, -1)
    want = (jnp.take_along_axis(full, y[..., None], -1)[..., 0], -jnp.sum(jnp.exp(full) * full, -1))
    f = jax.jit(lambda x, h: chunked_logprobs(x, h, y, 0.7, chunk=10, entropy_grad=True))
    g = jax.jit(jax.grad(lambda x, h: sum(v.sum() for v in chunked_logprobs(
        x, h, y, 0.7, chunk=10, entropy_grad=True)), (0, 1)))
    rg = jax.grad(lambda x, h: sum(v.sum() for v in (
        jnp.take_along_axis(jax.nn.log_softmax(x @ h / 0.7, -1), y[..., None], -1),
        -jnp.sum(jax.nn.softmax(x @ h / 0.7, -1) * jax.nn.log_softmax(x @ h / 0.7, -1), -1))),
        (0, 1))(x, head)
    with jax.set_mesh(mesh):
        from jax.sharding import NamedSharding, PartitionSpec as P
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        hs = jax.device_put(head, NamedSharding(mesh, P("fsdp", "tensor")))
        got = f(xs, hs)
        grads = g(xs, hs)
    for a, r in zip(got, want):       # (entropy = lse - sum p z: float32 cancellation)
        np.testing.assert_allclose(a, r, atol=1e-4)
    for a, r in zip(grads, rg):
        np.testing.assert_allclose(a, r, atol=1e-4)
    # FSDP over 8 devices, 2048 tokens of a 1024-token vocabulary: the head's gradient is the
    # largest all-reduce (flattened chunks all-reduced [256, V] logits here)
    b, t, e, vocab = 8, 256, 64, 1024
    mesh = make_mesh(1, 8, 1, devices=jax.devices()[:8])
    y = jnp.zeros((b, t), jnp.int32)
    g = jax.jit(jax.grad(lambda x, h: chunked_logprobs(x, h, y, chunk=512)[0].sum(), (0, 1)))
    with jax.set_mesh(mesh):
        hlo = g.lower(jax.device_put(jnp.ones((b, t, e)), NamedSharding(mesh, P("fsdp"))),
                      jax.device_put(jnp.ones((e, vocab)), NamedSharding(mesh, P("fsdp")))
                      ).compile().as_text()
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"f32\[([\d,]*)\][^\n]*all-reduce\(", hlo)]
    assert sizes and max(sizes) <= e * vocab, sizes


def test_a_head_split_over_the_vocabulary_gives_the_values_and_is_never_gathered():
    """model.head_split=vocab: under data 2 x fsdp 2 x tensor 2 the same log-probabilities,
    entropies and gradients as the full softmax; under FSDP over 8 the compiled backward
    gathers no whole head (the rows split's does: its all-gathers' largest is [E, V])."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    from supo_jax.model.sharding import make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them on the CPU)")
    x, head, y, ref = _logits_case(8, 12, 16, 64, 3)

    def total(fn):
        return lambda x, h: sum(v.sum() * (i + 1) for i, v in enumerate(fn(x, h)))

    ours = lambda x, h: chunked_logprobs(x, h, y, 0.7, chunk=10, entropy_grad=True,  # noqa: E731
                                         vocab_split=True)
    mesh = make_mesh(2, 2, 2, devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        hs = jax.device_put(head, NamedSharding(mesh, P("fsdp", "tensor")))
        got = jax.jit(ours)(xs, hs)
        grads = jax.jit(jax.grad(total(ours), (0, 1)))(xs, hs)
    for a, r in zip(got, ref(x, head)):
        np.testing.assert_allclose(a, r, atol=1e-4)
    for a, r in zip(grads, jax.grad(total(ref), (0, 1))(x, head)):
        np.testing.assert_allclose(a, r, atol=1e-4)

    b, t, e, vocab = 8, 256, 64, 1024
    mesh = make_mesh(1, 8, 1, devices=jax.devices()[:8])
    y = jnp.zeros((b, t), jnp.int32)

    def gathers(split):
        g = jax.jit(jax.grad(lambda x, h: chunked_logprobs(x, h, y, chunk=512,
                                                           vocab_split=split)[0].sum(), (0, 1)))
        with jax.set_mesh(mesh):
            hlo = g.lower(jax.device_put(jnp.ones((b, t, e)), NamedSharding(mesh, P("fsdp"))),
                          jax.device_put(jnp.ones((e, vocab)), NamedSharding(mesh, P("fsdp")))
                          ).compile().as_text()
        return [tuple(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"f32\[([\d,]*)\][^\n]*all-gather(?:-start)?\(", hlo)]
    assert (e, vocab) in gathers(False)
    assert gathers(True) and all(vocab not in s for s in gathers(True)), gathers(True)


@pytest.mark.parametrize("devices", [1, 8])
def test_a_logits_chunk_is_cut_to_its_bytes_on_a_device(devices):
    """chunk_bytes bounds a chunk's float32 logits on a device (tokens x the vocabulary it
    holds), on one device and with the rows split over 8: the same values and gradients as
    chunks of `chunk` tokens, and less scratch memory in the compiled backward."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from supo_jax.model.sharding import make_mesh

    if jax.device_count() < devices:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them on the CPU)")
    b, t, e, vocab = 8, 256, 32, 2048
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(ks[0], (b, t, e))
    head = jax.random.normal(ks[1], (e, vocab))
    y = jax.random.randint(ks[2], (b, t), 0, vocab)

    def grad(chunk_bytes):
        return jax.jit(jax.grad(lambda x, h: sum(v.sum() for v in chunked_logprobs(
            x, h, y, chunk=2048, entropy_grad=True, chunk_bytes=chunk_bytes)), (0, 1)))

    mesh = make_mesh(1, devices, 1, devices=jax.devices()[:devices])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
        hs = jax.device_put(head, NamedSharding(mesh, P("fsdp")))
        # a device's chunk: 2048 tokens (all its rows' tokens) = 16 MiB of logits, or 16 KiB
        big, small = grad(1 << 30), grad(1 << 14)
        temp = [f.lower(xs, hs).compile().memory_analysis().temp_size_in_bytes
                for f in (big, small)]
        for a, r in zip(small(xs, hs), big(xs, hs)):
            np.testing.assert_allclose(a, r, atol=1e-4)
    assert temp[1] < temp[0] / 4, temp


@pytest.mark.parametrize("attention,remat", [("blockwise", "full"), ("blockwise", "dots"),
                                             ("splash", "none")])
@pytest.mark.slow
def test_decoder_score_matches_plain_logits(attention, remat):
    """Decoder.score with another attention / remat = log_softmax of the plain forward's logits,
    values and parameter gradients, on a packed batch."""
    cfg = tiny_config("qwen2", vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64)
    b, t = 2, 128
    ref = Decoder(cfg, attention="xla", remat="none", rngs=nnx.Rngs(3))
    other = Decoder(cfg, attention=attention, remat=remat, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t), 0, 64)
    targets = jnp.roll(tokens, -1, axis=1)
    seg = _packed_segments(b, t)
    pos = jnp.asarray(np.concatenate([np.arange(t)[None]] * b))

    def loss(model):
        logp, ent = model.score(tokens, pos, targets, segment_ids=seg, chunk=48)
        return jnp.sum(logp * (seg > 0)), (logp, ent)

    (l1, (lp1, e1)), g1 = nnx.value_and_grad(loss, has_aux=True)(ref)
    (l2, (lp2, e2)), g2 = nnx.value_and_grad(loss, has_aux=True)(other)
    logits, _ = ref(tokens, pos, segment_ids=seg)
    full = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp1, full, atol=2e-5)
    np.testing.assert_allclose(lp2, lp1, atol=5e-5)
    np.testing.assert_allclose(e2, e1, atol=5e-5)
    for a, r in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, r, atol=1e-4 * max(1.0, float(jnp.abs(r).max())))


def test_remat_auto_by_size_and_bad_options():
    cfg = tiny_config("qwen2", vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64)
    m = Decoder(cfg, remat="auto")
    assert m.remat_mode(1024) == "none"
    assert m.remat_mode(10 ** 9) == "full"
    assert Decoder(cfg, remat=True).remat == "full"
    with pytest.raises(ValueError, match="model.remat='some'"):
        Decoder(cfg, remat="some")
    with pytest.raises(ValueError, match="model.precision='max'"):
        Decoder(cfg, precision="max")
    assert Decoder(cfg, precision="highest").matmul_precision() == jax.lax.Precision.HIGHEST
    # float32 compute: true float32 on accelerators, XLA's default on the host (where it is
    # float32 already: identical CPU programs)
    expect = None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST
    assert Decoder(cfg).matmul_precision() == expect
    assert Decoder(cfg, dtype=jnp.bfloat16).matmul_precision() is None


def test_config_names_a_bad_model_option():
    from supo_jax.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="model.attention='flash'"):
        load_config(None, ["model.attention=flash"])
    with pytest.raises(ConfigError, match="model.remat"):
        load_config(None, ["model.remat=always"])


@pytest.mark.slow
def test_train_step_memory_linear_in_row_length():
    """XLA's compiled memory of a train step (blockwise attention, chunked LM head, full remat)
    grows linearly with T and stays below one [T, V] float32 tensor; the plain path's does not."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from train_memory import step_memory

    kw = dict(layers=2, hidden=64, vocab=8192, chunk=512)
    cur = [step_memory(t, "full", **kw) for t in (2048, 4096)]
    growth = (cur[1]["total_bytes"] / cur[0]["total_bytes"]) / 2
    assert growth <= 1.3, growth
    assert all(r["total_bytes"] < r["logits_bytes"] for r in cur), cur
    plain = [step_memory(t, "plain", **kw) for t in (1024, 2048)]
    assert plain[1]["total_bytes"] / plain[0]["total_bytes"] > 3.0, plain   # T^2 scores
