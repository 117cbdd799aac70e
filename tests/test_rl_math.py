"""SUPO math against hand-written numpy references."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from supo_jax.agent.context import Segment
from supo_jax.rl.algo import (behaviour_weights, leave_one_out_advantages, policy_loss,
                              rollout_group_advantages, trajectory_group_advantages)
from supo_jax.rl.batch import build_batch
from supo_jax.rl.batch import rollout_advantages
from supo_jax.rl.configs import AdvantageConfig


def np_loss(logp, old, adv, mask, lo=0.2, hi=0.28):
    ratio = np.exp(logp - old)
    a = adv[:, None]
    tok = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - lo, 1 + hi))
    # gradient wrt logp: the unclipped branch is -A * ratio, the clipped branch is constant
    unclipped = (-a * ratio) >= (-a * np.clip(ratio, 1 - lo, 1 + hi))
    g = np.where(unclipped, -a * ratio, 0.0) * mask / mask.sum()
    return (tok * mask).sum() / mask.sum(), g


def test_policy_loss_and_grad_match_numpy():
    rs = np.random.RandomState(0)
    logp = rs.uniform(-3, -0.1, (3, 6)).astype(np.float32)
    old = (logp + rs.uniform(-0.5, 0.5, (3, 6))).astype(np.float32)
    adv = np.array([1.5, -0.7, 0.3], np.float32)
    mask = (rs.rand(3, 6) > 0.3).astype(np.float32)
    want, want_g = np_loss(logp, old, adv, mask)
    (got, m), g = jax.value_and_grad(
        lambda lp: policy_loss(lp, old, adv, mask), has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
    ratio = np.exp(logp - old)
    clipped = ((adv[:, None] > 0) & (ratio > 1.28)) | ((adv[:, None] < 0) & (ratio < 0.8))
    np.testing.assert_allclose(m["clip_fraction"], (clipped * mask).sum() / mask.sum(), rtol=1e-6)
    assert 0 < float(m["clip_fraction"]) < 1


def test_behaviour_corrections_by_hand():
    """Tokens sampled by a behaviour policy b, clipped against the proximal policy p:
    w = p / b per token. tis weighs each token's loss by min(w, C); decoupled by w and by 0
    the tokens with w > C, which stay counted in the token mean (AReaL's decoupled PPO:
    pg_loss * weight summed over the loss mask / its count); none changes nothing. Checked against the loss written out by
    hand for one row of four tokens (advantage 1, eps 0.2 / 0.28, C = 2.5)."""
    prox = np.log([[0.5, 0.2, 0.9, 0.4]])
    behav = np.log([[0.25, 0.2, 0.3, 0.4]])        # w = 2, 1, 3, 1
    mask = np.array([[1.0, 1.0, 1.0, 0.0]])        # the last token is not trained
    w, m, met = behaviour_weights(prox, behav, mask, "tis", 2.5)
    np.testing.assert_allclose(w, [[2.0, 1.0, 2.5, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(m, mask)
    assert met["behaviour_over_cap"] == pytest.approx(1 / 3)
    assert met["behaviour_weight"] == pytest.approx(2.0)      # (2 + 1 + 3) / 3
    wd, md, _ = behaviour_weights(prox, behav, mask, "decoupled", 2.5)
    np.testing.assert_allclose(wd, [[2.0, 1.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(md, mask)
    wn, mn, metn = behaviour_weights(prox, behav, mask, "none", 2.5)
    assert (wn == 1).all() and (mn == mask).all() and metn == {}

    # current policy: ratios p_theta / p = 1.5 (clipped to 1.28), 0.9, 1.1 on the trained tokens
    logp = prox + np.log([[1.5, 0.9, 1.1, 1.0]])
    adv = np.ones((1, 4))
    # l_t = max(-A r, -A clip(r)) = -min(r, clip(r)) for A = 1: -1.28, -0.9, -1.1
    hand = {"tis": (2.0 * -1.28 + 1.0 * -0.9 + 2.5 * -1.1) / 3,
            "decoupled": (2.0 * -1.28 + 1.0 * -0.9 + 0.0 * -1.1) / 3,
            "none": (-1.28 - 0.9 - 1.1) / 3}
    for corr, want in hand.items():
        w, m, _ = behaviour_weights(prox, behav, mask, corr, 2.5)
        loss, _ = policy_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(prox, jnp.float32),
                              jnp.asarray(adv * w, jnp.float32), jnp.asarray(m, jnp.float32))
        assert float(loss) == pytest.approx(want, rel=1e-5), corr


def test_behaviour_correction_needs_the_proximal_policy():
    from supo_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="recompute_old_logprobs=true"):
        load_config(None, ["loss.behaviour_correction=tis"])
    with pytest.raises((ConfigError, ValueError), match="none, tis, decoupled"):
        load_config(None, ["loss.behaviour_correction=is", "optim.recompute_old_logprobs=true"])
    cfg = load_config(None, ["loss.behaviour_correction=decoupled",
                             "optim.recompute_old_logprobs=true", "loss.behaviour_cap=3"])
    assert (cfg.loss.behaviour_correction, cfg.loss.behaviour_cap) == ("decoupled", 3.0)


def test_sequence_mean_and_kl_entropy_terms():
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.2, 0.2]]))
    old = logp
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="sequence-mean")
    np.testing.assert_allclose(loss, ((-1 - 1) / 2 + 1) / 2, rtol=1e-6)   # ratio 1: -A per token
    ref = logp + 0.1
    loss_kl, m = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5)
    k3 = np.exp(0.1) - 0.1 - 1
    np.testing.assert_allclose(loss_kl, (-1 - 1 + 1) / 3 + 0.5 * k3, rtol=1e-5)
    ent = jnp.ones_like(logp) * 2.0
    loss_e, m = policy_loss(logp, old, adv, mask, entropy=ent, entropy_coef=0.1)
    np.testing.assert_allclose(loss_e, -1 / 3 - 0.2, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], 2.0)


def test_advantages_match_hand_computation():
    r = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32)
    g = np.array([0, 0, 0, 1, 1, 1], np.int32)
    counts = np.array([1, 1, 1, 1, 1, 0], bool)   # last rollout masked out of the statistics
    nseg = np.array([1, 3, 1, 2, 1, 1], np.int32)
    a = np.asarray(rollout_group_advantages(r, g, counts, 2))
    m0, s0 = r[:3].mean(), r[:3].std()
    m1, s1 = r[3:5].mean(), r[3:5].std()
    np.testing.assert_allclose(a[:3], (r[:3] - m0) / (s0 + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(a[3:], (r[3:] - m1) / (s1 + 1e-6), rtol=1e-5)
    t = np.asarray(trajectory_group_advantages(r, g, counts, 2, num_segments=nseg))
    multiset = np.repeat(r[:3], nseg[:3])       # each rollout once per segment
    np.testing.assert_allclose(t[:3], (r[:3] - multiset.mean()) / (multiset.std() + 1e-6), rtol=1e-5)
    loo = np.asarray(leave_one_out_advantages(r, g, counts, 2))
    np.testing.assert_allclose(loo[:3], [1 - 0.5, 0 - 1.0, 1 - 0.5], rtol=1e-6)
    np.testing.assert_allclose(loo[5], 0 - np.mean(r[3:5]), rtol=1e-6)


def _rollout(gid, reward, reason, segs):
    return types.SimpleNamespace(group_id=gid, reward=reward, reason=reason, segments=segs)


def _seg(n, gen_from, seed):
    rs = np.random.RandomState(seed)
    toks = tuple(rs.randint(0, 11, n).tolist())
    mask = tuple(int(i >= gen_from) for i in range(n))
    return Segment(toks, mask, tuple(rs.uniform(-2, 0, n).tolist()))


def test_overlong_masking_and_broadcast():
    ro = [_rollout(0, 1.0, "answer", [_seg(8, 3, 0), _seg(9, 4, 1)]),
          _rollout(0, 0.0, "max_summaries", [_seg(7, 2, 2)]),
          _rollout(0, 0.0, "answer", [_seg(6, 2, 3)])]
    a = rollout_advantages(ro, AdvantageConfig())
    assert list(a.trained) == [True, False, True]
    assert len(a.segments) == 3
    assert a.segment_advantages[0] == a.segment_advantages[1] == pytest.approx(a.advantages[0])
    # masked rollouts still count in the group statistics by default
    np.testing.assert_allclose(a.advantages[0], (1 - 1 / 3) / (np.std([1, 0, 0]) + 1e-6),
                               rtol=1e-5)
    adv2 = rollout_advantages(ro, AdvantageConfig(masked_count_in_stats=False)).advantages
    np.testing.assert_allclose(adv2[0], (1 - 0.5) / (0.5 + 1e-6), rtol=1e-5)  # stats over [1, 0]


def test_equal_rollout_weight_gives_each_trained_rollout_the_same_total_weight():
    ro = [_rollout(0, 1.0, "answer", [_seg(8, 3, 0), _seg(9, 4, 1)]),     # 5 + 5 trained tokens
          _rollout(0, 0.0, "max_summaries", [_seg(7, 2, 2)]),             # masked
          _rollout(0, 0.0, "answer", [_seg(6, 2, 3)])]                    # 4 trained tokens
    a = rollout_advantages(ro, AdvantageConfig(rollout_weight="equal"))
    seg_adv, adv = a.segment_advantages, a.advantages
    w = [adv[0] * 7 / 10, adv[0] * 7 / 10, adv[2] * 7 / 4]               # mean of 10 and 4: 7
    np.testing.assert_allclose(seg_adv, w, rtol=1e-6)
    # the token-mean loss's weight of each rollout: sum over its tokens = advantage x mean tokens
    per_rollout = [seg_adv[0] * 5 + seg_adv[1] * 5, seg_adv[2] * 4]
    np.testing.assert_allclose(per_rollout, [adv[0] * 7, adv[2] * 7], rtol=1e-6)
    with pytest.raises(ValueError, match="rollout_weight"):
        AdvantageConfig(rollout_weight="per-token")


def test_negative_weight_scales_only_the_below_average_rollouts():
    ro = [_rollout(0, 1.0, "answer", [_seg(8, 3, 0), _seg(9, 4, 1)]),
          _rollout(0, 0.0, "answer", [_seg(7, 2, 2)]),
          _rollout(0, 0.0, "answer", [_seg(6, 2, 3)])]
    full = rollout_advantages(ro, AdvantageConfig()).segment_advantages
    a_pos, a_neg = (1 - 1 / 3) / np.std([1, 0, 0]), (0 - 1 / 3) / np.std([1, 0, 0])
    np.testing.assert_allclose(full, [a_pos, a_pos, a_neg, a_neg], rtol=1e-5)
    quarter = rollout_advantages(ro, AdvantageConfig(negative_weight=0.25))
    np.testing.assert_allclose(quarter.segment_advantages,
                               [a_pos, a_pos, a_neg / 4, a_neg / 4], rtol=1e-5)
    np.testing.assert_allclose(quarter.advantages, [a_pos, a_neg / 4, a_neg / 4], rtol=1e-5)
    none = rollout_advantages(ro, AdvantageConfig(negative_weight=0.0)).segment_advantages
    np.testing.assert_allclose(none, [a_pos, a_pos, 0, 0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="negative_weight"):
        AdvantageConfig(negative_weight=1.5)


def _bigram_loss(W, batch):
    logits = W[batch.inputs]                              # a tiny softmax policy
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch.targets[..., None], -1)[..., 0]
    return policy_loss(logp, jax.lax.stop_gradient(logp), batch.advantages[:, 0], batch.mask)[0]


@pytest.mark.slow
def test_segmented_gradient_equals_rollout_likelihood_gradient():
    """docs/SUPO.md §3: sum over segments of grad log pi = grad log-likelihood of the rollout."""
    W = jnp.asarray(np.random.RandomState(0).randn(11, 11), jnp.float32)
    segs = [_seg(12, 4, 10), _seg(9, 5, 11), _seg(15, 6, 12)]   # one rollout, two summaries
    A = 0.8
    batch = build_batch(segs, [A] * 3, max_len=32, rows_multiple=4)
    g = jax.grad(_bigram_loss)(W, batch) * float(batch.mask.sum())   # undo the token mean

    def rollout_loglik(W):
        total = 0.0
        for s in segs:
            lp = jax.nn.log_softmax(W[jnp.asarray(s.tokens[:-1])])
            tl = lp[jnp.arange(len(s.tokens) - 1), jnp.asarray(s.tokens[1:])]
            total += jnp.sum(tl * jnp.asarray(s.mask[1:], jnp.float32))
        return total

    np.testing.assert_allclose(g, -A * jax.grad(rollout_loglik)(W), rtol=1e-5, atol=1e-6)
    packed = build_batch(segs, [A] * 3, max_len=40, pack=True)
    assert packed.rows < batch.rows
    gp = jax.grad(_bigram_loss)(W, packed) * float(packed.mask.sum())
    np.testing.assert_allclose(gp, g, rtol=1e-5, atol=1e-6)


def test_dummy_rows_change_nothing():
    W = jnp.asarray(np.random.RandomState(1).randn(11, 11), jnp.float32)
    segs = [_seg(10, 3, 20), _seg(7, 2, 21)]
    b1 = build_batch(segs, [0.5, -1.0], max_len=16, rows_multiple=1)
    b8 = build_batch(segs, [0.5, -1.0], max_len=16, rows_multiple=8)
    assert b1.rows == 2 and b8.rows == 8 and b8.mask[2:].sum() == 0
    np.testing.assert_allclose(_bigram_loss(W, b1), _bigram_loss(W, b8), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(_bigram_loss)(W, b1), jax.grad(_bigram_loss)(W, b8),
                               rtol=1e-6)


def test_batch_alignment_and_errors():
    s = Segment((5, 6, 7, 8), (0, 0, 1, 1), (0.0, 0.0, -0.5, -0.25))
    b = build_batch([s], [2.0], max_len=8, min_len=4)
    np.testing.assert_array_equal(b.inputs[0, :3], [5, 6, 7])
    np.testing.assert_array_equal(b.targets[0, :3], [6, 7, 8])
    np.testing.assert_array_equal(b.mask[0, :3], [0, 1, 1])
    np.testing.assert_array_equal(b.old_logp[0, :3], [0.0, -0.5, -0.25])
    with pytest.raises(ValueError, match="exceeds"):
        build_batch([s], [1.0], max_len=2)


def test_a_rerun_with_no_steps_left_shows_its_evaluation():
    """summary_table of a finished run's rerun (no step, an eval) prints that eval, saying
    no step ran; with nothing at all, one line."""
    from supo_jax.rl.metrics import summary_table

    out = summary_table([], {"success_rate": 0.75})
    assert out.splitlines()[0].startswith("(no steps run")
    assert out.splitlines()[1].split() == ["metric", "eval"]
    assert out.splitlines()[2].split() == ["success_rate", "0.750"]
    assert summary_table([]) == "(no steps run)"
    two = summary_table([{"step": 1, "loss": 0.5}], {"success_rate": 0.5}, {"success_rate": 0.25})
    assert two.splitlines()[0].split() == ["metric", "eval", "before", "step", "1", "eval", "after"]
