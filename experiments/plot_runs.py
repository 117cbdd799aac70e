"""Plot a metric of finished or running runs against the RL step, one line per label (the mean
over its run directories, a band of +- one standard error):

    python experiments/plot_runs.py --out curve.png supo=runs/a,runs/b full=runs/c
    python experiments/plot_runs.py --out ctx.png --key working_context_mean --smooth 5 x=runs/a

Each run directory is read through its metrics.jsonl (the rows of training steps); only the
steps every run of a label has logged are drawn.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from supo_jax.sweep import plot_curves  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("series", nargs="+", metavar="LABEL=DIR[,DIR...]")
    p.add_argument("--out", required=True, help="the .png to write")
    p.add_argument("--key", default="success_rate", help="a metrics.jsonl field of training steps")
    p.add_argument("--ylabel", default=None)
    p.add_argument("--smooth", type=int, default=1, help="moving average over this many steps")
    args = p.parse_args(argv)
    series = {}
    for s in args.series:
        label, sep, dirs = s.rpartition("=")   # a label may hold "="
        if not sep or not label or not dirs:
            p.error(f"{s!r}: expected LABEL=DIR[,DIR...]")
        series[label] = dirs.split(",")
        missing = [d for d in series[label] if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
        if missing:
            p.error(f"no metrics.jsonl in {', '.join(missing)}")
    print(plot_curves(series, args.key, args.out, args.ylabel, smooth=args.smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
