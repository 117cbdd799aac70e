"""The loss and advantage settings (the `loss` and `advantage` config sections): plain frozen
dataclasses, checked on construction (config.py imports these, not the train step)."""
from __future__ import annotations

import dataclasses

from supo_jax.agent.context import NO_ANSWER
from supo_jax.rl.algo import ADVANTAGES

SCHEDULES = ("constant", "warmup_cosine")   # optim.schedule (rl/train_step.learning_rate)
# loss.behaviour_correction; "auto" (the default) is resolved by supo_jax.config.validate:
# "tis" with partial rollouts (rollout.budget_tokens > 0), else "none"
CORRECTIONS = ("auto", "none", "tis", "decoupled")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    objective: str = "ppo"       # "ppo" (the SUPO loss) | "sft" (NLL of the masked tokens)
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0     # the sampler's temperature (the trainer sets it from rollout.temperature)
    logit_chunk: int = 8192      # tokens per LM-head chunk (Decoder.score: no [B, T, V] tensor;
                                 # larger chunks run faster on a GPU, see BENCHMARKS.md)
    # the tokens' behaviour policy (the sampler's log-probabilities) vs the proximal policy the
    # ratio is clipped against (optim.recompute_old_logprobs: the trainer's forward at the
    # step's start): "none" (the ratio against the proximal policy alone), "tis" (each
    # token's loss weighed by min(p_prox / p_behav, behaviour_cap): truncated importance
    # sampling, as verl and slime), "decoupled" (weighed by p_prox / p_behav, tokens over
    # behaviour_cap left out: AReaL's decoupled PPO); "auto": "tis" with partial rollouts
    # (rollout.budget_tokens), whose resumed tokens are older policies', else "none"
    behaviour_correction: str = "auto"
    behaviour_cap: float = 2.0

    def __post_init__(self):
        if self.objective not in ("ppo", "sft"):
            raise ValueError(f"loss.objective={self.objective!r}: ppo or sft")
        if self.aggregation not in ("token-mean", "sequence-mean"):
            raise ValueError(f"loss.aggregation={self.aggregation!r}: token-mean or sequence-mean")
        if self.logit_chunk < 1:
            raise ValueError(f"loss.logit_chunk={self.logit_chunk}: must be >= 1")
        if self.behaviour_correction not in CORRECTIONS:
            raise ValueError(f"loss.behaviour_correction={self.behaviour_correction!r}: one of "
                             f"{', '.join(CORRECTIONS)}")
        if not self.behaviour_cap >= 1.0:
            raise ValueError(f"loss.behaviour_cap={self.behaviour_cap}: must be >= 1")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "rollout_group"
    normalize_std: bool = True
    eps: float = 1e-6
    masked_reasons: tuple[str, ...] = NO_ANSWER   # overlong masking: no gradient at all
    masked_count_in_stats: bool = True
    # how the token-mean loss weighs rollouts: "tokens" (the paper: every trained token alike,
    # so a long rollout weighs more) or "equal" (every trained rollout the same in total: its
    # segments' advantages scaled by the mean trained tokens per rollout / its own)
    rollout_weight: str = "tokens"
    # scale on negative advantages (1 = the paper). A failed rollout's rare tokens get an
    # unbounded push down (log p -> -inf) that spills over, through shared weights, onto the
    # tokens every rollout shares; < 1 weighs that push against the bounded push up of
    # successes (0 = learn from the group's better-than-average rollouts only)
    negative_weight: float = 1.0
    # a placebo control (experiments/placebo.py): each batch's rewards permuted at random
    # across its rollouts before the advantages, so updates keep their size and form but no
    # relation to what a rollout did; saved with the run, so a resume cannot mix the two
    permute_rewards: bool = False

    def __post_init__(self):
        if self.estimator not in ADVANTAGES:
            raise ValueError(f"advantage.estimator={self.estimator!r} is not one of "
                             f"{', '.join(ADVANTAGES)}")
        if self.rollout_weight not in ("tokens", "equal"):
            raise ValueError(f"advantage.rollout_weight={self.rollout_weight!r}: tokens or equal")
        if not 0.0 <= self.negative_weight <= 1.0:
            raise ValueError(f"advantage.negative_weight={self.negative_weight}: must be in [0, 1]")
