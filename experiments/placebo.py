"""A placebo control for an RL run: `supo-jax train` with each step's rewards permuted at random
across that step's rollouts, so its updates have the size and form of real ones but no relation
to what any rollout did:

    python experiments/placebo.py train --set 'env.imports=["my_envs.cards"]' --set env.name=cards --set train.run_dir=runs/placebo

Everything else (the config, its --set overrides, the metrics and their rollouts' own success)
is the normal run's. With dynamic sampling (rollout.dynamic_rounds), the groups a step keeps are
picked from a permutation of each round's rewards too, so they are as unrelated to what the
rollouts did as the advantages. If a run ends where its placebo does, its updates carried no more than
their noise.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np


def permuted(rollouts, rng):
    """The rollouts with their rewards permuted among them (the multiset of rewards is kept)."""
    rewards = [r.reward for r in rollouts]
    return [dataclasses.replace(r, reward=rewards[i])
            for r, i in zip(rollouts, rng.permutation(len(rollouts)))]


def main(argv=None) -> int:
    from supo_jax import cli
    from supo_jax.rl import trainer

    rng = np.random.default_rng(0)
    advantages = trainer.rollout_advantages
    trainer.rollout_advantages = lambda rollouts, cfg: advantages(permuted(rollouts, rng), cfg)
    try:
        return cli.main(sys.argv[1:] if argv is None else argv)
    finally:
        trainer.rollout_advantages = advantages


if __name__ == "__main__":
    sys.exit(main())
