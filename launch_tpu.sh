#!/usr/bin/env bash
# Launch a supo-jax training run on a Cloud TPU VM (single host or pod slice).
#
#   ./launch_tpu.sh --tpu NAME --zone ZONE [--project P] [--accelerator v5litepod-16]
#                   [--runtime v2-alpha-tpuv5-lite] [--create] [--config FILE]
#                   [--set key=value ...] [--dry-run]
#
# Ships this checkout to every worker, installs it with the [tpu] extra, and starts the same
# `supo-jax train` command on all workers (each worker's log: logs/<tpu>/worker-<i>.log on the
# worker, ~/supo_jax/logs/...). On a multi-host slice, supo-jax calls jax.distributed.initialize()
# itself (the TPU runtime supplies the coordinator). --dry-run prints every command instead.
set -euo pipefail

TPU="" ZONE="" PROJECT="" ACCEL="v5litepod-8" RUNTIME="v2-alpha-tpuv5-lite" CREATE=0 DRY=0
CONFIG="" SETS=()
usage() { sed -n '2,11p' "$0"; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) TPU="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --accelerator) ACCEL="$2"; shift 2 ;;
    --runtime) RUNTIME="$2"; shift 2 ;;
    --create) CREATE=1; shift ;;
    --config) CONFIG="$2"; shift 2 ;;
    --set) SETS+=("$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "launch_tpu.sh: unknown option $1" >&2; usage 2 ;;
  esac
done
[[ -n "$TPU" && -n "$ZONE" ]] || { echo "launch_tpu.sh: --tpu and --zone are required" >&2; exit 2; }

quote() {  # shell-quote one word for display (single quotes when needed)
  local s="$1"
  if [[ "$s" =~ [^A-Za-z0-9_./:=@,+-] ]]; then printf "'%s'" "${s//\'/\'\\\'\'}"; else printf '%s' "$s"; fi
}
run() {  # print, and run unless --dry-run
  printf '+'; for a in "$@"; do printf ' '; quote "$a"; done; printf '\n'
  if [[ $DRY -eq 0 ]]; then "$@"; fi
}

GC=(gcloud compute tpus tpu-vm)
LOC=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && LOC+=(--project "$PROJECT")
HERE="$(cd "$(dirname "$0")" && pwd)"
TARBALL="/tmp/supo_jax_${TPU}.tar.gz"

if [[ $CREATE -eq 1 ]]; then
  run "${GC[@]}" create "$TPU" "${LOC[@]}" --accelerator-type "$ACCEL" --version "$RUNTIME"
fi

run tar -czf "$TARBALL" -C "$HERE" --exclude .git --exclude runs --exclude '*.egg-info' .
run "${GC[@]}" scp "$TARBALL" "$TPU:~/supo_jax.tar.gz" "${LOC[@]}" --worker=all
run "${GC[@]}" ssh "$TPU" "${LOC[@]}" --worker=all --command \
  "mkdir -p ~/supo_jax && tar -xzf ~/supo_jax.tar.gz -C ~/supo_jax && cd ~/supo_jax && pip install -q -e \".[tpu]\""

TRAIN="supo-jax train"
[[ -n "$CONFIG" ]] && TRAIN+=" --config $(printf '%q' "$CONFIG")"
for s in "${SETS[@]+"${SETS[@]}"}"; do TRAIN+=" --set $(printf '%q' "$s")"; done
# every worker runs the same command; its log is named by its worker id
REMOTE="cd ~/supo_jax && mkdir -p logs/$TPU && W=\$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0) && SUPO_JAX_MULTIHOST=1 nohup $TRAIN > logs/$TPU/worker-\$W.log 2>&1 &"
run "${GC[@]}" ssh "$TPU" "${LOC[@]}" --worker=all --command "$REMOTE"
if [[ $DRY -eq 1 ]]; then
  echo "dry run: nothing was started on $TPU"
else
  echo "started on all workers of $TPU; logs: ~/supo_jax/logs/$TPU/worker-<i>.log on each worker"
fi
