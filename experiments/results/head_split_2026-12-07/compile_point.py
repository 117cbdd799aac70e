"""A calibration point's train step compiled as benchmarks/calibration.py compiles it, with
extra settings after the point's own (the last of a key holds); prints its bytes a chip.
    XLA_FLAGS=--xla_dump_to=DIR python compile_point.py POINT [SETTING ...]"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "benchmarks"))
import calibration  # noqa: E402

name, extra = sys.argv[1], sys.argv[2:]
pt = calibration.POINTS[name]
pt["sets"] = list(pt.get("sets", [])) + extra
t = time.time()
row = calibration.plan_point(name)
print(json.dumps({k: row.get(k) for k in ("bytes_per_chip", "fits", "no_overlap_seconds",
                                          "collective_bytes_per_chip", "error",
                                          "compile_seconds")}, indent=1))
print("wall", time.time() - t)
