"""The suite holds its own time budget (tests/suite_budget.py): a run over its budget, or a test
over the per-test limit that is neither marked slow nor listed, fails the run with one line."""
import os
import re
import subprocess
import sys

import pytest

TESTS = '''
import time, pytest

def test_quick():
    pass

def test_sleeps():
    time.sleep(1.2)

@pytest.mark.slow
def test_marked_slow():
    time.sleep(1.2)

def test_listed():
    time.sleep(1.2)
'''
INI = '''[pytest]
markers = slow: minutes
test_limit_s = {limit}
long_tests =
    t/test_timed.py::test_listed  # the reason it is long
suite_budget_s = {budget}
'''


def _run(tmp_path, budget, *args, limit=1, env=None):
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "test_timed.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text(INI.format(budget=budget, limit=limit))
    here = os.path.dirname(os.path.abspath(__file__))
    base = {k: v for k, v in os.environ.items() if k != "SUPO_JAX_SUITE_BUDGET_S"}
    env = dict(base, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_budget", "-p",
                           "no:cacheprovider", "-q", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]])   # xdist: the controller's verdict
def test_a_test_over_the_limit_fails_the_run_unless_slow_or_listed(tmp_path, workers):
    r = _run(tmp_path, 0, "t", *workers)
    assert r.returncode == 1, r.stdout
    assert "4 passed" in r.stdout
    over = [ln for ln in r.stdout.splitlines() if ln.startswith("suite budget:")]
    assert len(over) == 1 and "test_sleeps" in over[0], r.stdout
    assert "test_marked_slow" not in over[0] and "test_listed" not in over[0]
    if workers:    # each worker's busy seconds: the three 1.2 s tests' 3.6 s between them
        busy = re.search(r"workers' busy time: gw0 (\d+) s in (\d) tests, gw1 (\d+) s in "
                         r"(\d) tests; the run \d+ s", r.stdout)
        assert busy, r.stdout
        assert int(busy[2]) + int(busy[4]) == 4 and 3 <= int(busy[1]) + int(busy[3]) <= 5
    else:
        assert "workers' busy time" not in r.stdout
    r = _run(tmp_path, 0, "t", "-m", "not slow", "-k", "not sleeps")
    assert r.returncode == 0 and "suite budget" not in r.stdout, r.stdout


@pytest.mark.slow
def test_a_whole_run_over_its_budget_fails_and_a_selection_does_not(tmp_path):
    r = _run(tmp_path, 2, "t", "-k", "not sleeps", limit=100)   # a selection: no budget
    assert r.returncode == 0 and "suite budget" not in r.stdout, r.stdout
    r = _run(tmp_path, 2, "t", limit=100)
    assert r.returncode == 1 and "4 passed" in r.stdout, r.stdout
    assert "over suite_budget_s = 2 s" in r.stdout, r.stdout
    r = _run(tmp_path, 2, "t", limit=100, env={"SUPO_JAX_SUITE_BUDGET_S": "100"})
    assert r.returncode == 0 and "suite budget" not in r.stdout, r.stdout


HANGS = '''
import subprocess, sys, time

def test_sleeps_forever():
    time.sleep(600)

def test_waits_on_a_child_forever():
    subprocess.run([sys.executable, "-c", "import time; time.sleep(600)"])

def test_quick():
    pass
'''


def test_a_hung_test_fails_with_its_stacks_and_the_run_goes_on(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_hangs.py").write_text(HANGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntest_timeout_s = 600\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SUPO_JAX_TEST_TIMEOUT_S="2")          # overrides the ini's 600
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_budget", "-p",
                        "no:cacheprovider", "-q", "t"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout
    assert "2 failed, 1 passed" in r.stdout, r.stdout
    assert r.stdout.count("ran over test_timeout_s = 2 s") >= 2, r.stdout
    assert "time.sleep(600)" in r.stdout and "in test_waits_on_a_child_forever" in r.stdout
    assert "--- thread MainThread" in r.stdout
