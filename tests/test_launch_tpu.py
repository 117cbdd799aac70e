"""launch_tpu.sh --dry-run prints the whole launch without running it."""
import os
import subprocess

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
