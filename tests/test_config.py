"""Configs: every experiment file loads; overrides are typed; typos name the key."""
import glob
import os

import pytest

from supo_jax.config import Config, ConfigError, apply_overrides, from_dict, load_config, to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py"))))
def test_every_experiment_config_loads_and_roundtrips(path):
    try:
        cfg = load_config(path)
    except ConfigError as e:   # a config of a downloaded model (e.g. SmolLM2) while offline
        if "unavailable" not in str(e):
            raise
        pytest.skip(str(e))
    assert isinstance(cfg, Config)
    assert from_dict(to_dict(cfg)) == cfg


def test_overrides_are_typed():
    cfg = apply_overrides(Config(), ["context.working_context=2048", "env.knobs.size=[4, 8]",
                                     "train.eval_max_summaries=[0,2,4]", "loss.eps_high=0.3",
                                     "optim.pack=true", "model.path=/tmp/x"])
    assert cfg.context.working_context == 2048 and cfg.env.knobs == {"size": [4, 8]}
    assert cfg.train.eval_max_summaries == (0, 2, 4) and cfg.loss.eps_high == 0.3
    assert cfg.optim.pack is True and cfg.model.path == "/tmp/x"
    # the baseline shorthand: a manager name for the whole context section
    full = apply_overrides(Config(), ["context=full"])
    assert full.context.manager == "full"
    assert full.context.working_context == Config().context.working_context


@pytest.mark.parametrize("bad,name", [("context.workin_context=3", "context.workin_context"),
                                      ("context.working_context=abc", "context.working_context"),
                                      ("loss.aggregation=foo", "loss.aggregation"),
                                      ("context.manager=xx", "context.manager"),
                                      ("optim.lr=fast", "optim.lr"),
                                      ("rollout.dynamic_rounds=-1", "rollout.dynamic_rounds"),
                                      ("context=3", "context"),
                                      ("context=fulll", "context"),
                                      ("nonsense", "nonsense")])
def test_bad_overrides_name_the_key(bad, name):
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        apply_overrides(Config(), [bad])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/cfg.py")


def test_a_run_config_json_loads_as_config(tmp_path):
    """--config takes a run's saved config.json (or its run directory): the settings that run
    was made with, overrides on top; other files are a clear error."""
    import json
    cfg = apply_overrides(Config(), ["optim.lr=5e-5", "env.name=fncall/count"])
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg), default=str))
    for path in (str(tmp_path / "config.json"), str(tmp_path)):
        assert load_config(path) == cfg
    assert load_config(str(tmp_path), ["optim.lr=1e-4"]).optim.lr == 1e-4
    (tmp_path / "cfg.yaml").write_text("optim: {}")
    with pytest.raises(ConfigError, match="expected a .py file"):
        load_config(str(tmp_path / "cfg.yaml"))
    (tmp_path / "bad.json").write_text('{"optim": {"lrr": 1}}')
    with pytest.raises(ConfigError, match="lrr"):
        load_config(str(tmp_path / "bad.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="directory without a config.json"):
        load_config(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "gone.json"))


def test_rl_refuses_truncated_sampling():
    """top-k / top-p logprobs are the truncated distribution's; the training forward scores
    the full one, so an RL config with them on fails at start, naming the fields."""
    from supo_jax.config import ConfigError, load_config
    for bad in ("rollout.top_k=20", "rollout.top_p=0.9"):
        with pytest.raises(ConfigError, match="rollout.top_k=.*rollout.top_p"):
            load_config(None, [bad])


def test_config_changes_ignore_settings_added_since_at_their_default():
    import json

    from supo_jax.config import config_changes

    base = apply_overrides(Config(), ["advantage.negative_weight=1.0"])   # its class default
    saved = json.loads(json.dumps(to_dict(base), default=str))
    del saved["advantage"]["negative_weight"]           # a run saved before the setting existed
    assert config_changes(saved, base) == []
    changed = apply_overrides(Config(), ["advantage.negative_weight=0.5"])
    assert config_changes(saved, changed) == ["advantage.negative_weight: None -> 0.5"]
    assert config_changes(saved, apply_overrides(base, ["optim.lr=0.001"])) == [
        "optim.lr: 0.0001 -> 0.001"]
