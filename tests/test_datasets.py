"""Task sets as TFDS array_record datasets: roundtrip equals make_tasks, deterministic,
keyed by knobs, reused from disk, train/eval disjoint, stale sets rebuilt."""
import glob
import json
import os

import pytest

from supo_jax.envs import datasets as D
from supo_jax.envs.base import make_tasks

SEARCH = dict(corpus_size=300, hops=(2, 3))


def _files(path):
    return {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(path, "*"))}


@pytest.mark.parametrize("env,knobs", [("search", SEARCH), ("fncall", {}),
                                       ("fncall/graph", dict(size=(4, 9)))])
def test_roundtrip_equals_make_tasks(tmp_path, env, knobs):
    ts = D.load_tasks(env, "train", 25, seed=2, data_dir=str(tmp_path), **knobs)
    expected = make_tasks(env, "train", 25, 2, **knobs)
    assert len(ts) == 25 and list(ts) == expected
    assert ts[0] == expected[0] and ts[-1] == expected[-1] and ts[3:7] == expected[3:7]
    with pytest.raises(IndexError):
        ts[25]
    files = os.listdir(ts.path)
    assert any(".array_record-" in f for f in files), files
    meta = json.load(open(os.path.join(ts.path, "metadata.json")))
    assert meta["spec"] == {"env": env, "split": "train", "n": 25, "seed": 2,
                            "knobs": json.loads(json.dumps(knobs))}


def test_deterministic_keyed_and_reused(tmp_path, monkeypatch):
    calls = []
    real = D.make_tasks

    def counting(*args, **kw):
        calls.append(args[2])  # n
        return real(*args, **kw)

    monkeypatch.setattr(D, "make_tasks", counting)
    d = str(tmp_path)
    a = D.load_tasks("search", "eval", 12, seed=0, data_dir=d, **SEARCH)
    assert calls == [12]
    files = _files(a.path)
    b = D.load_tasks("search", "eval", 12, seed=0, data_dir=d, **SEARCH)
    assert calls == [12, 4]  # reused: only the staleness check regenerated 4 tasks
    assert b.path == a.path and list(b) == list(a) and _files(b.path) == files
    D.load_tasks("search", "eval", 12, seed=0, data_dir=d, verify=0, **SEARCH)
    assert calls == [12, 4]
    # tuples and lists are the same knob; other knobs, seeds, sizes and splits are other sets
    assert D.load_tasks("search", "eval", 12, 0, d, corpus_size=300, hops=[2, 3]).path == a.path
    others = [D.load_tasks("search", "eval", 12, 0, d, corpus_size=300, hops=4),
              D.load_tasks("search", "eval", 12, 1, d, **SEARCH),
              D.load_tasks("search", "eval", 13, 0, d, **SEARCH),
              D.load_tasks("search", "train", 12, 0, d, **SEARCH)]
    assert len({a.path} | {o.path for o in others}) == 5
    assert {t["hops"] for t in others[0]} == {4} and list(others[1]) != list(a)
    assert list(others[2])[:12] == list(a)
    # a fresh directory gives the same records (deterministic by seed)
    c = D.load_tasks("search", "eval", 12, seed=0, data_dir=str(tmp_path / "x"), **SEARCH)
    assert list(c) == list(a)


def test_train_eval_disjoint(tmp_path):
    for env, knobs in [("search", SEARCH), ("fncall", {})]:
        tr = D.load_tasks(env, "train", 40, data_dir=str(tmp_path), **knobs)
        ev = D.load_tasks(env, "eval", 40, data_dir=str(tmp_path), **knobs)
        assert not {t["task_id"] for t in tr} & {t["task_id"] for t in ev}
        hidden = lambda t: json.dumps({k: v for k, v in t.items() if k != "task_id"},
                                      sort_keys=True)
        assert not {hidden(t) for t in tr} & {hidden(t) for t in ev}


def test_stale_set_is_rebuilt(tmp_path, monkeypatch):
    d = str(tmp_path)
    a = D.load_tasks("fncall/pages", "train", 6, data_dir=d)
    real = D.make_tasks
    changed = lambda *args, **kw: [{**t, "answer": -1} for t in real(*args, **kw)]
    monkeypatch.setattr(D, "make_tasks", changed)  # the generator "changed"
    b = D.load_tasks("fncall/pages", "train", 6, data_dir=d)
    assert b.path == a.path and all(t["answer"] == -1 for t in b)


def test_edge_cases(tmp_path, monkeypatch):
    assert len(D.load_tasks("fncall", "train", 0, data_dir=str(tmp_path))) == 0
    with pytest.raises(ValueError, match="split"):
        D.load_tasks("fncall", "test", 3, data_dir=str(tmp_path))
    with pytest.raises(TypeError, match="JSON"):
        D.load_tasks("fncall", "train", 3, data_dir=str(tmp_path), size=object())
    monkeypatch.setenv("SUPO_JAX_DATA", str(tmp_path / "env"))
    ts = D.load_tasks("fncall/chain", "eval", 3)
    assert ts.path.startswith(str(tmp_path / "env")) and "fncall_chain-eval-n3-seed0-" in ts.path
