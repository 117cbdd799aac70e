"""experiments/results/INDEX.md and the meta.json of every result folder
(experiments/results_index.py), and the provenance producers record (supo_jax.utils.provenance)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import results_index  # noqa: E402


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _has_git():
    return os.path.exists(os.path.join(ROOT, ".git")) and _git("rev-parse", "HEAD").returncode == 0


def test_index_is_the_rendering_of_the_folders_meta():
    with open(os.path.join(RESULTS, "INDEX.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == results_index.render(RESULTS), \
        "experiments/results/INDEX.md is stale: run python experiments/results_index.py"
    assert results_index.main(["--check"]) == 0


def test_every_result_folder_has_its_meta():
    names = results_index.folders(RESULTS)
    assert len(names) >= 40 and all(os.path.isdir(os.path.join(RESULTS, n)) for n in names)
    # every top-level folder and every folder of archive/ is listed
    top = [n for n in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, n))
           and n != "archive" and not n.startswith(".")]
    assert set(top) <= set(names)
    git = _has_git()
    for name in names:
        with open(os.path.join(RESULTS, name, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        for k in ("question", "command", "commit", "date", "status"):
            assert isinstance(meta.get(k), str) and meta[k].strip(), (name, k)
        assert re.fullmatch(r"[0-9a-f]{7,40}", meta["commit"]), (name, meta["commit"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"]), (name, meta["date"])
        assert meta["status"] in ("current", "superseded"), name
        if meta["status"] == "superseded":
            by = meta.get("superseded_by")
            assert by and by != name, name
            assert any(os.path.isdir(os.path.join(RESULTS, d, by)) for d in ("", "archive")), \
                (name, by)
        else:
            assert "superseded_by" not in meta, name
        if git:
            r = _git("cat-file", "-e", meta["commit"] + "^{commit}")
            assert r.returncode == 0, (name, meta["commit"], r.stderr)
    if not git:
        pytest.skip("not a git checkout: the commits were not looked up")


def test_a_folder_without_meta_is_an_error_naming_it(tmp_path):
    metas = {"a": {"question": "Q?", "command": "x " * 100, "commit": "abc1234",
                   "date": "2026-11-26", "status": "current"},
             "archive/b": {"question": "Q|R?", "command": "y", "commit": "abc1234",
                           "date": "2026-11-27", "status": "superseded", "superseded_by": "a"}}
    for d, meta in metas.items():
        os.makedirs(tmp_path / d)
        (tmp_path / d / "meta.json").write_text(json.dumps(meta))
    text = results_index.render(str(tmp_path))
    rows = [ln for ln in text.splitlines() if ln.startswith("| [")]
    # current first, then superseded; archive folders as archive/NAME; long commands cut at 120
    assert rows[0].startswith("| [a](a/) |") and rows[1].startswith("| [archive/b](archive/b/) |")
    assert "superseded by a" in rows[1] and "Q\\|R?" in rows[1]
    cmd = re.search(r"`([^`]*)` \|$", rows[0])[1]
    assert len(cmd) == 120 and cmd.endswith("…")
    assert results_index.main(["--results-dir", str(tmp_path), "--check"]) == 1
    assert results_index.main(["--results-dir", str(tmp_path)]) == 0
    assert results_index.main(["--results-dir", str(tmp_path), "--check"]) == 0
    os.makedirs(tmp_path / "c")
    with pytest.raises(results_index.MetaError, match="^c: no meta.json"):
        results_index.render(str(tmp_path))


def test_provenance_names_the_checkout_head():
    from supo_jax.utils import provenance

    p = provenance()
    assert set(p) == {"commit", "dirty", "date"} and isinstance(p["dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+00:00", p["date"])
    if not _has_git():
        pytest.skip("not a git checkout")
    assert p["commit"] == _git("rev-parse", "--short", "HEAD").stdout.strip()
