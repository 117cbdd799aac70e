"""Ablation sweeps: a grid of config overrides x seeds, run one after another, then one table
(mean and spread over seeds) and plots.

    supo-jax sweep --config NAME.py --grid context.manager=supo,full \
        --grid context.working_context=400,1600 --seeds 0,1,2 --out runs/sweep

Every (grid point, seed) is one training run in DIR/<point>/seed<k> (a normal run directory:
metrics.jsonl, checkpoints, eval.json). A finished run leaves result.json and is skipped when
the sweep is run again with its settings, so an interrupted sweep picks up where it stopped (an
unfinished run resumes from its own checkpoints); a finished run whose steps or eval settings
changed is run again (it resumes), and a run whose other settings changed is an error at start,
as `supo-jax train` refuses it. On a pod, give each host its share with
--host-index/--host-count (one run per host at a time, without jax.distributed); any host can
then `--collect-only` the table once all shares are done.

Every configuration is built and validated before the first run starts, so a typo in a grid
key or value fails at once, naming the key.

Warm start: where the runs would each warm-start the tiny policy by SFT and the grid varies
nothing the warm start depends on (sft.*, model.*, env.*, train.init_from,
train.sft_warm_start), one SFT per seed is made under the sweep's base settings (its --config
and --set, without the grid) in DIR/warm_start/seed<k>, and every grid point of that seed
starts from it (train.init_from), as a comparison of methods needs, and as the base settings
can demonstrate where a grid point could not (e.g. context.manager=full on a task that needs
summaries). A grid point with context.manager=state or fold makes its own (the same SFT
under its manager: its replies need what the other managers' demonstrations never show).
sweep.md says which was done. A run that fails (its warm start included) is a
row of the table with its one-line reason, and the sweep goes on; a rerun tries it again.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
from typing import Callable, Sequence

import numpy as np

from supo_jax import storage
from supo_jax.agent.context import OWN_DEMONSTRATIONS
from supo_jax.config import (RESUMABLE_KEYS, Config, ConfigError, config_changes,
                             load_config, saved_config)
from supo_jax.utils import json_safe, provenance

REPORT_KEYS = ("success_rate", "reward_mean", "tool_calls_mean", "summaries_mean",
               "working_context_mean", "working_context_max", "effective_context_mean",
               "summary_state_share")


def split_values(text: str) -> list[str]:
    """'a,[1, 2],{"x": 1}' -> ['a', '[1, 2]', '{"x": 1}']: commas inside brackets, braces or
    quotes do not split."""
    out, depth, cur, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    if any(not v for v in out):
        raise ConfigError(f"grid values {text!r} contain an empty value")
    return out


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--grid {item!r} is not of the form key=v1,v2,...")
        key, values = item.split("=", 1)
        grid.append((key.strip(), split_values(values)))
    keys = [k for k, _ in grid]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--grid names a key twice: {keys}")
    return grid


def points(grid: Sequence[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination of grid values, in order (the first key varies slowest)."""
    if not grid:
        return [{}]
    keys = [k for k, _ in grid]
    return [dict(zip(keys, vals)) for vals in itertools.product(*(v for _, v in grid))]


def point_name(point: dict[str, str]) -> str:
    if not point:
        return "base"
    name = ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9_.,=+-]+", "_", name)[:120]


@dataclasses.dataclass(frozen=True)
class Run:
    name: str          # the grid point's label (its directory under the sweep's output)
    point: dict        # its overrides
    seed: int
    run_dir: str
    cfg: Config
    warm: Config | None = None    # the seed's shared warm start's config (None: its own)


# grid keys a shared warm start depends on (prefixes): a grid over one of them warm-starts
# each run on its own
WARM_KEYS = ("sft.", "model.", "env.", "train.init_from", "train.sft_warm_start")


def warm_start_dir(out: str, seed: int) -> str:
    return storage.join(out, "warm_start", f"seed{seed}")


def warm_start_once(cfg: Config, out: str, log: Callable[[str], None] = print) -> tuple[str, dict]:
    """SFT the configured tiny policy once into out/sft (an HF directory); returns (that
    directory, the SFT report, also in out/sft.json). Reused when present."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.rl.runs import build_policy
    from supo_jax.rl.trainer import warm_start

    hf, meta = storage.join(out, "sft"), storage.join(out, "sft.json")
    if storage.exists(meta) and storage.isdir(hf):
        return hf, json.loads(storage.read_text(meta))
    log(f"{out}: the SFT warm start, on scripted demonstrations")
    t0 = time.time()
    policy = build_policy(cfg, storage.join(out, "sft_tokenizer"))
    report = warm_start(policy, ChatFormat(policy.tokenizer), cfg, cfg.train.progress)
    policy.save_pretrained(hf)
    report["seconds"] = time.time() - t0
    storage.write_text(meta, json.dumps(json_safe(report), indent=2))
    return hf, report


def plan(config_path: str | None, grid_points: Sequence[dict], seeds: Sequence[int], out: str,
         overrides: Sequence[str] = (), names: Sequence[str] | None = None) -> list[Run]:
    """All runs (grid point x seed), each config loaded and validated now. grid_points:
    dicts of overrides (e.g. points(parse_grid(...))); names: their labels (default: the
    overrides written out)."""
    if not seeds:
        raise ConfigError("--seeds needs at least one seed")
    names = list(names) if names is not None else [point_name(p) for p in grid_points]
    if len(names) != len(grid_points) or len(set(names)) != len(names):
        raise ValueError("one distinct name per grid point")
    keys = {k for p in grid_points for k in p}
    warm = {}
    for seed in seeds:   # the seed's shared warm start, where one is made (module docstring)
        base = load_config(config_path, [*overrides, f"train.seed={seed}",
                                         f"train.run_dir={warm_start_dir(out, seed)}"])
        if (base.train.sft_warm_start and not (base.train.init_from or base.model.path)
                and not any(k.startswith(WARM_KEYS) for k in keys)):
            warm[seed] = base
    runs = []
    for name, point in zip(names, grid_points):
        for seed in seeds:
            run_dir = storage.join(out, name, f"seed{seed}")
            sets = [*overrides, *(f"{k}={v}" for k, v in point.items()),
                    f"train.seed={seed}", f"train.run_dir={run_dir}"]
            m = point.get("context.manager")
            shared = seed in warm and not (m in OWN_DEMONSTRATIONS
                                           and m != warm[seed].context.manager)
            if shared:
                sets += [f"train.init_from={storage.join(warm_start_dir(out, seed), 'sft')}",
                         "train.sft_warm_start=false"]
            runs.append(Run(name, dict(point), int(seed), run_dir, load_config(config_path, sets),
                            warm.get(seed) if shared else None))
    stale = [f"{r.run_dir}: {'; '.join(ch)}" for r in runs
             if not r.cfg.train.accept_config_change and (ch := _changes(r))]
    if stale:
        raise ConfigError(
            f"{len(stale)} of the sweep's runs exist with other settings:\n  "
            + "\n  ".join(stale[:8]) + ("\n  ..." if len(stale) > 8 else "")
            + "\nuse another --out, or continue them with the new settings: --set "
            "train.accept_config_change=true")
    return runs


# what may differ between a finished run and the sweep's plan for it with the run reused as it is
REUSABLE_KEYS = ("train.run_dir", "train.progress", "train.accept_config_change")


def _changes(run: Run, ignore: Sequence[str] = RESUMABLE_KEYS) -> list[str]:
    """How the settings saved in run.run_dir differ from the planned ones (none if unsaved)."""
    saved = saved_config(run.run_dir)
    return [] if saved is None else config_changes(saved, run.cfg, ignore)


def run_sweep(runs: Sequence[Run], *, host_index: int = 0, host_count: int = 1,
              train_fn: Callable[[Config], dict] | None = None,
              warm_fn: Callable[[Config, str], object] = warm_start_once,
              log: Callable[[str], None] = print) -> list[dict]:
    """Run this host's share of `runs` (run i goes to host i % host_count), each after its
    seed's shared warm start (warm_fn(config, directory), made once); returns the results of
    those that finished (finished runs are read back, not rerun). A run that fails leaves
    failed.json with its one-line reason and the sweep goes on."""
    if not 0 <= host_index < host_count:
        raise ValueError(f"host index {host_index} is not in [0, {host_count})")
    if train_fn is None:
        from supo_jax.rl.trainer import train as train_fn
    results = []
    for i, run in enumerate(runs):
        if i % host_count != host_index:
            continue
        done = storage.join(run.run_dir, "result.json")
        changed = _changes(run, REUSABLE_KEYS) if storage.exists(done) else []
        if storage.exists(done) and not changed:
            results.append(json.loads(storage.read_text(done)))
            log(f"[{i + 1}/{len(runs)}] {run.run_dir}: finished earlier")
            continue
        log(f"[{i + 1}/{len(runs)}] {run.run_dir}" + (
            f": finished with other settings ({'; '.join(changed)}), run again" if changed else ""))
        t0 = time.time()
        failed = storage.join(run.run_dir, "failed.json")
        try:
            if run.warm is not None:
                warm_fn(run.warm, run.warm.train.run_dir)
            out = train_fn(run.cfg)
        except Exception as e:     # the run's row says why; the other runs go on
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            log(f"[{i + 1}/{len(runs)}] {run.run_dir} failed: {why}")
            storage.makedirs(run.run_dir)
            storage.write_text(failed, json.dumps({"seed": run.seed, "error": why}))
            continue
        if storage.exists(failed):
            storage.remove(failed)
        res = {"name": run.name, "point": run.point, "seed": run.seed, "run_dir": run.run_dir,
               "seconds": time.time() - t0, "eval": _scalars(out.get("eval", {})),
               "eval_before": _scalars(out.get("eval_before") or {}),
               "last_step": _scalars(out["history"][-1]) if out.get("history") else {}}
        storage.write_text(done, json.dumps(json_safe(res), indent=2, allow_nan=False))
        results.append(res)
    return results


def _scalars(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def collect(runs: Sequence[Run]) -> list[dict]:
    """One row per grid point: (mean, standard error) over the finished seeds of the final eval
    metrics, of the success of the starting policy (`before_success`, from the runs' step-0
    evals) and each seed's success before and after (`per_seed`: (seed, before, after); None
    where a run did not evaluate its start), plus the seeds that have not finished."""
    rows = []
    for name in _unique(r.name for r in runs):
        mine = [r for r in runs if r.name == name]
        res = []
        for r in mine:
            p = storage.join(r.run_dir, "result.json")
            if storage.exists(p):
                res.append(json.loads(storage.read_text(p)))
        row = {"name": name, "point": mine[0].point, "seeds": [r["seed"] for r in res],
               "missing_seeds": [r.seed for r in mine if r.seed not in {x["seed"] for x in res}],
               "failed": []}
        for r in mine:
            p = storage.join(r.run_dir, "failed.json")
            if r.seed in row["missing_seeds"] and storage.exists(p):
                row["failed"].append(json.loads(storage.read_text(p)))
        for k in REPORT_KEYS:
            vals = [r["eval"][k] for r in res if isinstance(r["eval"].get(k), (int, float))
                    and not np.isnan(r["eval"][k])]
            row[k] = mean_se(vals) if vals else None
        before = [(r.get("eval_before") or {}).get("success_rate") for r in res]
        before = [b if isinstance(b, (int, float)) else None for b in before]
        row["before_success"] = mean_se([b for b in before if b is not None]) \
            if any(b is not None for b in before) else None
        row["per_seed"] = [(r["seed"], b, r["eval"].get("success_rate")) for r, b in zip(res, before)]
        row["seconds"] = float(np.mean([r["seconds"] for r in res])) if res else None
        rows.append(row)
    return rows


def mean_se(vals: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of seed results; the error is 0 for one seed."""
    v = np.asarray(vals, dtype=float)
    se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
    return float(v.mean()), se


def _unique(items):
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def table_markdown(rows: Sequence[dict]) -> str:
    """The final evals' means (± standard error over seeds), the starting policy's success
    and each seed's success before -> after."""
    head = ["run", "seeds", "success before", *REPORT_KEYS[:5], "per seed: before -> after",
            "minutes", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(v, one):
        return "-" if v is None else f"{v[0]:.3f}" if one else f"{v[0]:.3f} ± {v[1]:.3f}"

    for r in rows:
        one = len(r["seeds"]) == 1     # one seed: no spread known
        cells = [r["name"], ",".join(map(str, r["seeds"])) or "-",
                 fmt(r.get("before_success"), one)]
        cells += [fmt(r[k], one) for k in REPORT_KEYS[:5]]
        cells.append(" / ".join("-" if b is None else f"{b:.3f}" for _, b, _ in r.get("per_seed", ()))
                     + " -> " + " / ".join("-" if a is None else f"{a:.3f}"
                                          for _, _, a in r.get("per_seed", ())))
        cells.append("-" if r["seconds"] is None else f"{r['seconds'] / 60:.1f}")
        cells.append("; ".join(f"seed {x['seed']}: {x['error']}".replace("|", "/")
                               for x in r.get("failed", ())) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_rows(path: str) -> list[dict]:
    """The rows of a sweep.json: {"meta": ..., "rows": [...]} since sweeps record their
    commit, a bare list of rows before."""
    data = json.loads(storage.read_text(path))
    return data["rows"] if isinstance(data, dict) else data


def read_metrics(run_dir: str) -> list[dict]:
    from supo_jax.rl.metrics import load_row

    p = storage.join(run_dir, "metrics.jsonl")
    if not storage.exists(p):
        return []
    return [load_row(line) for line in storage.read_text(p).splitlines() if line.strip()]


def curves(run_dirs: Sequence[str], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, standard error) of a per-step training metric over runs (the steps all
    runs have)."""
    per_run = []
    for d in run_dirs:
        rows = {m["step"]: m[key] for m in read_metrics(d) if key in m and "loss" in m}
        if rows:
            per_run.append(rows)
    if not per_run:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    vals = np.asarray([[r[s] for s in steps] for r in per_run], dtype=float)
    se = vals.std(0, ddof=1) / np.sqrt(len(vals)) if len(vals) > 1 else np.zeros(len(steps))
    return np.asarray(steps), vals.mean(0), se


def plot_curves(series: dict[str, Sequence[str]], key: str, path: str, ylabel: str | None = None,
                smooth: int = 1) -> str:
    """One line per label (mean over its run dirs, a band of ± one standard error) of metric
    `key` vs step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, dirs in series.items():
        steps, mean, se = curves(dirs, key)
        if not len(steps):
            continue
        if smooth > 1 and len(mean) >= smooth:
            k = np.ones(smooth) / smooth
            mean = np.convolve(mean, k, mode="valid")
            se = np.convolve(se, k, mode="valid")
            steps = steps[smooth - 1:]
        ax.plot(steps, mean, label=label)
        ax.fill_between(steps, mean - se, mean + se, alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel or key)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no run has logged a step yet", ha="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with storage.open(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return path


def report(runs: Sequence[Run], out: str) -> dict:
    """Write DIR/sweep.json ({"meta": provenance(), the commit and date it was written at,
    "rows": the rows}), DIR/sweep.md and DIR/success_vs_step.png; return the rows."""
    rows = collect(runs)
    by_point = {n: [r.run_dir for r in runs if r.name == n] for n in _unique(r.name for r in runs)}
    storage.makedirs(out)
    plot = plot_curves(by_point, "success_rate", storage.join(out, "success_vs_step.png"),
                       "training success rate")
    storage.write_text(storage.join(out, "sweep.json"), json.dumps(
        json_safe({"meta": provenance(), "rows": rows}), indent=2, allow_nan=False))
    md = table_markdown(rows)
    shared = sorted({r.seed for r in runs if r.warm is not None})
    own = sorted({r.name for r in runs if r.warm is None})
    warm = (f"Warm start: one SFT per seed ({', '.join(map(str, shared))}) under the sweep's base "
            "settings, in warm_start/seed<k>, shared by every grid point of that seed"
            + (f" but {', '.join(own)} (each run its own)" if own else "") + "."
            if shared else "Warm start: each run its own (as its settings say).")
    storage.write_text(storage.join(out, "sweep.md"), (f"# Sweep\n\nHeld-out eval of the starting policy (success before) and after "
                f"training, mean ± standard error over seeds. {warm}\n\n{md}\n\n"
                f"![success vs step]({plot.rstrip('/').rsplit('/', 1)[-1]})\n"))
    return {"rows": rows, "markdown": md, "plot": plot, "warm_start": warm}
