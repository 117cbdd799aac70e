"""What every benchmark script shares: the machine and versions it ran on, min/median/max
of repeated timings, peak host memory, the results JSON (benchmarks/results/NAME.json,
which run_all.py turns into BENCHMARKS.md) and an XLA op profile.

Benchmarks print figures and ratios; they are not tests (tests/test_benchmarks.py only
runs each script at its --smoke size and checks the JSON's fields).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


COMPILE_S = [0.0]    # seconds spent tracing, lowering and compiling, once count_compiles ran
_COUNTING = []


def count_compiles() -> None:
    """From now on, add the seconds jax spends compiling (jax.monitoring) to COMPILE_S[0]."""
    import jax

    def add(event, seconds, **_):
        if event.startswith("/jax/core/compile/"):
            COMPILE_S[0] += seconds
    if not _COUNTING:
        jax.monitoring.register_event_duration_secs_listener(add)
        _COUNTING.append(add)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) CPU ticks since boot from /proc/stat: on a VM, steal is the time the
    hypervisor gave this machine's cores to others (a contended host slows every timing)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def steal_share(start, end) -> float | None:
    """Fraction of the CPU time between two cpu_times() readings that was stolen."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing optional package is reported as None
        return None


def machine_info() -> dict:
    import jax
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(),
            "jax_devices": ", ".join(str(d) for d in jax.devices())}


def versions() -> dict:
    import jax
    return {"jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
            "flax": _version("flax"), "transformers": _version("transformers"),
            "optax": _version("optax"), "numpy": _version("numpy")}


def warm_times(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after one untimed (compiling) call.
    fn must wait for its result (block_until_ready)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def stats(xs) -> dict:
    """min / median / max of a list of numbers (and how many)."""
    xs = list(xs)
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="smallest sizes, one repeat: checks the script runs (figures meaningless)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default per script)")
    ap.add_argument("--out-dir", default=RESULTS, help="where NAME.json is written")
    return ap


class Run:
    """Collects a benchmark's metadata; `write(results)` saves NAME.json."""

    def __init__(self, name: str, args, argv=None):
        self.name, self.args = name, args
        argv = sys.argv[1:] if argv is None else list(argv)
        shown = [a for i, a in enumerate(argv)
                 if a != "--out-dir" and not (i and argv[i - 1] == "--out-dir")]
        self.command = " ".join([f"python benchmarks/{name}.py"] + shown)
        self.t0 = time.perf_counter()
        self.load_start = loadavg()
        self.cpu_start = cpu_times()
        self.date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        if self.load_start != "n/a" and float(self.load_start.split()[0]) > 0.5 and not args.smoke:
            print(f"warning: load average {self.load_start} at start: other processes will "
                  "distort the timings", file=sys.stderr)

    def write(self, results: dict, **extra) -> str:
        machine = machine_info()
        machine["load"] = f"{self.load_start} at start, {loadavg()} at end"
        steal = steal_share(self.cpu_start, cpu_times())
        if steal is not None:
            machine["steal"] = steal
            if steal > 0.03 and not self.args.smoke:
                print(f"warning: {steal:.0%} of the CPU time was stolen by the hypervisor "
                      "during the run: a contended host distorts the timings", file=sys.stderr)
        out = {"name": self.name, "command": self.command, "date": self.date,
               "smoke": bool(self.args.smoke), "wall_s": time.perf_counter() - self.t0,
               "machine": machine, "versions": versions(), "peak_rss_mb": peak_rss_mb(),
               **extra, "results": results}
        os.makedirs(self.args.out_dir, exist_ok=True)
        fn = os.path.join(self.args.out_dir, f"{self.name}.json")
        with open(fn, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {fn} ({out['wall_s']:.0f} s, peak RSS {out['peak_rss_mb']:.0f} MB)")
        return fn


_NOT_OPS = ("$", "ThunkExecutor", "PjitFunction", "CommonPjRt", "np.asarray", "SlinkyThreadPool")


def op_profile(fn) -> tuple[collections.Counter, collections.Counter]:
    """Run fn() under jax.profiler; (microseconds, calls) per XLA op name, summed over threads."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            fn()   # (time it inside fn: starting and stopping the trace take seconds)
        (fn_,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(fn_) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and not name.startswith(_NOT_OPS):
            total[name] += e["dur"]
            count[name] += 1
    return total, count


def device_profile(fn, top: int = 12) -> dict:
    """Run fn() under jax.profiler and split the accelerator's time: kernels launched, the
    time the device was busy (union of its kernels' intervals) against the wall time of the
    traced window, and the kernels that took longest. Only events of device processes
    ("/device:GPU:0", "/device:TPU:0") count; on CPU the result is empty."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t1 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t1
        (fn_,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(fn_) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "/device:" in str(e.get("args", {}).get("name", ""))}
    spans, total, count = [], collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device and "dur" in e:
            spans.append((e["ts"], e["ts"] + e["dur"]))
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    busy, end = 0.0, -1.0
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"wall_s": wall, "kernels": len(spans), "busy_s": busy / 1e6,
            "busy_share": busy / 1e6 / wall if wall else None, "trace_overhead_s": t1 - t0,
            "top": [(n, total[n] / 1e6, count[n]) for n, _ in total.most_common(top)]}


def tiny_policy(hidden: int, layers: int, *, heads: int = 4, kv_heads: int = 2, mlp: int | None = None,
                seed: int = 0, smoke: bool = False):
    """A random tiny policy as the default run builds it (qwen2 family, float32, compact chat
    template, BPE tokenizer trained on fncall/tallest texts), at the given width and depth.
    smoke: the tokenizer is trained on the built-in corpus only (seconds faster; longer prompts)."""
    from supo_jax.config import load_config
    from supo_jax.rl.runs import build_policy

    cfg = load_config(None, [f"model.tiny_hidden={hidden}", f"model.tiny_layers={layers}",
                             f"model.tiny_heads={heads}", f"model.tiny_kv_heads={kv_heads}",
                             f"model.tiny_mlp={mlp or 3 * hidden}", f"train.seed={seed}"])
    if not smoke:
        return build_policy(cfg), cfg
    from supo_jax.model.policy import new_policy
    from supo_jax.model.tiny import tiny_config, tiny_tokenizer

    m = cfg.model
    tok = tiny_tokenizer(vocab_size=m.tiny_vocab, template=m.tiny_template)
    mc = tiny_config(m.tiny_family, vocab_size=-(-len(tok) // 8) * 8, hidden=hidden, layers=layers,
                     heads=heads, kv_heads=kv_heads, mlp=m.tiny_mlp)
    return new_policy(mc, dtype=m.dtype, seed=seed, tokenizer=tok), cfg


def kv_bytes(model_cfg, rows: int, length: int, itemsize: int = 4) -> int:
    """Bytes of a KV cache: rows x length x layers x 2 (k, v) x kv_heads x head_dim x itemsize."""
    return (rows * length * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim
            * itemsize)


def rollout_config(ctx, mc, max_len: int, repeats: int) -> dict:
    """The settings a rollout benchmark records: the context's, the row's cache, greedy
    sampling, the repeats and the model's shape."""
    return {"working_context": ctx.working_context, "trigger": ctx.trigger,
            "max_steps": ctx.max_steps, "max_summaries": ctx.max_summaries,
            "max_action_tokens": ctx.max_action_tokens,
            "max_summary_tokens": ctx.max_summary_tokens, "cache_slots_per_row": max_len,
            "sampling": "greedy", "repeats": repeats,
            "model": {"params": mc.num_params, "hidden": mc.hidden_size,
                      "layers": mc.num_layers, "heads": mc.num_heads,
                      "kv_heads": mc.num_kv_heads, "mlp": mc.intermediate_size,
                      "vocab": mc.vocab_size, "dtype": "float32"}}
