"""A miniature of experiments/reproduce_cpu.py (2 SFT steps, 2 RL steps per method), so the
reproduction pipeline cannot silently rot."""
import importlib.util
import json
import re
import os
import subprocess
import sys

import pytest

from tests.readme_helpers import ROOT


@pytest.mark.long
def test_reproduce_cpu_quick(tmp_path, capsys):
    out = str(tmp_path / "repro")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "reproduce_cpu.py"), "--out", out,
           "--quick"]
    env = dict(os.environ, XLA_FLAGS="")   # one CPU device: the fastest trainer runs
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["sft"]["sft_full_context_demos"] == 1   # a third of the 4 demos: whole history
    names = [m["name"] for m in res["methods"]]
    assert names == ["supo", "grpo_w", "grpo_w_s1", "supo_no_mask", "supo_eq4", "state", "fold",
                     "clear"]
    for m in res["methods"]:
        assert m["seeds"] == [0] and m["success_rate"] is not None and m["before_success"] is not None
    from supo_jax.config import load_config
    base = load_config(os.path.join(ROOT, "experiments", "configs", "cpu_reproduce.py"))
    W, S = base.context.working_context, base.context.max_summaries
    assert [s for s, _ in res["test_time_scaling"]] == [0, S, 2 * S, 4 * S]
    cfgs = {x["name"]: json.load(open(os.path.join(x["run_dir"], "config.json")))
            for x in res["runs"]}
    assert cfgs["grpo_w"]["context"]["manager"] == "full"
    assert cfgs["grpo_w_s1"]["context"]["working_context"] == W * (S + 1)
    assert cfgs["supo_no_mask"]["advantage"]["masked_reasons"] == []
    assert cfgs["supo_eq4"]["advantage"]["estimator"] == "trajectory_group"
    assert [cfgs[m]["context"]["manager"] for m in ("state", "fold", "clear")] == [
        "state", "fold", "clear"]
    # state and fold: the same SFT under their own manager, where the expert can demonstrate it
    assert res["warm_starts"]["state"] == "own"
    assert cfgs["state"]["context"]["max_state_tokens"] == 0     # sized from W
    for name, c in cfgs.items():
        own = res["warm_starts"].get(name) == "own"
        assert c["train"]["init_from"] == os.path.join(out, *((f"sft_{name}", "sft") if own
                                                            else ("sft",)))
    md = open(os.path.join(out, "results.md")).read()
    assert "| method | working context | effective context |" in md and f"GRPO (W={W * (S + 1)})" in md
    for png in ("success_vs_step", "working_context", "summaries", "test_time_scaling",
                "summary_state_share"):
        assert os.path.getsize(os.path.join(out, png + ".png")) > 1000
    # a second run reuses the SFT checkpoint and every finished run; it and the next two
    # train nothing, so they run in this process (its start-up and imports are paid once)
    spec = importlib.util.spec_from_file_location("reproduce_cpu", cmd[1])
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    assert repro.main(cmd[2:]) == 0
    out2 = capsys.readouterr().out
    assert out2.count("finished earlier") == len(names) and "training the SFT" not in out2
    # a subset of the methods (the new-families table runs supo and grpo_w only)
    assert repro.main(cmd[2:] + ["--methods", "supo,grpo_w"]) == 0
    with open(os.path.join(out, "results.json")) as f:
        assert [m["name"] for m in json.load(f)["methods"]] == ["supo", "grpo_w"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        repro.main(cmd[2:] + ["--methods", "supo,sup"])
    assert e.value.code != 0 and "--methods: unknown sup" in capsys.readouterr().err


def test_new_family_config_changes_only_the_task():
    """experiments/configs/cpu_listing.py is the reproduction's recipe on another task."""
    from supo_jax import config as C
    rep = C.to_dict(C.load_config(os.path.join(ROOT, "experiments", "configs", "cpu_reproduce.py")))
    lst = C.to_dict(C.load_config(os.path.join(ROOT, "experiments", "configs", "cpu_listing.py")))
    assert lst["env"]["name"] == "fncall/listing"
    assert {k: v for k, v in lst.items() if k not in ("env", "train")} == \
        {k: v for k, v in rep.items() if k not in ("env", "train")}
    assert {k: v for k, v in lst["train"].items() if k != "run_dir"} == \
        {k: v for k, v in rep["train"].items() if k != "run_dir"}


@pytest.mark.slow
def test_update_probe_reports_greedy_failures_and_the_update_by_advantage_sign(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from reproduce_cpu import QUICK
    from update_probe import main

    lines = []
    sets = [a for s in QUICK for a in ("--set", s)] + ["--set", "env.name=fncall/count",
                                                       "--set", "env.eval_tasks=3"]
    assert main(["--run-dir", str(tmp_path / "probe"), *sets, "--steps", "2", "--only",
                 "negative"], log=lines.append) == 0
    assert re.fullmatch(r"greedy: [\d.]+ success on 3 held-out tasks", lines[0])
    steps = [l for l in lines if l.startswith("step ")]
    assert len(steps) == 4 and all("4 rollouts" in l and "grad norm" in l for l in steps[::2])
    assert not any("A>0" in l for l in steps[::2])  # --only negative zeroes the positive half
    kept = [l for l in steps if "retention" in l]
    assert len(kept) == 2, steps
    for line in kept:   # a probability and a log-probability change per token class measured
        assert ("no successful rollout" in line
                or re.search(r"all \d+ tokens P [\d.]+ -> [\d.]+ \(log-probability [-+][\d.]+\)", line)), line


@pytest.mark.slow
def test_placebo_permutes_each_steps_rewards_and_runs_a_normal_train(tmp_path, monkeypatch,
                                                                     capsys):
    """experiments/placebo.py (advantage.permute_rewards): the advantages of every training step
    are computed from a permutation of that step's rewards, the run is otherwise a normal
    `train`, and the setting is saved with the run: resuming it without the setting is refused."""
    import dataclasses

    import numpy as np

    monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
    import placebo
    from reproduce_cpu import QUICK
    from supo_jax.cli import main
    from supo_jax.rl import trainer
    from supo_jax.rl.batch import permute_rewards

    @dataclasses.dataclass(frozen=True)
    class R:
        reward: float

    rs = [R(float(i)) for i in range(16)]
    out = permute_rewards(rs, np.random.default_rng(0))
    assert sorted(r.reward for r in out) == [r.reward for r in rs]
    assert [r.reward for r in out] != [r.reward for r in rs]

    calls = []   # (the step's rollouts, what the advantages were computed from)

    def recording(ro, rng):
        calls.append((ro, permute_rewards(ro, rng)))
        return calls[-1][1]

    monkeypatch.setattr(trainer, "permute_rewards", recording)
    run_dir = tmp_path / "placebo"
    sets = [a for s in QUICK for a in ("--set", s)] + ["--set", "env.name=fncall/count",
                                                       "--set", f"train.run_dir={run_dir}"]
    # one round per step (dynamic sampling computes advantages once more per round, to pick
    # the groups it keeps: from a permutation of its own, as unrelated to what they did)
    assert placebo.main(["train", *sets, "--set", "rollout.dynamic_rounds=0"]) == 0
    steps = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    assert len(calls) == len(steps) == 2
    for (ro, used), m in zip(calls, steps):
        assert len(ro) == m["rollouts"] and sorted(r.reward for r in used) == sorted(
            r.reward for r in ro)
        assert [r.task_id for r in used] == [r.task_id for r in ro]   # only rewards move
    assert json.load(open(run_dir / "config.json"))["advantage"]["permute_rewards"] is True
    capsys.readouterr()
    assert main(["train", *sets, "--set", "rollout.dynamic_rounds=0", "--set",
                 "train.steps=3"]) == 2
    assert "advantage.permute_rewards: True -> False" in capsys.readouterr().err
    assert len(calls) == 2


@pytest.mark.slow
def test_update_probe_retention_measures_what_an_update_does_to_kept_tokens(tmp_path):
    """Retention (update_probe.py step 3): unchanged params give the start's probabilities; one
    PPO update with a positive advantage on the kept segments themselves raises them."""
    import dataclasses

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from reproduce_cpu import QUICK
    from update_probe import Retention

    from supo_jax import config as C
    from supo_jax.envs.datasets import load_tasks
    from supo_jax.rl import trainer as T
    from supo_jax.rl.batch import build_batch
    from supo_jax.rl.sft import expert_segments

    cfg = C.load_config(None, [*QUICK, "env.name=fncall/count", "train.sft_warm_start=false",
                               f"train.run_dir={tmp_path / 'r'}"])
    run = T.open_run(cfg)
    tasks = load_tasks(cfg.env.name, "train", 2, seed=0, **cfg.env.knobs)
    segs, _ = expert_segments(run.fmt, cfg.env.name, tasks, cfg.context)
    loss_cfg = dataclasses.replace(cfg.loss, temperature=cfg.rollout.temperature)
    kept = Retention(run, cfg, segs, loss_cfg)
    pat = r"all (\d+) tokens P ([\d.]+) -> ([\d.]+) \(log-probability ([-+][\d.]+)\)"
    m = re.search(pat, kept.report())
    assert m and m[2] == m[3] and float(m[4]) == 0.0, kept.report()
    assert "numbers" in kept.report()          # count's demonstrations write numbers
    batch = build_batch(segs, [1.0] * len(segs), max_len=T.row_len(cfg, run.fmt),
                        rows_multiple=cfg.optim.minibatch_rows)
    run.params, run.opt_state, _ = T.ppo_update(
        run.policy, run.graphdef, run.params, run.opt_state, batch, tx=run.tx,
        loss_cfg=loss_cfg, optim=cfg.optim, mesh=run.mesh, seed=0)
    m = re.search(pat, kept.report())
    assert float(m[4]) > 0, kept.report()
