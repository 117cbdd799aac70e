"""Run every benchmark, each in a fresh process, and rewrite BENCHMARKS.md from their JSONs.

Each benchmark script writes benchmarks/results/NAME.json and can be rerun alone; this
script runs them one after another (never two at once: they time the same cores) and
then assembles BENCHMARKS.md from every NAME.json it finds. The sampler benchmark
takes ~7 minutes; with --skip-sampler its section keeps its figures (from
results/sampler.json, or, before that file exists, the section already in BENCHMARKS.md).

    python benchmarks/run_all.py                   # everything (~20 min on 2 cores)
    python benchmarks/run_all.py --skip-sampler    # the others (~20 min)
    python benchmarks/run_all.py --only horizon    # one benchmark, then reassemble
    python benchmarks/run_all.py --assemble        # no runs: BENCHMARKS.md from the JSONs
    python benchmarks/run_all.py --only gpu        # the accelerator benchmark (never run by
                                                   # default; its section is added whenever
                                                   # results/gpu.json exists)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile
import sys
import time

import common

# (name, section title, extra arguments run_all passes)
BENCHMARKS = (
    ("sampler", "Sampler decode throughput (supo_jax vs transformers vs google-tunix)", ["--write"]),
    ("rollout", "Multi-turn rollout: KV cache kept across turns vs re-prefilled", []),
    ("rows", "Rows that advance independently vs turn-synchronous rounds (long tail, slow tools)",
     []),
    ("horizon", "Horizon scaling: supo at a fixed W vs full", []),
    ("train_step", "Train step: ~100M model, FLOP/s vs the matmul peak, 8 devices vs 1", []),
    ("train_memory", "Train-step memory vs row length (compiled, 8K to 64K tokens)", []),
    ("lora", "LoRA adapters vs full training: train-step memory and time, decode", []),
    ("serve", "Serving: the OpenAI endpoint vs the sampler itself, time to first token, "
              "prefix reuse", []),
    ("harness", "Harness mode: rollouts through the sessions server vs the built-in loop", []),
)
# Run only when named in --only (an accelerator's benchmark: on a CPU it measures nothing of
# interest; capacity: scripted experts, minutes, no timing); their sections are assembled
# whenever results/NAME.json exists.
OPTIONAL = (
    ("gpu", "GPU: train step, decode vs transformers, bf16 logprob mismatch (Qwen2.5-0.5B shapes)",
     []),
    ("tpu_plan", "TPU slices for the paper's setups (verified by compilation, no TPU)", []),
    ("capacity", "Capacity: the largest task each context manager lets the scripted expert "
                 "solve", []),
    ("calibration", "TPU planner calibration: published MaxText train steps beside the "
                    "planner's band", []),
)
TITLES = {n: t for n, t, _ in BENCHMARKS + OPTIONAL}
OUT = os.path.join(common.REPO, "BENCHMARKS.md")


def _env() -> dict:
    """The environment a benchmark runs in: one host device unless the script asks for more."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")).strip()
    return env


def run(name: str, extra=(), smoke: bool = False, results_dir: str = common.RESULTS) -> None:
    cmd = [sys.executable, os.path.join(common.HERE, f"{name}.py"), *extra]
    if smoke:
        cmd.append("--smoke")
    if results_dir != common.RESULTS:
        cmd += ["--out-dir", results_dir]
    print(f"== {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=_env(), check=True)
    print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)


def load(results_dir: str) -> dict:
    out = {}
    for name, _, _ in BENCHMARKS + OPTIONAL:
        fn = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(fn):
            with open(fn) as f:
                out[name] = json.load(f)
    return out


def old_section(text: str, title: str) -> str | None:
    """The body of the '## title' section of an existing BENCHMARKS.md (None if absent); a
    title's parenthesized tail may have changed since that file was written."""
    stem = re.escape(title.split(" (")[0])
    m = re.search(r"^## " + stem + r"[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1).strip() + "\n" if m else None


def meta(res: dict) -> str:
    m, v = res["machine"], res["versions"]
    extra = "" if not res.get("smoke") else " **(--smoke run: sizes too small to mean anything)**"
    steal = ("" if m.get("steal") is None else
             f"; CPU time stolen by the hypervisor during the run (`/proc/stat`): {m['steal']:.1%}")
    return f"""**Machine**: {m['nproc']} CPU cores (`os.cpu_count()`), {m['cpu']} (`/proc/cpuinfo`);
{m['platform']}; Python {m['python']}; JAX devices: {m['jax_devices']}; load average (1/5/15 min):
{m['load']}{steal}.

**Versions**: jax {v['jax']} (jaxlib {v['jaxlib']}), flax {v['flax']}, transformers {v['transformers']},
optax {v['optax']}, numpy {v['numpy']}.

**Date**: {res['date']} (whole run: {res['wall_s']:.0f} s; peak host memory of its process:
{res['peak_rss_mb']:.0f} MB){extra}

**Command**:

    {res['command']}
"""


def targets_table(all_res: dict) -> str:
    lines = ["| benchmark | what | target | measured | met |", "|---|---|---|---|---|"]
    for name, res in all_res.items():
        for t in res["results"].get("targets", []):
            met = "yes" if t["met"] else "**no**" + (f" ({t['note']})" if t.get("note") else "")
            lines.append(f"| {name} | {t['what']} | {t['target']} | {t['measured']} | {met} |")
    return "\n".join(lines)


def memory_table(all_res: dict) -> str:
    lines = ["| benchmark | process | peak RSS (MB) |", "|---|---|---|"]
    for name, res in all_res.items():
        lines.append(f"| {name} | `{res['command']}` | {res['peak_rss_mb']:.0f} |")
        for label, r in res["results"].get("runs", {}).items():   # train_step's worker processes
            what = ("compiled only, measured before the same process's runs" if "skipped" in r
                    else "model, optimizer, batch, steps")
            lines.append(f"| {name} | worker, mesh {label} on {r['devices']} device(s) ({what}) "
                         f"| {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def assemble(results_dir: str = common.RESULTS, out: str = OUT, keep_from: str | None = OUT) -> str:
    """Write BENCHMARKS.md from results_dir/*.json; a benchmark without a JSON keeps its section
    from `keep_from` (the existing BENCHMARKS.md) when it has one."""
    all_res = load(results_dir)
    old = ""
    if keep_from and os.path.exists(keep_from):
        with open(keep_from) as f:
            old = f.read()
    parts = ["""# Benchmarks

Written by `python benchmarks/run_all.py` (see `--help`) from `benchmarks/results/NAME.json`;
each benchmark is one script, `python benchmarks/NAME.py`, which can be rerun alone (then
`python benchmarks/run_all.py --assemble` rebuilds this file). Every figure is the median
(min-max) of repeated runs after an untimed compiling one, on the machine named in its
section. Benchmarks print figures and ratios; they are not tests.
"""]
    if all_res:
        parts.append("## Targets (the speed and memory goals set for the project)\n\n" + targets_table(all_res) + "\n")
        notes = [n for n in (_module(name).limits(res) for name, res in all_res.items()
                             if hasattr(_module(name), "limits")) if n]
        if notes:
            parts.append("What limits the missed (or barely met) targets:\n\n" + "\n".join(notes))
    for name, title, _ in BENCHMARKS + OPTIONAL:
        if name in all_res:
            res = all_res[name]
            parts.append(f"## {title}\n\n{meta(res)}\n{_module(name).markdown(res).rstrip()}\n")
        else:
            body = old_section(old, title)
            if body:
                parts.append(f"## {title}\n\n{body}")
    if all_res:
        parts.append("## Peak host memory\n\n`resource.getrusage(RUSAGE_SELF).ru_maxrss` of each "
                     "benchmark's own fresh process at its end (train_step: also of each worker "
                     "process).\n\n" + memory_table(all_res) + "\n")
    text = "\n".join(parts)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")
    return text


def _module(name: str):
    return importlib.import_module(name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-sampler", action="store_true",
                    help="do not rerun the (long) sampler benchmark; keep its section")
    ap.add_argument("--only", default="", help="comma-separated benchmark names to run")
    ap.add_argument("--assemble", action="store_true", help="run nothing, only rebuild the file")
    ap.add_argument("--smoke", action="store_true",
                    help="pass --smoke to every benchmark (tiny sizes: checks that they run; "
                    "written under the temp directory unless --results-dir / --out say where, "
                    "never over the committed results)")
    ap.add_argument("--results-dir", default=None, help=f"where the JSONs go (default: "
                    f"{os.path.relpath(common.RESULTS, common.REPO)})")
    ap.add_argument("--out", default=None, help="the markdown file to write (default: "
                    "BENCHMARKS.md)")
    args = ap.parse_args(argv)
    scratch = os.path.join(tempfile.gettempdir(), "supo_jax_benchmarks_smoke")
    args.results_dir = args.results_dir or (scratch if args.smoke else common.RESULTS)
    args.out = args.out or (os.path.join(scratch, "BENCHMARKS.md") if args.smoke else OUT)
    os.makedirs(args.results_dir, exist_ok=True)
    names = [n for n, _, _ in BENCHMARKS]
    known = names + [n for n, _, _ in OPTIONAL]
    chosen = args.only.split(",") if args.only else names
    unknown = set(chosen) - set(known)
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if args.skip_sampler and "sampler" in chosen:
        chosen.remove("sampler")
    t0 = time.perf_counter()
    if not args.assemble:
        for name, _, extra in BENCHMARKS + OPTIONAL:
            if name in chosen:
                if name == "sampler" and args.smoke:
                    continue   # the sampler benchmark has no smoke size
                run(name, extra, args.smoke, args.results_dir)
    assemble(args.results_dir, args.out, keep_from=OUT if os.path.exists(OUT) else None)
    print(f"run_all: {time.perf_counter() - t0:.0f} s; wrote {args.out} (results in "
          f"{args.results_dir})")


if __name__ == "__main__":
    main()
