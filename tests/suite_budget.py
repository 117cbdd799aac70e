"""The suite's time budget, held by the suite itself (tests/conftest.py loads it; `-p
suite_budget` loads it as a plugin: tests/test_suite_budget.py).

- A test whose setup, call and teardown take more than `test_limit_s` (pytest.ini) and that is
  neither marked `slow` nor named in `long_tests` (pytest.ini, each with its reason) fails the
  run: the fast tier (`-m "not slow"`) stays fast because nothing minutes-long hides in it.
- A run of the whole suite (no -k, no file or node selection) that takes longer than its
  budget fails: `suite_budget_s` for the README's test command, `fast_budget_s` for the fast
  tier (`-m "not slow"`). Both are set well under CI's 90 minutes, so that a run which
  creeps up is told while it still lands. SUPO_JAX_SUITE_BUDGET_S overrides the one in force
  (0: no budget), for a slower machine.
The run's tests pass or fail as they did; the budget's verdict is printed before the closing
line and sets the exit status.
- A test phase (setup, call or teardown) still running after `test_timeout_s` (pytest.ini;
  SUPO_JAX_TEST_TIMEOUT_S overrides, 0: none) fails with every thread's stack in its report: a
  hung test (a subprocess waited on forever, a peer that never comes) costs that long, not
  CI's whole limit. It interrupts Python code, and the waits (sleep, subprocess, sockets),
  where the main thread is (POSIX; SIGALRM).
"""
import os
import signal
import sys
import threading
import time
import traceback

import pytest

_START = time.monotonic()


def pytest_addoption(parser):
    parser.addini("test_limit_s", "seconds a test may take unless marked slow or listed in "
                  "long_tests", default="120")
    parser.addini("long_tests", "node ids (without parameters) allowed over test_limit_s "
                  "without the slow mark: `node id  # reason`", type="linelist", default=[])
    parser.addini("suite_budget_s", "seconds the whole suite may take (0: none)", default="0")
    parser.addini("test_timeout_s", "seconds a test's setup, call or teardown may run before "
                  "it is stopped and fails with every thread's stack (0: none)", default="0")
    parser.addini("fast_budget_s", "seconds the fast tier (-m 'not slow') may take (0: none)",
                  default="0")


class _Budget:
    def __init__(self, config):
        self.config = config
        self.limit = float(config.getini("test_limit_s"))
        self.allowed = {ln.split("#")[0].strip() for ln in config.getini("long_tests")}
        self.seconds: dict[str, float] = {}
        self.slow: set[str] = set()
        self.workers: dict[str, list] = {}    # xdist worker -> [busy seconds, tests]

    def pytest_runtest_logreport(self, report):
        # under pytest-xdist the controller sees reports, not items: the marks are keywords
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if "slow" in report.keywords:
            self.slow.add(report.nodeid)
        node = getattr(report, "node", None)           # xdist's WorkerController
        worker = getattr(getattr(node, "gateway", None), "id", None)
        if worker:
            busy = self.workers.setdefault(worker, [0.0, 0])
            busy[0] += report.duration
            busy[1] += report.when == "call"

    def balance(self, took: float) -> str:
        """One line of each xdist worker's busy seconds (setup + call + teardown of its tests)
        against the run's: where a shorter run must cut (a worker idle at the end waits)."""
        parts = [f"{w} {s:.0f} s in {n} tests" for w, (s, n) in sorted(self.workers.items())]
        return f"workers' busy time: {', '.join(parts)}; the run {took:.0f} s"

    def over(self) -> list[str]:
        """The tests over the per-test limit that are neither slow nor listed."""
        def base(nodeid):   # without parameters and the xdist group suffix
            return nodeid.split("@")[0].split("[")[0]
        return [f"{s:.1f} s {n}" for n, s in sorted(self.seconds.items(), key=lambda x: -x[1])
                if s > self.limit and n not in self.slow and base(n) not in self.allowed]

    def budget(self) -> tuple[str, float]:
        """(which budget, seconds) for this run; 0 when the run is a selection."""
        opt = self.config.option
        if getattr(opt, "keyword", "") or any("::" in a or a.endswith(".py") for a in self.config.args):
            return "", 0.0
        fast = (getattr(opt, "markexpr", "") or "").replace(" ", "") == "notslow"
        if getattr(opt, "markexpr", "") and not fast:
            return "", 0.0
        name = "fast_budget_s" if fast else "suite_budget_s"
        env = os.environ.get("SUPO_JAX_SUITE_BUDGET_S")
        return name, float(env) if env else float(self.config.getini(name))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workerinput"):
            return       # a pytest-xdist worker: the controller holds every worker's reports
        lines = []
        over = self.over()
        if over:
            lines.append(f"suite budget: {len(over)} test(s) over {self.limit:.0f} s neither "
                         "marked slow nor listed in pytest.ini's long_tests: " + "; ".join(over))
        name, seconds = self.budget()
        took = time.monotonic() - _START
        if seconds and took > seconds:
            lines.append(f"suite budget: the run took {took:.0f} s, over {name} = {seconds:.0f} s "
                         "(pytest.ini; SUPO_JAX_SUITE_BUDGET_S overrides): see the durations "
                         "above for what to trim")
        failing = bool(lines)
        if self.workers and name:      # a whole run under xdist (CI's): how its workers shared it
            lines.append(self.balance(took))
        if lines:
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            if tr:
                tr.write_line("")     # after the progress line of -q
            for line in lines:
                (tr.write_line if tr else print)(line)
        if failing and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


class TestTimeout(Exception):
    """A test phase ran past test_timeout_s."""


class _Watchdog:
    """SIGALRM at test_timeout_s into each test phase: the phase fails with the stacks."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.phase = ""

    def _fire(self, signum, frame):
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = [f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(f))
                  for ident, f in sys._current_frames().items()]
        raise TestTimeout(f"the test's {self.phase} ran over test_timeout_s = {self.seconds:.0f} s "
                          "(pytest.ini; SUPO_JAX_TEST_TIMEOUT_S overrides): every thread's "
                          "stack then:\n" + "\n".join(stacks))

    def _phase(self, name):
        self.phase = name
        old = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._phase("setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._phase("call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._phase("teardown")


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("suite_budget_state"):
        config.pluginmanager.register(_Budget(config), "suite_budget_state")
    env = os.environ.get("SUPO_JAX_TEST_TIMEOUT_S")
    seconds = float(env) if env else float(config.getini("test_timeout_s"))
    if (seconds > 0 and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
            and not config.pluginmanager.has_plugin("suite_budget_watchdog")):
        config.pluginmanager.register(_Watchdog(seconds), "suite_budget_watchdog")
