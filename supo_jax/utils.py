"""Small process-level helpers."""
import datetime
import math
import os
import subprocess


def json_safe(obj):
    """obj for strict JSON: every non-finite float (a figure without a value, e.g. nan) as
    None, in nested dicts, lists and tuples too."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def provenance() -> dict:
    """Where an output was made: {"commit": the short hash of HEAD of the git checkout this
    package was imported from (None when it is not imported from a checkout, e.g. an installed
    copy, or git is missing), "dirty": whether tracked files differ from that commit (True too
    when git could not tell; False without a commit), "date": now, UTC, ISO 8601 to the
    second}. Fails quietly: a result file is not worth an error."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the repository of this file, whatever the caller's environment points git at
    env = {k: v for k, v in os.environ.items()
           if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    env["GIT_OPTIONAL_LOCKS"] = "0"     # `git status` refreshes no index others may be writing

    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=root, env=env, capture_output=True,
                               text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    # an installed copy (site-packages) may sit inside some other checkout: not ours
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return {"commit": None, "dirty": False, "date": date}
    commit = git("rev-parse", "--short", "HEAD") or None
    if commit is None:      # a checkout without a commit yet
        return {"commit": None, "dirty": False, "date": date}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": status is None or bool(status), "date": date}


def enable_compile_cache(path: str | None = None) -> str:
    """Persistent XLA compilation cache (SUPO_JAX_COMPILE_CACHE, default ~/.cache/supo_jax/jax).

    Rollouts compile a handful of bucketed shapes; caching them across runs saves
    most of a short run's start-up time.
    """
    import jax

    path = path or os.environ.get("SUPO_JAX_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "supo_jax", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    # every compile, however short: a process pays ~30 ms for each of the ~100 small
    # programs (eager ops, bucketed shapes) it would otherwise compile again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


HEARTBEAT_S = 100        # jax.distributed's default failure detection (seconds)
PEER_LOST_EXIT = 75      # exit status of a process stopped because another one stopped


def maybe_init_distributed() -> bool:
    """jax.distributed.initialize() for multi-host runs, and a PeerWatch over the processes.

    On a TPU slice launched by launch_tpu.sh (SUPO_JAX_MULTIHOST=1) the runtime supplies
    the coordinator; elsewhere set SUPO_JAX_COORDINATOR=host:port, SUPO_JAX_NUM_PROCESSES
    and SUPO_JAX_PROCESS_ID (e.g. several CPU processes on one machine).
    SUPO_JAX_HEARTBEAT_S (default 100): jax.distributed's heartbeat timeout; a process that
    stops without a word is noticed by the others in a quarter of it (PeerWatch). Not half:
    a process beats to the coordinator every half of the timeout, so the runtime may abort
    the others (with stack traces) as soon as half of it after the silence began.
    """
    import jax

    hb = os.environ.get("SUPO_JAX_HEARTBEAT_S", str(HEARTBEAT_S))
    if not hb.isdigit() or int(hb) < 2:
        raise ValueError(f"SUPO_JAX_HEARTBEAT_S={hb!r}: a whole number of seconds, at least 2")
    coord = os.environ.get("SUPO_JAX_COORDINATOR")
    if coord:
        # cross-process collectives of the CPU backend (jax's default, set for clarity:
        # without an implementation CPU processes cannot share a mesh)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord,
                                   num_processes=int(os.environ["SUPO_JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["SUPO_JAX_PROCESS_ID"]),
                                   heartbeat_timeout_seconds=int(hb))
    elif os.environ.get("SUPO_JAX_MULTIHOST") == "1":
        jax.distributed.initialize(heartbeat_timeout_seconds=int(hb))
    else:
        return False
    PeerWatch.start(timeout_s=int(hb) / 4)
    return True


class PeerWatch:
    """Every process of a multi-process run says every few seconds that it is alive, and how
    it left, through jax.distributed's key-value store; a thread in each reads the others'.
    When another process stops (an error, kill -9, a lost host) this one prints one line
    naming it and exits with PEER_LOST_EXIT, within a beat (an error) or timeout_s (no
    word), instead of waiting in its next collective until the runtime's heartbeat timeout
    aborts it with stack traces, or for its shutdown barrier (5 minutes) after an error.
    Process 0 hosts the store and leaves last (its runtime's exit stops the others with stack
    traces); when it dies the others' runtime stops them at once."""

    PREFIX, GONE = "supo_jax/peer/", "supo_jax/gone/"
    _active: "PeerWatch | None" = None

    def __init__(self, client, me: int, n: int, timeout_s: float) -> None:
        import threading

        self.client, self.me, self.n, self.timeout_s = client, me, n, timeout_s
        self.beat_s = max(0.5, min(5.0, timeout_s / 5))
        self.stop = threading.Event()
        self.deciding = threading.Lock()    # who says how this process leaves: the first
        self.leaving = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="supo-jax-peer-watch",
                                       daemon=True)

    @classmethod
    def start(cls, timeout_s: float) -> "PeerWatch | None":
        """Watch this run's processes (None: a single process, or a jax without the store)."""
        import jax
        from jax._src import distributed

        client = getattr(distributed.global_state, "client", None)
        if client is None or jax.process_count() == 1:
            return None
        import atexit

        cls._active = cls(client, jax.process_index(), jax.process_count(), timeout_s)
        cls._active.thread.start()
        atexit.register(cls.leave, "done")    # before jax.distributed's shutdown (LIFO)
        return cls._active

    @classmethod
    def leave(cls, how: str, code: int | None = None) -> None:
        """This process is leaving: how = "done" (returns), or "error: <what it printed>"
        (the others stop, naming it; this process exits with `code` once they have read
        it). No-op without a watch."""
        w = cls._active
        if w is None:
            return
        w._decide(how[:500])        # (unless the watch has already said why it stops)
        if code is not None:
            w._exit(code)

    def _decide(self, status: str) -> bool:
        """Say `status` and stop the watch, if nothing has been said yet: the check and the
        word under one lock, so that the main thread's error is never overwritten by the
        watch's "stopped" (which the others read as a clean departure), nor the reverse."""
        with self.deciding:
            if self.stop.is_set():
                return False
            self.stop.set()
            self._say(status)
            return True

    def _say(self, status: str) -> None:
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", status, allow_overwrite=True)
        except Exception:      # the store is gone: nothing to tell
            pass

    def _said(self) -> dict[int, str]:
        """Each process's last word; "gone" for those that exited after an error."""
        said = {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(self.PREFIX)}
        said.update({int(k.rsplit("/", 1)[1]): "gone"
                     for k, _ in self.client.key_value_dir_get(self.GONE)})
        return said

    def _exit(self, code: int, silent: tuple[int, ...] = ()) -> None:
        """Exit without the runtime's shutdown barrier. Process 0 first waits (a bounded
        time) until every other process has gone or fallen silent (`silent`: known so);
        the others first wait until process 0 has read why they leave (it no longer says
        it is alive)."""
        import sys
        import time

        sys.stdout.flush()
        sys.stderr.flush()
        with self.leaving:
            last: dict[int, tuple[str, float]] = {}
            quiet = 2 * self.beat_s + 1
            start = time.monotonic()
            while time.monotonic() < start + self.timeout_s:
                try:
                    said = self._said()
                except Exception:
                    break
                now = time.monotonic()
                if self.me == 0:
                    for p in range(1, self.n):
                        v = said.get(p, "")
                        if last.get(p, (None,))[0] != v:
                            last[p] = (v, now)
                    if all(said.get(p) == "gone" or p in silent or now - last[p][1] > quiet
                           for p in range(1, self.n)):
                        time.sleep(0.5)     # their exits, begun
                        break
                elif not said.get(0, "alive").startswith("alive") or now - start > quiet:
                    break
                time.sleep(0.2)
            try:
                self.client.key_value_set(f"{self.GONE}{self.me}", "1", allow_overwrite=True)
            except Exception:
                pass
            os._exit(code)

    def _run(self) -> None:
        import time

        seen: dict[int, tuple[str, float]] = {}
        beat, failures = 0, 0
        while not self.stop.wait(self.beat_s):
            beat += 1
            try:
                self._say(f"alive {beat}")
                said = self._said()
                failures = 0
            except Exception as e:      # the coordinator's store is unreachable
                failures += 1
                if failures * self.beat_s >= self.timeout_s:
                    self._fail(f"process 0 (the coordinator) is unreachable ({e})")
                continue
            now = time.monotonic()
            for p in range(self.n):
                if p == self.me or self.stop.is_set():
                    continue
                v = said.get(p, "")
                if v.startswith("error"):
                    self._fail(f"process {p} stopped with an {v}")
                if v in ("done", "gone") or v.startswith("stopped"):
                    continue
                if seen.get(p, (None,))[0] != v:
                    seen[p] = (v, now)
                elif now - seen[p][1] > self.timeout_s:
                    self._fail(f"process {p} has not been heard from in {self.timeout_s:.0f} s "
                               "(SUPO_JAX_HEARTBEAT_S / 4): it died, or hangs; its log or "
                               "its host says which", silent=(p,))

    def _fail(self, what: str, silent: tuple[int, ...] = ()) -> None:
        import sys

        if not self._decide(f"stopped: {what}"):
            return
        sys.stdout.flush()
        sys.stderr.write(f"supo-jax: error: process {self.me} of {self.n} stops: {what}. Rerun "
                         "every process with the same command: the run resumes from its last "
                         "checkpoint.\n")
        self._exit(PEER_LOST_EXIT, silent)


def skip_absent_tpu() -> str | None:
    """Keep jax off the TPU backend where libtpu is installed but no TPU is attached (CI
    installs libtpu to compile for TPU slices ahead of time: supo_jax.plan). jax would
    otherwise start libtpu in every process, which prints its initialisation warnings
    before jax falls back to the CPU. Only where JAX_PLATFORMS is unset and jax has not
    started its backends: the platforms then become the CPU (and an installed GPU plugin's
    platform where that GPU is visible). Returns the platforms set, None when unchanged.
    Compile-only TPU topologies (jax.experimental.topologies) are not affected."""
    import importlib.util
    import pkgutil

    if os.environ.get("JAX_PLATFORMS") is not None or importlib.util.find_spec("libtpu") is None:
        return None
    import jax
    from jax._src import hardware_utils, xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return None
    try:
        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return None
        try:
            import jax_plugins
            plugins = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
        except ImportError:
            plugins = []
        gpus = [p for p, seen in (("cuda", hardware_utils.has_visible_nvidia_gpu),
                                  ("rocm", lambda: hardware_utils.num_available_amd_gpus(1) > 0))
                if any(p in name for name in plugins) and seen()]
    except Exception:   # noqa: BLE001  (jax's hardware probes moved: leave jax as it is)
        return None
    platforms = ",".join(gpus + ["cpu"])
    jax.config.update("jax_platforms", platforms)
    return platforms


CPU_OPT_FLAG = "--xla_backend_optimization_level"
CPU_OPT_LEVEL = 1


def cpu_compile_level() -> str | None:
    """LLVM optimization level 1 (XLA_FLAGS) for the XLA CPU backend where the CPU is the only
    platform. XLA compiles at level 3 by default; at level 1 the CPU recipe's run on one core
    compiled in 23% less time (72 s, not 93) and ran as fast, every metric the same to the
    last bit (experiments/LOG.md, 2026-12-07); other programs may round differently (a chunked
    entropy moved by 5e-6: tests/test_attention.py). Only where XLA_FLAGS names no level of
    its own, jax has not started its backends (XLA reads XLA_FLAGS then), JAX_PLATFORMS (if
    set) names only the CPU, and no TPU or GPU device file is present (/dev/accel*,
    /dev/vfio/N, /dev/nvidiaN, /dev/kfd): XLA's GPU backend would compile its kernels at the
    lower level too. Imports no jax (supo_jax.envs and supo_jax.text import without it).
    Returns XLA_FLAGS as set, None when unchanged."""
    import glob
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_OPT_FLAG in flags:
        return None
    platforms = os.environ.get("JAX_PLATFORMS") or ""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return None
        platforms = sys.modules["jax"].config.jax_platforms or platforms
    if platforms:
        if platforms.strip().lower() != "cpu":
            return None
    elif any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*",
                                    "/dev/kfd")):
        return None
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_OPT_FLAG}={CPU_OPT_LEVEL}".strip()
    return os.environ["XLA_FLAGS"]
