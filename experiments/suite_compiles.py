"""Where a test run's XLA compiles go: every Python process a command starts (pytest's workers,
the `supo-jax` runs, benchmark scripts, notebook kernels) records the compiles JAX reports
(jax.monitoring: seconds by jitted function, persistent-cache hits and writes) and its wall and
CPU seconds, one JSON file a process; `summarize` adds them up.

    python experiments/suite_compiles.py install /tmp/hook       # writes /tmp/hook/sitecustomize.py
    SUPO_JAX_COMPILE_LOG=/tmp/log PYTHONPATH=/tmp/hook python -m pytest -q -n 2 tests
    python experiments/suite_compiles.py summarize /tmp/log [--out FILE.json] [--jsonl FILE]

The hook is Python's sitecustomize (imported at every interpreter's start on PYTHONPATH): it
does nothing unless SUPO_JAX_COMPILE_LOG is set, and then only registers listeners once jax is
imported. A process that ends by a signal or os._exit writes no file. The seconds are wall
seconds inside the compile call: on a loaded machine they include waiting for a core.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

HOOK = r'''# written by experiments/suite_compiles.py install: per-process compile records
import os
if os.environ.get("SUPO_JAX_COMPILE_LOG"):
    import atexit, importlib.abc, importlib.machinery, json, sys, time
    _t0 = time.time()
    _rec = {"compile_s": 0.0, "compiles": 0, "hits": 0, "writes": 0, "by_function": {}}

    def _listen():
        import jax.monitoring as m

        def duration(event, seconds, **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                _rec["compile_s"] += seconds
                _rec["compiles"] += 1
                f = _rec["by_function"].setdefault(str(kw.get("fun_name")), [0, 0.0])
                f[0] += 1
                f[1] += seconds

        def event(name, **kw):
            if name == "/jax/compilation_cache/cache_hits":
                _rec["hits"] += 1
            elif name == "/jax/compilation_cache/cache_misses":   # JAX sends it on a write
                _rec["writes"] += 1
        m.register_event_duration_secs_listener(duration)
        m.register_event_listener(event)

    class _AfterJax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "jax":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _listen()
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterJax())

    @atexit.register
    def _write():
        out = os.environ["SUPO_JAX_COMPILE_LOG"]
        os.makedirs(out, exist_ok=True)
        _rec.update(pid=os.getpid(), argv=sys.argv[:8], wall_s=time.time() - _t0,
                    cpu_s=time.process_time(), worker=os.environ.get("PYTEST_XDIST_WORKER"),
                    pytest="_pytest" in sys.modules)
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump(_rec, f)
'''


def install(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "sitecustomize.py")
    with open(path, "w") as f:
        f.write(HOOK)
    return path


def kind(rec: dict) -> str:
    """A process's kind, from its command line: the script or module it ran (pytest-xdist's
    workers run as `python -c`, told apart by pytest among their modules)."""
    argv = rec["argv"]
    text = " ".join(argv)
    if argv[:1] == ["-c"]:
        return "pytest worker" if rec.get("pytest") else "python -c"
    for pat, name in ((r"ipykernel", "notebook kernel"), (r"rollout_worker", "tests/rollout_worker"),
                      (r"benchmarks/(\w+)\.py", r"benchmarks/\1"),
                      (r"experiments/(\w+)\.py", r"experiments/\1"),
                      (r"(?:supo-jax|supo_jax[./]cli(?:\.py)?) (\w+)", r"supo-jax \1"),
                      (r"pytest", "pytest")):
        m = re.search(pat, text)
        if m:
            return m.expand(name)
    return os.path.basename(argv[0]) if argv else "?"


def records(log: str) -> list[dict]:
    """The records of a run: a directory of the hook's files, or a .jsonl of them (`--jsonl`)."""
    if os.path.isfile(log):
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]
    out = []
    for path in sorted(glob.glob(os.path.join(log, "*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def summarize(log: str | list[dict]) -> dict:
    """The totals of a run's records (`log`: as `records` takes it, or the records)."""
    recs = records(log) if isinstance(log, str) else log
    kinds: dict[str, dict] = {}
    funcs: dict[str, list] = {}
    for r in recs:
        k = kinds.setdefault(kind(r), {"processes": 0, "wall_s": 0.0, "cpu_s": 0.0,
                                                "compile_s": 0.0, "compiles": 0, "hits": 0,
                                                "writes": 0})
        k["processes"] += 1
        for f in ("wall_s", "cpu_s", "compile_s", "compiles", "hits", "writes"):
            k[f] += r[f]
        for name, (n, s) in r["by_function"].items():
            acc = funcs.setdefault(name, [0, 0.0])
            acc[0] += n
            acc[1] += s
    total = {f: sum(k[f] for k in kinds.values())
             for f in ("processes", "cpu_s", "compile_s", "compiles", "hits", "writes")}
    return {"total": total,
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["compile_s"])),
            "by_function": {n: {"compiles": c, "seconds": s}
                            for n, (c, s) in sorted(funcs.items(), key=lambda kv: -kv[1][1])}}


def table(res: dict, top: int = 15) -> str:
    t = res["total"]
    lines = [f"{t['processes']} processes: {t['cpu_s']:.0f} CPU s, {t['compile_s']:.0f} s compiling "
             f"({t['compiles']} compiles: {t['hits']} persistent-cache hits, {t['writes']} writes)",
             "", "| processes | kind | compile s | compiles | hits | writes | CPU s |",
             "|---|---|---|---|---|---|---|"]
    for name, k in list(res["by_kind"].items())[:top]:
        lines.append(f"| {k['processes']} | {name} | {k['compile_s']:.0f} | {k['compiles']} | "
                     f"{k['hits']} | {k['writes']} | {k['cpu_s']:.0f} |")
    lines += ["", "| function | compiles | seconds |", "|---|---|---|"]
    for name, f in list(res["by_function"].items())[:top]:
        lines.append(f"| {name} | {f['compiles']} | {f['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="write DIR/sitecustomize.py").add_argument("dir")
    s = sub.add_parser("summarize", help="add up the records of a run")
    s.add_argument("log", help="the SUPO_JAX_COMPILE_LOG directory, or a .jsonl of its records")
    s.add_argument("--out", help="also write the summary as JSON")
    s.add_argument("--jsonl", help="also write the records, one a line")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        print(install(args.dir))
        return 0
    recs = records(args.log) if os.path.exists(args.log) else []
    if not recs:
        print(f"suite_compiles: no records in {args.log}", file=sys.stderr)
        return 1
    res = summarize(recs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in recs)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
