"""A miniature of experiments/reproduce_cpu.py (2 SFT steps, 2 RL steps per method), so the
reproduction pipeline cannot silently rot."""
import functools
import json
import re
import os
import subprocess
import sys

import pytest

from tests.readme_helpers import README, ROOT, TUNING


@pytest.mark.long
def test_reproduce_cpu_quick(tmp_path):
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
    assert names == ["supo", "grpo_w", "grpo_w_s1", "supo_no_mask", "supo_eq4"]
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
    assert all(c["train"]["init_from"] == os.path.join(out, "sft") for c in cfgs.values())
    md = open(os.path.join(out, "results.md")).read()
    assert "| method | working context | effective context |" in md and f"GRPO (W={W * (S + 1)})" in md
    for png in ("success_vs_step", "working_context", "summaries", "test_time_scaling",
                "summary_state_share"):
        assert os.path.getsize(os.path.join(out, png + ".png")) > 1000
    # a second run reuses the SFT checkpoint and every finished run
    r2 = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stdout.count("finished earlier") == 5 and "training the SFT" not in r2.stdout
    # a subset of the methods (the new-families table runs supo and grpo_w only)
    r3 = subprocess.run(cmd + ["--methods", "supo,grpo_w"], env=env, capture_output=True,
                        text=True, timeout=300)
    assert r3.returncode == 0, r3.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        assert [m["name"] for m in json.load(f)["methods"]] == ["supo", "grpo_w"]
    r4 = subprocess.run(cmd + ["--methods", "supo,sup"], env=env, capture_output=True, text=True)
    assert r4.returncode != 0 and "--methods: unknown sup" in r4.stderr


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


def test_readme_results_block_is_the_committed_results_md():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import update_readme
    finally:
        sys.path.pop(0)
    md = open(os.path.join(ROOT, update_readme.RESULTS, "results.md")).read()
    assert update_readme.current(README) == update_readme.block(md), \
        "README's Results block differs from results.md: run python experiments/update_readme.py"
    for png in re.findall(r"\]\((experiments/results/cpu_reproduce/[^)]+\.png)\)", README):
        assert os.path.getsize(os.path.join(ROOT, png)) > 1000


def _before_after(d, label):
    """'before -> after' of one method's row in experiments/results/<d>/results.md."""
    md = open(os.path.join(ROOT, "experiments", "results", d, "results.md")).read()
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| {label} |"))
    before, after = row.split(" | ")[3:5]
    return f"{before} -> {after}"


def _sweep_point(d, name):
    """One point of experiments/results/<d>/sweep.json (`supo-jax sweep`'s output)."""
    with open(os.path.join(ROOT, "experiments", "results", d, "sweep.json")) as f:
        return next(p for p in json.load(f) if p["name"] == name)


def _sweep_cell(d, name):
    """'before -> after' in % of one point of experiments/results/<d>/sweep.json."""
    point = _sweep_point(d, name)
    (b, be), (a, ae) = point["before_success"], point["success_rate"]
    return f"{100 * b:.1f} ± {100 * be:.1f} -> {100 * a:.1f} ± {100 * ae:.1f}"


def test_readme_new_families_tables_are_the_committed_results():
    """The families tables quote the committed outputs: README's rows the default of 2026-11-27
    (experiments/results/default_2026-11-27/{count,count_grpo,cards,cards_full}, redcount's in
    the environment example's test), with their 512-rollout re-scoring (reeval_2026-11-26);
    experiments/TUNING.md keeps the table at 3e-4 (cpu_count_sft600_ep2(_grpo),
    cards_families_sft600); the 300-step default's count figures and placebo under the table;
    TUNING's reproduction-recipe rows experiments/results/{cpu_reproduce,cpu_listing} and its
    count variants' figures."""
    section = README.split("### Task families nobody tuned for", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    new = "default_2026-11-27/"
    row = next(ln for ln in section.splitlines() if ln.startswith("| `fncall/count`"))
    supo, grpo = (_before_after(new + d, label) for d, label in (
        ("count", "SUPO (W=512, S=3)"), ("count_grpo", "GRPO (W=512)")))
    cells = row.split(" | ")
    sft = 100 * scores_of("count", new + "count/sft")
    after = _reeval_mean("count", new + r"count/runs/supo/seed(\d)/hf")
    assert cells[3] == f"{supo} [{sft:.1f} -> {after}]" and row.endswith(f"| {grpo} |"), (row, supo, grpo)
    rl = _reeval_seeds("count", new + r"count/runs/supo/seed(\d)/hf", "%")
    assert f"(62.9 -> {rl})" in flat and f"{sft:.1f}" == "62.9", rl
    # its placebo (rewards permuted), from the same SFT (sft.json: the same warm start)
    d = os.path.join(ROOT, "experiments", "results", "default_2026-11-27")
    warm = [json.load(open(os.path.join(d, x, "sft.json"))) for x in ("count", "count_placebo")]
    assert [{k: v for k, v in w.items() if k != "seconds"} for w in warm][0] == \
        {k: v for k, v in warm[1].items() if k != "seconds"}
    pattern = new + r"count_placebo/runs/supo/seed(\d)/hf"
    placebo = f"{_reeval_seeds('count', pattern, '%')} ({_reeval_mean('count', pattern)})"
    assert f"to {placebo} from the same SFT policy" in flat, placebo
    own = _before_after(new + "count_placebo", "SUPO (W=512, S=3)")
    assert f"(its own evals: {own}%, experiments/results/default_2026-11-27/count_placebo/" in flat, own
    gains = [a - b for a, b in zip(_reeval_scores("count", new + r"count/runs/supo/seed(\d)/hf"),
                                   _reeval_scores("count", pattern))]
    assert f"worth {min(gains):.0f}-{max(gains):.0f} points a seed" in flat, gains
    # at 3e-4 (the default until 2026-11-27): the paragraph and TUNING's copy of the table
    old = _reeval_seeds("count", r"count_sft600_ep2/runs/supo/seed(\d)/hf", "%")
    old_sft = 100 * scores_of("count", "count_sft600_ep2/sft")
    assert f"the runs ended at {old} from an SFT policy of {old_sft:.1f}%" in flat, old
    pattern = r"count_sft600_ep2_placebo/runs/supo/seed(\d)/hf"
    placebo = f"{_reeval_seeds('count', pattern, '%')} ({_reeval_mean('count', pattern)}"
    own = _before_after("cpu_count_sft600_ep2_placebo", "SUPO (W=512, S=3)")
    assert f"their placebo at {placebo}; own evals {own}%" in flat, (placebo, own)
    tuning = TUNING.split("## The learning rate becomes 1e-4", 1)[1]
    row = next(ln for ln in tuning.splitlines() if ln.startswith("| `fncall/count`"))
    supo, grpo = (_before_after(d, label) for d, label in (
        ("cpu_count_sft600_ep2", "SUPO (W=512, S=3)"), ("cpu_count_sft600_ep2_grpo", "GRPO (W=512)")))
    cells = row.split(" | ")
    after = _reeval_mean("count", r"count_sft600_ep2/runs/supo/seed(\d)/hf")
    assert cells[3] == f"{supo} [{old_sft:.1f} -> {after}]" and row.endswith(f"| {grpo} |"), row
    row = next(ln for ln in tuning.splitlines() if ln.startswith("| `cards`"))
    supo, full = (_sweep_cell("cards_families_sft600", f"manager={m}") for m in ("supo", "full"))
    rescored = " -> ".join(_reeval_mean("cards", f"cards_families/{p}") for p in (
        r"sft600/seed(\d)/sft", r"runs/cards_families/manager=supo/seed(\d)/hf"))
    cells = row.split(" | ")
    assert cells[3] == f"{supo} [{rescored}]" and row.endswith(f"| {full} |"), row
    row = next(ln for ln in tuning.splitlines() if ln.startswith("| `redcount`"))
    runs = r"runs/redcount_families/manager=supo/seed(\d)/"
    rescored = " -> ".join(_reeval_mean("redcount", runs + k) for k in ("sft", "hf"))
    assert row.split(" | ")[3] == f"{_sweep_cell('redcount_families', 'manager=supo')} [{rescored}]"
    # the 300-step default (until 2026-11-26) quoted under the table, and its placebo
    ep2 = _reeval_mean("count", r"count_ep2/runs/supo/seed(\d)/hf")
    own = _before_after("cpu_count_nw_ep2", "SUPO (W=512, S=3)")
    assert f"(34.8 -> {ep2}%, 5 seeds; own evals {own}%" in flat, (ep2, own)
    placebo = _reeval_mean("count", r"count_ep2_placebo/runs/supo/seed(\d)/hf")
    assert f"to {placebo}% on 512 rollouts" in flat, placebo
    assert f"its own evals: {_before_after('cpu_count_nw_ep2_placebo', 'SUPO (W=512, S=3)')}%" in flat
    row = next(ln for ln in section.splitlines() if ln.startswith("| `cards`"))
    supo = _sweep_cell(new + "cards", "lr=0.0001")
    full = _sweep_cell(new + "cards_full", "manager=full")
    cells = row.split(" | ")
    rescored = " -> ".join(_reeval_mean("cards", new + p) for p in (
        r"cards/seed(\d)/sft", r"cards/seed(\d)/hf"))
    assert cells[3] == f"{supo} [{rescored}]" and row.endswith(f"| {full} |"), (row, supo, rescored, full)
    flat = " ".join(TUNING.split())
    for d in ("cpu_count_nw_lr1e4", "cpu_count_nw_kl", "cpu_count_nw_g8", "cpu_count_nw_t1"):
        quote = f"{_before_after(d, 'SUPO (W=512, S=3)')}% (experiments/results/{d}/"
        assert quote in flat, quote
    reproduction = TUNING.split("The same two families under the reproduction's recipe", 1)[1]
    for family, d in (("count", "cpu_reproduce"), ("listing", "cpu_listing")):
        cells = [_before_after(d, label) for label in ("SUPO (W=512, S=3)", "GRPO (W=512)")]
        row = next(ln for ln in reproduction.splitlines() if ln.startswith(f"| {family} |"))
        assert "| {} | {} |".format(*cells) in row, (family, row, cells)


def _per_seed(d, name):
    """('0.328 / 0.344 / 0.125', '0.578 / 0.172 / 0.203'): one point's held-out success by seed,
    before and after, from experiments/results/<d>/sweep.json."""
    return tuple(" / ".join(f"{row[k]:.3f}" for row in _sweep_point(d, name)["per_seed"])
                 for k in (1, 2))


# redcount's re-scored policies at today's default (lr 1e-4: the sweep made as `--grid
# optim.lr=0.0001`, experiments/results/redcount_lr1e4/) and its placebo
RC_DEFAULT = r"runs/probe_lr/lr=0\.0001/seed(\d)/hf"
RC_PLACEBO = r"default_2026-11-27/redcount_placebo/seed(\d)/hf"


def test_readme_environment_example_figures_are_the_committed_results():
    """README's "Adding an environment" quotes the example's sweep (experiments/results/
    redcount_families/, seed 0 being its train command), its placebo (redcount_placebo/) and
    their 512-rollout scores (reeval_2026-11-26, family redcount); the families table its row;
    experiments/TUNING.md the earlier versions' (redcount_guess/, redcount_plain_thoughts/)."""
    scores = _reeval_results()["redcount"]
    flat = " ".join(README.split("## Adding an environment", 1)[1].split("\n## ", 1)[0].split())
    # the default (lr 1e-4 since 2026-11-27): the sweep redcount_lr1e4, seed 0 its train command
    before, after = _per_seed("redcount_lr1e4", "lr=0.0001")
    assert f"the evals went {before} -> {after}," in flat, (before, after)
    assert (f"starts at {before.split(' / ')[0]} held-out success and ends at "
            f"{after.split(' / ')[0]} after 30 SUPO steps") in flat
    runs = r"runs/redcount_families/manager=supo/seed(\d)/"   # the sweep's SFT and RL policies
    sft = _reeval_seeds("redcount", runs + "sft", "%")
    rl = _reeval_seeds("redcount", RC_DEFAULT, "%")
    assert f"a policy (`python experiments/reeval.py`) {sft} -> {rl}" in flat, (sft, rl)
    placebo = _reeval_seeds("redcount", RC_PLACEBO, "%")
    own = _per_seed("default_2026-11-27/redcount_placebo", "base")
    assert own[0] == before   # the same SFT policies
    assert f"end at {placebo} on 512 rollouts (own evals {own[1]})" in flat, (placebo, own)
    gains = [a - b for a, b in zip(_reeval_scores("redcount", RC_DEFAULT),
             _reeval_scores("redcount", RC_PLACEBO))]
    assert f"worth {min(gains):.0f}-{max(gains):.0f} points a seed over the updates alone" in flat
    # the learning rate of before (3e-4): the sweep redcount_families and its placebo
    old = _reeval_seeds("redcount", runs + "hf", "%")
    placebo = _reeval_seeds("redcount", r"runs/redcount_placebo/base/seed(\d)/hf", "%")
    own = _per_seed("redcount_placebo", "base")[1]
    assert f"went to {old} and their placebo to {placebo} (own evals {own}," in flat, (old, placebo, own)
    plain = [100 * scores[f"plain_thoughts/{k}"]["success_rate"] for k in ("sft", "hf")]
    assert "SFT policy solved {:.1f}% and RL took it to {:.1f}%".format(*plain) in flat, plain
    # the families table: own evals (mean ± se) [512-rollout mean ± se]
    section = README.split("### Task families nobody tuned for", 1)[1].split("\n## ", 1)[0]
    row = next(ln for ln in section.splitlines() if ln.startswith("| `redcount`"))
    rescored = " -> ".join(_reeval_mean("redcount", p) for p in (
        runs + "sft", RC_DEFAULT))
    cell = f"{_sweep_cell('redcount_lr1e4', 'lr=0.0001')} [{rescored}]"
    assert row.split(" | ")[3] == cell, (row, cell)
    gain = [b - a for a, b in zip(_reeval_scores("redcount", runs + "sft"),
                                  _reeval_scores("redcount", RC_DEFAULT))]
    assert (f"gains {gain[0]:.1f} points on seed 0 and {gain[2]:.1f} on seed 2 and loses "
            f"{-gain[1]:.1f} on seed 1") in " ".join(section.split()), gain
    # TUNING: the version that rewarded any right count (default, placebo, trust region)
    tuning = " ".join(TUNING.split("## The environment example", 1)[1].split())
    guess_sft = _reeval_seeds("redcount", r"guess/runs/redcount_families/manager=supo/seed(\d)/sft",
                              "%")
    for arm, pattern in (("default/", r"guess/runs/redcount_families/manager=supo/seed(\d)/hf"),
                         ("placebo/", r"guess/runs/redcount_placebo/base/seed(\d)/hf"),
                         ("max_kl/", r"guess/runs/redcount_kl/base/seed(\d)/hf")):
        quote = f"{_reeval_seeds('redcount', pattern, '%')} ({arm})"
        assert quote in tuning, quote
        assert _per_seed(f"redcount_guess/{arm[:-1]}", "manager=supo" if arm == "default/"
                         else "base")[0] == "0.328 / 0.344 / 0.125"   # the same SFT policies
    assert f"SFT {guess_sft} ->" in tuning, guess_sft
    # single changes from the same SFT policies: TUNING's item and README's tuning rows
    lr = _reeval_seeds("redcount", RC_DEFAULT, "%")
    assert f"gives {lr} (own evals {' -> '.join(_per_seed('redcount_lr1e4', 'lr=0.0001'))})" in tuning
    nw = _reeval_seeds("redcount", r"runs/probe_nw/negative_weight=1\.0/seed(\d)/hf", "%")
    assert f"seed 1: {nw} (own evals {' -> '.join(_per_seed('redcount_nw1', 'negative_weight=1.0'))})" in tuning
    rows = " ".join(README.split("## Tuning a new task", 1)[1].split("\n## ", 1)[0].split())
    assert f"{sft} -> {lr} against {old} (experiments/results/redcount_lr1e4/" in rows
    means = [_reeval_mean("redcount", p).split(" ± ")[0] for p in (
        runs + "hf", RC_DEFAULT, r"runs/redcount_placebo/base/seed(\d)/hf",
        RC_PLACEBO)]
    assert "redcount {} -> {}% over 3 seeds, its placebo {} -> {}%".format(*means) in rows, means
    # the same row: count, tallest and cards under the default of 2026-11-27 against 3e-4
    new = {f: _reeval_seeds(f, rf"default_2026-11-27/{f}/{p}", "%") for f, p in (
        ("count", r"runs/supo/seed(\d)/hf"), ("tallest", r"seed(\d)/hf"))}
    count_sft = 100 * scores_of("count", "default_2026-11-27/count/sft")
    old = _reeval_seeds("count", r"count_sft600_ep2/runs/supo/seed(\d)/hf", "%")
    old_sft = 100 * scores_of("count", "count_sft600_ep2/sft")
    assert f"count {count_sft:.1f}% -> {new['count']} against {old_sft:.1f}% -> {old}" in rows
    tallest = [_reeval_seeds("tallest", p, "%") for p in (
        r"default_2026-11-27/tallest/seed(\d)/sft", r"sft600/seed(\d)/sft",
        r"runs/tallest_sft600/base/seed(\d)/hf")]
    assert "tallest {} -> {} against {} -> {}".format(tallest[0], new["tallest"], *tallest[1:]) in rows
    cards = [_reeval_mean("cards", p).split(" ± ")[0] for p in (
        r"default_2026-11-27/cards/seed(\d)/sft", r"default_2026-11-27/cards/seed(\d)/hf",
        r"cards_families/sft600/seed(\d)/sft", r"cards_families/runs/cards_families/manager=supo/seed(\d)/hf")]
    assert "cards {} -> {}% against {} -> {}%".format(*cards) in rows, cards
    guess = [_reeval_seeds("redcount", rf"guess/runs/{d}/seed(\d)/{k}", "%") for d, k in (
        ("redcount_families/manager=supo", "sft"), ("redcount_kl/base", "hf"),
        ("redcount_families/manager=supo", "hf"))]
    assert "{} -> {} (without: {};".format(*guess) in rows, guess


def _training_success_mean(path):
    """The mean training success over a run's RL steps, from a committed metrics.jsonl."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    vals = [r["success_rate"] for r in rows if "step" in r and r.get("success_rate") is not None]
    assert len(vals) == 30, (path, len(vals))
    return sum(vals) / len(vals)


def test_redcount_control_table_is_the_committed_metrics():
    """experiments/results/redcount_control/README.md's table (each arm's mean training
    success by seed) is computed from the metrics files beside it; the no-update run is the
    sweep's run with a learning rate of 0 from the same SFT policy (the same step-1 rollouts)."""
    d = os.path.join(ROOT, "experiments", "results", "redcount_control")
    md = open(os.path.join(d, "README.md")).read()
    tuning = " ".join(TUNING.split("## The environment example", 1)[1].split())
    for arm, label in (("no_update", "no update (`optim.lr=0`)"),
                       ("default", "lr 3e-4 (the default until 2026-11-27)"),
                       ("lr1e4", "`optim.lr=0.0001` (the default since 2026-11-27)"),
                       ("placebo", "placebo (lr 3e-4, rewards permuted)")):
        means = [_training_success_mean(os.path.join(d, f"{arm}_seed{s}.jsonl")) for s in range(3)]
        row = f"| {label} | " + " | ".join(f"{m:.3f}" for m in means) + " |"
        assert row in md, row
        tuning_label = {"no_update": "no update", "default": "3e-4 (the default then)",
                        "lr1e4": "`optim.lr=0.0001`", "placebo": "the placebo"}[arm]
        assert f"{tuning_label} {' / '.join(f'{m:.3f}' for m in means)}" in tuning, arm
    readme = " ".join(README.split("## Adding an environment", 1)[1].split("\n## ", 1)[0].split())
    seed1 = [_training_success_mean(os.path.join(d, f"{arm}_seed1.jsonl"))
             for arm in ("default", "no_update")]
    assert ("over the 30 steps its training rollouts solve {:.3f} where the SFT policy, not "
            "updated, solves {:.3f}".format(*seed1)) in readme, seed1
    for s in range(3):
        first = [next(json.loads(line) for line in open(os.path.join(d, f"{arm}_seed{s}.jsonl"))
                      if '"step": 1,' in line) for arm in ("no_update", "default")]
        assert first[0]["success_rate"] == first[1]["success_rate"]   # the same SFT policy
        assert first[0]["approx_kl"] < 1e-9 < first[1]["approx_kl"]     # lr 0: it did not move


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


@functools.lru_cache(maxsize=1)
def _reeval_results():
    """experiments/results/reeval_2026-11-26/results.json: experiments/reeval.py's scores."""
    with open(os.path.join(ROOT, "experiments", "results", "reeval_2026-11-26",
                           "results.json")) as f:
        return json.load(f)


def scores_of(family, key):
    """One re-scored policy's success rate (0-1) in experiments/results/reeval_2026-11-26."""
    return _reeval_results()[family][key]["success_rate"]


def _reeval_scores(family, pattern):
    """Success in % by seed of the re-scored policies whose path matches pattern (its group:
    the seed)."""
    got = {int(m[1]): v["success_rate"] for k, v in _reeval_results()[family].items()
           if (m := re.fullmatch(pattern, k))}
    return [100 * got[s] for s in sorted(got)]


def _reeval_mean(family, pattern):
    import numpy as np

    xs = _reeval_scores(family, pattern)
    return f"{np.mean(xs):.1f} ± {np.std(xs, ddof=1) / np.sqrt(len(xs)):.1f}"


def _reeval_seeds(family, pattern, unit=""):
    """The re-scored policies' success by seed as the docs quote it: '92.6 / 92.6 / 92.8'."""
    return " / ".join(f"{x:.1f}" for x in _reeval_scores(family, pattern)) + unit


def test_tuning_reeval_table_is_the_committed_scores():
    """experiments/TUNING.md's 512-rollout table quotes experiments/results/reeval_2026-11-26/
    results.json (experiments/reeval.py's output): each cell's seeds, mean and standard error."""
    scores = _reeval_results()

    def cell(family, pattern, unit=""):
        return f"{_reeval_seeds(family, pattern, unit)} ({_reeval_mean(family, pattern)})"

    table = TUNING.split("### The same policies on 512 rollouts each", 1)[1].split("\n### ", 1)[0]
    rows = {ln.split(" | ")[0]: ln for ln in table.splitlines() if ln.startswith("| ")}
    count = rows["| count (256 x 2)"]
    assert f"{100 * scores['count']['count_default/sft']['success_rate']:.1f}" in count
    sft600, sft300 = (100 * scores["count"][f"count_sft{n}/sft"]["success_rate"] for n in (600, 300))
    assert f"(`sft.steps=600`): {sft600:.1f} (rebuilt at 300 steps: {sft300:.1f}," in count
    rl600 = cell("count", r"count_sft600_ep2/runs/supo/seed(\d)/hf")
    assert f"default after it: {rl600} |" in count, rl600
    for arm in ("default", "ep2", "ep4", "b16g8", "g8", "b16"):
        assert cell("count", rf"count_{arm}/runs/supo/seed(\d)/hf") in count, (arm, count)
    for family, label in (("cards", "| cards (128 x 4)"), ("tallest", "| `fncall/tallest` (128 x 4)")):
        for pattern in (r"sft/seed(\d)/sft", r"runs/\w+_ep/ppo_epochs=1/seed(\d)/hf",
                        r"runs/\w+_ep/ppo_epochs=2/seed(\d)/hf"):
            assert cell(family, pattern) in rows[label], (family, pattern, rows[label])
        sft600 = cell(family, r"sft600/seed(\d)/sft")
        assert f"(`sft.steps=600`): {sft600};" in rows[label], (family, sft600)
    rl = cell("tallest", r"runs/tallest_sft600/base/seed(\d)/hf")
    assert f"30 SUPO steps of the default after them: {rl} |" in rows["| `fncall/tallest` (128 x 4)"]
    sft, rl = (cell("cards", f"cards_families/{p}") for p in (
        r"sft600/seed(\d)/sft", r"runs/cards_families/manager=supo/seed(\d)/hf"))
    assert (f"its SFT policies {sft} and 30 SUPO steps of the default after them {rl},"
            in rows["| cards (128 x 4)"]), (sft, rl)
    # README's `sft.num_demos=192` row at 600 SFT steps: seed 0's SFT policies, 64 -> 192 demos
    pairs = [(f, 100 * scores[f][a]["success_rate"], 100 * scores[f][b]["success_rate"])
             for f, a, b in (
        ("cards", "cards_families/sft600/seed0/sft", "cards_families/sft600_192/seed0/sft"),
        ("tallest", "quickstart_sft600/sft600/sft", "quickstart_sft600/sft600_192/sft"),
        ("count", "count_sft600_ep2_placebo/sft", "count_sft600_192/sft"))]
    quoted = " ".join(README.split())
    assert "seed 0: " + ", ".join(f"{f} {x:.1f} -> {y:.1f}%" for f, x, y in pairs) in quoted, pairs
    rl = cell("count", r"count_sft600_192_ep2/runs/supo/seed(\d)/hf", "%")
    assert f"the default's 24 SUPO steps after that count SFT: {rl[:-1]}, every seed" in quoted, rl
    for family, sweep in (("tallest", "tallest_192"), ("cards", "cards_192")):
        before, after = (_reeval_seeds(family, rf"runs/{sweep}/base/seed(\d)/{k}", "%")
                         for k in ("sft", "hf"))
        assert f"{family} {before} -> {after}" in quoted, (family, before, after)
    same = (scores["count"][k]["success_rate"] for k in ("count_sft600_192_ep2/sft", "count_sft600_192/sft"))
    assert len(set(same)) == 1   # the run's SFT is the one rebuilt by `supo-jax sft`
    seed2 = _reeval_scores("cards", r"sft192demos/seed(\d)/sft")[0]
    assert f"(`sft.num_demos=192`): {seed2:.1f} |" in rows["| cards (128 x 4)"]


def test_readme_quickstart_placebo_figures_are_the_committed_runs():
    """The Quickstart's seed-0 figures are experiments/results/default_2026-11-27/quickstart/:
    its held-out evals (the README's run and its placebo) and the 512-rollout scores of the SFT
    policy, the run and the placebo; the 3-seed sweep beside it; the learning rate of before
    (3e-4) is quickstart_sft600/."""
    quick = " ".join(README.split("## Quickstart", 1)[1].split("\n## ", 1)[0].split())

    def evals(d, name):
        with open(os.path.join(ROOT, "experiments", "results", d, f"{name}_metrics.jsonl")) as f:
            rows = [json.loads(x) for x in f if x.strip()]
        return [f"{r['eval/success_rate']:.3f}" for r in rows if "eval/success_rate" in r][:4]

    def scores(d):
        with open(os.path.join(ROOT, "experiments", "results", d, "reeval.json")) as f:
            return {k.split("|")[0]: 100 * v["success_rate"] for k, v in json.load(f).items()}

    d = "default_2026-11-27/quickstart"
    real, placebo = evals(d, "default"), evals(d, "placebo")
    assert "held-out success (16 tasks x 4 samples at temperature 0.7) " + " -> ".join(real) in quick
    assert f"goes {placebo[0]} -> " + " / ".join(placebo[1:]) in quick, placebo
    new = scores(d)
    assert (f"from the SFT policy's {new['runs/default/sft']:.1f}% to {new['runs/placebo/hf']:.1f}% "
            f"where the real run reaches {new['runs/default/hf']:.1f}%") in quick, new
    before, after = _per_seed("default_2026-11-27/tallest", "lr=0.0001")
    assert f"held-out success went {before} -> {after};" in quick, (before, after)
    sft, rl = (_reeval_seeds("tallest", rf"default_2026-11-27/tallest/seed(\d)/{k}", "%")
               for k in ("sft", "hf"))
    assert f"under \"Tuning a new task\"), {sft} -> {rl}." in quick, (sft, rl)
    assert f"{new['runs/default/hf']:.1f}%" == rl.split(" / ")[0] + "%"   # the same run as seed 0
    old = scores("quickstart_sft600")
    assert (f"seed 0 reached {old['runs/default/hf']:.1f}% and its placebo "
            f"{old['runs/placebo/hf']:.1f}%") in quick, old
    sft, rl = (_reeval_seeds("tallest", p, "%") for p in (
        r"sft600/seed(\d)/sft", r"runs/tallest_sft600/base/seed(\d)/hf"))
    assert f"over seeds {sft} -> {rl} on another machine" in quick, (sft, rl)
    tips = " ".join(README.split("## Tuning a new task", 1)[1].split("\n## ", 1)[0].split())
    gaps = [f"{round(s['runs/default/hf'], 1) - round(s['runs/placebo/hf'], 1):.1f}"
            for s in (old, new)]   # of the figures as quoted
    assert "600-step one {} points less at 3e-4 and {} less at today's 1e-4".format(*gaps) in tips, gaps


def test_tuning_learning_rate_table_is_the_committed_scores():
    """experiments/TUNING.md's "The learning rate becomes 1e-4" table: each cell the re-scored
    policies (reeval_2026-11-26, by seed and their mean) of the runs it names."""
    tuning = TUNING.split("## The learning rate becomes 1e-4", 1)[1]
    rows = {ln.split(" | ")[0][2:]: ln for ln in tuning.splitlines() if ln.startswith("| ")}

    def cell(family, pattern):
        seeds = _reeval_scores(family, pattern)
        return " / ".join(f"{x:.1f}" for x in seeds) + f" ({sum(seeds) / len(seeds):.1f})"

    new = "default_2026-11-27/"
    assert rows["redcount"].startswith("| redcount | {} | {} | {} |".format(
        cell("redcount", r"runs/redcount_families/manager=supo/seed(\d)/sft"),
        cell("redcount", RC_DEFAULT),
        cell("redcount", r"runs/redcount_families/manager=supo/seed(\d)/hf"))), rows["redcount"]
    count_sft = 100 * scores_of("count", new + "count/sft")
    old_sft = 100 * scores_of("count", "count_sft600_ep2/sft")
    assert rows["count (256 tasks x 2)"].startswith("| count (256 tasks x 2) | {:.1f} | {} | {}, from an SFT policy of {:.1f}".format(
        count_sft, cell("count", new + r"count/runs/supo/seed(\d)/hf"),
        cell("count", r"count_sft600_ep2/runs/supo/seed(\d)/hf"), old_sft)), rows["count (256 tasks x 2)"]
    assert rows["tallest"].startswith("| tallest | {} | {} | {}, from {} on another machine".format(
        cell("tallest", new + r"tallest/seed(\d)/sft"), cell("tallest", new + r"tallest/seed(\d)/hf"),
        cell("tallest", r"runs/tallest_sft600/base/seed(\d)/hf"),
        _reeval_seeds("tallest", r"sft600/seed(\d)/sft", ""))), rows["tallest"]
    assert rows["cards"] == "| cards | {} | {} | {} |".format(
        cell("cards", new + r"cards/seed(\d)/sft"), cell("cards", new + r"cards/seed(\d)/hf"),
        cell("cards", r"cards_families/runs/cards_families/manager=supo/seed(\d)/hf")), rows["cards"]
