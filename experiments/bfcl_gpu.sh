#!/usr/bin/env bash
# BFCL multi-turn on a lent GPU: SFT on bfcl/base's train split (ground-truth demonstrations),
# then RL on bfcl/long_context with SUPO at W = 8192 against `full` at 8192 and at 8192 x (S + 1)
# = 40960, three seeds each; then BFCL-style accuracy of every run's policy on every category.
#
#   experiments/bfcl_gpu.sh MODEL [OUTPUT_ROOT]     # MODEL: a local HF directory or .gguf
#
# Answers: on BFCL's long_context (62% of its histories exceed 8K tokens), does SUPO at 8K learn
# more than `full` at 8K (which ends rollouts at the context limit), and how close does it come to
# `full` with the context SUPO's summaries stand in for (40K)?
# Settings: experiments/configs/bfcl_supo.py (the paper's update; S = 4). A run directory that
# already holds a run is resumed.
set -euo pipefail

MODEL="${1:?usage: experiments/bfcl_gpu.sh MODEL [OUTPUT_ROOT]}"
ROOT="${2:-runs}"
ROOT="${ROOT%/}/bfcl"
CONFIG=experiments/configs/bfcl_supo.py
mkdir -p "$ROOT"

supo-jax sft --config "$CONFIG" --set model.path="$MODEL" --set env.name=bfcl/base \
    --set train.run_dir="$ROOT/sft"

for seed in 0 1 2; do
    common=(--config "$CONFIG" --set train.init_from="$ROOT/sft/sft" --set train.seed="$seed"
            --set env.seed="$seed" --set train.progress=false)
    supo-jax train "${common[@]}" --set train.run_dir="$ROOT/supo_8k_s$seed"
    supo-jax train "${common[@]}" --set context.manager=full \
        --set train.run_dir="$ROOT/full_8k_s$seed"
    supo-jax train "${common[@]}" --set context.manager=full \
        --set context.working_context=40960 --set train.run_dir="$ROOT/full_40k_s$seed"
done

python experiments/bfcl_accuracy.py --model "$ROOT/sft/sft" --out "$ROOT/accuracy_sft"
for run in "$ROOT"/supo_8k_s* "$ROOT"/full_8k_s* "$ROOT"/full_40k_s*; do
    python experiments/bfcl_accuracy.py --model "$run/hf" --out "$run/accuracy"
done
