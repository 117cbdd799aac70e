"""Regenerate the README's Results block from the reproduction's output files:

    python experiments/reproduce_cpu.py --out runs/reproduce --seeds 0,1,2
    cp runs/reproduce/{results.md,results.json,sft.json,*.png} experiments/results/cpu_reproduce/
    python experiments/update_readme.py

The block between the README's `<!-- reproduce_cpu:begin -->` and `<!-- reproduce_cpu:end -->`
markers is results.md (without its title, image paths made relative to the repository root);
tests/test_reproduce.py fails when the two differ.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("experiments", "results", "cpu_reproduce")
BEGIN, END = "<!-- reproduce_cpu:begin -->", "<!-- reproduce_cpu:end -->"


def block(results_md: str) -> str:
    """The README's Results block made from results.md."""
    lines = results_md.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    text = "\n".join(lines).strip()
    text = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", lambda m: f"![{m[1]}]({RESULTS}/{m[2]})", text)
    return f"{BEGIN}\n{text}\n{END}"


def current(readme: str) -> str | None:
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), readme, re.S)
    return m.group(0) if m else None


def main() -> int:
    path = os.path.join(ROOT, "README.md")
    readme = open(path).read()
    new = block(open(os.path.join(ROOT, RESULTS, "results.md")).read())
    old = current(readme)
    if old is None:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    with open(path, "w") as f:
        f.write(readme.replace(old, new))
    print("README.md results block", "unchanged" if old == new else "updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
