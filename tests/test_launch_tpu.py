"""launch_tpu.sh --dry-run prints the whole launch without running it."""
import os
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_prints_every_step():
    r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), "--tpu", "my-tpu", "--zone",
                        "us-central2-b", "--project", "proj", "--accelerator", "v4-16", "--create",
                        "--config", "experiments/configs/paper_fncall_supo.py",
                        "--set", "model.path=/ckpt/Qwen2.5-7B-Instruct", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tpu-vm create my-tpu --zone us-central2-b --project proj --accelerator-type v4-16" in out
    assert "scp" in out and "--worker=all" in out
    assert 'pip install -q -e ".[tpu]"' in out
    assert "supo-jax train --config experiments/configs/paper_fncall_supo.py" in out
    assert "model.path=/ckpt/Qwen2.5-7B-Instruct" in out and "worker-" in out
    assert not os.path.exists("/tmp/supo_jax_my-tpu.tar.gz")  # nothing was run
    assert out.rstrip().endswith("dry run: nothing was started on my-tpu")
    assert "started on all workers" not in out


def test_help_is_the_usage_text_only():
    r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("# Launch a supo-jax training run")
    assert "set -euo" not in r.stdout and "--dry-run" in r.stdout


def test_missing_required_options_fail():
    r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tpu and --zone are required" in r.stderr


FAKE_GCLOUD = r'''#!/usr/bin/env bash
# gcloud as launch_tpu.sh drives it, for tests: a slice's state in $FAKE_GCLOUD_DIR; the run's
# first start is preempted (the slice turns PREEMPTED), the next ones exit with $FAKE_RUN_EXIT;
# FAKE_SCENARIO names another course (below), with gcloud's own error lines
d="$FAKE_GCLOUD_DIR"; a="$*"; echo "$a" >> "$d/calls"
sc="${FAKE_SCENARIO:-}"
case "$a" in
  "compute tpus tpu-vm create "*|"compute tpus queued-resources create "*)
    echo x >> "$d/creates"; n=$(wc -l < "$d/creates")
    if [[ -f "$d/state" ]]; then   # as gcloud does: the name is taken
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.create) ALREADY_EXISTS: Resource already exists" >&2
      exit 1
    fi
    # a Spot stock-out when the preempted slice is created again (the second creation)
    if [[ "$sc" == stockout && $n -eq 2 ]]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: There is no more" \
           "capacity in the zone" >&2; exit 1
    fi
    echo READY > "$d/state"; echo ACTIVE > "$d/qr"
    # the queue's first grant fails (the queued resource goes FAILED, no VM)
    if [[ "$sc" == qr_failed && $n -eq 1 ]]; then echo FAILED > "$d/qr"; rm -f "$d/state"; fi ;;
  "compute tpus tpu-vm delete "*|"compute tpus queued-resources delete "*) rm -f "$d/state" "$d/qr" ;;
  "compute tpus tpu-vm describe "*)
    # an API error while the slice is READY and the run trains: $FAKE_DESCRIBE_FAILS in a row
    if [[ -f "$d/flaky" ]]; then
      f=$(cat "$d/flaky"); if [[ $f -le 1 ]]; then rm -f "$d/flaky"; else echo $((f - 1)) > "$d/flaky"; fi
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) UNAVAILABLE: The service is currently" \
           "unavailable." >&2; exit 1
    fi
    if [[ ! -f "$d/state" ]]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource" \
           "'projects/p/locations/z1/nodes/x' was not found." >&2; exit 1
    fi
    cat "$d/state" ;;
  "compute tpus queued-resources describe "*) cat "$d/qr" ;;
  "compute tpus tpu-vm scp "*)   # sigterm_ready: the VM dies under the next start
    if [[ -f "$d/dying" ]]; then rm -f "$d/dying"; echo PREEMPTED > "$d/state"; exit 255; fi ;;
  "compute tpus tpu-vm ssh "*)
    [[ "$(cat "$d/state" 2>/dev/null)" == READY ]] || exit 255
    if [[ "$a" == *"supo-jax train"* ]]; then
      echo x >> "$d/tries"
      # the first ssh to a fresh VM fails (its SSH keys not there yet)
      if [[ "$sc" == ssh_fails_once && $(wc -l < "$d/tries") -eq 1 ]]; then
        echo "ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255]." >&2
        exit 255
      fi
      rm -f "$d/exit"; echo x >> "$d/starts"; n=$(wc -l < "$d/starts")
      case "$sc" in
        # the run is SIGTERMed (exit 143) while the slice still reads READY
        sigterm_ready) if [[ $n -eq 1 ]]; then echo 143 > "$d/exit"; touch "$d/dying"
                       else echo 0 > "$d/exit"; fi ;;
        # the run vanishes: no exit status, no process (a VM restarted under it)
        lost) if [[ $n -eq 1 ]]; then touch "$d/lost"; else rm -f "$d/lost"; echo 0 > "$d/exit"; fi ;;
        # gcloud fails to describe the READY slice while the run trains, then the run ends
        describe_flaky) echo "${FAKE_DESCRIBE_FAILS:-1}" > "$d/flaky"; touch "$d/running_once"
                        echo 0 > "$d/exit_later" ;;
        # every start is preempted
        always_preempted) echo PREEMPTED > "$d/state" ;;
        ssh_fails_once|qr_failed) echo "${FAKE_RUN_EXIT:-0}" > "$d/exit" ;;
        *) if [[ $n -eq 1 ]]; then echo PREEMPTED > "$d/state"
           else echo "${FAKE_RUN_EXIT:-0}" > "$d/exit"; fi ;;
      esac
    elif [[ "$a" == *"worker-0.exit"* ]]; then   # the watcher's poll
      if [[ -f "$d/running_once" ]]; then rm -f "$d/running_once"; echo running
        [[ -f "$d/exit_later" ]] && mv "$d/exit_later" "$d/exit"
      elif [[ -f "$d/exit" ]]; then cat "$d/exit"; elif [[ -f "$d/lost" ]]; then echo lost
      else echo running; fi
    fi ;;
esac
'''


def _launch(tmp_path, mode, run_exit=0, scenario="", state_before=None, restarts=3, **extra):
    bin_dir, state = tmp_path / "bin", tmp_path / "gcloud"
    bin_dir.mkdir()
    state.mkdir()
    if state_before:      # a slice of that name already there (an earlier run's)
        (state / "state").write_text(state_before + "\n")
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    tpu = f"fake-{mode}-{os.getpid()}"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FAKE_GCLOUD_DIR": str(state), "FAKE_RUN_EXIT": str(run_exit),
           "FAKE_SCENARIO": scenario, **extra}
    try:
        r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), "--tpu", tpu, "--zone",
                            "z1", f"--{mode}", "--poll-seconds", "0", "--max-restarts", str(restarts),
                            "--set", "train.run_dir=gs://bucket/run"],
                           capture_output=True, text=True, timeout=300, env=env)
        # what ships is the checkout as git sees it: the package, no caches or venvs
        with tarfile.open(f"/tmp/supo_jax_{tpu}.tar.gz") as tar:
            names = tar.getnames()
        assert "supo_jax/__init__.py" in names and "launch_tpu.sh" in names
        assert not [n for n in names if "__pycache__" in n or ".venv" in n or n.startswith(".git/")]
    finally:
        if os.path.exists(f"/tmp/supo_jax_{tpu}.tar.gz"):
            os.remove(f"/tmp/supo_jax_{tpu}.tar.gz")
    calls = (state / "calls").read_text().splitlines()
    return r, calls


def _count(calls, *words):
    return sum(all(w in c for w in words) for c in calls)


@pytest.mark.parametrize("mode,group", [("spot", "tpu-vm"), ("queued", "queued-resources")])
def test_a_preempted_slice_is_recreated_and_the_same_run_started_again(tmp_path, mode, group):
    """--spot / --queued with gcloud faked: the slice is preempted while the run is on it; the
    launcher deletes and recreates it, ships the checkout again and starts the same command
    (which resumes from its run directory), and stops when the run exits 0."""
    r, calls = _launch(tmp_path, mode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _count(calls, f"compute tpus {group} create") == 2
    assert _count(calls, f"compute tpus {group} delete") == 1
    if mode == "spot":
        assert all("--spot" in c for c in calls if "create" in c)
    starts = [c for c in calls if "supo-jax train" in c]
    assert len(starts) == 2 and starts[0] == starts[1]
    assert "train.run_dir=gs://bucket/run" in starts[0]
    assert _count(calls, "tpu-vm scp") == 2
    assert "preempted (slice PREEMPTED): recreating" in r.stdout
    assert r.stdout.rstrip().endswith("finished")


def test_a_sigterm_before_the_slice_turns_and_a_start_on_a_dying_vm(tmp_path):
    """The run exits 143 (a Spot VM's SIGTERM) while the slice still reads READY, and the VM
    dies under the next start (its scp fails): the launcher does not die with gcloud's
    error; it sees the slice preempted, recreates it and starts again."""
    r, calls = _launch(tmp_path, "spot", scenario="sigterm_ready")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped (run exit 143) on a READY slice: starting the run again" in r.stdout
    assert "preempted (slice PREEMPTED while starting): recreating" in r.stdout
    assert _count(calls, "tpu-vm create") == 2 and _count(calls, "tpu-vm delete") == 1
    assert r.stdout.rstrip().endswith("finished")


def test_a_run_that_vanishes_is_started_again_not_watched_forever(tmp_path):
    """No exit status and no live process on worker 0 (the VM restarted under the run) for
    two polls: the run is lost, and the launcher starts it again on the READY slice."""
    r, calls = _launch(tmp_path, "spot", scenario="lost")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped (no run on worker 0 (no exit status, no process)) on a READY slice" in r.stdout
    assert len([c for c in calls if "supo-jax train" in c]) == 2
    assert _count(calls, "tpu-vm delete") == 0
    assert r.stdout.rstrip().endswith("finished")


def test_a_run_that_fails_on_a_healthy_slice_is_not_restarted(tmp_path):
    r, calls = _launch(tmp_path, "spot", run_exit=1)
    assert r.returncode == 1 and "failed (exit 1)" in r.stderr
    assert _count(calls, "tpu-vm create") == 2 and len([c for c in calls
                                                        if "supo-jax train" in c]) == 2


def test_an_api_error_on_a_healthy_slice_neither_deletes_it_nor_stops_the_run(tmp_path):
    """gcloud fails to describe the READY slice while the run trains (UNAVAILABLE, three
    times: every retry of one poll): the state is unknown, not gone; the slice is neither
    deleted nor created again, and the run goes on to its end."""
    r, calls = _launch(tmp_path, "spot", scenario="describe_flaky", FAKE_DESCRIBE_FAILS="3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _count(calls, "tpu-vm delete") == 0 and _count(calls, "tpu-vm create") == 1
    assert len([c for c in calls if "supo-jax train" in c]) == 1
    assert "describe" in r.stderr and "UNAVAILABLE" in r.stderr   # each failed try is said
    assert r.stdout.rstrip().endswith("finished")


def test_a_stock_out_on_recreation_is_retried_as_a_restart(tmp_path):
    """The preempted Spot slice cannot be created again at once (no capacity): the launcher
    says so, retries with backoff (a restart), and the run starts on the slice it gets."""
    r, calls = _launch(tmp_path, "spot", scenario="stockout")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _count(calls, "tpu-vm create") == 3 and "no more capacity" in r.stderr
    assert "creating fake-spot" in r.stdout and "failed: trying again in 0 s (restart 2" in r.stdout
    assert len([c for c in calls if "supo-jax train" in c]) == 2
    assert r.stdout.rstrip().endswith("finished")


def test_a_failed_queued_resource_is_removed_and_queued_again(tmp_path):
    r, calls = _launch(tmp_path, "queued", scenario="qr_failed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "queued resource" in r.stderr and "is FAILED" in r.stderr
    creates = [i for i, c in enumerate(calls) if "queued-resources create" in c]
    deletes = [i for i, c in enumerate(calls) if "queued-resources delete" in c]
    assert len(creates) == 2 and len(deletes) == 1 and creates[0] < deletes[0] < creates[1]
    assert r.stdout.rstrip().endswith("finished")


def test_a_first_ssh_that_fails_on_a_fresh_vm_is_retried(tmp_path):
    r, calls = _launch(tmp_path, "spot", scenario="ssh_fails_once")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting it again" in r.stdout
    assert _count(calls, "tpu-vm delete") == 0 and _count(calls, "tpu-vm create") == 1
    assert r.stdout.rstrip().endswith("finished")


def test_a_slice_left_preempted_by_an_earlier_run_is_removed_before_it_is_created(tmp_path):
    r, calls = _launch(tmp_path, "spot", scenario="ssh_fails_once", state_before="PREEMPTED")
    assert r.returncode == 0, r.stdout + r.stderr
    first = [c.split()[3] for c in calls if c.split()[3] in ("create", "delete")][:2]
    assert first == ["delete", "create"], calls


def test_restarts_run_out(tmp_path):
    """Every start is preempted: after --max-restarts recreations the launcher gives up with
    one line naming the cause and the limit, and exits 1."""
    r, calls = _launch(tmp_path, "spot", scenario="always_preempted", restarts=2)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "slice PREEMPTED; 2 restarts spent, giving up (--max-restarts)" in r.stderr
    assert len([c for c in calls if "supo-jax train" in c]) == 3


def test_spot_dry_run_prints_the_watch_and_the_recreation():
    r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), "--tpu", "my-tpu", "--zone",
                        "z1", "--queued", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "queued-resources create my-tpu --zone z1 --node-id my-tpu" in r.stdout
    assert "queued-resources delete my-tpu --zone z1 --force --quiet" in r.stdout
    assert "at most 10 restarts" in r.stdout and not os.path.exists("/tmp/supo_jax_my-tpu.tar.gz")


def test_scaling_docs_bucket_launch_command_runs_as_written():
    """docs/SCALING.md's bucket walkthrough: its launch_tpu.sh command, as written, with
    --dry-run: a Spot slice whose run reads the model from and writes the run to the bucket."""
    import re
    import shlex

    with open(os.path.join(ROOT, "docs", "SCALING.md")) as f:
        doc = f.read().split("### Run directories in a bucket", 1)[1]
    block = re.search(r"\n    (\./launch_tpu\.sh .*?)\n    (?!    )", doc, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[0] == "./launch_tpu.sh" and "--spot" in argv
    r = subprocess.run(["bash", os.path.join(ROOT, "launch_tpu.sh"), *argv[1:], "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout.replace("\\", "")   # (the printed commands are shell-quoted)
    assert "train.run_dir=gs://<bucket>/runs/paper_fncall_supo" in out
    assert "model.path=gs://<bucket>/ckpt/Qwen2.5-7B-Instruct" in out
    assert "spot" in r.stdout.lower()
