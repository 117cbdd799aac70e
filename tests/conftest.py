"""Test set-up: 8 simulated CPU devices, GPU memory shared with the tests' subprocesses,
tests that need the 8 CPU devices pinned to the CPU, and a persistent compile cache that
every process the tests start shares (JAX_COMPILATION_CACHE_DIR).

- XLA_FLAGS gets --xla_force_host_platform_device_count=8 (added to flags already set,
  unless they name a count): the sharding tests build meshes of 8 devices. Without the
  flag they would not find them; tests/test_platforms.py checks that the CPU has them.
- XLA_PYTHON_CLIENT_PREALLOCATE=false: where the default platform is a GPU, JAX would take
  75% of its memory in every process at start; this process and the `supo-jax`, trainer,
  benchmark and notebook subprocesses the tests start (they inherit os.environ) share it.
- Tests marked `cpu_devices` (meshes of 8 simulated devices) run in this process where the
  default JAX platform is the CPU. Elsewhere (a GPU machine: 1 device, the model picks
  GPU-only code paths by jax.default_backend()) they run together in one pytest
  subprocess with JAX_PLATFORMS=cpu, and each reports here the outcome it had there
  (SUPO_JAX_TESTS_DELEGATE_CPU=1 does that on a CPU machine too: tests/test_platforms.py).
- Under pytest-xdist (`-n 2`) with no more usable cores than workers, each worker and the
  processes its tests start run on a core of their own (SUPO_JAX_TESTS_PIN=0: not pinned):
  two JAX processes on the same 2 cores each run XLA thread pools sized for both and contend.
  Two 10-step `supo-jax train` runs side by side took 279 s unpinned and 249 s pinned
  (2-core AMD EPYC, 2026-11-25).
- Scheduling (pytest.ini: `--dist loadgroup --no-loadscope-reorder`): a module marked
  `xdist_group` runs on one worker, so its module-scoped fixture (a training run, a model
  build) is built once, not once per worker; the items of modules with a `long` item run
  first, then the xdist groups', then the single tests, so that no minutes-long unit ends
  the run on one worker while the other worker, done, leaves its core idle.
"""
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest

import suite_budget
from suite_budget import pytest_addoption  # noqa: F401  (pytest.ini's budget settings)
from xdist_groups import name_xdist_groups


def _pin_xdist_worker():
    """Pin this pytest-xdist worker to one usable core when the workers are at least as many as
    the cores (before JAX sizes its thread pools; child processes inherit the affinity)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if (not worker.startswith("gw") or os.environ.get("SUPO_JAX_TESTS_PIN") == "0"
            or not hasattr(os, "sched_setaffinity")):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1 and count >= len(cpus):
        os.environ["SUPO_JAX_TESTS_CPUS"] = ",".join(map(str, cpus))   # for unpinned children
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_xdist_worker()

CPU_DEVICES = 8
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_flags = os.environ.get("XLA_FLAGS", "")
if _COUNT_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_COUNT_FLAG}={CPU_DEVICES}".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

os.environ.setdefault("SUPO_JAX_COMPILE_CACHE",
                      os.path.join(tempfile.gettempdir(), "supo_jax_compile_cache"))
from supo_jax.utils import enable_compile_cache  # noqa: E402

# the same cache for every process the tests start, also those that never call
# enable_compile_cache (the benchmark scripts, the notebook's kernel, experiments/ scripts,
# tests/rollout_worker.py): JAX reads these at import. Processes with the same XLA_FLAGS and
# the same programs then compile each once (most of a smoke run's seconds are compiles)
os.environ["JAX_COMPILATION_CACHE_DIR"] = enable_compile_cache()
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

_CPU_CHILD = "SUPO_JAX_TESTS_CPU_CHILD"   # set in the CPU subprocess: never delegate again
_DELEGATE = "SUPO_JAX_TESTS_DELEGATE_CPU"  # "1": delegate even where the default is the CPU


def pytest_configure(config):
    suite_budget.pytest_configure(config)
    config.addinivalue_line(
        "markers", "long: minutes of work; the items of its module are scheduled first")
    config.addinivalue_line(
        "markers", "slow: left out of the fast tier (`-m \"not slow\"`); every `long` test is")
    config.addinivalue_line(
        "markers", f"cpu_devices: needs the {CPU_DEVICES} simulated CPU devices; where the "
        "default JAX platform is not the CPU it runs in a subprocess with JAX_PLATFORMS=cpu")


def pytest_itemcollected(item):
    """Before -m deselects: the fast tier (`-m "not slow"`) leaves the `long` tests out."""
    if item.get_closest_marker("long") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: delegate only what will run
def pytest_collection_modifyitems(session, config, items):
    _order_and_delegate(config, items)
    name_xdist_groups(config, items)


def _order_and_delegate(config, items):
    # the modules with a `long` item first, then those of an xdist_group (a unit one worker
    # runs whole: tpu_compile's 5 minutes, the harness venv's 2-4), then the single tests,
    # which fill the workers' last minutes evenly (with the groups last, one worker ran the
    # harness group alone for the run's last 95 s: experiments/LOG.md, 2026-12-07); each
    # module's items stay together and in order, so its module-scoped fixtures are built once
    long_modules = {item.module for item in items if item.get_closest_marker("long")}
    items.sort(key=lambda item: (item.module not in long_modules,            # a stable sort
                                 item.get_closest_marker("xdist_group") is None))
    marked = [i for i, item in enumerate(items) if item.get_closest_marker("cpu_devices")]
    if not marked or os.environ.get(_CPU_CHILD):
        return
    if jax.default_backend() == "cpu" and os.environ.get(_DELEGATE) != "1":
        return
    batch = _CpuBatch(str(config.rootpath), [items[i].nodeid for i in marked])
    for i in marked:
        item = items[i]
        items[i] = CpuSubprocessItem.from_parent(item.parent, name=item.name, batch=batch,
                                                 location=item.location)


def cpu_child_env() -> dict:
    """This process's environment for a JAX child process on the CPU with the simulated
    devices."""
    env = dict(os.environ)
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", env.get("XLA_FLAGS", ""))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} {_COUNT_FLAG}={CPU_DEVICES}".strip())
    return env


class _CpuBatch:
    """The delegated tests, run once in one `python -m pytest` subprocess on the CPU."""

    def __init__(self, rootdir: str, nodeids: list[str]):
        self.rootdir, self.nodeids, self.results, self.log = rootdir, nodeids, None, ""

    def outcome(self, nodeid: str):
        if self.results is None:
            self._run()
        return self.results.get(_junit_key(nodeid))

    def _run(self):
        with tempfile.TemporaryDirectory() as tmp:
            xml = os.path.join(tmp, "junit.xml")
            env = cpu_child_env()
            env[_CPU_CHILD] = "1"
            env.pop(_DELEGATE, None)
            cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                   f"--junitxml={xml}", *self.nodeids]
            try:
                r = subprocess.run(cmd, cwd=self.rootdir, env=env, capture_output=True, text=True,
                                   timeout=1800)
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
                self.log = (f"(the CPU subprocess exited with status {r.returncode}; "
                            f"its last lines:)\n{tail}")
            except subprocess.TimeoutExpired as e:
                self.log = f"timed out after {e.timeout} s"
            self.results = _junit_outcomes(xml) if os.path.exists(xml) else {}


def _junit_outcomes(path: str) -> dict:
    """(classname, name) -> ("passed" | "failed" | "skipped", text) of each test case of a
    pytest junit XML file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                text += f"{child.tag}: {child.get('message', '')}\n{child.text or ''}\n"
            elif child.tag == "skipped" and outcome == "passed":
                outcome, text = "skipped", child.get("message", "")
        out[(cls, name)] = (outcome, text)
    return out


def _junit_key(nodeid: str):
    """The (classname, name) pytest's junit XML gives a test: tests/test_x.py::C::t[p] ->
    ("tests.test_x.C", "t[p]")."""
    parts = nodeid.split("::")
    module = parts[0][:-3].replace("/", ".") if parts[0].endswith(".py") else parts[0]
    return ".".join([module] + parts[1:-1]), parts[-1]


class CpuSubprocessItem(pytest.Item):
    """Stands for a `cpu_devices` test where the default platform is not the CPU: reports
    the outcome the test had in the CPU subprocess (_CpuBatch)."""

    def __init__(self, *, batch: _CpuBatch, location, **kwargs):
        super().__init__(**kwargs)
        self.batch, self._location = batch, location
        self.plain_nodeid = self.nodeid      # before an `@group` suffix (xdist_groups.py)

    def runtest(self):
        res = self.batch.outcome(self.plain_nodeid)
        if res is None:
            pytest.fail(f"{self.nodeid} did not run in the CPU subprocess:\n{self.batch.log}",
                        pytrace=False)
        outcome, text = res
        if outcome == "skipped":
            pytest.skip(f"(in the CPU subprocess) {text}")
        if outcome == "failed":
            pytest.fail(f"failed in the CPU subprocess (JAX_PLATFORMS=cpu):\n{text}",
                        pytrace=False)

    def reportinfo(self):
        return self.path, self._location[1], f"{self._location[2]} (on the CPU)"
