"""SUPO math: advantages, overlong masking, the clipped policy loss. Pure and jittable.

Notation: rollout j of group g has reward R_j and I_j + 1 segments (training
rows). Every generated token of every segment of rollout j carries A_j.

Advantages (registered by name in ADVANTAGES):
  rollout_group     (SUPO Eq. 3, the default)
        A_j = (R_j - mean_{k in g} R_k) / (std_{k in g} R_k + eps)
  trajectory_group  (SUPO Eq. 4, the ablation) the same statistics over the
        multiset in which rollout k appears once per segment (weight I_k + 1)
  leave_one_out     A_j = R_j - mean_{k in g, k != j} R_k  (optionally / std)
Only rollouts with `counts` set enter the group statistics (switch: whether
overlong-masked rollouts still count; default they do).

Policy loss (token level, SUPO §4): with r_t = exp(logp_t - logp_old_t),
        l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
  aggregated as token-mean (sum_t m_t l_t / sum_t m_t over the whole batch; the
  default) or sequence-mean (mean over rows of each row's token mean).
  Optional: + beta * KL(pi || pi_ref) with the k3 estimator
        k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1,
  and - entropy_coef * H_t. Both off by default.
Off-policy correction (loss.behaviour_correction; behaviour_weights): tokens sampled by a
behaviour policy b other than the proximal policy old (recomputed at the step's start),
w_t = p_old / p_b: "tis" l_t * min(w_t, C); "decoupled" l_t * w_t, tokens with w_t > C
weighted 0 (still counted in the token mean, as in AReaL's decoupled PPO).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _group_stats(values, weights, group_ids, num_groups):
    """Weighted mean and (population) std of `values` per group."""
    w_sum = jax.ops.segment_sum(weights, group_ids, num_groups)
    mean = jax.ops.segment_sum(weights * values, group_ids, num_groups) / jnp.maximum(w_sum, 1e-12)
    var = jax.ops.segment_sum(weights * (values - mean[group_ids]) ** 2, group_ids, num_groups)
    std = jnp.sqrt(var / jnp.maximum(w_sum, 1e-12))
    return mean, std, w_sum


def rollout_group_advantages(rewards, group_ids, counts, num_groups: int, *, normalize_std=True,
                             eps=1e-6, num_segments=None):
    """SUPO Eq. 3. rewards [N], group_ids [N] int, counts [N] bool -> advantages [N]."""
    mean, std, _ = _group_stats(rewards, counts.astype(jnp.float32), group_ids, num_groups)
    adv = rewards - mean[group_ids]
    return adv / (std[group_ids] + eps) if normalize_std else adv


def trajectory_group_advantages(rewards, group_ids, counts, num_groups: int, *, normalize_std=True,
                                eps=1e-6, num_segments=None):
    """SUPO Eq. 4: group statistics with each rollout weighted by its number of segments."""
    w = counts.astype(jnp.float32) * num_segments.astype(jnp.float32)
    mean, std, _ = _group_stats(rewards, w, group_ids, num_groups)
    adv = rewards - mean[group_ids]
    return adv / (std[group_ids] + eps) if normalize_std else adv


def leave_one_out_advantages(rewards, group_ids, counts, num_groups: int, *, normalize_std=False,
                             eps=1e-6, num_segments=None):
    """A_j = R_j - mean of the other counted rollouts of the group (RLOO baseline)."""
    c = counts.astype(jnp.float32)
    n = jax.ops.segment_sum(c, group_ids, num_groups)
    s = jax.ops.segment_sum(c * rewards, group_ids, num_groups)
    others = (s[group_ids] - c * rewards) / jnp.maximum(n[group_ids] - c, 1.0)
    adv = rewards - others
    if normalize_std:
        _, std, _ = _group_stats(rewards, c, group_ids, num_groups)
        adv = adv / (std[group_ids] + eps)
    return adv


ADVANTAGES: dict[str, Callable] = {
    "rollout_group": rollout_group_advantages,
    "trajectory_group": trajectory_group_advantages,
    "leave_one_out": leave_one_out_advantages,
}


def policy_loss(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.28,
                aggregation="token-mean", ref_logp=None, kl_coef=0.0, entropy=None,
                entropy_coef=0.0, norm=None):
    """Clipped surrogate. logp/old_logp/mask [R, T], advantages [R] or [R, T].

    norm: the aggregation's denominator (token-mean: number of unmasked tokens;
    sequence-mean: number of rows with any) when this call sees only a
    microbatch of the batch being averaged; defaults to this call's own count.
    Returns (loss, metrics) with clip_fraction, approx_kl, entropy (when given), kl_ref.
    """
    mask = mask.astype(jnp.float32)
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    ratio = jnp.exp(logp - old_logp)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    tok = jnp.maximum(pg1, pg2)
    metrics = {}
    if kl_coef:
        d = ref_logp - logp
        k3 = jnp.exp(d) - d - 1.0
        tok = tok + kl_coef * k3
        metrics["kl_ref"] = _agg(k3, mask, "token-mean", None)
    if entropy_coef:
        tok = tok - entropy_coef * entropy
    loss = _agg(tok, mask, aggregation, norm)
    n = jnp.maximum(mask.sum(), 1.0)
    metrics["clip_fraction"] = jnp.sum((pg2 > pg1) * mask) / n
    metrics["approx_kl"] = jnp.sum(0.5 * (logp - old_logp) ** 2 * mask) / n
    if entropy is not None:
        metrics["entropy"] = jnp.sum(entropy * mask) / n
    return loss, metrics


def behaviour_weights(prox_logp, behav_logp, mask, correction: str, cap: float):
    """The off-policy correction of tokens sampled by a behaviour policy other than the
    proximal one the PPO ratio is clipped against (loss.behaviour_correction). All [R, T]
    host arrays -> (weight [R, T], mask [R, T], metrics). w = p_prox / p_behav:
    "tis" weighs each token by min(w, cap); "decoupled" by w, and 0 for the tokens with
    w > cap, which stay in the mask (counted in the token mean, and in the KL and entropy
    terms: AReaL's decoupled PPO); "none": weight 1. A positive weight on a token scales both
    clipped-surrogate terms alike, so it multiplies that token's advantage (the KL and
    entropy terms are not weighed)."""
    mask = np.asarray(mask, np.float32)
    if correction in ("none", "auto"):   # auto: a LossConfig no run config resolved (no
        return np.ones_like(mask), mask, {}     # partial rollouts, so none)
    trained = mask > 0
    w = np.exp(np.asarray(prox_logp, np.float64) - np.asarray(behav_logp, np.float64))
    over = (w > cap) & trained
    if correction == "tis":
        weight = np.minimum(w, cap)
    elif correction == "decoupled":
        weight = np.where(over, 0.0, w)
    else:
        raise ValueError(f"loss.behaviour_correction={correction!r}: none, tis or decoupled")
    n = max(int(trained.sum()), 1)
    metrics = {"behaviour_weight": float(w[trained].sum() / n),   # mean p_prox / p_behav
               "behaviour_over_cap": float(over.sum() / n)}       # share of tokens over cap
    return (weight * (mask > 0)).astype(np.float32), mask, metrics


def aggregation_norm(mask, aggregation):
    """The denominator of an aggregation over `mask` [R, T]."""
    if aggregation == "token-mean":
        return jnp.maximum(mask.sum(), 1.0)
    if aggregation == "sequence-mean":
        return jnp.maximum((mask.sum(-1) > 0).sum(), 1.0)
    raise ValueError(f"unknown aggregation {aggregation!r} (token-mean, sequence-mean)")


def _agg(x, mask, aggregation, norm):
    norm = aggregation_norm(mask, aggregation) if norm is None else norm
    if aggregation == "token-mean":
        return jnp.sum(x * mask) / norm
    if aggregation == "sequence-mean":
        per_row = jnp.sum(x * mask, -1) / jnp.maximum(mask.sum(-1), 1.0)
        return jnp.sum(per_row) / norm
    raise ValueError(f"unknown aggregation {aggregation!r} (token-mean, sequence-mean)")
