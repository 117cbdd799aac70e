"""What a run reports: progress (a bar on a terminal or in a notebook, plain periodic lines
otherwise), metrics.jsonl + TensorBoard events (process 0), and the closing summary table."""
from __future__ import annotations

import json
import math
import sys
import time

from supo_jax import storage
from supo_jax.agent.rollout import summarize
from supo_jax.rl.multihost import is_main


class LineProgress:
    """Progress as plain log lines (when stderr is not a terminal, e.g. a log file): the
    tqdm calls the trainer makes (update, set_postfix, close), printed at most every
    `every` seconds and once at the end."""

    def __init__(self, total: int, desc: str, every: float = 30.0, stream=None,
                 closing_line: bool = True, initial: int = 0):
        self.total, self.desc, self.every = total, desc, every
        self.stream = stream or sys.stderr
        # initial: done before this process (a resumed run counts from its step)
        self.initial = self.n = initial
        self.postfix, self.lines, self.printed = "", 0, -1
        self.closing_line = closing_line   # False: a closing line only after periodic ones
        self.t0 = self.last = time.time()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.time() - self.last >= self.every:
            self._line()

    def set_postfix(self, **kw) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kw.items())

    def _line(self) -> None:
        self.last, self.lines, self.printed = time.time(), self.lines + 1, self.n
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        spent, done = self.last - self.t0, self.n - self.initial
        eta = (f", {_duration(spent / done * (self.total - self.n))} left"
               if done and self.total and self.n < self.total else "")
        print(f"{self.desc}: {self.n}/{self.total}{pct} {_duration(spent)}{eta} {self.postfix}"
              .rstrip(), file=self.stream, flush=True)

    def close(self) -> None:
        """A last line, unless the last one printed already showed where it ended."""
        if (self.closing_line or self.lines) and self.printed != self.n:
            self._line()


def _duration(s: float) -> str:
    """37s, 4m05s, 2h03m."""
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _in_notebook() -> bool:
    """Running in a Jupyter kernel (ipykernel's shell is active), not merely a process that
    imported ipykernel (e.g. one that ran a notebook through nbclient)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def progress_bar(total, desc, enabled, closing_line: bool = True, initial: int = 0):
    """A progress bar on a terminal or in a notebook, plain periodic lines otherwise (where a
    bar without `closing_line`, e.g. one step's rollouts, prints only if it runs long); both
    show the time left. `initial`: done already (a resumed run's steps: it counts on from
    there)."""
    if not enabled or not is_main():
        return None
    if not sys.stderr.isatty() and not _in_notebook():
        return LineProgress(total, desc, closing_line=closing_line, initial=initial)
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, initial=initial)


def dump_row(row: dict) -> str:
    """A metrics row as strict JSON: a metric without a value (nan: e.g. no summaries to
    measure) is null."""
    from supo_jax.utils import json_safe

    return json.dumps(json_safe(row), allow_nan=False)


def load_row(line: str) -> dict:
    """A metrics.jsonl row, null metrics as nan again."""
    return {k: float("nan") if v is None else v for k, v in json.loads(line).items()}


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet:
    its writer imports torch when installed (a second of a run's start) only to accept
    torch tensors, and this log writes floats."""
    import sys

    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None          # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsLog:
    """metrics.jsonl (one object per step) + TensorBoard event files, process 0 only."""

    def __init__(self, run_dir: str, resume_step: int):
        self.path = storage.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.kept: list[dict] = []   # rows of the steps before a resume
        if not is_main():
            return
        kept = []
        if storage.exists(self.path):  # drop rows of steps that will be replayed
            kept = [ln + "\n" for ln in storage.read_text(self.path).splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step]
        storage.write_text(self.path, "".join(kept))
        self.kept = [load_row(ln) for ln in kept]
        try:
            self.tb = _summary_writer()(storage.join(run_dir, "tb"))
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            self.tb = None

    def write(self, row: dict) -> None:
        if not is_main():
            return
        storage.append_text(self.path, dump_row(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def write_eval(self, step: int, row: dict) -> None:
        """The eval row of `step`, replacing one already there (a finished run rerun is
        evaluated again)."""
        if is_main():
            lines = [ln + "\n" for ln in storage.read_text(self.path).splitlines() if ln.strip()]
            storage.write_text(self.path, "".join(
                ln for ln in lines if not ((d := json.loads(ln))["step"] == step
                                           and "loss" not in d)))
        self.write({"step": step, **row})

    def close(self):
        if self.tb is not None:
            self.tb.close()


def eval_row(ev: dict) -> dict:
    return {f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))}


def summarize_scalars(rollouts) -> dict:
    s = summarize(rollouts)
    return {k: v for k, v in s.items() if isinstance(v, (int, float))}


def summary_table(history: list[dict], final: dict | None = None,
                  before: dict | None = None) -> str:
    """A terminal table: the eval before training, the first / last step, the final eval."""
    keys = ["success_rate", "reward_mean", "loss", "updates", "p_summary", "summaries_mean", "tool_calls_mean",
            "working_context_mean", "working_context_max", "effective_context_mean",
            "overlong_rate", "env_error_rate", "summary_state_share",
            "rollout_seconds", "update_seconds"]
    steps = [history[0]] + history[1:][-1:] if history else []   # the first and the last
    cols = ([("eval before", before)] if before else []) + [
        (f"step {h['step']}", h) for h in steps
    ] + ([("eval after" if before and steps else "eval", final)] if final else [])
    if not cols:
        return "(no steps run)"

    def cell(d, k):
        v = d.get(k) if d else None
        ok = isinstance(v, (int, float)) and math.isfinite(v)   # nan: e.g. no state probe
        return f"{v:12.3f}" if ok else f"{'-':>12s}"
    lines = [] if steps else ["(no steps run: the evaluation of the run's policy)"]
    lines.append(f"{'metric':28s}" + "".join(f" {name:>12s}" for name, _ in cols))
    for k in keys:
        lines.append(f"{k:28s}" + "".join(f" {cell(d, k)}" for _, d in cols))
    return "\n".join(lines)
