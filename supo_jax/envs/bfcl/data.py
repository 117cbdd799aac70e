"""BFCL's multi-turn tasks, read from the installed bfcl-eval package (its data files and
simulator classes; nothing of it is evaluated but the simulators' own methods).

bfcl-eval pins numpy 1.26 and a dozen API clients, while jax needs numpy 2: install it
without its dependencies (its multi-turn simulators need only mpmath):

    pip install --no-deps bfcl-eval==2026.3.23 mpmath
"""
from __future__ import annotations

import functools
import importlib
import json
import pickle

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 mpmath"


def _package():
    try:
        import bfcl_eval  # noqa: F401
        from bfcl_eval.constants import executable_backend_config as backend
    except ImportError as e:
        raise ImportError(f"the bfcl environments need bfcl-eval's data and simulators: "
                          f"{INSTALL} ({e})") from None
    return backend


def _data(*parts: str):
    import importlib.resources

    _package()
    path = importlib.resources.files("bfcl_eval").joinpath("data")
    for p in parts:
        path = path.joinpath(p)
    return path


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_category(category: str) -> str:
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; one of "
                         f"{', '.join(CATEGORIES)}")
    return category


@functools.lru_cache(maxsize=None)
def entries(category: str) -> dict[str, dict]:
    """task id -> BFCL's test entry (question turns, initial_config, involved_classes, ...)."""
    rows = _lines(_data(f"BFCL_v4_multi_turn_{check_category(category)}.json"))
    return {r["id"]: r for r in rows}


@functools.lru_cache(maxsize=None)
def ground_truth(category: str) -> dict[str, list[list[str]]]:
    """task id -> the ground truth: per user turn, its calls as "name(arg=value, ...)"."""
    rows = _lines(_data("possible_answer", f"BFCL_v4_multi_turn_{check_category(category)}.json"))
    return {r["id"]: r["ground_truth"] for r in rows}


@functools.lru_cache(maxsize=None)
def class_docs(class_name: str) -> tuple[dict, ...]:
    """The function docs (BFCL's JSON) of one simulator class."""
    backend = _package()
    return tuple(_lines(_data("multi_turn_func_doc",
                              backend.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name])))


def task_docs(entry: dict) -> tuple[list[dict], dict[int, list[dict]]]:
    """(the docs offered from the start, {turn index: docs that arrive at that turn}) as BFCL
    builds them: every involved class's docs, minus miss_func's held-out functions."""
    docs = [d for c in entry["involved_classes"] for d in class_docs(c)]
    later: dict[int, list[dict]] = {}
    for turn, names in (entry.get("missed_function") or {}).items():
        for name in names:
            i = next(i for i, d in enumerate(docs) if d["name"] == name)
            later.setdefault(int(turn), []).append(docs.pop(i))
    return docs, later


def _loaded(entry: dict, category: str) -> dict[str, object]:
    """The entry's simulator instances, loaded with its initial_config as BFCL loads them
    (long_context: the category's long scenario). They hold module-level objects of
    bfcl-eval (TravelAPI's extra credit cards and bookings of the long scenario, ...)."""
    backend = _package()
    out = {}
    for name in entry["involved_classes"]:
        module = importlib.import_module(backend.CLASS_FILE_PATH_MAPPING[name])
        inst = getattr(module, name)()
        if name not in backend.STATELESS_CLASSES:
            # a copy of the config: loading changes the dicts it is given
            config = pickle.loads(pickle.dumps(entry["initial_config"].get(name, {})))
            inst._load_scenario(config, long_context=category == "long_context")
        out[name] = inst
    return out


def world_bytes(entry: dict, category: str) -> bytes:
    """A fresh world of the task (class name -> simulator instance), pickled: a copy of
    everything it holds, module-level objects included."""
    return pickle.dumps(_loaded(entry, category), protocol=pickle.HIGHEST_PROTOCOL)


def new_instances(entry: dict, category: str) -> dict[str, object]:
    """A fresh world of the task that shares no mutable object with anything else. BFCL's
    own instances do share: a booking on a long scenario's extra card in one lowers its
    balance in every other TravelAPI instance of the process."""
    return pickle.loads(world_bytes(entry, category))
