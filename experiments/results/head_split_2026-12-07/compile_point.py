import os, sys, json, time
sys.path.insert(0, "/work/main/benchmarks")
name = sys.argv[1]; extra = sys.argv[2:]
import calibration
pt = calibration.POINTS[name]
pt["sets"] = list(pt.get("sets", [])) + extra
t = time.time()
row = calibration.plan_point(name)
print(json.dumps({k: row.get(k) for k in ("bytes_per_chip", "fits", "no_overlap_seconds", "collective_bytes_per_chip", "error", "compile_seconds")}, indent=1))
print("wall", time.time() - t)
