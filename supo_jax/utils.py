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


def maybe_init_distributed() -> bool:
    """jax.distributed.initialize() for multi-host runs.

    On a TPU slice launched by launch_tpu.sh (SUPO_JAX_MULTIHOST=1) the runtime supplies
    the coordinator; elsewhere set SUPO_JAX_COORDINATOR=host:port, SUPO_JAX_NUM_PROCESSES
    and SUPO_JAX_PROCESS_ID (e.g. several CPU processes on one machine).
    """
    import jax

    coord = os.environ.get("SUPO_JAX_COORDINATOR")
    if coord:
        # cross-process collectives of the CPU backend (jax's default, set for clarity:
        # without an implementation CPU processes cannot share a mesh)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord,
                                   num_processes=int(os.environ["SUPO_JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["SUPO_JAX_PROCESS_ID"]))
        return True
    if os.environ.get("SUPO_JAX_MULTIHOST") == "1":
        jax.distributed.initialize()
        return True
    return False


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
