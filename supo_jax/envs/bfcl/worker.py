"""Where the BFCL environments run simulator code: worker processes a deadline can stop.

One call on a simulator can run for hours (`power(base=10, exponent=10**9)` is one bytecode
holding the GIL), and no thread can stop it. So the environments send each step's calls to
a worker process and kill it when the step's deadline passes (`run` raises Stopped).

A worker holds nothing between requests: a task's world (its simulator instances) lives in
its environment as pickled bytes, goes to a worker with the step's calls and comes back with
their results. A killed worker takes nothing with it but the step it ran, and no two
rollouts, or a rollout and a scoring replay, ever hold the same object. What the simulators
set for the whole process (mpmath's precision, the decimal context) is put back before each
request.

Requests, each a tuple:
  ("step", world, calls)            -> ("ok", (world after the calls, [result text, ...]))
  ("verdict", category, task_id, calls) -> ("ok", calls.verdict(...))
  anything that fails               -> ("error", message)

A worker is this file run as a script by the interpreter of the parent (not multiprocessing:
the parent is a multithreaded JAX process, and a child must not import supo_jax, whose
__init__ imports jax); it imports only data.py and calls.py of this folder, bfcl-eval and
mpmath, and may use at most MEMORY_BYTES of address space. A process has at most
MAX_WORKERS, each started in a thread of its own when a request finds none idle (`start`
starts them ahead); idle ones wait for the next request and exit when the parent closes
their pipe (as it does when it ends). A request waits for an idle worker at most its
queue bound (then Queued: it never ran); its deadline counts from when a worker has it.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
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


class Queued(Exception):
    """No worker was free within the request's queue bound: the request never ran (its
    rollout ends as "queued")."""
    rollout_reason = "queued"


class _Pool:
    """At most `size` workers, each started in a thread of its own when a request finds
    none idle: a request takes whichever is idle first, and a start goes on after the
    requests that waited for it gave up."""

    def __init__(self, size: int):
        self.size, self.live = size, 0        # live: started or starting
        self.idle: list[_Worker] = []
        self.failed, self.why = 0, ""         # starts that failed, why the last one did
        self.changed = threading.Condition()

    def take(self, queue_s: float) -> _Worker:
        """An idle worker; Queued past queue_s, RuntimeError when a start failed meanwhile."""
        until = time.monotonic() + queue_s
        with self.changed:
            failed = self.failed
            while not self.idle:
                if self.failed > failed:
                    raise RuntimeError(self.why)
                if self.live < self.size:
                    self.live += 1
                    threading.Thread(target=self._start, daemon=True).start()
                left = until - time.monotonic()
                if left <= 0:
                    raise Queued(f"no BFCL simulator worker was free in {queue_s:g} s")
                self.changed.wait(left)
            return self.idle.pop()

    def give(self, worker: _Worker | None) -> None:
        """A worker back after a request (None: it was killed)."""
        with self.changed:
            keep = worker is not None and self.live <= self.size
            if keep:
                self.idle.append(worker)
            else:
                self.live -= 1
            self.changed.notify()
        if worker is not None and not keep:     # start() made more than requests use
            worker.kill()

    def add(self, worker: _Worker) -> None:
        """A worker started ahead (start), idle."""
        with self.changed:
            self.live += 1
            self.idle.append(worker)
            self.changed.notify()

    def _start(self) -> None:
        try:
            worker = _Worker()
        except Exception as e:  # noqa: BLE001 - said to the requests waiting
            with self.changed:
                self.live -= 1
                self.failed, self.why = self.failed + 1, str(e)
                self.changed.notify_all()
            return
        self.give(worker)


_POOL = _Pool(MAX_WORKERS)


def run(message: tuple, timeout_s: float, queue_s: float):
    """One request on an idle worker, its reply's value. The wait for one (a start
    included) is bounded by queue_s: past it, Queued, and the request never ran. The
    request's deadline, timeout_s, counts from when a worker has it: past it, Stopped (the
    worker is killed). RuntimeError when it failed."""
    pool = _POOL
    worker = pool.take(queue_s)
    try:
        kind, value = worker.request(message, timeout_s)
    except Stopped:
        pool.give(None)
        raise
    except BaseException:
        worker.kill()
        pool.give(None)
        raise
    pool.give(worker)
    if kind != "ok":
        raise RuntimeError(f"BFCL simulator worker: {value}")
    return value


def start(n: int) -> None:
    """Have at least n idle workers (a test that forbids starting processes starts them
    before)."""
    pool = _POOL
    with pool.changed:
        missing = min(n, pool.size) - len(pool.idle)
    for _ in range(missing):
        pool.add(_Worker())


# --- the worker process -------------------------------------------------------------------

def _step(calls, world: bytes, requested: list) -> tuple[bytes, list[str]]:
    sims = calls.Simulators(pickle.loads(world))
    results = [sims.call(name, [], kwargs) for name, kwargs in requested]
    return pickle.dumps(sims.instances, protocol=pickle.HIGHEST_PROTOCOL), results


def _verdict(calls, category: str, task_id: str, requested: list) -> dict:
    return calls.verdict(category, task_id, requested)


_OPS = {"step": _step, "verdict": _verdict}


def _module_state():
    """A function that puts back what the simulators set for the whole process (MathAPI:
    mpmath's precision, the decimal context's): a worker serves one rollout after another,
    and one task's call must not change another's results."""
    import decimal

    import mpmath

    prec, pretty, context = mpmath.mp.prec, mpmath.mp.pretty, decimal.getcontext().copy()

    def restore() -> None:
        mpmath.mp.prec, mpmath.mp.pretty = prec, pretty
        decimal.setcontext(context.copy())
    return restore


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
    restore = _module_state()
    while True:
        try:
            op, *args = rx.recv()
        except EOFError:
            return
        restore()
        try:
            reply = ("ok", _OPS[op](calls, *args))
        except Exception as e:  # noqa: BLE001 - a failed request is an answer, not an end
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        tx.send(reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
