#!/usr/bin/env bash
# Launch a supo-jax training run on a Cloud TPU VM (single host or pod slice).
#
#   ./launch_tpu.sh --tpu NAME --zone ZONE [--project P] [--accelerator v5litepod-16]
#                   [--runtime v2-alpha-tpuv5-lite] [--create | --spot | --queued]
#                   [--max-restarts 10] [--poll-seconds 60] [--config FILE]
#                   [--set key=value ...] [--dry-run]
#
# Ships this checkout to every worker, installs it with the [tpu] extra, and starts the same
# `supo-jax train` command on all workers (each worker's log: logs/<tpu>/worker-<i>.log on the
# worker, ~/supo_jax/logs/...). On a multi-host slice, supo-jax calls jax.distributed.initialize()
# itself (the TPU runtime supplies the coordinator). --dry-run prints every command instead.
# --spot (a Spot TPU VM) or --queued (a queued resource, Spot) creates the slice and stays to
# watch it: when the slice is preempted or lost, or the run stops preempted (exit 143 or 75), it
# recreates the slice and starts the same command again, which resumes from train.run_dir (a
# gs:// bucket, or a disk every new slice mounts); a run that vanishes from worker 0 (no exit
# status, no process) is started again; it stops when the run exits 0 (its last step done),
# exits with the run's status when the run fails otherwise, and gives up after
# --max-restarts restarts. A slice is deleted only when gcloud says it is PREEMPTED,
# TERMINATED or gone, never when gcloud fails to answer (retried, then watched on); a failed
# creation (a Spot stock-out, a FAILED queued resource) or start is retried with backoff,
# each try counted as a restart.
set -euo pipefail

TPU="" ZONE="" PROJECT="" ACCEL="v5litepod-8" RUNTIME="v2-alpha-tpuv5-lite" CREATE=0 DRY=0
CONFIG="" SETS=() MODE="" MAX_RESTARTS=10 POLL=60
usage() { sed -n '2,22p' "$0"; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) TPU="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --accelerator) ACCEL="$2"; shift 2 ;;
    --runtime) RUNTIME="$2"; shift 2 ;;
    --create) CREATE=1; shift ;;
    --spot) MODE=spot; shift ;;
    --queued) MODE=queued; shift ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --poll-seconds) POLL="$2"; shift 2 ;;
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
QR=(gcloud compute tpus queued-resources)
LOC=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && LOC+=(--project "$PROJECT")
HERE="$(cd "$(dirname "$0")" && pwd)"
TARBALL="/tmp/supo_jax_${TPU}.tar.gz"
ERR="$(mktemp)"   # gcloud's stderr, read to tell "not found" from an API error
trap 'rm -f "$ERR"' EXIT

create() {  # the slice: on demand (--create), a Spot VM (--spot) or a queued resource (--queued)
  case "$MODE" in
    spot) run "${GC[@]}" create "$TPU" "${LOC[@]}" --accelerator-type "$ACCEL" --version "$RUNTIME" \
            --spot ;;
    queued)
      run "${QR[@]}" create "$TPU" "${LOC[@]}" --node-id "$TPU" --accelerator-type "$ACCEL" \
        --runtime-version "$RUNTIME" --spot || return 1
      [[ $DRY -eq 1 ]] && return 0
      local st=""   # wait until the queue grants it
      until [[ "$st" == ACTIVE ]]; do
        st=$("${QR[@]}" describe "$TPU" "${LOC[@]}" --format='value(state.state)' 2>/dev/null || true)
        case "$st" in FAILED|SUSPENDED) echo "launch_tpu.sh: queued resource $TPU is $st" >&2
                                        return 1 ;; esac
        [[ "$st" == ACTIVE ]] || sleep "$POLL"
      done ;;
    *) run "${GC[@]}" create "$TPU" "${LOC[@]}" --accelerator-type "$ACCEL" --version "$RUNTIME" ;;
  esac
}
remove() {  # the preempted or lost slice (and its queued resource)
  if [[ "$MODE" == queued ]]; then run "${QR[@]}" delete "$TPU" "${LOC[@]}" --force --quiet || true
  else run "${GC[@]}" delete "$TPU" "${LOC[@]}" --quiet || true; fi
}
backoff() {  # seconds to wait before try $1 + 1: the poll interval, doubled each try, <= 600
  local s=$((POLL * (1 << ($1 > 5 ? 5 : $1 - 1))))
  echo $((s > 600 ? 600 : s))
}
DESCRIBE_TRIES=3
slice_state() {  # the slice's state: READY (it can run), PREEMPTED, TERMINATED, ... (it cannot),
  # GONE (gcloud: not found), UNKNOWN (gcloud failed otherwise DESCRIBE_TRIES times: an API
  # error says nothing of the slice, which is then neither deleted nor taken as READY)
  local st err i
  for ((i = 1; i <= DESCRIBE_TRIES; i++)); do
    if st=$("${GC[@]}" describe "$TPU" "${LOC[@]}" --format='value(state)' 2>"$ERR"); then
      echo "${st:-GONE}"; return 0
    fi
    if grep -qiE 'NOT_FOUND|not found' "$ERR"; then echo GONE; return 0; fi
    err=$(tr '\n' ' ' < "$ERR" | cut -c1-200)
    echo "launch_tpu.sh: gcloud describe $TPU failed (try $i of $DESCRIBE_TRIES): $err" >&2
    [[ $i -lt $DESCRIBE_TRIES ]] && sleep "$(backoff "$i")"
  done
  echo UNKNOWN
}

TRAIN="supo-jax train"
[[ -n "$CONFIG" ]] && TRAIN+=" --config $(printf '%q' "$CONFIG")"
for s in "${SETS[@]+"${SETS[@]}"}"; do TRAIN+=" --set $(printf '%q' "$s")"; done
# every worker runs the same command; its log is named by its worker id, and its exit status
# lands beside it (worker-<i>.exit), which the watcher (--spot / --queued) reads
WORKER="W=\$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0)"
REMOTE="cd ~/supo_jax && mkdir -p logs/$TPU && $WORKER && rm -f logs/$TPU/worker-\$W.exit && (trap '' HUP; SUPO_JAX_MULTIHOST=1 $TRAIN > logs/$TPU/worker-\$W.log 2>&1; echo \$? > logs/$TPU/worker-\$W.exit) > /dev/null 2>&1 < /dev/null & echo \$! > logs/$TPU/worker-\$W.pid"
# what worker 0's run is doing: its exit status once it ended, "running" while its process
# lives, "lost" when neither (the VM restarted under it, or it never started)
POLL_CMD="cat ~/supo_jax/logs/$TPU/worker-0.exit 2>/dev/null || { kill -0 \$(cat ~/supo_jax/logs/$TPU/worker-0.pid 2>/dev/null || echo 0) 2>/dev/null && echo running; } || echo lost"

pack() {  # this checkout as git sees it: tracked files and untracked ones it does not
  # ignore (no .venv, caches or runs); a copy outside git: all but .git, runs, venvs, caches
  if git -C "$HERE" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git -C "$HERE" ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do if [[ -e "$HERE/$f" ]]; then printf '%s\0' "$f"; fi; done \
      | tar -czf "$TARBALL" -C "$HERE" --null --no-recursion -T -
  else
    tar -czf "$TARBALL" -C "$HERE" --exclude .git --exclude runs --exclude '*.egg-info' \
      --exclude .venv --exclude venv --exclude __pycache__ --exclude .pytest_cache .
  fi
}

start() {  # ship this checkout, install it and start the run on every worker; 1 on a failure
  run pack || return 1
  run "${GC[@]}" scp "$TARBALL" "$TPU:~/supo_jax.tar.gz" "${LOC[@]}" --worker=all || return 1
  run "${GC[@]}" ssh "$TPU" "${LOC[@]}" --worker=all --command \
    "mkdir -p ~/supo_jax && tar -xzf ~/supo_jax.tar.gz -C ~/supo_jax && cd ~/supo_jax && pip install -q -e \".[tpu]\"" \
    || return 1
  run "${GC[@]}" ssh "$TPU" "${LOC[@]}" --worker=all --command "$REMOTE" || return 1
}

if [[ -z "$MODE" ]]; then
  [[ $CREATE -eq 1 ]] && create
  start || { echo "launch_tpu.sh: starting the run on $TPU failed (the command above)" >&2; exit 1; }
  if [[ $DRY -eq 1 ]]; then
    echo "dry run: nothing was started on $TPU"
  else
    echo "started on all workers of $TPU; logs: ~/supo_jax/logs/$TPU/worker-<i>.log on each worker"
  fi
  exit 0
fi

# --spot / --queued: create, start, watch; recreate and restart after a preemption
restarts=0
LOST_POLLS=2          # polls that find no run (no exit status, no live process) before it is lost
UNREACHABLE_POLLS=10  # polls that cannot reach worker 0 on a READY slice before giving up
count_restart() {  # one restart more, for $1 (what happened); past --max-restarts, give up
  restarts=$((restarts + 1))
  if [[ $restarts -gt $MAX_RESTARTS ]]; then
    echo "launch_tpu.sh: $TPU: $1; $MAX_RESTARTS restarts spent, giving up (--max-restarts)" >&2
    exit 1
  fi
}
recreate() {  # a slice that cannot run ($1: its state) removed, and created again; a failed
  # creation (a Spot stock-out, a FAILED queued resource) is retried with backoff
  local state="$1" tries=0 wait
  while true; do
    [[ "$state" != GONE ]] && remove
    if create; then return 0; fi
    tries=$((tries + 1))
    count_restart "creating the slice failed (the command above)"
    wait=$(backoff "$tries")
    echo "creating $TPU failed: trying again in $wait s (restart $restarts of at most" \
         "$MAX_RESTARTS)"
    sleep "$wait"
    state=FAILED   # what a failed creation left is removed first
  done
}

if [[ $DRY -eq 1 ]]; then
  create
  start
  echo "dry run: nothing was started on $TPU; then every $POLL s: the slice's state" \
       "(describe) and worker 0's run (logs/$TPU/worker-0.exit, .pid); on a preemption:"
  remove; create
  echo "and start again (at most $MAX_RESTARTS restarts)"
  exit 0
fi
state=$(slice_state)
case "$state" in
  READY) ;;
  UNKNOWN) echo "launch_tpu.sh: cannot read the state of $TPU (gcloud describe failed" \
                "$DESCRIBE_TRIES times); nothing was created or deleted" >&2
           exit 1 ;;
  *) recreate "$state" ;;   # gone: created; left PREEMPTED or TERMINATED: removed first
esac
start_fails=0
while true; do
  if ! start; then
    start_fails=$((start_fails + 1))
    state=$(slice_state)
    why="starting the run failed (the command above)"
    [[ "$state" == READY || "$state" == UNKNOWN ]] || why="slice $state while starting"
  else
    start_fails=0
    echo "started on all workers of $TPU (restart $restarts of at most $MAX_RESTARTS); watching"
    lost=0 unreachable=0 why=""
    while [[ -z "$why" ]]; do
      sleep "$POLL"
      got=$("${GC[@]}" ssh "$TPU" "${LOC[@]}" --worker=0 --command "$POLL_CMD" 2>/dev/null || true)
      got="${got//[^a-z0-9]/}"
      code="${got//[^0-9]/}"
      state=$(slice_state)
      if [[ "$got" == "$code" && -n "$code" ]]; then     # the run's exit status
        if [[ "$code" == 0 ]]; then echo "the run on $TPU finished"; exit 0; fi
        if [[ "$code" != 143 && "$code" != 75 ]]; then
          echo "launch_tpu.sh: the run on $TPU failed (exit $code); see its logs" >&2; exit "$code"
        fi
        why="run exit $code"
        # a Spot VM's SIGTERM comes before its state turns: wait a poll for it to say so
        sleep "$POLL"; state=$(slice_state)
      elif [[ "$state" != READY && "$state" != UNKNOWN ]]; then
        why="slice $state"
      elif [[ "$got" == lost ]]; then
        lost=$((lost + 1)); unreachable=0
        [[ $lost -ge $LOST_POLLS ]] && why="no run on worker 0 (no exit status, no process)"
      elif [[ "$got" == running ]]; then
        lost=0; unreachable=0
      else
        unreachable=$((unreachable + 1)); lost=0
        if [[ $unreachable -ge $UNREACHABLE_POLLS ]]; then
          echo "launch_tpu.sh: worker 0 of $TPU ($state) did not answer $unreachable polls in" \
               "a row; giving up (the run may still be going: see its logs)" >&2
          exit 1
        fi
      fi
    done
  fi
  count_restart "$why"
  case "$state" in
    READY|UNKNOWN)
      if [[ $start_fails -gt 0 ]]; then
        wait=$(backoff "$start_fails")
        echo "$why on $TPU ($state): starting it again in $wait s"
        sleep "$wait"
      elif [[ "$state" == READY ]]; then
        echo "stopped ($why) on a READY slice: starting the run again on $TPU"
      else
        echo "stopped ($why); the state of $TPU is unknown (gcloud describe failed): starting" \
             "the run again on it"
      fi ;;
    *) echo "preempted ($why): recreating $TPU"
       recreate "$state" ;;
  esac
done
