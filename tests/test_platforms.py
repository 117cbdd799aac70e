"""Where the tests run (tests/conftest.py): the CPU backend has the 8 simulated devices, and
tests marked `cpu_devices` run on it, in a subprocess where the default platform is not the
CPU (a GPU machine), reporting their outcome, failures included, to this process."""
import os
import subprocess
import sys

import jax
import pytest

CPU_DEVICES = 8   # as conftest.CPU_DEVICES
PROBE = "SUPO_JAX_TESTS_PROBE"   # set by test_cpu_devices_tests_run_in_a_cpu_subprocess


def test_the_cpu_backend_has_the_simulated_devices():
    """conftest's XLA flag took effect: the `cpu_devices` tests build meshes of 8 devices and
    must never find fewer (they would fail, not skip)."""
    try:
        cpu = jax.devices("cpu")
    except RuntimeError as e:   # JAX_PLATFORMS without cpu: the cpu_devices subprocess has it
        pytest.skip(f"no CPU backend in this process: {e}")
    assert len(cpu) == CPU_DEVICES, os.environ.get("XLA_FLAGS")
    if jax.default_backend() == "cpu":
        assert jax.device_count() == CPU_DEVICES


@pytest.mark.cpu_devices
@pytest.mark.parametrize("planted_failure", [False, True])
def test_cpu_devices_probe(planted_failure):
    """Runs on the CPU with its 8 devices wherever the suite runs; fails on purpose only when
    test_cpu_devices_tests_run_in_a_cpu_subprocess asks."""
    assert jax.default_backend() == "cpu" and jax.device_count() == CPU_DEVICES
    probe = os.environ.get(PROBE)
    if probe:
        with open(probe, "a") as f:
            f.write(f"{planted_failure} {os.environ.get('SUPO_JAX_TESTS_CPU_CHILD', '')}\n")
        assert not planted_failure, "a planted failure"


def test_cpu_devices_tests_run_in_a_cpu_subprocess(tmp_path):
    """What a GPU machine does with the `cpu_devices` tests, forced on any machine
    (SUPO_JAX_TESTS_DELEGATE_CPU=1): they run in one child pytest with JAX_PLATFORMS=cpu,
    and the parent reports each one's outcome: a pass as a pass, a failure as a failure."""
    probe = tmp_path / "probe.txt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SUPO_JAX_TESTS_DELEGATE_CPU="1", **{PROBE: str(probe)})
    env.pop("SUPO_JAX_TESTS_CPU_CHILD", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"{os.path.relpath(__file__, root)}::test_cpu_devices_probe"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 failed, 1 passed" in out and "failed in the CPU subprocess" in out, out
    assert "a planted failure" in out, out
    # both ran once, in the child (SUPO_JAX_TESTS_CPU_CHILD=1), not in the parent
    assert sorted(probe.read_text().splitlines()) == ["False 1", "True 1"]
