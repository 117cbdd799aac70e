"""Sweeps: grid parsing, planning (typos fail before any run), running with resume, host
shares, and the collected table and plot."""
import json
import os

import pytest

from supo_jax import storage, sweep
from supo_jax.cli import main
from supo_jax.config import ConfigError

TINY = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "tiny_test.py")


def test_split_values_keeps_brackets_and_quotes():
    assert sweep.split_values('supo,full') == ["supo", "full"]
    assert sweep.split_values('[3, 6],{"a": 1, "b": 2},"x,y"') == ['[3, 6]', '{"a": 1, "b": 2}', '"x,y"']
    with pytest.raises(ConfigError):
        sweep.split_values("a,,b")


def test_points_is_the_product_in_order():
    grid = sweep.parse_grid(["context.manager=supo,full", "optim.lr=1e-3,1e-4"])
    pts = sweep.points(grid)
    assert len(pts) == 4
    assert pts[0] == {"context.manager": "supo", "optim.lr": "1e-3"}
    assert pts[3] == {"context.manager": "full", "optim.lr": "1e-4"}
    assert sweep.point_name(pts[1]) == "manager=supo,lr=1e-4"
    with pytest.raises(ConfigError, match="twice"):
        sweep.parse_grid(["a.b=1", "a.b=2"])


def test_plan_validates_every_config_before_running(tmp_path):
    with pytest.raises(ConfigError, match="context.manger"):
        sweep.plan(TINY, [{"context.manger": "full"}], [0], str(tmp_path))
    with pytest.raises(ConfigError, match="optim.lr"):
        sweep.plan(TINY, [{"optim.lr": "fast"}], [0], str(tmp_path))
    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(["context.manager=supo,full"])), [0, 1],
                      str(tmp_path))
    assert [(r.name, r.seed) for r in runs] == [("manager=supo", 0), ("manager=supo", 1),
                                                 ("manager=full", 0), ("manager=full", 1)]
    assert runs[2].cfg.context.manager == "full" and runs[3].cfg.train.seed == 1
    assert runs[3].cfg.train.run_dir == os.path.join(str(tmp_path), "manager=full", "seed1")


def test_plan_sweeps_lora_rank(tmp_path):
    """A sweep over the adapters' rank: one run a rank, a bad rank fails before any run."""
    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(["model.lora_rank=8,16"])), [0],
                      str(tmp_path))
    assert [r.cfg.model.lora_rank for r in runs] == [8, 16]
    assert runs[0].cfg.train.run_dir != runs[1].cfg.train.run_dir
    with pytest.raises(ConfigError, match="lora_rank must be >= 0"):
        sweep.plan(TINY, [{"model.lora_rank": "-4"}], [0], str(tmp_path))


def _fake_train(calls):
    """A stand-in trainer: success = seed/10 (+0.5 for 'full'), three logged steps."""
    def train(cfg):
        calls.append(cfg.train.run_dir)
        storage.makedirs(cfg.train.run_dir)
        base = cfg.train.seed / 10 + (0.5 if cfg.context.manager == "full" else 0.0)
        hist = [{"step": s, "loss": 0.1, "success_rate": base * s / 3} for s in (1, 2, 3)]
        storage.write_text(storage.join(cfg.train.run_dir, "metrics.jsonl"),
                           "".join(json.dumps(h) + "\n" for h in hist))
        return {"history": hist, "eval": {"success_rate": base, "tool_calls_mean": 2.0},
                "eval_before": {"success_rate": 0.0}}
    return train


@pytest.fixture(scope="module")
def bucket():
    """A GCS API server on a loopback port (tests/gcs.py), used by STORAGE_EMULATOR_HOST."""
    from tests import gcs

    server, host = gcs.start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = host
    yield f"gs://{gcs.BUCKET}"
    server.stop()
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_run_collect_report_resume_and_host_shares(tmp_path, where, request):
    """The same sweep with its --out on a local disk and in a bucket (gs://)."""
    out = str(tmp_path) if where == "local" else request.getfixturevalue("bucket") + "/sweep"
    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(["context.manager=supo,full"])), [0, 2], out)
    calls = []
    # two hosts: each runs every other run
    sweep.run_sweep(runs, host_index=1, host_count=2, train_fn=_fake_train(calls), log=lambda *_: 0)
    assert calls == [runs[1].run_dir, runs[3].run_dir]
    rows = sweep.collect(runs)
    assert rows[0]["seeds"] == [2] and rows[0]["missing_seeds"] == [0]
    md = sweep.table_markdown(rows)   # one seed each: the figure alone, no spread
    assert "| 0.200 |" in md and "| 0.700 |" in md and "±" not in md
    sweep.run_sweep(runs, train_fn=_fake_train(calls), log=lambda *_: 0)
    assert calls[2:] == [runs[0].run_dir, runs[2].run_dir]   # finished runs are not rerun
    rep = sweep.report(runs, out)
    supo, full = rep["rows"]
    assert supo["success_rate"] == pytest.approx((0.1, 0.1))   # seeds 0, 2 -> 0.0, 0.2
    assert full["success_rate"] == pytest.approx((0.6, 0.1))
    assert "0.600 ± 0.100" in rep["markdown"]
    # the starting policy's success and each seed's before -> after
    assert supo["before_success"] == pytest.approx((0.0, 0.0))
    assert full["per_seed"] == [(0, 0.0, pytest.approx(0.5)), (2, 0.0, pytest.approx(0.7))]
    assert "| 0.000 / 0.000 -> 0.500 / 0.700 |" in rep["markdown"]
    with storage.open(rep["plot"], "rb") as f:
        assert len(f.read()) > 1000
    assert "0.600 ± 0.100" in storage.read_text(storage.join(out, "sweep.md"))
    steps, mean, std = sweep.curves([r.run_dir for r in runs if r.name == "manager=full"],
                                    "success_rate")
    assert list(steps) == [1, 2, 3] and mean[-1] == pytest.approx(0.6)


def test_sweep_cli_names_a_bad_grid_key(tmp_path, capsys):
    rc = main(["sweep", "--config", TINY, "--grid", "context.manger=supo,full",
               "--out", str(tmp_path)])
    assert rc == 2
    assert "context.manger" in capsys.readouterr().err


def test_mean_se_is_the_standard_error_over_seeds():
    m, se = sweep.mean_se([0.2, 0.4, 0.9])
    assert m == pytest.approx(0.5)
    # sample std sqrt(((-.3)^2 + (-.1)^2 + .4^2) / 2) = sqrt(0.13), over sqrt(3)
    assert se == pytest.approx((0.13 ** 0.5) / 3 ** 0.5)
    assert sweep.mean_se([0.7]) == (pytest.approx(0.7), 0.0)


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused_or_run_again_never_reused(tmp_path):
    """A finished run is reused only under the settings that made it: other eval / steps
    settings run it again (it resumes), other training settings are an error at start."""
    from supo_jax import config as C

    def train(cfg):
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w") as f:
            json.dump(C.to_dict(cfg), f, default=str)
        return _fake_train(calls)(cfg)

    out, calls, pts = str(tmp_path), [], [{"context.manager": "supo"}]
    runs = sweep.plan(TINY, pts, [0, 1], out)
    sweep.run_sweep(runs, train_fn=train, log=lambda *_: 0)
    assert len(calls) == 2
    sweep.run_sweep(sweep.plan(TINY, pts, [0, 1], out), train_fn=train, log=lambda *_: 0)
    assert len(calls) == 2                                       # the same settings: reused
    with pytest.raises(ConfigError, match=r"(?s)2 of the sweep's runs exist with other settings:\n"
                                          r"  .*seed0: optim.lr: 0.001 -> 0.01\n.*"
                                          r"train.accept_config_change=true"):
        sweep.plan(TINY, pts, [0, 1], out, overrides=["optim.lr=1e-2"])
    said = []
    sweep.run_sweep(sweep.plan(TINY, pts, [0, 1], out, overrides=["train.steps=9"]),
                    train_fn=train, log=said.append)
    assert len(calls) == 4 and "finished with other settings (train.steps: 3 -> 9)" in said[0]
    sweep.run_sweep(sweep.plan(TINY, pts, [0, 1], out, overrides=[
        "optim.lr=1e-2", "train.accept_config_change=true"]), train_fn=train, log=lambda *_: 0)
    assert len(calls) == 6
    with open(os.path.join(runs[0].run_dir, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match=r"seed0/config.json is not a readable run config"):
        sweep.plan(TINY, pts, [0, 1], out)


def test_collect_only_before_any_run_says_so(tmp_path, capsys):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # matplotlib's "No artists with labels" was one
        assert main(["sweep", "--config", TINY, "--grid", "context.manager=supo,full",
                     "--seeds", "0", "--out", str(tmp_path), "--collect-only"]) == 0
    out = capsys.readouterr().out
    assert f"no run of this sweep has finished yet in {tmp_path}" in out
    assert os.path.getsize(tmp_path / "success_vs_step.png") > 1000


def test_grid_points_share_each_seeds_warm_start_unless_the_grid_varies_it(tmp_path):
    out = str(tmp_path)
    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(["context.manager=supo,full"])),
                      [0, 1], out)
    for r in runs:
        assert r.cfg.train.init_from == os.path.join(out, "warm_start", f"seed{r.seed}", "sft")
        assert not r.cfg.train.sft_warm_start
        assert r.warm.context.manager == "supo" and r.warm.train.seed == r.seed   # the base
    own = sweep.plan(TINY, [{"sft.steps": "1"}, {"sft.steps": "2"}], [0], out)
    assert all(r.warm is None and r.cfg.train.sft_warm_start and not r.cfg.train.init_from
               for r in own)


def test_a_failing_run_is_a_row_with_its_reason_and_the_sweep_goes_on(tmp_path):
    """The sweep's own example: `full` runs that cannot train (here: fail) are rows of the
    table with the reason; the warm start is made once a seed; a rerun tries them again."""
    out, calls, warmed = str(tmp_path), [], []

    def train(cfg):
        if cfg.context.manager == "full":
            raise ValueError("the scripted expert solved none of\n 64 tasks | here")
        return _fake_train(calls)(cfg)

    def warm(cfg, d):
        if d not in warmed:
            warmed.append(d)

    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(["context.manager=supo,full"])),
                      [0, 1], out)
    said = []
    sweep.run_sweep(runs, train_fn=train, warm_fn=warm, log=said.append)
    assert warmed == [sweep.warm_start_dir(out, 0), sweep.warm_start_dir(out, 1)]
    assert len(calls) == 2 and sum("failed: ValueError" in s for s in said) == 2
    rep = sweep.report(runs, out)
    supo, full = rep["rows"]
    assert supo["seeds"] == [0, 1] and full["seeds"] == [] and len(full["failed"]) == 2
    line = next(ln for ln in rep["markdown"].splitlines() if ln.startswith("| manager=full"))
    assert "seed 0: ValueError: the scripted expert solved none of 64 tasks / here" in line
    assert "shared by every grid point" in open(os.path.join(out, "sweep.md")).read()
    sweep.run_sweep(runs, train_fn=_fake_train(calls), warm_fn=warm, log=lambda *_: 0)
    assert len(calls) == 4                          # the failed ones, again; now they finish
    assert all(r["failed"] == [] and len(r["seeds"]) == 2 for r in sweep.collect(runs))


def test_state_and_fold_points_warm_start_on_their_own_demonstrations(tmp_path):
    """A grid over context.manager: supo and full share the seed's warm start; state and fold
    (their replies need a <state> block / the branch tools, which the base's demonstrations
    never show) each make their own, unless the base settings are already theirs."""
    out = str(tmp_path)
    runs = sweep.plan(TINY, sweep.points(sweep.parse_grid(
        ["context.manager=supo,full,state,fold"])), [0], out)
    by = {r.point["context.manager"]: r for r in runs}
    for m in ("supo", "full"):
        assert by[m].warm is not None and by[m].cfg.train.init_from and \
            not by[m].cfg.train.sft_warm_start
    for m in ("state", "fold"):
        assert by[m].warm is None and by[m].cfg.train.sft_warm_start
        assert not by[m].cfg.train.init_from
    same = sweep.plan(TINY, sweep.points(sweep.parse_grid(["optim.lr=1e-3,1e-4"])), [0], out,
                      overrides=["context.manager=state"])
    assert all(r.warm is not None and r.warm.context.manager == "state" for r in same)


@pytest.mark.slow
def test_the_sweep_help_example_compares_managers_from_one_warm_start(tmp_path, capsys):
    """`supo-jax sweep --grid context.manager=supo,full --seeds 0` (sweep --help's example, at
    a few steps): the CPU recipe's task needs summaries, so `full` cannot demonstrate it; both
    points start from the seed's warm start made under the recipe (SUPO) and finish."""
    small = ["model.tiny_hidden=32", "model.tiny_layers=1", "model.tiny_heads=2",
             "model.tiny_kv_heads=1", "model.tiny_mlp=64", "env.eval_tasks=2",
             "sft.num_demos=8", "sft.steps=2", "train.steps=1", "rollout.tasks_per_step=2",
             "train.progress=false", "train.eval_before=false"]
    argv = ["sweep", "--grid", "context.manager=supo,full", "--seeds", "0", "--out", str(tmp_path)]
    for s in small:
        argv += ["--set", s]
    assert main(argv) == 0
    rows = json.load(open(tmp_path / "sweep.json"))["rows"]
    assert [(r["name"], r["seeds"], r["failed"]) for r in rows] == [
        ("manager=supo", [0], []), ("manager=full", [0], [])]
    assert os.path.isdir(tmp_path / "warm_start" / "seed0" / "sft")
    assert not os.path.isdir(tmp_path / "manager=full" / "seed0" / "sft")   # no SFT of its own
