"""The README and docs as the tests read them: their text, the environment example (docs/
ENVIRONMENTS.md) in a working directory of its own, and the environment of a user's shell for
running their commands."""
import contextlib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
DOCS = {name: open(os.path.join(ROOT, "docs", name)).read()
        for name in sorted(os.listdir(os.path.join(ROOT, "docs"))) if name.endswith(".md")}
# the example environment, shipped as my_envs/redcount.py (docs/ENVIRONMENTS.md shows it)
EXAMPLE = open(os.path.join(ROOT, "my_envs", "redcount.py")).read()
# docs/HARNESS.md's harness, which its command reads as my_harness.py in the working directory
HARNESS = re.findall(r"```python\n(.*?)```", DOCS["HARNESS.md"], re.S)[0]


@contextlib.contextmanager
def example_dir(path, monkeypatch):
    """`path` as the working directory, holding the README's example as my_envs/redcount.py
    and docs/HARNESS.md's harness as my_harness.py; environment and expert registrations,
    sys.path and the imported modules are undone afterwards."""
    from supo_jax.envs import base
    from supo_jax.envs import experts as E

    (path / "my_envs").mkdir()
    (path / "my_envs" / "redcount.py").write_text(EXAMPLE)
    (path / "my_harness.py").write_text(HARNESS)
    monkeypatch.chdir(path)
    monkeypatch.setattr(base, "_ENVS", dict(base._ENVS))
    monkeypatch.setattr(E, "_EXPERTS", dict(E._EXPERTS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        yield path
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] in ("my_envs", "my_harness",
                                                                  "experiments")]:
            sys.modules.pop(m, None)   # imported again next time, so they register again


def user_shell_cores():
    """For subprocess.run(preexec_fn=...): the cores a user's shell has. tests/conftest.py pins
    each pytest-xdist worker to one core and children inherit it, and XLA's CPU thread pool, so
    the rounding of its reductions, follows the cores it sees: the README's train command on
    one core of the machine that printed its figures samples another run (0.266 -> 0.344)."""
    cpus = os.environ.get("SUPO_JAX_TESTS_CPUS")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def user_shell_env() -> dict:
    """os.environ as a user's shell has it for a README command: one CPU device (no forced
    device count), and this Python's scripts (`supo-jax`) on the PATH."""
    return dict(os.environ, XLA_FLAGS="",
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
