"""One process of a rollout run for tests/test_multihost.py: the tiny_test policy on the run's
mesh (every device of every process: SUPO_JAX_COORDINATOR etc. start several processes),
trainer.rollout_batch over a fixed set of tasks, each rollout written as JSON to
OUT/rollouts_<process index>.json (and the same rollouts cut at a token budget and resumed,
phase after phase), with what this process saw: the meshes, which rollouts
it reset (env.name=recorded/pages), where the policy's parameters live, and how many
programs a hundred exchanges of random sizes between the processes compiled.

    python -m tests.rollout_worker RUN_DIR OUT [key=value ...]

With SUPO_JAX_TEST_FAULTY=1 the same processes then roll out faulty/pages on the same rows
(tests/worker_envs.py: process 1's environments fail in turn) into "faulty_rollouts": one
launch for both checks.
"""
import json
import os
import sys

import numpy as np


def main(run_dir: str, out: str, sets: list[str]) -> None:
    from supo_jax.utils import maybe_init_distributed

    maybe_init_distributed()
    import jax

    from supo_jax.agent.render import ChatFormat
    from supo_jax.config import load_config
    from supo_jax.envs import make_tasks
    from supo_jax.rl.multihost import allgather_json, make_run_mesh
    from supo_jax.rl.runs import build_policy, serving_policy
    from supo_jax.rl.trainer import rollout_batch
    from tests import worker_envs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "experiments", "configs", "tiny_test.py"), sets)
    mesh = make_run_mesh(cfg)
    policy = build_policy(cfg, run_dir, mesh)
    fmt = ChatFormat(policy.tokenizer)
    tasks = make_tasks(cfg.env.name, "train", cfg.rollout.tasks_per_step, seed=cfg.env.seed,
                       **cfg.env.knobs)
    worker_envs.RESETS.clear()      # (building the tokenizer resets environments too)
    ro = rollout_batch(policy, fmt, cfg, tasks, seed=7)
    resets = list(worker_envs.RESETS)
    # the same rollouts under a token budget, a phase at a time (each a new sampler, the
    # same weights and key): the suspended between phases, and the rollouts in the end
    from supo_jax.agent.rollout import Suspended
    from supo_jax.rl.trainer import policy_rollouts

    G = cfg.rollout.group_size
    items = [Suspended(t, gi, s) for gi, t in enumerate(tasks) for s in range(G)]
    phases, ended = [], {}
    while items and len(phases) < 30:
        done, items, _ = policy_rollouts(policy, fmt, cfg, items, seed=7, group_size=G,
                                         budget_tokens=300, version=len(phases))
        ended.update(done)
        phases.append([x.to_json() for x in items])
    leaf = jax.tree.leaves(policy.split()[1])[0]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    rng = np.random.default_rng(jax.process_index())
    for _ in range(100):
        got = allgather_json("x" * int(rng.integers(1, 100_000)))
        assert len(got) == jax.process_count()
    exchange_compiles = len(compiles)
    jax.jit(lambda x: x * 3 + 1)(np.arange(7))      # one new program: the count hears it
    probe_compiles = len(compiles) - exchange_compiles
    faulty = None
    if os.environ.get("SUPO_JAX_TEST_FAULTY") == "1":
        fcfg = load_config(os.path.join(root, "experiments", "configs", "tiny_test.py"),
                           sets + ["env.name=faulty/pages"])
        ftasks = make_tasks(fcfg.env.name, "train", fcfg.rollout.tasks_per_step,
                            seed=fcfg.env.seed, **fcfg.env.knobs)
        faulty = [r.to_json() for r in rollout_batch(policy, fmt, fcfg, ftasks, seed=7)]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rollouts_{jax.process_index()}.json"), "w") as f:
        json.dump({"mesh": dict(mesh.shape) if mesh else None,
                   "serving_mesh": dict(m.shape) if (m := serving_policy(
                       cfg, policy).mesh) else None,
                   "processes": jax.process_count(), "devices": jax.device_count(),
                   "resets": resets,
                   "phases": phases,
                   "budget_rollouts": [ended[k].to_json() for k in sorted(ended)],
                   "param_devices": len(leaf.sharding.device_set),
                   "param_processes": len({d.process_index for d in leaf.sharding.device_set}),
                   "exchange_compiles": exchange_compiles,
                   "probe_compiles": probe_compiles,
                   "faulty_rollouts": faulty,
                   "rollouts": [r.to_json() for r in ro]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
