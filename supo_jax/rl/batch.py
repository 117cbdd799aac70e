"""Rollouts -> training rows.

Every segment of a rollout becomes one row (or part of a packed row) carrying
the rollout's advantage on its generated tokens. Rows are next-token aligned:
inputs = tokens[:-1], targets = tokens[1:], and the loss mask / old logprobs are
those of the targets. Row length is bucketed (powers of two) so few shapes
compile; packing puts several segments in one row with segment ids (attention
never crosses segments; positions restart per segment); dummy rows with an
all-zero mask pad the row count to a multiple of the minibatch size.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from supo_jax.agent.context import Segment
from supo_jax.agent.rollout import Rollout
from supo_jax.rl.algo import ADVANTAGES
from supo_jax.rl.configs import AdvantageConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """All [R, T]: inputs, targets, positions, segment_ids (0 = padding),
    mask (1 = trained target), old_logp, advantages."""
    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    advantages: np.ndarray

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    def take(self, idx: np.ndarray) -> TrainBatch:
        return jax.tree.map(lambda x: x[idx], self)


def row_bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest of minimum * {1, 1.5} * 2^k >= n (capped at maximum). Finer than powers of two:
    attention cost grows with T^2, so a 523-token row should not pay for 1024."""
    b = minimum
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3
    return min(b, max(maximum, minimum))


def build_batch(segments: Sequence[Segment], advantages: Sequence[float], *, max_len: int,
                rows_multiple: int = 1, pack: bool = False, min_len: int = 32) -> TrainBatch:
    """segments: objects with .tokens/.mask/.logprobs; advantages: one float per segment.

    Segments longer than max_len + 1 are an error (the context bound should prevent them).
    """
    items = []
    for seg, adv in zip(segments, advantages):
        n = len(seg.tokens) - 1
        if n > max_len:
            raise ValueError(f"segment of {n + 1} tokens exceeds the training row length {max_len}")
        if n < 1 or not any(seg.mask[1:]):
            continue
        items.append((seg, float(adv)))
    rows: list[list] = []
    if pack:
        fill: list[int] = []
        for seg, adv in sorted(items, key=lambda x: -len(x[0].tokens)):
            n = len(seg.tokens) - 1
            for i, used in enumerate(fill):
                if used + n <= max_len:
                    rows[i].append((seg, adv))
                    fill[i] += n
                    break
            else:
                rows.append([(seg, adv)])
                fill.append(n)
    else:
        rows = [[it] for it in items]
    longest = max((sum(len(s.tokens) - 1 for s, _ in r) for r in rows), default=1)
    t = row_bucket(longest, min_len, max_len)
    r = max(1, len(rows))
    r += -r % rows_multiple
    out = {k: np.zeros((r, t), dt) for k, dt in (
        ("inputs", np.int32), ("targets", np.int32), ("positions", np.int32),
        ("segment_ids", np.int32), ("mask", np.float32), ("old_logp", np.float32),
        ("advantages", np.float32))}
    for i, row in enumerate(rows):
        off = 0
        for sid, (seg, adv) in enumerate(row, start=1):
            tok = np.asarray(seg.tokens, np.int32)
            n = len(tok) - 1
            sl = slice(off, off + n)
            out["inputs"][i, sl] = tok[:-1]
            out["targets"][i, sl] = tok[1:]
            out["positions"][i, sl] = np.arange(n)
            out["segment_ids"][i, sl] = sid
            out["mask"][i, sl] = np.asarray(seg.mask[1:], np.float32)
            out["old_logp"][i, sl] = np.asarray(seg.logprobs[1:], np.float32)
            out["advantages"][i, sl] = adv
            off += n
    return TrainBatch(**out)


def permute_rewards(rollouts: Sequence[Rollout], rng: np.random.Generator) -> list[Rollout]:
    """The rollouts with their rewards permuted among them by `rng` (the multiset of rewards
    is kept): a placebo control's batch (advantage.permute_rewards)."""
    rewards = [r.reward for r in rollouts]
    return [dataclasses.replace(r, reward=rewards[i])
            for r, i in zip(rollouts, rng.permutation(len(rollouts)))]


class Advantages(NamedTuple):
    """rollout_advantages' result: the rows to train on and what each rollout carries."""
    segments: list[Segment]          # the trained rollouts' segments, in rollout order
    segment_advantages: list[float]  # one per segment: its rollout's advantage x weight
    advantages: np.ndarray           # float [n rollouts]: group-relative, negatives scaled
    trained: np.ndarray              # bool [n rollouts]: reason not in cfg.masked_reasons


def rollout_advantages(rollouts: Sequence[Rollout], cfg: AdvantageConfig) -> Advantages:
    """Each rollout's group-relative advantage (cfg.estimator) broadcast to its segments
    (negative ones scaled by cfg.negative_weight, and per rollout with
    cfg.rollout_weight="equal"); rollouts whose reason is in cfg.masked_reasons give no
    segments (trained False)."""
    if not rollouts:
        return Advantages([], [], np.zeros(0), np.zeros(0, bool))
    groups = sorted({r.group_id for r in rollouts})
    gidx = np.asarray([groups.index(r.group_id) for r in rollouts], np.int32)
    rewards = np.asarray([r.reward for r in rollouts], np.float32)
    trained = np.asarray([r.reason not in cfg.masked_reasons for r in rollouts])
    counts = np.ones_like(trained) if cfg.masked_count_in_stats else trained
    nseg = np.asarray([max(1, len(r.segments)) for r in rollouts], np.int32)
    adv = np.asarray(ADVANTAGES[cfg.estimator](
        jnp.asarray(rewards), jnp.asarray(gidx), jnp.asarray(counts), len(groups),
        normalize_std=cfg.normalize_std, eps=cfg.eps, num_segments=jnp.asarray(nseg)))
    adv = np.where(adv < 0, cfg.negative_weight * adv, adv)
    scale = np.ones(len(rollouts))
    if cfg.rollout_weight == "equal":
        ntok = np.asarray([sum(sum(s.mask) for s in r.segments) for r in rollouts], np.float64)
        counted = trained & (ntok > 0)
        if counted.any():
            scale = np.where(counted, ntok[counted].mean() / np.maximum(ntok, 1), 1.0)
    segs, seg_adv = [], []
    for r, a, t, w in zip(rollouts, adv, trained, scale):
        if t:
            for s in r.segments:
                segs.append(s)
                seg_adv.append(float(a * w))
    return Advantages(segs, seg_adv, adv, trained)
