"""notebooks/quickstart.ipynb runs top to bottom at tiny size on CPU."""
import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    monkeypatch.setenv("SUPO_JAX_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.chdir(tmp_path)
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "(summary)" in outs and "success_rate" in outs
    assert (tmp_path / "runs" / "notebook" / "curves.png").exists()
