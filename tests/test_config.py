"""Configs: every experiment file loads; overrides are typed; typos name the key."""
import dataclasses
import functools
import glob
import os
import re

import pytest

from supo_jax.config import Config, ConfigError, apply_overrides, from_dict, load_config, to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py"))))
def test_every_experiment_config_loads_and_roundtrips(path):
    try:
        cfg = _experiment(os.path.basename(path))
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
                                      ("rollout.budget_tokens=-5", "rollout.budget_tokens"),
                                      ("rollout.max_staleness=-1", "rollout.max_staleness"),
                                      ("optim.lr=-1", "optim.lr"),
                                      ("optim.micro=0", "optim.micro"),
                                      ("train.save_every=0", "train.save_every"),
                                      ("context=3", "context"),
                                      ("context=fulll", "context"),
                                      ("nonsense", "nonsense")])
def test_bad_overrides_name_the_key(bad, name):
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        apply_overrides(Config(), [bad])


def test_numeric_settings_out_of_range_name_themselves():
    """A setting that must be positive (or >= 0) fails at start, naming itself, not as a
    division by zero or a run that trains with a negative learning rate."""
    from supo_jax.config import AT_LEAST_0, POSITIVE

    for key, bad in [(k, 0) for k in POSITIVE] + [(k, -1) for k in AT_LEAST_0]:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=-?[01](\.0)?: must be"):
            apply_overrides(Config(), [f"{key}={bad}"])


def test_partial_rollouts_and_dynamic_sampling_are_one_or_the_other():
    with pytest.raises(ConfigError, match="rollout.budget_tokens and rollout.dynamic_rounds"):
        apply_overrides(Config(), ["rollout.budget_tokens=1000", "rollout.dynamic_rounds=2"])
    ok = ["rollout.budget_tokens=1000", "optim.recompute_old_logprobs=true",
          "loss.behaviour_correction=tis"]
    assert apply_overrides(Config(), ok).rollout.budget_tokens == 1000


def test_a_token_budget_alone_turns_the_off_policy_correction_on():
    """Resumed rollouts hold tokens sampled by older policies: rollout.budget_tokens alone
    recomputes the proximal log-probs and weighs the tokens by truncated importance sampling
    (loss.behaviour_correction auto -> tis), what the run's config.json then holds; without a
    budget auto is none. An explicit correction of none with a budget is refused in one line;
    decoupled is kept."""
    cfg = apply_overrides(Config(), ["rollout.budget_tokens=1000"])
    assert cfg.loss.behaviour_correction == "tis" and cfg.optim.recompute_old_logprobs
    assert to_dict(cfg)["loss"]["behaviour_correction"] == "tis"
    plain = apply_overrides(Config(), [])
    assert plain.loss.behaviour_correction == "none" and not plain.optim.recompute_old_logprobs
    kept = apply_overrides(Config(), ["rollout.budget_tokens=1000", "loss.behaviour_correction="
                                      "decoupled", "optim.recompute_old_logprobs=true"])
    assert kept.loss.behaviour_correction == "decoupled"
    with pytest.raises(ConfigError, match=r"^rollout\.budget_tokens: .*behaviour_correction=none"
                       ) as e:
        apply_overrides(Config(), ["rollout.budget_tokens=1000", "loss.behaviour_correction=none"])
    assert "\n" not in str(e.value)


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
        "optim.lr: 1e-06 -> 0.001"]


# The paper's SUPO, written here from the paper (docs/SUPO.md §2, §4; "(?)" = the paper is silent and
# this is our reading): the reference the code's PAPER_SUPO, the class defaults and the paper
# configs are held to.
PAPER = {
    "context.manager": "supo", "context.trigger_ratio": 0.95, "context.trigger_rule": "paper",
    "context.summary_role": "system", "context.show_dropped_to_summarizer": False,   # (?)
    "context.summary_counts_as_step": True,                                          # (?)
    "rollout.group_size": 8, "rollout.temperature": 1.0, "rollout.dynamic_rounds": 0,
    "rollout.budget_tokens": 0,                     # every rollout ends in its step
    "advantage.estimator": "rollout_group", "advantage.normalize_std": True,
    "advantage.negative_weight": 1.0,
    "advantage.masked_reasons": ("max_summaries", "max_steps", "context_limit", "env_error",
                                 "timeout", "summary_cut", "queued"),
    "advantage.masked_count_in_stats": True, "advantage.rollout_weight": "tokens",
    "advantage.permute_rewards": False,
    "loss.objective": "ppo", "loss.eps_low": 0.2, "loss.eps_high": 0.28,
    "loss.aggregation": "token-mean", "loss.kl_coef": 0.0, "loss.entropy_coef": 0.0,
    "optim.lr": 1e-6, "optim.schedule": "constant", "optim.warmup_steps": 0,
    "optim.ppo_epochs": 1, "optim.max_kl": 0.0,
    "train.sft_warm_start": False, "train.eval_temperature": 0.0,      # (?) greedy evaluation
    "train.eval_samples": 1,
}
PAPER_CONFIGS = ("paper_fncall_supo.py", "paper_search_supo.py")
SECTIONS = {"context": "ContextConfig", "rollout": "RolloutSection", "advantage": "AdvantageConfig",
            "loss": "LossConfig", "optim": "OptimSection", "train": "TrainSection"}


def _values(cfg):
    from supo_jax.config import get
    return {k: get(cfg, k) for k in PAPER}


@functools.lru_cache(maxsize=None)
def _experiment(name):
    """An experiment config, loaded once (the search setup builds a 100K-document corpus to
    check its knobs)."""
    return load_config(os.path.join(ROOT, "experiments", "configs", name))


@pytest.mark.slow
def test_defaults_and_paper_configs_are_the_papers_algorithm():
    from supo_jax import config as C
    from supo_jax.text.templates import SUMMARY_INSTRUCTION

    assert {k: v for k, v in C.PAPER_SUPO.items() if k != "context.summary_instruction"} == PAPER
    assert C.PAPER_SUPO["context.summary_instruction"] == SUMMARY_INSTRUCTION
    assert _values(Config()) == PAPER and C.departures(Config()) == {}
    for name in PAPER_CONFIGS:
        cfg = _experiment(name)
        assert _values(cfg) == PAPER, name
        assert C.departures(cfg) == {}, name
    grpo = _experiment("paper_fncall_grpo32k.py")
    assert list(C.departures(grpo)) == ["context.manager"]     # the baseline, same update


@pytest.mark.parametrize("name", PAPER_CONFIGS + ("smollm2_supo.py",))
def test_paper_and_pretrained_configs_state_every_algorithm_field(name):
    """Inherited values change when a default does: these files write each setting out."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "experiments", "configs", name)).read())
    stated = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            stated.setdefault(node.func.id, set()).update(k.arg for k in node.keywords)
    missing = [k for k in [*PAPER, "context.summary_instruction"]
               if k.split(".")[1] not in stated.get(SECTIONS[k.split(".")[0]], ())]
    assert not missing, f"{name} leaves {missing} to the defaults"


def test_cpu_recipe_departs_in_exactly_its_listed_settings():
    from supo_jax import config as C
    from supo_jax.configs import cpu_recipe

    cfg = load_config(None)
    assert cfg == C.validate(cpu_recipe.config())
    assert set(C.departures(cfg)) == set(cpu_recipe.DEPARTURES)
    assert all(0 < len(why) <= 100 for why in cpu_recipe.DEPARTURES.values())


def test_runs_saved_before_the_trigger_rule_and_role_existed_keep_their_behaviour():
    """A config.json without context.trigger_rule / summary_role ran with L = min(0.95 W,
    W - reserve) and a user-turn instruction: read back so, and no change against the recipe."""
    import json

    from supo_jax.config import config_changes

    recipe = load_config(None)
    saved = json.loads(json.dumps(to_dict(recipe), default=str))
    del saved["context"]["trigger_rule"], saved["context"]["summary_role"]
    old = from_dict(saved)
    assert (old.context.trigger_rule, old.context.summary_role) == ("reserve", "user")
    assert config_changes(saved, recipe) == []
    paper = apply_overrides(recipe, ["context.trigger_rule=paper"])
    assert config_changes(saved, paper) == ["context.trigger_rule: None -> 'paper'"]


def test_paper_configs_train_the_papers_epochs():
    """CodeGym: 100 steps of 128 tasks over 12,800 tasks (one pass); BrowseComp-Plus: 5 epochs
    (docs/SUPO.md §8). The trainer walks the train tasks in order, B a step."""
    for name, epochs in (("paper_fncall_supo.py", 1), ("paper_search_supo.py", 5)):
        cfg = _experiment(name)
        assert cfg.train.steps * cfg.rollout.tasks_per_step == epochs * cfg.env.train_tasks, name


def test_paper_trigger_is_095_W_and_reserve_is_the_recipes_L():
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.model.tiny import tiny_tokenizer
    from supo_jax.rl.runs import env_tokenizer

    fmt = ChatFormat(tiny_tokenizer(template="qwen"))
    for name, w in (("paper_fncall_supo.py", 4096), ("paper_search_supo.py", 65536)):
        ctx = _experiment(name).context
        assert ctx.limit(fmt) == int(0.95 * w) and ctx.trigger_rule == "paper"
        reserve = dataclasses.replace(ctx, trigger_rule="reserve")
        assert reserve.limit(fmt) == min(int(0.95 * w), w - reserve.reserve(fmt))
        # at 4K the reserve rule (a 1024-token summary's room) triggers far below 0.95 W
        assert reserve.limit(fmt) < 0.75 * w if w == 4096 else reserve.limit(fmt) == ctx.limit(fmt)
    # an action always has a token of room, however close to W the trigger is
    tight = ContextConfig(working_context=40, trigger_ratio=1.0)
    assert tight.limit(fmt) == 40 - len(fmt.gen_prompt) - 1
    recipe = load_config(None)
    fmt = ChatFormat(env_tokenizer(recipe))
    # W - (instruction turn + generation prompt + 48-token summary); 0.95 W would be 423
    assert recipe.context.limit(fmt) == 446 - recipe.context.reserve(fmt) == 371


def test_print_config_marks_every_departure_and_exits(capsys):
    from supo_jax import cli
    from supo_jax.configs.cpu_recipe import DEPARTURES

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--print-config", "--set", "optim.lr=0.5"])
    assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("config: the CPU recipe")
    marked = {line.split(" = ")[0] for line in out if "   # paper: " in line}
    assert marked == set(DEPARTURES)
    assert "optim.lr = 0.5   # paper: 1e-06" in out
    assert "# context: L = 371 tokens (reserve rule, W = 446)" in out


def test_bad_values_name_the_setting_once_and_what_is_allowed():
    from supo_jax.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["context.trigger_rule=papr"])
    assert str(e.value).count("context.trigger_rule") == 1 and "paper, reserve" in str(e.value)
    with pytest.raises(ConfigError, match=r"env.knobs=.*size \[9, 5\]: an int, or a range "
                                          r"\[low, high\] with low <= high"):
        load_config(None, ["env.knobs.size=[9, 5]"])
