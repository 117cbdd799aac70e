"""notebooks/quickstart.ipynb runs top to bottom at tiny size on CPU, by the command its first
cell gives: the plot is shown inline, the last cell is a trained policy's rollout, and the
install cell fails clearly outside a checkout when nothing says where to install from."""
import os
import shlex
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def _run_command():
    """The command the notebook's first cell gives to run it (python -c CODE)."""
    intro = nbformat.read(NB, as_version=4).cells[0].source
    line = next(ln for ln in intro.splitlines() if ln.strip().startswith("python -c "))
    return shlex.split(line)[2]


def test_the_notebooks_run_command_needs_only_the_test_extras():
    """It imports what setup.py's test extras install (not jupyter's nbconvert), and the run it
    leaves where the notebook runs (the root or notebooks/) is ignored by git."""
    import ast

    tree = ast.parse(_run_command())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    extras = open(os.path.join(ROOT, "setup.py")).read().split('"test":', 1)[1]
    assert mods and all(f'"{m}>=' in extras for m in mods), mods
    if os.path.isdir(os.path.join(ROOT, ".git")):
        for d in ("runs", os.path.join("notebooks", "runs")):
            r = subprocess.run(["git", "check-ignore", "-q", os.path.join(d, "notebook", "x")],
                               cwd=ROOT)
            assert r.returncode == 0, f"{d}/ is not ignored by git"


@pytest.mark.long
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """Run by its own command (the first cell's), from a directory holding notebooks/."""
    monkeypatch.setenv("SUPO_JAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("XLA_FLAGS", "")
    os.symlink(os.path.join(ROOT, "notebooks"), tmp_path / "notebooks")
    r = subprocess.run([sys.executable, "-c", _run_command()], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    nb = nbformat.read(tmp_path / "runs" / "notebook" / "quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outs = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "(summary)" in outs and "(cut: reached L)" in outs and "success_rate" in outs
    assert (tmp_path / "runs" / "notebook" / "curves.png").exists()
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)   # inline
    last = "".join(o.get("text", "") for o in code[-1].outputs)
    assert "--- assistant" in last and "reason:" in last
    # transformers, given the prompt the policy was trained on (its tools too), greedily writes
    # what the SUPO loop's greedy rollout of the same export wrote first
    hf_cell = next(c for c in code if "model.generate" in c.source)
    hf_out = "".join(o.get("text", "") for o in hf_cell.outputs
                     if o.get("name") == "stdout").strip()
    first = last.split("--- assistant", 1)[1].split("\n---", 1)[0].strip()
    n = min(len(hf_out), len(first))
    assert n > 0 and hf_out[:n] == first[:n], (hf_out, first)


def test_install_cell_names_what_to_set_outside_a_checkout(tmp_path):
    nb = nbformat.read(NB, as_version=4)
    install = nb.cells[1].source
    assert 'REPO = ""' in install
    # a Python where supo_jax is not importable, in a directory that is not a checkout
    code = "import importlib.util\nimportlib.util.find_spec = lambda name: None\n" + install
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "set REPO to the repository's git URL" in r.stderr


def _install_functions(monkeypatch):
    """The install cell's functions, defined without running its install."""
    nb = nbformat.read(NB, as_version=4)
    cell = nb.cells[1].source
    ns: dict = {}
    exec(cell.split("\nif importlib.util.find_spec(\"supo_jax\") is None:")[0], ns)
    return ns


def test_install_cell_keeps_the_runtimes_jax_and_installs_from_the_url(tmp_path, monkeypatch):
    import importlib.metadata
    import re

    ns = _install_functions(monkeypatch)
    have = ns["runtime_jax"]()      # this Python has jax: its versions, pinned
    assert have == {"jax": importlib.metadata.version("jax"),
                    "jaxlib": importlib.metadata.version("jaxlib")}
    url = "https://example.org/owner/supo_jax.git"
    args = ns["install_args"](url, None, have)
    assert args[0] == "-c" and args[2:] == [f"supo-jax @ git+{url}"]
    pins = open(args[1]).read().split()
    assert pins == [f"jax=={have['jax']}", f"jaxlib=={have['jaxlib']}"]
    # inside a checkout: that checkout; the tested pins only where jax is missing
    assert ns["install_args"]("", ROOT, have)[-2:] == ["-e", ROOT]
    assert ns["install_args"]("", ROOT, {}) == ["-c", os.path.join(ROOT, "constraints.txt"),
                                                "-e", ROOT]
    with pytest.raises(RuntimeError, match="set REPO"):
        ns["install_args"]("", None, have)
    # the cell's minimum is setup.py's
    req = re.search(r'"jax>=([0-9.]+)"', open(os.path.join(ROOT, "setup.py")).read()).group(1)
    assert ns["JAX_MIN"] == tuple(int(x) for x in req.split("."))
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.4.30" if name == "jax" else "0.4.30")
    with pytest.raises(RuntimeError, match="older than supo_jax needs"):
        ns["runtime_jax"]()
