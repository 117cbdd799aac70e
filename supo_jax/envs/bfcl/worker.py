"""Where the BFCL environments run simulator code: worker processes a deadline can stop.

One call on a simulator can run for hours (`power(base=10, exponent=10**9)` is one bytecode
holding the GIL), and no thread can stop it. So the environments send each step's calls to
a worker process and kill it when the step's deadline passes (`run` raises Stopped).

A worker holds nothing between requests: a task's world (its simulator instances) lives in
its environment as pickled bytes, goes to a worker with the step's calls and comes back with
their results. A killed worker takes nothing with it but the step it ran, and no two
rollouts, or a rollout and a scoring replay, ever hold the same object.

Requests, each a tuple:
  ("step", world, calls)            -> ("ok", (world after the calls, [result text, ...]))
  ("verdict", category, task_id, calls) -> ("ok", calls.verdict(...))
  anything that fails               -> ("error", message)

A worker is this file run as a script by the interpreter of the parent (not multiprocessing:
the parent is a multithreaded JAX process, and a child must not import supo_jax, whose
__init__ imports jax); it imports only data.py and calls.py of this folder, bfcl-eval and
mpmath, and may use at most MEMORY_BYTES of address space. A process has at most
MAX_WORKERS (more requests at once wait for one), started when first needed (`start`
starts them ahead); idle ones wait for the next request and exit when the parent closes
their pipe (as it does when it ends).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

MEMORY_BYTES = 2 << 30      # a worker's address space: a runaway value fails with MemoryError
START_TIMEOUT_S = 120.0     # a worker's start (an interpreter, bfcl-eval's simulators)
_HERE = os.path.dirname(os.path.abspath(__file__))


class Stopped(Exception):
    """The worker ran past the deadline (or died) and was killed."""


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self):
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        self.tx, self.rx = Connection(down_w, readable=False), Connection(up_r, writable=False)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", os.path.join(_HERE, "worker.py"), str(down_r), str(up_w)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            self.tx.close()
            self.rx.close()
            raise
        finally:
            os.close(down_r)
            os.close(up_w)
        self.tx.send(list(sys.path))
        try:
            kind, *rest = self.request(None, START_TIMEOUT_S)
        except Stopped:
            raise RuntimeError("the BFCL simulator worker did not start") from None
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"the BFCL simulator worker did not start: {rest[0]}")

    def request(self, message, timeout_s: float):
        """Send `message` (None: only wait) and return the reply; past timeout_s, kill."""
        why = f"it ran past {timeout_s:g} s"
        try:
            if message is not None:
                self.tx.send(message)
            if self.rx.poll(timeout_s):
                return self.rx.recv()
        except (EOFError, OSError):
            why = "the worker process died"
        self.kill()
        raise Stopped(why)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.tx.close()
        self.rx.close()


MAX_WORKERS = max(4, os.cpu_count() or 1)    # more requests at once wait for a worker
_IDLE: list[_Worker] = []
_IDLE_LOCK = threading.Lock()
_SLOTS = threading.BoundedSemaphore(MAX_WORKERS)


def run(message: tuple, timeout_s: float):
    """One request on an idle worker (started if none is), its reply's value; Stopped when
    it ran past timeout_s (the worker is killed); RuntimeError when it failed. The deadline
    counts from the request: not the wait for a worker, nor a worker's start."""
    with _SLOTS:
        with _IDLE_LOCK:
            worker = _IDLE.pop() if _IDLE else None
        worker = worker or _Worker()
        try:
            kind, value = worker.request(message, timeout_s)
        except Stopped:
            raise
        except BaseException:
            worker.kill()
            raise
        with _IDLE_LOCK:
            keep = len(_IDLE) < MAX_WORKERS
            if keep:
                _IDLE.append(worker)
        if not keep:        # start() made more than run() uses
            worker.kill()
    if kind != "ok":
        raise RuntimeError(f"BFCL simulator worker: {value}")
    return value


def start(n: int) -> None:
    """Have at least n idle workers (a test that forbids starting processes starts them
    before)."""
    with _IDLE_LOCK:
        missing = min(n, MAX_WORKERS) - len(_IDLE)
    for _ in range(missing):
        worker = _Worker()
        with _IDLE_LOCK:
            _IDLE.append(worker)


# --- the worker process -------------------------------------------------------------------

def _step(calls, world: bytes, requested: list) -> tuple[bytes, list[str]]:
    sims = calls.Simulators(pickle.loads(world))
    results = [sims.call(name, [], kwargs) for name, kwargs in requested]
    return pickle.dumps(sims.instances, protocol=pickle.HIGHEST_PROTOCOL), results


def _verdict(calls, category: str, task_id: str, requested: list) -> dict:
    return calls.verdict(category, task_id, requested)


_OPS = {"step": _step, "verdict": _verdict}


def _import_calls():
    """supo_jax.envs.bfcl.calls without running supo_jax's __init__ (jax): the packages
    above it as empty modules over their folders."""
    import types

    for name, path in (("supo_jax", os.path.dirname(os.path.dirname(_HERE))),
                       ("supo_jax.envs", os.path.dirname(_HERE)), ("supo_jax.envs.bfcl", _HERE)):
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module
    from supo_jax.envs.bfcl import calls
    return calls


def _serve(down: int, up: int) -> None:
    rx, tx = Connection(down, writable=False), Connection(up, readable=False)
    sys.path[:] = rx.recv()
    try:
        calls = _import_calls()
        calls.new_instances({"involved_classes": []}, "base")       # bfcl-eval importable
        import resource     # POSIX
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except Exception as e:  # noqa: BLE001 - said to the parent, which raises it
        tx.send(("error", f"{type(e).__name__}: {e}"))
        return
    tx.send(("ready", None))
    while True:
        try:
            op, *args = rx.recv()
        except EOFError:
            return
        try:
            reply = ("ok", _OPS[op](calls, *args))
        except Exception as e:  # noqa: BLE001 - a failed request is an answer, not an end
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        tx.send(reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
