"""Regenerate every block of README.md that quotes results or settings, from the files that
hold them. A block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; tests/
test_docs.py fails when a block differs from its rendering.

    python experiments/update_docs.py            # rewrite the blocks
    python experiments/update_docs.py --check    # exit 1 when one differs

Blocks:
  quickstart     the table `supo-jax train` ends with, rendered by supo_jax.rl.metrics.
                 summary_table from the committed metrics of that run (QUICKSTART)
  departures     the CPU recipe's departures from the paper's algorithm: supo_jax.config.
                 departures() with the reasons in supo_jax/configs/cpu_recipe.py
  reproduce_cpu  the reproduction's results.md (experiments/reproduce_cpu.py writes it;
                 copy it to RESULTS first)
docs/ENVIRONMENTS.md:
  redcount_example  my_envs/redcount.py, the example environment (REDCOUNT)
docs/CLI.md:
  cli_commands   the subcommands: what each does, and its example (supo_jax.cli's parser)
  cli_NAME       each subcommand's flags, defaults and help texts (its argparse parser)
docs/SCALING.md:
  gpu_smollm2    the SmolLM2 GPU runs' table, from their metrics.jsonl files (GPU_SMOLLM2)
  tpu_plan_example  supo_jax.plan.format_plan of the committed `supo-jax plan` report
                 (TPU_PLAN)
"""
from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("experiments", "results", "cpu_reproduce")
QUICKSTART = os.path.join("experiments", "results", "quickstart_2026-11-28",
                          "default_metrics.jsonl")
QUICK_ROWS = ("success_rate", "summaries_mean", "tool_calls_mean", "effective_context_mean",
              "overlong_rate", "summary_state_share")


def reproduce_cpu() -> str:
    lines = open(os.path.join(ROOT, RESULTS, "results.md")).read().strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    text = "\n".join(lines).strip()
    return re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", lambda m: f"![{m[1]}]({RESULTS}/{m[2]})",
                  text)


def quickstart_metrics(path: str = QUICKSTART) -> tuple[list, dict, dict]:
    """(training steps, the last eval, the eval before training) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, path)) if line.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [{k[5:]: v for k, v in r.items() if k.startswith("eval/")} for r in rows
             if any(k.startswith("eval/") for k in r)]
    return steps, evals[-1], evals[0]


def quickstart() -> str:
    from supo_jax.rl.metrics import summary_table

    table = summary_table(*quickstart_metrics()).splitlines()
    keep = [table[0]] + [ln for ln in table[1:] if ln.split()[0] in QUICK_ROWS]
    return (f"Seed 0, as committed in {QUICKSTART} ({len(keep) - 1} of the "
            f"{len(table) - 1} metrics the command prints). The eval columns are held-out "
            "tasks before and after training; step 1 and step 30 are that step's training "
            "rollouts:\n\n" + "\n".join("    " + ln.rstrip() for ln in keep))


def departures() -> str:
    from supo_jax import config as C
    from supo_jax.configs import cpu_recipe

    def show(v):
        s = repr(v)
        return s if len(s) <= 24 else s[:20] + "...'"
    rows = ["| setting | CPU recipe | paper | why |", "|---|---|---|---|"]
    for key, (ours, paper) in C.departures(C.load_config(None)).items():
        rows.append(f"| `{key}` | `{show(ours)}` | `{show(paper)}` | "
                    f"{cpu_recipe.DEPARTURES[key]} |")
    return "\n".join(rows)


GPU_SMOLLM2 = os.path.join("experiments", "results", "gpu_smollm2_listing")


def gpu_smollm2() -> str:
    """Held-out success at each eval; training success and the share of rollouts at the cap,
    means of the first and the last 10 steps (in %)."""
    from supo_jax.sweep import read_metrics

    def pct(x):
        return f"{100 * x:.1f}"

    def mean(xs):
        return sum(xs) / len(xs)
    rows = ["| method at W = 512 | seed | held-out at step 0 / 10 / 20 / 30 / 40 | "
            "training, steps 1-10 -> last 10 | at the cap |", "|---|---|---|---|---|"]
    for method, seed in (("supo", 0), ("supo", 1), ("full", 0)):
        ms = read_metrics(os.path.join(ROOT, GPU_SMOLLM2, f"{method}_seed{seed}"))
        evals = {m["step"]: m["eval/success_rate"] for m in ms if "eval/success_rate" in m}
        steps = [m for m in ms if "loss" in m]
        held = " / ".join(pct(evals[s]) if s in evals else "-" for s in (0, 10, 20, 30, 40))
        cells = [f"{pct(mean([m[k] for m in steps[:10]]))} -> "
                 f"{pct(mean([m[k] for m in steps[-10:]]))}"
                 for k in ("success_rate", "overlong_rate")]
        rows.append(f"| {'SUPO' if method == 'supo' else 'full'} | {seed} | {held} | "
                    f"{cells[0]} | {cells[1]} |")
    return "\n".join(rows)


TPU_PLAN = os.path.join("experiments", "results", "tpu_plan_cpu_recipe", "plan.json")


def tpu_plan_example() -> str:
    from supo_jax.plan import format_plan

    rep = json.load(open(os.path.join(ROOT, TPU_PLAN)))
    return (f"(jax {rep['versions']['jax']}, libtpu {rep['versions']['libtpu']}; "
            f"{TPU_PLAN})\n\n" + "\n".join("    " + ln if ln else "" for ln in
                                      format_plan(rep).splitlines()))


REDCOUNT = os.path.join("my_envs", "redcount.py")


def redcount_example() -> str:
    """The example as the docs show it: its code, under its path (the docstring left out)."""
    text = open(os.path.join(ROOT, REDCOUNT)).read()
    code = re.sub(r'^""".*?"""\n', "", text, count=1, flags=re.S)
    return f"```python\n# {REDCOUNT}\n{code}```"


def _subcommands():
    """{name: (help, its argparse parser)} of supo-jax, in the parser's order."""
    import argparse

    from supo_jax.cli import build_parser

    sp = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sp._choices_actions}
    return {name: (helps[name], p) for name, p in sp.choices.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def cli_commands() -> str:
    from supo_jax.cli import _EXAMPLES

    rows = ["| command | what it does | example |", "|---|---|---|"]
    for name, (help_, _) in _subcommands().items():
        example = _EXAMPLES[name].split("\n")[0].split("   #")[0].strip()
        rows.append(f"| [`{name}`](#supo-jax-{name}) | {_cell(help_)} | `{_cell(example)}` |")
    return "\n".join(rows)


def cli_flags(name: str) -> str:
    """The flag table of `supo-jax NAME`, from its parser: what --help says."""
    import argparse

    rows = ["| flag | default | what it is |", "|---|---|---|"]
    for a in _subcommands()[name][1]._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        flag, help_ = a.option_strings[-1], a.help
        if a.nargs != 0:
            flag += " " + (a.metavar or a.dest.upper())
        if a.required:
            default = "required"
        elif isinstance(a, argparse._StoreTrueAction):
            default = "off"
        elif a.default in (None, "") and "; default: " in help_:   # the help says what
            help_, default = help_.rsplit("; default: ", 1)
        elif a.default in (None, ""):
            default = "none"
        else:
            default = f"`{a.default}`"
        rows.append(f"| `{_cell(flag)}` | {_cell(default)} | {_cell(help_)} |")
    return "\n".join(rows)


BLOCKS = {"README.md": {"quickstart": quickstart, "departures": departures,
                        "reproduce_cpu": reproduce_cpu},
          os.path.join("docs", "ENVIRONMENTS.md"): {"redcount_example": redcount_example},
          os.path.join("docs", "CLI.md"): {
              "cli_commands": cli_commands,
              **{f"cli_{n}": (lambda n=n: cli_flags(n)) for n in
                 ("train", "eval", "sft", "sweep", "rollout", "generate", "export", "plan",
                  "serve")}},
          os.path.join("docs", "SCALING.md"): {"gpu_smollm2": gpu_smollm2,
                                               "tpu_plan_example": tpu_plan_example}}


def render(text: str, blocks: dict) -> str:
    """text with each of `blocks` (name -> renderer) replaced by its rendering."""
    for name, fn in blocks.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        pat = re.escape(begin) + r".*?" + re.escape(end)
        if not re.search(pat, text, re.S):
            raise SystemExit(f"no {begin} ... {end} block")
        text = re.sub(pat, lambda m: f"{begin}\n{fn()}\n{end}", text, flags=re.S)
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    differ = []
    for fn, blocks in BLOCKS.items():
        path = os.path.join(ROOT, fn)
        old = open(path).read()
        new = render(old, blocks)
        if new != old:
            differ.append(fn)
            if "--check" not in argv:
                with open(path, "w") as f:
                    f.write(new)
    if "--check" in argv and differ:
        print(f"blocks differ from their rendering in {', '.join(differ)}: python "
              "experiments/update_docs.py", file=sys.stderr)
        return 1
    print("updated: " + ", ".join(differ) if differ else "every block as rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
