"""Where the tests run (tests/conftest.py): the CPU backend has the 8 simulated devices, and
tests marked `cpu_devices` run on it, in a subprocess where the default platform is not the
CPU (a GPU machine), reporting their outcome, failures included, to this process."""
import json
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


def _flags_after_import(code="", **env):
    """XLA_FLAGS after `import supo_jax` (code runs first) in a fresh process."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    r = subprocess.run([sys.executable, "-c", code + "\nimport json, os, supo_jax\n"
                        "print(json.dumps(os.environ.get('XLA_FLAGS')))"],
                       env=dict(base, **env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cpu_programs_compile_at_llvm_level_1_unless_the_user_says_otherwise():
    """supo_jax.utils.cpu_compile_level: on the CPU alone XLA_FLAGS gains level 1, after any
    flags already there; a level of the user's, another platform, or backends already started
    (XLA has read its flags) leave XLA_FLAGS as it was."""
    from supo_jax.utils import CPU_OPT_FLAG

    level1 = f"{CPU_OPT_FLAG}=1"
    assert _flags_after_import(JAX_PLATFORMS="cpu") == level1
    assert _flags_after_import(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_dump_to=/tmp/x") == \
        f"--xla_dump_to=/tmp/x {level1}"
    assert _flags_after_import(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{CPU_OPT_FLAG}=3") == \
        f"{CPU_OPT_FLAG}=3"
    assert _flags_after_import(JAX_PLATFORMS="cuda") is None
    assert _flags_after_import("import jax; jax.devices()", JAX_PLATFORMS="cpu") is None
    # this process (tests/conftest.py imports supo_jax before any backend starts)
    if jax.default_backend() == "cpu":
        assert CPU_OPT_FLAG in os.environ["XLA_FLAGS"], os.environ["XLA_FLAGS"]
