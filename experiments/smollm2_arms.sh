#!/usr/bin/env bash
# SmolLM2-135M-Instruct on fncall/listing, one GPU session: an SFT warm start, then three RL arms.
#
#   experiments/smollm2_arms.sh [OUTPUT_ROOT]      # default: runs/
#
# (1) SFT: the 60-step warm start of README "SmolLM2-135M-Instruct on a GPU", same flags
#     (SmolLM2 calls no tools as it comes). Its checkpoint, OUTPUT_ROOT/smollm2_listing/sft, is
#     the starting policy of all three RL arms.
# (2) recipe: SUPO as the committed GPU runs had it (experiments/results/gpu_smollm2_listing/,
#     the flags of the committed seed-0 command: optim.lr=1e-5, 40 steps, W = 512, S = 3,
#     advantage.negative_weight=0.25, context.trigger_rule=reserve, context.summary_role=user).
#     Answers: does the recipe's held-out / training lift reproduce?
# (3) placebo: the recipe with each step's rewards permuted at random across its rollouts
#     (advantage.permute_rewards=true). Answers: how much of (2)'s lift is the reward signal
#     and not the update's noise, the KL pull or the step count alone (its noise floor)?
# (4) paper update: the recipe with the paper's update and context (advantage.negative_weight=1.0,
#     context.trigger_rule=paper, context.summary_role=system). Answers: does the paper's
#     algorithm, unchanged, learn as well as (or better than) the recipe's departures from it?
#
# All three RL arms use seed 0 (train.seed and env.seed: the same tasks at each step) and the
# same SFT checkpoint from (1), so they differ only in the settings named above. The SFT was
# made with the recipe's context (reserve rule, summary instruction as a user turn), so (4)
# also changes the instruction's role the policy was warm-started on.
# Every train command has train.progress=false (plain log lines). A run directory that already
# holds a run is resumed (supo-jax train resumes automatically).
set -euo pipefail

ROOT="${1:-runs}"
ROOT="${ROOT%/}"
mkdir -p "$ROOT"
ROOT="$(cd "$ROOT" && pwd)"              # absolute: the commands run from the repository root
cd "$(dirname "$0")/.."

CONFIG=experiments/configs/smollm2_supo.py
SFT_DIR="$ROOT/smollm2_listing"

# (1) SFT warm start (README "SmolLM2-135M-Instruct on a GPU")
supo-jax sft --config "$CONFIG" --set env.name=fncall/listing --set 'env.knobs.size=[5,10]' \
    --set sft.num_demos=64 --set sft.steps=60 --set sft.batch_rows=4 --set sft.lr=3e-5 \
    --set train.run_dir="$SFT_DIR"

# the committed SUPO seed-0 command's flags, less its run_dir
RECIPE=(--config "$CONFIG" --set env.name=fncall/listing --set 'env.knobs.size=[5,10]'
        --set train.init_from="$SFT_DIR/sft" --set optim.lr=1e-5 --set env.eval_tasks=32
        --set train.eval_every=10 --set train.steps=40 --set train.save_every=1000
        --set train.progress=false)

# (2) recipe arm, seed 0
supo-jax train "${RECIPE[@]}" --set train.run_dir="$ROOT/smollm2_listing_supo0"

# (3) placebo arm: the recipe with each step's rewards permuted across its rollouts
supo-jax train "${RECIPE[@]}" --set advantage.permute_rewards=true \
    --set train.run_dir="$ROOT/smollm2_listing_placebo0"

# (4) paper-update arm: full weight on negative advantages, the paper's trigger and system turn
supo-jax train "${RECIPE[@]}" --set advantage.negative_weight=1.0 \
    --set context.trigger_rule=paper --set context.summary_role=system \
    --set train.run_dir="$ROOT/smollm2_listing_paper0"
