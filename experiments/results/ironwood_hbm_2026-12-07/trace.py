"""The Ironwood 70B calibration point's train step compiled at this commit, its HLO's HBM
bytes counted by supo_jax.hlo_cost as it is and as it was before 3375650 (a nested fusion
that only copies its parameter read as a copy of the whole stack, not as a view).
    python trace.py [POINT]          # default llama3.1-70b_tpu7x-128; writes POINT.json"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..", "..")
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]
import calibration  # noqa: E402
from supo_jax import hlo_cost, plan  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "llama3.1-70b_tpu7x-128"
texts = []
figures = plan._figures


def keep(compiled, *a, **k):
    texts.append(compiled.as_text())
    return figures(compiled, *a, **k)


plan._figures = keep
t = time.time()
row = calibration.plan_point(name)
wall = time.time() - t
now_view = hlo_cost._Walker.is_view


def old_view(comp, p):   # supo_jax/hlo_cost.py's is_view before 3375650
    root = hlo_cost._source(comp, comp.root.name) if comp.root is not None else None
    return root is not None and root.name == p.name


out = {"point": name, "compile_wall_s": round(wall, 1), "programs": len(texts),
       "row_hbm_seconds": row.get("parts_seconds", {}).get("hbm"),
       "row_no_overlap_seconds": row.get("no_overlap_seconds")}
for label, fn in (("now", now_view), ("before_3375650", old_view)):
    hlo_cost._Walker.is_view = staticmethod(fn)
    costs = [hlo_cost.hlo_cost(x) for x in texts]
    out[label] = {"hbm_bytes": sum(c.hbm_bytes - c.alt_memory_bytes for c in costs),
                  "flops": sum(c.flops for c in costs),
                  "collective_bytes": sum(c.collective_bytes for c in costs)}
hlo_cost._Walker.is_view = staticmethod(now_view)
print(json.dumps(out, indent=1))
with open(os.path.join(HERE, f"{name}.json"), "w") as f:
    json.dump(out, f, indent=1)
