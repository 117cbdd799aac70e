"""Compare the runs of this folder: XLA's CPU code at LLVM level 1 against level 3 (XLA's default).

python experiments/results/cpu_llvm_level_2026-12-07/compare.py  -> summary.json beside it
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(name):
    with open(os.path.join(HERE, f"{name}_metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def untimed(rs):
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rs]


def main():
    out = {}
    for run, pair in {"full": ("full_level3", "full_level1"),
                      "short": ("short_default", "short_level1")}.items():
        entry = {}
        for name in pair:
            with open(os.path.join(HERE, f"{name}_process.json")) as f:
                p = json.load(f)
            rs = rows(name)
            entry[name] = {"wall_s": round(p["wall_s"], 1), "compile_s": round(p["compile_s"], 1),
                           "compiles": p["compiles"], "cpu_s": round(p["cpu_s"], 1),
                           "rollout_s": round(sum(r.get("rollout_seconds", 0) for r in rs), 1),
                           "update_s": round(sum(r.get("update_seconds", 0) for r in rs), 1)}
        a, b = (untimed(rows(n)) for n in pair)
        entry["metrics_identical"] = a == b
        entry["compile_saved"] = round(1 - entry[pair[1]]["compile_s"] / entry[pair[0]]["compile_s"], 3)
        entry["wall_saved"] = round(1 - entry[pair[1]]["wall_s"] / entry[pair[0]]["wall_s"], 3)
        out[run] = entry
    with open(os.path.join(HERE, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
