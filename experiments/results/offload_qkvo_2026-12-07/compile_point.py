"""MaxText's Mistral-7B point (6 x 8192 a chip on v6e-8) compiled as benchmarks/calibration.py
compiles it, at remat offload_qkvo instead of offload (the calibration's row: offload).
    python experiments/results/offload_qkvo_2026-12-07/compile_point.py"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
import calibration  # noqa: E402

calibration.REMAT[:] = ["model.remat=offload_qkvo"]
row = calibration.plan_point("mistral-7b_v6e-8")
print(json.dumps({k: row.get(k) for k in ("bytes_per_chip", "fits", "no_overlap_seconds",
                                          "parts_seconds", "collective_bytes_per_chip",
                                          "overrides", "error", "compile_seconds")}, indent=1))
