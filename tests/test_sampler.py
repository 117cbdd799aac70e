"""KV-cache sampler: multi-turn primitives, logprob convention, stops, bad input."""
import jax
import numpy as np
import pytest

from supo_jax.model.policy import new_policy
from supo_jax.model.tiny import tiny_config
from supo_jax.sampling.sampler import Sampler, SamplingParams, generate, token_logprobs

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def policy():
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    # spread the logits so greedy choices are not near-ties
    from flax import nnx
    st = nnx.state(pol.model, nnx.Param)
    nnx.update(pol.model, jax.tree.map(lambda x: x * 12.0 if x.ndim > 1 else x, st))
    return pol


def _ids(rs, n, v=97):
    return rs.randint(0, v, n).tolist()


@pytest.mark.slow
def test_incremental_prefill_equals_full_prefill(policy):
    rs = np.random.RandomState(0)
    a, b = _ids(rs, 9), _ids(rs, 13)
    s = Sampler(policy, batch=2, max_len=128)
    s.append({0: a})
    g1 = s.generate([0], 6, set(), GREEDY, jax.random.key(0))[0]
    s.append({0: b})  # only the new tokens are prefilled
    logits_inc = np.asarray(s.last_logits[0])
    g2 = s.generate([0], 6, set(), GREEDY, jax.random.key(0))[0]
    ctx = a + g1.tokens + b
    full = np.asarray(policy.logits([ctx]))[0, -1]
    np.testing.assert_allclose(logits_inc, full, atol=1e-4)
    fresh = generate(policy, [ctx], 6)[0]
    assert g2.tokens == fresh.tokens
    np.testing.assert_allclose(g2.logprobs, fresh.logprobs, atol=1e-4)
    assert s.lengths[0] == len(ctx) + 6 and int(s.cache.lengths[0]) == len(ctx) + 6


def test_long_appends_prefill_in_chunks(policy):
    """An append longer than prefill_chunk runs as several prefill calls (rows of other
    lengths idle in the later ones): the cache and last logits equal one call's."""
    rs = np.random.RandomState(3)
    toks = {0: _ids(rs, 50), 1: _ids(rs, 20), 2: _ids(rs, 33)}
    one, chunked = Sampler(policy, 3, 128), Sampler(policy, 3, 128, prefill_chunk=16)
    one.append(toks)
    chunked.append(toks)
    assert {k[2] for k in chunked.shapes_compiled if k[0] == "prefill"} == {16}
    np.testing.assert_array_equal(chunked.lengths, [50, 20, 33])
    np.testing.assert_allclose(np.asarray(chunked.last_logits), np.asarray(one.last_logits),
                               atol=1e-4)
    # (this fixture's weights are scaled x12: keys reach ~40, float32 rounding differs by
    # the attention's span)
    np.testing.assert_allclose(np.asarray(chunked.cache.k), np.asarray(one.cache.k), rtol=1e-3,
                               atol=1e-3)
    a = one.generate([0, 1, 2], 5, set(), GREEDY, jax.random.key(0))
    b = chunked.generate([0, 1, 2], 5, set(), GREEDY, jax.random.key(0))
    assert [a[r].tokens for r in range(3)] == [b[r].tokens for r in range(3)]


@pytest.mark.slow
def test_prefill_of_a_few_rows_computes_only_them(policy):
    """A new prompt in one freed row while the others wait: only that row is prefilled
    (its count bucketed: 1 of 4 rows); the cache and logits equal the whole-batch prefill's,
    and the other rows' cache is left exactly as it was."""
    rs = np.random.RandomState(4)
    first = {r: _ids(rs, n) for r, n in enumerate((30, 12, 25, 7))}
    late, more = _ids(rs, 40), {1: _ids(rs, 6), 3: _ids(rs, 9)}
    subset, whole = Sampler(policy, 4, 128), Sampler(policy, 4, 128, row_subsets=False)
    for s in (subset, whole):
        s.append(first)
        s.generate([0, 1, 2, 3], 4, set(), GREEDY, jax.random.key(0))
    before = np.asarray(subset.cache.k).copy()
    for s in (subset, whole):
        s.reset(2, 0)
        s.append({2: late})
    assert ("prefill", 1, 64, 128) in subset.shapes_compiled
    assert ("prefill", 4, 64, 128) in whole.shapes_compiled
    k = np.asarray(subset.cache.k)
    np.testing.assert_array_equal(np.delete(k, 2, axis=1), np.delete(before, 2, axis=1))
    np.testing.assert_allclose(k, np.asarray(whole.cache.k), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(subset.last_logits), np.asarray(whole.last_logits),
                               atol=1e-4)
    for s in (subset, whole):
        s.append(more)          # two rows of four: bucketed to 2
    assert ("prefill", 2, 16, 128) in subset.shapes_compiled
    np.testing.assert_array_equal(subset.lengths, whole.lengths)
    np.testing.assert_array_equal(np.asarray(subset.cache.lengths), whole.lengths)
    a = subset.generate([0, 1, 2, 3], 6, set(), GREEDY, jax.random.key(0))
    b = whole.generate([0, 1, 2, 3], 6, set(), GREEDY, jax.random.key(0))
    assert [a[r].tokens for r in range(4)] == [b[r].tokens for r in range(4)]
    for r in range(4):
        np.testing.assert_allclose(a[r].logprobs, b[r].logprobs, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("unroll", [True, False])
def test_decode_of_a_few_rows_runs_only_them(policy, unroll):
    """3 of 8 rows generating: decode runs on 4 rows (the 3 and an idle one, whose context is
    longer than the span attended); tokens and logprobs, greedy and sampled, equal the
    whole batch's, and the rows outside the 3 keep their cache exactly."""
    rs = np.random.RandomState(6)
    lens = (90, 9, 40, 30, 14, 25, 5, 60)
    prompts = {r: _ids(rs, n) for r, n in enumerate(lens)}
    kw = dict(min_attend=16, unroll_layers=unroll)
    subset, whole = Sampler(policy, 8, 128, **kw), Sampler(policy, 8, 128, row_subsets=False, **kw)
    for s in (subset, whole):
        s.append(prompts)
    before = np.asarray(subset.cache.k).copy()
    for sp in (GREEDY, SamplingParams(temperature=1.0)):
        a = subset.generate([1, 4, 6], 9, set(), sp, jax.random.key(3))
        b = whole.generate([1, 4, 6], 9, set(), sp, jax.random.key(3))
        assert [a[r].tokens for r in (1, 4, 6)] == [b[r].tokens for r in (1, 4, 6)]
        for r in (1, 4, 6):
            np.testing.assert_allclose(a[r].logprobs, b[r].logprobs, atol=1e-4)
    assert {k[1] for k in subset.shapes_compiled if k[0] == "decode"} == {4}
    assert {k[3] for k in subset.shapes_compiled if k[0] == "decode"} == {24, 32}  # < 90
    k = np.asarray(subset.cache.k)
    idle = [0, 2, 3, 5, 7]
    np.testing.assert_array_equal(k[:, idle], before[:, idle])
    np.testing.assert_allclose(k, np.asarray(whole.cache.k), rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(subset.lengths, whole.lengths)
    np.testing.assert_array_equal(np.asarray(subset.cache.lengths), whole.lengths)
    np.testing.assert_allclose(np.asarray(subset.last_logits), np.asarray(whole.last_logits),
                               atol=1e-4)


@pytest.mark.slow
def test_reset_and_copy_prefix_reuse_cached_prompt(policy):
    rs = np.random.RandomState(1)
    s1, x = _ids(rs, 11), _ids(rs, 5)
    s = Sampler(policy, batch=3, max_len=128)
    s.append({0: s1})
    s.generate([0], 7, set(), GREEDY, jax.random.key(0))
    s.reset(0, len(s1))               # back to the cached initial prompt
    assert s.lengths.tolist() == [len(s1), 0, 0]
    np.testing.assert_array_equal(np.asarray(s.cache.lengths), s.lengths)   # synced lazily
    s.copy_prefix(0, 2, len(s1))      # another row starts from the same prefix
    s.append({0: x, 2: x})
    out = s.generate([0, 2], 8, set(), GREEDY, jax.random.key(0))
    fresh = generate(policy, [s1 + x], 8)[0]
    assert out[0].tokens == fresh.tokens and out[2].tokens == fresh.tokens


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_k=20),
                                SamplingParams(1.3, top_p=0.8), GREEDY])
def test_sampler_logprobs_equal_training_forward(policy, sp):
    """The sampler's logprobs = the training forward's, under the distribution sampled from:
    with top-k / top-p, renormalised over the kept tokens (numpy reference)."""
    rs = np.random.RandomState(2)
    prompts = [_ids(rs, n) for n in (4, 10, 7)]
    outs = generate(policy, prompts, 24, sampling=sp, seed=5)
    for p, o in zip(prompts, outs):
        logits = np.asarray(policy.logits([p + o.tokens])[0, len(p) - 1:-1], np.float64)
        if sp.temperature:
            logits = logits / sp.temperature
        keep = np.ones_like(logits, bool)
        if sp.top_k:
            keep &= logits >= np.sort(logits, -1)[:, -sp.top_k][:, None]
        if sp.top_p < 1.0:
            srt = np.sort(logits, -1)[:, ::-1]
            prob = np.exp(srt - srt.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            n_keep = np.sum(np.cumsum(prob, -1) - prob < sp.top_p, -1)
            keep &= logits >= srt[np.arange(len(srt)), n_keep - 1][:, None]
        z = np.where(keep, logits, -np.inf)
        lp = (z - z.max(-1, keepdims=True)
              - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)))
        lp = lp[np.arange(len(o.tokens)), o.tokens]
        if not (sp.top_k or sp.top_p < 1.0):   # the jitted helper the trainer's convention uses
            lp2 = np.asarray(token_logprobs(logits, np.array(o.tokens), 1.0))
            np.testing.assert_allclose(lp2, lp, atol=1e-5)
        # 4e-4: the x12 weights make attention nearly hard, which amplifies float32
        # rounding between the decode program and the training forward (a convention
        # error, e.g. a missing temperature, is > 1e-2)
        np.testing.assert_allclose(lp, o.logprobs, atol=1e-3)


@pytest.mark.slow
def test_unrolled_decode_equals_scan_decode():
    """Decode over per-layer weights and per-layer caches (the CPU default) = decode with
    the layer scan over the stacked cache: tokens, logprobs, and the cache it leaves
    behind, over two turns (the second starts from the first's merged cache)."""
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)   # plain weights
    rs = np.random.RandomState(3)
    prompts = [_ids(rs, n) for n in (4, 10, 7)]
    obs = [_ids(rs, n) for n in (3, 1, 6)]
    out, caches = {}, {}
    for unroll in (False, True):
        s = Sampler(pol, batch=3, max_len=128, unroll_layers=unroll)
        s.append(dict(enumerate(prompts)))
        first = s.generate(range(3), 20, set(), SamplingParams(1.0), jax.random.key(1))
        s.append(dict(enumerate(obs)))
        second = s.generate(range(3), 9, set(), SamplingParams(1.0), jax.random.key(2))
        out[unroll] = [first[r].tokens + second[r].tokens for r in range(3)], \
            [first[r].logprobs + second[r].logprobs for r in range(3)]
        caches[unroll] = s.cache, s.lengths.copy()
    assert out[True][0] == out[False][0]
    np.testing.assert_allclose(out[True][1], out[False][1], atol=1e-5)
    (c1, n1), (c0, n0) = caches[True], caches[False]
    assert not c1.per_layer and c1.k.shape == c0.k.shape
    np.testing.assert_array_equal(n1, n0)
    np.testing.assert_array_equal(np.asarray(c1.lengths), n0)
    for r in range(3):
        for a, b in ((c1.k, c0.k), (c1.v, c0.v)):
            np.testing.assert_allclose(np.asarray(a[:, r, :, :n0[r]]), np.asarray(b[:, r, :, :n0[r]]),
                                       atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("unroll", [False, True])
def test_chunked_decode_equals_one_call(unroll):
    """A generation cut into chunks of 8 steps, each attending over the span its rows
    reach by the chunk's end, = the same generation in one call: sampled tokens,
    logprobs, lengths and cache, with per-row budgets, a stop token that lands on a
    chunk's last step, and a second turn."""
    policy = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)   # plain weights
    rs = np.random.RandomState(6)
    prompts = [_ids(rs, n) for n in (4, 10, 7)]
    obs = [_ids(rs, n) for n in (3, 1, 6)]
    sp, key = SamplingParams(1.0), jax.random.key(3)
    ref = Sampler(policy, batch=3, max_len=96, min_attend=16, decode_chunk=0, unroll_layers=unroll)
    ref.append(dict(enumerate(prompts)))
    free = ref.generate(range(3), 30, set(), sp, key)
    stop = free[1].tokens[7]                     # row 1 stops at the end of the first chunk
    k = free[1].tokens.index(stop)
    runs = {}
    for chunk in (0, 8):
        s = Sampler(policy, batch=3, max_len=96, min_attend=16, decode_chunk=chunk,
                    unroll_layers=unroll)
        s.append(dict(enumerate(prompts)))
        first = s.generate(range(3), {0: 30, 1: 30, 2: 19}, {0: set(), 1: {stop}, 2: set()},
                           sp, key)
        s.append(dict(enumerate(obs)))
        second = s.generate([0, 2], 21, set(), sp, jax.random.key(4))
        runs[chunk] = first, second, s
    (f0, g0, s0), (f8, g8, s8) = runs[0], runs[8]
    assert f8[0].tokens == free[0].tokens and f8[2].tokens == free[2].tokens[:19]
    assert f8[1].tokens == free[1].tokens[:k + 1] and k <= 7
    for a, b in ((f0, f8), (g0, g8)):
        for r in a:
            assert a[r].tokens == b[r].tokens
            np.testing.assert_allclose(a[r].logprobs, b[r].logprobs, atol=1e-5)
    assert len(g8[0].tokens) == 21 and len(g8[2].tokens) == 21
    np.testing.assert_array_equal(s8.lengths, s0.lengths)
    np.testing.assert_array_equal(np.asarray(s8.cache.lengths), s0.lengths)
    for r in range(3):
        n = s0.lengths[r]
        for a, b in ((s8.cache.k, s0.cache.k), (s8.cache.v, s0.cache.v)):
            np.testing.assert_allclose(np.asarray(a[:, r, :, :n]), np.asarray(b[:, r, :, :n]),
                                       atol=1e-5)
    # the chunks attend over growing spans; the single call over the final one
    spans = sorted({key[3] for key in s8.shapes_compiled if key[0] == "decode"})
    assert spans[0] < spans[-1] and len(spans) >= 3, spans
    assert {key[2] for key in s8.shapes_compiled if key[0] == "decode"} == {8}
    with pytest.raises(ValueError, match="decode_chunk"):
        Sampler(policy, batch=1, max_len=32, decode_chunk=12)


def test_layer_weights_cut_once_per_weight_update():
    """The unrolled decode's per-layer weights are cut once and kept across generate
    calls, and cut again when the policy's weights change: after an update the sampler
    decodes with the new weights (= a fresh sampler), never the stale copy."""
    from flax import nnx
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    prompt = _ids(np.random.RandomState(7), 6)

    def run(s, n=12):
        s.reset(0, 0)
        s.append({0: prompt})
        return s.generate([0], n, set(), GREEDY, jax.random.key(0))[0]

    s = Sampler(pol, batch=1, max_len=64, unroll_layers=True)
    before = run(s)
    cut = s._layers[1]
    assert run(s).tokens == before.tokens and s._layers[1] is cut     # kept
    st = nnx.state(pol.model, nnx.Param)
    nnx.update(pol.model, jax.tree.map(lambda x: x * 12.0 if x.ndim > 1 else x, st))
    after = run(s)
    assert s._layers[1] is not cut
    fresh = run(Sampler(pol, batch=1, max_len=64, unroll_layers=True))
    assert after.tokens == fresh.tokens and after.tokens != before.tokens
    np.testing.assert_allclose(after.logprobs, fresh.logprobs, atol=1e-5)


def test_kv_cache_split_and_merge_layers():
    """split_layers cuts a span into per-layer arrays (keys transposed); merge_layers
    puts them back and leaves the slots past the span untouched."""
    import jax.numpy as jnp
    from supo_jax.model.decoder import KVCache
    cfg = tiny_config("qwen2", vocab_size=97)
    rs = np.random.RandomState(5)
    full = KVCache(*(jnp.asarray(rs.randn(cfg.num_layers, 2, cfg.num_kv_heads, 32, cfg.head_dim),
                                 jnp.float32) for _ in range(2)), jnp.array([3, 9], jnp.int32))
    part = full.split_layers(16)
    assert part.per_layer and len(part.k) == cfg.num_layers
    assert part.max_len == 16 and part.batch == 2
    assert part.k[1].shape == (2, cfg.num_kv_heads, cfg.head_dim, 16)
    np.testing.assert_array_equal(np.asarray(part.k[1]), np.asarray(full.k[1, :, :, :16]).swapaxes(-1, -2))
    np.testing.assert_array_equal(np.asarray(part.v[1]), np.asarray(full.v[1, :, :, :16]))
    zero = KVCache(tuple(jnp.zeros_like(a) for a in part.k), tuple(jnp.zeros_like(a) for a in part.v),
                   part.lengths + 1)
    merged = full.merge_layers(zero)
    assert np.all(np.asarray(merged.k[:, :, :, :16]) == 0) and np.all(np.asarray(merged.v[:, :, :, :16]) == 0)
    np.testing.assert_array_equal(np.asarray(merged.k[:, :, :, 16:]), np.asarray(full.k[:, :, :, 16:]))
    np.testing.assert_array_equal(np.asarray(merged.lengths), [4, 10])
    model = new_policy(cfg, seed=0).model
    tok = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="per-layer"):      # per-layer cache, layer scan
        model(tok, tok, cache=part)
    with pytest.raises(ValueError, match="per-layer"):      # stacked cache, per-layer weights
        model(tok, tok, cache=full, layer_weights=model.layer_weights())


def test_kv_cache_write_and_read_agree_across_layouts():
    """write stores new keys / values at each row's own slots (a slot past the cache is
    dropped) in one layer only; read returns them; the stacked and the per-layer layouts
    hold the same values."""
    import jax.numpy as jnp
    from supo_jax.model.decoder import KVCache
    cfg = tiny_config("qwen2", vocab_size=97)
    K, D = cfg.num_kv_heads, cfg.head_dim
    full = KVCache.zeros(cfg, 2, 8)
    rs = np.random.RandomState(7)
    k, v = (jnp.asarray(rs.randn(2, K, 3, D), jnp.float32) for _ in range(2))
    pos = jnp.array([[0, 1, 2], [5, 6, 9]], jnp.int32)       # row 1's last slot is past S = 8
    stacked = full.write(jnp.int32(1), k, v, pos)
    split = full.split_layers(8).write(1, k, v, pos)
    sk, sv = stacked.read(jnp.int32(1), 8, jnp.float32)
    pk, pv = split.read(1, 8, jnp.float32)
    np.testing.assert_array_equal(np.asarray(sk), np.asarray(pk).swapaxes(-1, -2))
    np.testing.assert_array_equal(np.asarray(sv), np.asarray(pv))
    np.testing.assert_array_equal(np.asarray(sv[0, :, :3]), np.asarray(v[0]))
    np.testing.assert_array_equal(np.asarray(sk[1, :, 5:7]), np.asarray(k[1, :, :2]))
    assert not np.any(np.asarray(sv[1, :, :5])) and not np.any(np.asarray(sv[1, :, 7:]))
    assert not np.any(np.asarray(stacked.k[0])) and not np.any(np.asarray(stacked.k[2:]))


@pytest.mark.slow
def test_top_k_top_p_restrict_support(policy):
    rs = np.random.RandomState(3)
    p = _ids(rs, 6)
    logits = np.asarray(policy.logits([p]))[0, -1]
    top3 = set(np.argsort(logits)[-3:].tolist())
    firsts = {generate(policy, [p], 1, sampling=SamplingParams(2.0, top_k=3), seed=i)[0].tokens[0]
              for i in range(12)}
    assert firsts <= top3
    probs = np.exp(logits - logits.max()); probs /= probs.sum()
    order = np.argsort(-probs)
    keep = set(order[:np.searchsorted(np.cumsum(probs[order]), 0.5) + 1].tolist())
    firsts = {generate(policy, [p], 1, sampling=SamplingParams(1.0, top_p=0.5), seed=i)[0].tokens[0]
              for i in range(12)}
    assert firsts <= keep


def test_same_seed_same_samples_and_seed_matters(policy):
    p = [[1, 2, 3, 4], [5, 6]]
    a = generate(policy, p, 16, sampling=SamplingParams(1.0), seed=7)
    b = generate(policy, p, 16, sampling=SamplingParams(1.0), seed=7)
    c = generate(policy, p, 16, sampling=SamplingParams(1.0), seed=8)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.tokens for x in a] != [x.tokens for x in c]


def test_per_row_stops_and_budgets(policy):
    rs = np.random.RandomState(4)
    prompts = [_ids(rs, 5), _ids(rs, 8)]
    free = generate(policy, prompts, 12, stop_tokens=())
    stop0 = free[0].tokens[3]
    s = Sampler(policy, batch=2, max_len=64)
    s.append({0: prompts[0], 1: prompts[1]})
    out = s.generate([0, 1], {0: 12, 1: 5}, {0: {stop0}, 1: set()}, GREEDY, jax.random.key(0))
    k = free[0].tokens.index(stop0)
    assert out[0].tokens == free[0].tokens[:k + 1]      # stop token included
    assert out[1].tokens == free[1].tokens[:5]          # per-row budget


def test_generate_stops_at_the_models_end_of_sequence_by_default(policy, monkeypatch):
    import dataclasses
    import types

    p = _ids(np.random.RandomState(4), 5)
    free = generate(policy, [p], 12, stop_tokens=())[0].tokens
    assert len(free) == 12
    for owner, eos in (("config", free[3]), ("tokenizer", free[5])):
        k = free.index(eos)
        if owner == "config":
            monkeypatch.setattr(policy.model, "cfg",
                                dataclasses.replace(policy.config, eos_token_ids=(eos,)))
        else:
            monkeypatch.setattr(policy.model, "cfg",
                                dataclasses.replace(policy.config, eos_token_ids=()))
            monkeypatch.setattr(policy, "tokenizer", types.SimpleNamespace(eos_token_id=eos))
        assert generate(policy, [p], 12)[0].tokens == free[:k + 1]     # the eos included
        assert generate(policy, [p], 12, stop_tokens=())[0].tokens == free


def test_bad_input_is_a_clear_error(policy):
    s = Sampler(policy, batch=1, max_len=32)
    with pytest.raises(ValueError, match="exceed the cache length"):
        s.append({0: list(range(40))})
    with pytest.raises(ValueError, match="empty context"):
        s.generate([0], 4, set(), GREEDY, jax.random.key(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.append({0: [1, 2, 97]})
    with pytest.raises(ValueError, match="empty"):
        generate(policy, [[]], 4)
    s.append({0: list(range(30))})
    with pytest.raises(ValueError, match="exceed the cache length"):
        s.generate([0], 4, set(), GREEDY, jax.random.key(0))


def test_shapes_are_bucketed(policy):
    s = Sampler(policy, batch=2, max_len=256)
    rs = np.random.RandomState(5)
    for n in (3, 5, 9, 11, 14):   # all fit the 16-token prefill bucket
        s.reset(0, 0)
        s.append({0: _ids(rs, n)})
        s.generate([0], 5, set(), GREEDY, jax.random.key(0))
    assert len(s.shapes_compiled) == 2, s.shapes_compiled


def test_logits_at_selects_one_position_per_row(policy):
    """Decoder(logits_at=i) = the full forward's logits at row b's index i[b] (prefill uses it)."""
    import jax.numpy as jnp
    rs = np.random.RandomState(4)
    toks = jnp.asarray(rs.randint(0, 97, (3, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9), (3, 9))
    full, _ = policy.model(toks, pos)
    at = jnp.array([8, 0, 5])
    one, _ = policy.model(toks, pos, logits_at=at)
    assert one.shape == (3, 1, 97)
    np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(full[jnp.arange(3), at]), atol=1e-5)


def test_rope_table_lookup_equals_computed_rope():
    """Decoder(rope_table=model.rope_table(n)) (decode's precomputed cos / sin) = the
    rotary angles computed in the forward, with a cache; padding positions >= n are
    clipped into the table and their cache writes dropped as before."""
    import jax.numpy as jnp
    from supo_jax.model.decoder import KVCache
    pol = new_policy(tiny_config("llama3", vocab_size=97), seed=1)   # llama3 rope scaling
    m, cfg = pol.model, pol.config
    rs = np.random.RandomState(8)
    toks = jnp.asarray(rs.randint(0, 97, (2, 6)), jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 32, 32]], jnp.int32)  # row 1: 2 pads
    out = {}
    for table in (None, m.rope_table(32)):
        cache = KVCache.zeros(cfg, 2, 32)
        out[table is None] = m(toks, pos, cache=cache, rope_table=table)
    (la, ca), (lb, cb) = out[True], out[False]
    np.testing.assert_allclose(np.asarray(la[:, :4]), np.asarray(lb[:, :4]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ca.k), np.asarray(cb.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ca.v), np.asarray(cb.v), atol=1e-5)
    assert float(jnp.abs(ca.k[:, 1, :, 7:11]).sum()) > 0


@pytest.mark.slow
def test_a_rows_tokens_depend_on_its_stream_alone():
    """A row samples the same tokens alone or beside other rows, in one decode call or cut
    into calls of 8 steps that other rows join and leave (Sampler.start / advance): its
    draws come from its own stream, not from the batch or the schedule."""
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    rs = np.random.RandomState(5)
    prompts = [_ids(rs, n) for n in (6, 9, 4)]
    key, sp = jax.random.key(7), SamplingParams(1.0)

    alone = Sampler(pol, batch=4, max_len=96, decode_chunk=0)
    alone.append({0: prompts[0]})
    ref = alone.generate([0], 30, set(), sp, key, {0: (3, 1)})[0]

    s = Sampler(pol, batch=4, max_len=96, decode_chunk=8)
    s.append({2: prompts[1], 3: prompts[2]})
    s.start([2, 3], {2: 5, 3: 40}, set(), {2: (0, 0), 3: (1, 0)})
    got = s.advance(sp, key)            # row 2 ends here; rows 0 and 1 join after
    s.append({0: prompts[0], 1: prompts[0]})
    s.start([0, 1], 30, set(), {0: (3, 1), 1: (3, 2)})
    while s.generating:
        got.update(s.advance(sp, key))
    assert len(got[2].tokens) == 5 and len(got[3].tokens) == 40
    assert got[0].tokens == ref.tokens and len(ref.tokens) == 30
    np.testing.assert_allclose(got[0].logprobs, ref.logprobs, atol=1e-5)
    assert got[1].tokens != got[0].tokens     # the same context, another stream
    assert s.live_steps == 5 + 40 + 30 + 30 and s.slot_steps > s.live_steps


def test_per_row_settings_share_a_call_and_sample_as_the_compiled_setting():
    """Rows under other temperatures / top_p decode in one call (the settings as per-row
    arrays: Sampler.advance with a dict) and each samples what it samples with its setting
    compiled into the call, bit for bit, logprobs included. So the server's greedy rows
    equal the sampler's own greedy generation, and the rollouts' compiled path needs no
    change."""
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    rs = np.random.RandomState(5)
    prompts = {0: _ids(rs, 6), 1: _ids(rs, 9)}
    sps = {0: GREEDY, 1: SamplingParams(0.7, top_p=0.5)}
    key, streams = jax.random.key(3), {0: (0, 1), 1: (1, 1)}

    def run(sampling):
        s = Sampler(pol, batch=2, max_len=96, decode_chunk=8)
        s.append(prompts)
        return s.generate([0, 1], 20, set(), sampling, key, streams), s

    mixed, s = run(sps)
    assert sum(k[0] == "decode" for k in s.shapes_compiled) == 1     # one program, 3 calls
    for r, sp in sps.items():
        compiled = run(sp)[0][r]
        assert (mixed[r].tokens, mixed[r].logprobs) == (compiled.tokens, compiled.logprobs)
        assert len(compiled.tokens) == 20
    assert len(set(mixed[1].tokens)) > 1                 # sampled, not a greedy loop
    with pytest.raises(ValueError, match="share top_k"):
        run({0: SamplingParams(1.0, top_k=5), 1: SamplingParams(1.0)})
    with pytest.raises(ValueError, match="without sampling settings"):
        run({0: GREEDY})


def test_the_cache_is_a_multiple_of_128_slots_and_rows_still_end_at_max_len():
    """A cache length that is not a multiple of the TPU's tile made XLA move the whole cache
    in the compiled decode loop (Qwen3-8B on v6e-8 at 5283 slots: 1.78x its HBM roofline,
    1.00x at 5376; experiments/LOG.md): the sampler allocates max_len rounded up to 128."""
    from supo_jax.sampling.sampler import cache_length

    assert [cache_length(n) for n in (1, 128, 129, 5283)] == [128, 128, 256, 5376]
    pol = new_policy(tiny_config("qwen2", vocab_size=97), seed=0)
    s = Sampler(pol, batch=2, max_len=100)
    assert s.cache.k.shape[-2] == 128 and s.max_len == 100
    s.append({0: list(range(1, 91))})
    with pytest.raises(ValueError, match="exceed the cache length 100"):
        s.append({0: list(range(1, 12))})
    with pytest.raises(ValueError, match="exceed the cache length 100"):
        s.generate([0], 11, set(), SamplingParams(0.0), jax.random.key(0))
    out = s.generate([0], 10, set(), SamplingParams(0.0), jax.random.key(0))
    assert len(out[0].tokens) == 10 and s.lengths[0] == 100


def test_rows_without_stop_ids_share_the_decode_program(policy):
    """A batch whose rows have no stop ids (a server's ignore_eos requests) runs the decode
    program a batch with two stop ids a row compiled (the ids are padded to 4): a server
    does not stall on a new compile for it."""
    from supo_jax.sampling import sampler as S

    rs = np.random.RandomState(3)
    prompts = {r: _ids(rs, 12) for r in range(4)}
    done = []
    for stops in ({1, 2}, set()):
        s = Sampler(policy, 4, 64)
        s.append(prompts)
        s.generate(list(prompts), 6, stops, GREEDY, jax.random.key(0))
        done.append(S.decode._cache_size())
    assert done[1] == done[0]
