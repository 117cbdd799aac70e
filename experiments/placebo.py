"""A placebo control for an RL run: `supo-jax train` with each step's rewards permuted at random
across that step's rollouts, so its updates have the size and form of real ones but no relation
to what any rollout did:

    python experiments/placebo.py train --set 'env.imports=["my_envs.redcount"]' --set env.name=redcount --set train.run_dir=runs/placebo

Everything else (the config, its --set overrides, the metrics and their rollouts' own success)
is the normal run's. With dynamic sampling (rollout.dynamic_rounds), the groups a step keeps are
picked from a permutation of each round's rewards too, so they are as unrelated to what the
rollouts did as the advantages. If a run ends where its placebo does, its updates carried no more than
their noise.

It is `supo-jax` with `--set advantage.permute_rewards=true` (which a sweep grid can set too):
the setting is saved with the run, so neither a placebo run resumed without it nor a real run
resumed with it can mix the two kinds of steps.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from supo_jax import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    return cli.main(argv + ["--set", "advantage.permute_rewards=true"])


if __name__ == "__main__":
    sys.exit(main())
