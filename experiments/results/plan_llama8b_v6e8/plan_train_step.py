import json, sys, time
from supo_jax.config import load_config
from supo_jax.plan import plan
cfg = load_config("experiments/configs/paper_fncall_supo.py", ["optim.minibatch_rows=24", "optim.micro=1", "optim.max_row_len=8192"])
t = time.time()
rep = plan(cfg, "v6e-8", model_config="experiments/models/llama3.1-8b", programs=("train_step",))
p = rep["programs"]["train_step"]
print("compile+plan s", time.time() - t)
print({k: p.get(k) for k in ("fits", "bytes_per_chip", "collective_bytes_per_chip", "estimated_seconds", "no_overlap_seconds", "bound", "seconds")})
for c in p.get("largest_collectives", []): print(c)
print(rep.get("estimates"))
json.dump(rep, open(sys.argv[1], "w"), indent=1, default=str)
