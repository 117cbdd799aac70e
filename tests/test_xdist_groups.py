"""The README's test command (`-n 2`, pytest.ini's `--dist loadgroup`) sends the items of a
module marked `xdist_group` to one worker, so its module fixtures are built once."""
import os
import subprocess
import sys

MODULE = '''
import os, time, pytest
pytestmark = pytest.mark.xdist_group("one")

@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILDS"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none") + "\\n")
    time.sleep(0.5)

@pytest.mark.parametrize("i", range(6))
def test_grouped(built, i):
    time.sleep(0.05)
'''
OTHER = '''
import time, pytest

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.05)
'''


def test_a_groups_module_fixture_is_built_on_one_worker(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_grouped.py").write_text(MODULE)
    (tests / "test_free.py").write_text(OTHER)
    here = os.path.dirname(os.path.abspath(__file__))
    ini = os.path.join(os.path.dirname(here), "pytest.ini")
    builds = tmp_path / "builds"
    env = dict(os.environ, BUILDS=str(builds),
               PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-c", ini, "--rootdir",
                        str(tmp_path), "-p", "xdist_groups", "-p", "no:cacheprovider", "-v",
                        str(tests)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "12 passed" in r.stdout, r.stdout[-3000:]
    assert len(builds.read_text().split()) == 1, (builds.read_text(), r.stdout[-3000:])
    assert "test_grouped.py::test_grouped[0]@one" in r.stdout, r.stdout[-3000:]
