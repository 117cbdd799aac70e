"""The supo-jax command line: real commands on a tiny model, one-line errors on bad input."""
import os
import subprocess
import sys

import numpy as np
import pytest

import supo_jax
from supo_jax.cli import main
from supo_jax.model.tiny import tiny_tokenizer
from tests.helpers import make_hf_model

pytestmark = pytest.mark.xdist_group("test_cli")   # module fixtures: built on one worker


@pytest.mark.slow
def test_generate_and_export(tmp_path):
    src = tmp_path / "m"
    make_hf_model("qwen2_bias_gqa", str(src))
    tiny_tokenizer(str(src))
    assert main(["generate", "--model", str(src), "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out")]) == 0
    a, b = supo_jax.load_policy(str(src)), supo_jax.load_policy(str(tmp_path / "out"))
    assert b.tokenizer is not None
    ids = np.arange(10)[None]
    np.testing.assert_allclose(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)), atol=1e-6)


def test_missing_model_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "export", "--model",
                        str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and lines[0].startswith("supo-jax export: error:")


# ---- bad input: every command fails fast with one line naming the problem (exit code 2) ----

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "configs", "tiny_test.py")
COMMANDS = ("train", "eval", "sft", "rollout", "generate", "export")
CONFIGURED = ("train", "eval", "sft", "rollout")   # the commands that read a config


def _argv(cmd, tmp_path, model=None, sets=(), env="fncall/pages"):
    if cmd in ("generate", "export"):
        argv = [cmd, "--model", model]
        return argv + ["--out", str(tmp_path / "out")] if cmd == "export" else argv
    if cmd == "rollout":
        argv = ["rollout", "--env", env, "--config", CONFIG, "--num", "1",
                "--out", str(tmp_path / "r.jsonl")] + (["--policy", model] if model else [])
    else:
        argv = [cmd, "--config", CONFIG, "--set", f"train.run_dir={tmp_path / 'run'}"]
        argv += ["--set", f"model.path={model}"] if model else []
        argv += ["--set", f"env.name={env}"] if env != "fncall/pages" else []
    for s in sets:
        argv += ["--set", s]
    return argv


def _one_line_error(capsys, argv, *needles):
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"supo-jax {argv[0]}: error: "), lines
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_missing_or_unreadable_model_path(cmd, tmp_path, capsys):
    missing = str(tmp_path / "no_such_model")
    _one_line_error(capsys, _argv(cmd, tmp_path, missing), missing)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file")
    _one_line_error(capsys, _argv(cmd, tmp_path, str(garbage)), str(garbage), "GGUF")
    run = tmp_path / "a_run"   # a run directory where a model belongs: say which of it to pass
    (run / "sft").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    _one_line_error(capsys, _argv(cmd, tmp_path, str(run)), "is a supo_jax run directory, not a "
                    "model: pass its hf/", f"it has {run / 'sft'}/")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text('{"model_type": "llama"}')
    _one_line_error(capsys, _argv(cmd, tmp_path, str(partial)), "config.json", "num_attention_heads")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["train", "sft"])
@pytest.mark.parametrize("name", ["paper_fncall_supo.py", "paper_search_supo.py", "bfcl_supo.py"])
def test_a_pretrained_models_config_without_a_model_refuses(cmd, name, tmp_path, capsys):
    """A config of a pretrained model (the paper's) without model.path does not train the
    2-layer random policy in its place: one line naming model.path; model.path=tiny asks
    for the tiny policy by name."""
    from supo_jax.config import load_config

    config = os.path.join(os.path.dirname(CONFIG), name)
    argv = [cmd, "--config", config, "--set", f"train.run_dir={tmp_path / 'run'}"]
    _one_line_error(capsys, argv, "model.path", "model.path=tiny")
    tiny = load_config(config, ["model.path=tiny"]).model
    assert tiny.path == "" and not tiny.pretrained


@pytest.mark.parametrize("cmd", CONFIGURED)
def test_unknown_environment_and_config_key(cmd, tmp_path, capsys):
    _one_line_error(capsys, _argv(cmd, tmp_path, env="fncall/nope"), "env.name", "fncall/nope")
    _one_line_error(capsys, _argv(cmd, tmp_path, sets=["context.workin_context=100"]),
                    "context.workin_context")


@pytest.mark.parametrize("cmd", CONFIGURED)
def test_working_context_smaller_than_the_prompt(cmd, tmp_path, capsys, trained_run):
    sets = ["context.working_context=60"]
    if cmd == "eval":       # eval needs something to evaluate first
        sets.append(f"train.run_dir={trained_run}")
    _one_line_error(capsys, _argv(cmd, tmp_path, sets=sets),
                    "initial prompt", "context.working_context")
    assert not os.path.isdir(tmp_path / "run" / "checkpoints")   # refused before any work


@pytest.mark.parametrize("argv", [
    ["rollout", "--env", "fncall/count", "--num", "-3"],
    ["rollout", "--env", "fncall/count", "--num", "0"],
    ["eval", "--max-summaries", "a,b"],
    ["eval", "--max-summaries", "0,-2"],
    ["sweep", "--seeds", "a"],
    ["sweep", "--host-count", "0"],
    ["generate", "--model", "m", "--max-new-tokens", "0"],
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(argv, capsys):
    """Refused as the flags are parsed: before any config, policy or compile."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"supo-jax {argv[0]}: error: argument {argv[-2]}: expected a "), lines


@pytest.mark.parametrize("cmd", ("train", "eval", "sft"))
def test_a_run_dir_that_is_a_file_is_one_line(cmd, tmp_path, capsys):
    (tmp_path / "run").write_text("")
    _one_line_error(capsys, _argv(cmd, tmp_path), f"train.run_dir='{tmp_path / 'run'}' is a file")


def test_sweep_refuses_an_out_file_and_bad_hosts_before_its_configs(tmp_path, capsys,
                                                                    monkeypatch):
    (tmp_path / "out").write_text("")
    _one_line_error(capsys, ["sweep", "--out", str(tmp_path / "out")], "--out", "is a file")
    _one_line_error(capsys, ["sweep", "--host-index", "1"], "--host-index 1 is not in [0, ")
    monkeypatch.setenv("SUPO_JAX_SWEEP_HOSTS", "two")
    _one_line_error(capsys, ["sweep"], "SUPO_JAX_SWEEP_HOSTS='two'")


def test_eval_without_a_checkpoint_or_model_is_an_error(tmp_path, capsys):
    _one_line_error(capsys, _argv("eval", tmp_path), "no checkpoint", "nothing to evaluate")
    assert not os.path.exists(tmp_path / "run")      # and writes nothing


def test_resume_with_other_settings_is_refused_then_accepted(tmp_path, trained_run):
    """A run directory with checkpoints resumes only with its saved settings (steps, eval and
    logging may change); train.accept_config_change continues and keeps the old config."""
    import json
    import shutil

    from supo_jax.config import ConfigError, load_config, to_dict
    from supo_jax.rl.runs import check_resume_config

    run = str(tmp_path / "run")
    shutil.copytree(trained_run, run)
    cfg = load_config(CONFIG, [f"train.run_dir={run}"])
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, default=str)
    check_resume_config(run, load_config(CONFIG, [f"train.run_dir={run}", "train.steps=99",
                                                  "train.eval_every=3"]), [0])
    changed = load_config(CONFIG, [f"train.run_dir={run}", "optim.lr=0.5", "rollout.group_size=3"])
    with pytest.raises(ConfigError, match=r"(?s)optim\.lr: .* -> 0\.5.*rollout\.group_size.*"
                       "accept_config_change"):
        check_resume_config(run, changed, [0])
    check_resume_config(run, load_config(CONFIG, [f"train.run_dir={run}", "optim.lr=0.5",
                                                  "train.accept_config_change=true"]), [0])
    assert os.path.exists(os.path.join(run, "config.step0.json"))
    check_resume_config(run, changed, [])          # no checkpoint yet: nothing to protect


def test_eval_uses_the_runs_saved_settings(tmp_path, trained_run, monkeypatch, capsys):
    """`eval` on a run directory evaluates under the settings its checkpoints were trained with
    (its config.json, e.g. a user environment), with the command's --set on top; a --config
    whose settings differ from the saved ones is a one-line error naming them."""
    import json
    import shutil

    from supo_jax.config import load_config, to_dict
    from supo_jax.rl import trainer

    run = str(tmp_path / "run")
    shutil.copytree(trained_run, run)
    saved = load_config(CONFIG, [f"train.run_dir=elsewhere", "env.name=fncall/count",
                                 "env.knobs.size=3", "context.max_summaries=2",
                                 "context.max_action_tokens=96"])
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(to_dict(saved), f, default=str)
    seen = []

    def evaluate(policy, fmt, cfg, max_summaries=None, **kw):
        seen.append(cfg)
        return {"max_summaries": cfg.context.max_summaries, "success_rate": 0.0,
                "summaries_mean": 0.0, "tool_calls_mean": 0.0, "working_context_mean": 0.0,
                "effective_context_mean": 0.0, "overlong_rate": 0.0}

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    assert main(["eval", "--set", f"train.run_dir={run}", "--set", "env.eval_tasks=5"]) == 0
    cfg = seen[-1]
    assert (cfg.env.name, cfg.env.knobs, cfg.context.max_summaries) == ("fncall/count",
                                                                        {"size": 3}, 2)
    assert (cfg.env.eval_tasks, cfg.train.run_dir) == (5, run)
    assert "the run's settings" in capsys.readouterr().out
    assert os.path.exists(os.path.join(run, "eval_scaling.json"))
    # the file the run was made with, plus the --set it was made with: no difference
    assert main(["eval", "--config", CONFIG, "--set", f"train.run_dir={run}", "--set",
                 "env.name=fncall/count", "--set", "env.knobs.size=3", "--set",
                 "context.max_summaries=2", "--set", "context.max_action_tokens=96"]) == 0
    capsys.readouterr()
    assert main(["eval", "--config", CONFIG, "--set", f"train.run_dir={run}"]) == 2
    err = capsys.readouterr().err   # like a refused resume: one line per difference
    assert err.startswith("supo-jax eval: error: ") and "Traceback" not in err, err
    for needle in ("env.name: 'fncall/count' -> 'fncall/pages'", "context.max_summaries: 2 -> 3",
                   "leave out --config"):
        assert needle in err, err
    (tmp_path / "run" / "config.json").write_text("{not json")
    _one_line_error(capsys, ["eval", "--set", f"train.run_dir={run}"], "config.json",
                    "not a readable run config")


@pytest.fixture(scope="module")
def trained_run(run_of_another_model):
    """A run directory with a checkpoint of CONFIG's own model (what `eval` restores)."""
    return run_of_another_model


@pytest.fixture(scope="module")
def run_of_another_model(tmp_path_factory):
    """A run directory as `train` leaves it after step 0: tokenizer, run.json, checkpoint."""
    from supo_jax.checkpoint import RunCheckpoints
    from supo_jax.config import load_config
    from supo_jax.rl.train_step import make_optimizer
    from supo_jax.rl.runs import build_policy, check_run_dir

    run_dir = str(tmp_path_factory.mktemp("other_model") / "run")
    os.makedirs(run_dir)
    policy = build_policy(load_config(CONFIG, [f"train.run_dir={run_dir}"]), run_dir)
    check_run_dir(run_dir, policy, record=True)
    _, params = policy.split()
    ck = RunCheckpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
    ck.save(0, params, make_optimizer().init(params), {"step": 0})
    ck.close()
    return run_dir


@pytest.mark.parametrize("cmd", ("train", "eval", "sft"))   # the commands with a run directory
def test_run_dir_of_a_different_model(cmd, run_of_another_model, capsys):
    argv = [cmd, "--config", CONFIG, "--set", f"train.run_dir={run_of_another_model}",
            "--set", "model.tiny_hidden=48"]
    _one_line_error(capsys, argv, run_of_another_model, "different model",
                    "hidden_size 32 there, 48 here")


@pytest.mark.parametrize("argv", [
    ["rollout", "--env", "nope", "--num", "1"],
    ["eval", "--config", CONFIG],
    ["generate", "--model", "/nonexistent/model.gguf"],
])
def test_bad_input_exits_2_without_traceback(argv, tmp_path):
    if argv[0] == "eval":
        argv = argv + ["--set", f"train.run_dir={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli"] + argv, capture_output=True,
                       text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"supo-jax {argv[0]}: error: "), r.stderr


def test_ctrl_c_is_one_line_with_a_resume_hint(monkeypatch, capsys, tmp_path):
    import supo_jax.cli as cli
    from supo_jax.rl import trainer

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "train", interrupted)
    run = tmp_path / "run"
    for name in ("checkpoints/1", "checkpoints/2", "checkpoints/3.orbax-checkpoint-tmp-9"):
        os.makedirs(run / name)
    hint = "supo-jax train: interrupted; rerun the same command to resume from the latest checkpoint"
    for ckpt in (True, False):
        capsys.readouterr()
        assert cli.main(["train", "--config", CONFIG, "--set", f"train.run_dir={run}"]) == 130
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [hint + (" (checkpoint step 2 of 3)" if ckpt else
                               " (no checkpoint yet: a rerun starts the run over)")], err
        if ckpt:
            import shutil
            shutil.rmtree(run / "checkpoints")
    monkeypatch.setattr(cli, "_cmd_sweep", lambda args: interrupted(None))
    assert cli.main(["sweep"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [hint.replace("train", "sweep")]


def test_progress_is_plain_lines_when_not_a_terminal(capsys, monkeypatch):
    import io
    import types

    from supo_jax.rl import metrics
    bar = metrics.progress_bar(3, "train", True)   # pytest's stderr is not a terminal
    assert isinstance(bar, metrics.LineProgress)
    # a process that imported ipykernel (tests/test_notebook.py's nbclient) is no notebook
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert isinstance(metrics.progress_bar(3, "train", True), metrics.LineProgress)
    out = io.StringIO()
    bar = metrics.LineProgress(4, "rollouts 1", every=0.0, stream=out)
    bar.set_postfix(success="0.50", loss="0.012")
    bar.update(1)
    bar.update(3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("rollouts 1: 1/4 (25%) ") and lines[0].endswith(
        "success=0.50 loss=0.012")
    assert lines[-1].startswith("rollouts 1: 4/4 (100%)")
    assert len(lines) == 2   # close() after a line at 4/4 does not print 4/4 again
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    # a resumed run's bar counts on from its step, with the time left at this pace
    resumed = metrics.LineProgress(30, "train (RL steps)", every=0.0, stream=out, initial=6)
    resumed.t0 -= 8.0                       # 8 s for 2 steps: 4 s a step, 22 steps to go
    resumed.update(2)
    assert out.getvalue().splitlines()[-1].startswith("train (RL steps): 8/30 (27%) 8s, 1m28s left")
    quiet = metrics.LineProgress(10, "sft", every=3600.0, stream=out)
    n = len(out.getvalue())
    quiet.update(5)
    assert len(out.getvalue()) == n   # at most one line per `every` seconds
    inner = metrics.LineProgress(4, "rollouts 2", every=3600.0, stream=out, closing_line=False)
    inner.update(4)
    inner.close()
    assert len(out.getvalue()) == n   # a short inner bar (one step's rollouts) says nothing
    quiet.close()
    assert out.getvalue()[n:].startswith("sft: 5/10 (50%)")   # the outer one closes with a line


def test_models_by_hub_id_from_the_cache_and_one_line_when_missing(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from supo_jax.model.policy import resolve_model_path
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny" / "snapshots" / "0123abcd"
    make_hf_model("qwen2_bias_gqa", str(snap))
    tiny_tokenizer(str(snap))
    (cache / "models--someorg--tiny" / "refs").mkdir()
    (cache / "models--someorg--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("someorg/tiny") == str(snap)
    assert resolve_model_path(str(snap)) == str(snap)   # local paths as given
    a, b = supo_jax.load_policy("someorg/tiny"), supo_jax.load_policy(str(snap))
    ids = np.arange(10)[None]
    np.testing.assert_array_equal(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)))
    assert main(["generate", "--model", "someorg/tiny", "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 0
    _one_line_error(capsys, ["generate", "--model", "someorg/absent"], "someorg/absent",
                    "offline", str(cache / "models--someorg--absent"))


def test_train_refuses_a_run_dir_whose_checkpoints_cannot_be_restored(tmp_path, capsys):
    """Checkpoints that no longer restore (here: the optimizer state of an older supo_jax, a
    plain AdamW without its learning rate in the state) stop `train` with the reason; nothing
    is overwritten and the run does not silently start over."""
    import optax

    from supo_jax.checkpoint import RunCheckpoints
    from supo_jax.config import load_config
    from supo_jax.rl.runs import build_policy, check_run_dir

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    policy = build_policy(load_config(CONFIG, [f"train.run_dir={run_dir}"]), run_dir)
    check_run_dir(run_dir, policy, record=True)
    _, params = policy.split()
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ck = RunCheckpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
    ck.save(0, params, old_tx.init(params), {"step": 0})
    ck.close()
    before = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    capsys.readouterr()
    with pytest.warns(UserWarning, match="step 0 .* cannot be restored"):
        assert main(_argv("train", tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("supo-jax train: error: ") and "none of its checkpoints" in err, err
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == before
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))


@pytest.mark.parametrize("value", ["x", "1", "-5"])
def test_a_bad_heartbeat_setting_is_one_line(value, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SUPO_JAX_HEARTBEAT_S", value)
    _one_line_error(capsys, ["train", "--set", f"train.run_dir={tmp_path}"],
                    f"SUPO_JAX_HEARTBEAT_S={value!r}", "at least 2")


@pytest.mark.parametrize("cmd", ["train", "rollout"])
def test_frozen_summarizer_is_refused_in_one_line(cmd, tmp_path, capsys):
    argv = ([cmd, "--set", "context.manager=frozen_summarizer"] if cmd == "train" else
            [cmd, "--env", "fncall/count", "--context", "frozen_summarizer"])
    _one_line_error(capsys, argv + ["--set", f"train.run_dir={tmp_path}"],
                    "frozen_summarizer", "run_rollouts")


@pytest.mark.parametrize("manager,counter", [("state", "states_mean"), ("fold", "folds_mean"),
                                             ("clear", "cleared_mean")])
def test_scripted_rollouts_under_the_other_managers_print_their_counter(manager, counter,
                                                                         capsys):
    """`supo-jax rollout --context state|fold|clear --policy scripted`: the expert as the
    manager needs it (state blocks; branches) solves the tasks, and the manager's own counter
    is printed."""
    assert main(["rollout", "--env", "fncall/chain", "--context", manager, "--num", "2",
                 "--set", "context.working_context=3000", "--set", "context.max_steps=100",
                 "--set", "context.max_action_tokens=200"]) == 0
    lines = dict(ln.split(None, 1) for ln in capsys.readouterr().out.splitlines()
                 if ln.strip())
    assert lines["success_rate"].strip() == "1.0"
    assert float(lines[counter]) > (0 if manager != "clear" else -1)
