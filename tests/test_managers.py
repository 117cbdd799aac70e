"""Context managers where a user first switches them on: the CPU recipe's settings, each
built-in fncall family as `supo-jax rollout --env fncall/<family> --policy scripted --context
<manager>` runs it (the family's own knobs, the config's tokenizer), the scripted expert."""
import functools
import re

import pytest

FAMILIES = ("tallest", "count", "pages", "graph", "chain", "listing", "reports", "records",
            "sections")
# a W where results and finished sub-tasks outgrow `full` (experiments/LOG.md, 2026-11-29)
WIDE = ("context.working_context=2048", "context.max_observation_tokens=256",
        "context.max_steps=100")


@functools.lru_cache(maxsize=None)
def _expert(family: str, manager: str, n: int = 4, sets: tuple = ()) -> dict:
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts, summarize
    from supo_jax.config import load_config
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.envs.experts import expert_for, for_context
    from supo_jax.rl.runs import env_tokenizer

    cfg = load_config(None, [f"env.name=fncall/{family}", f"context.manager={manager}",
                             "train.sft_warm_start=false", *sets])
    fmt = ChatFormat(env_tokenizer(cfg))
    tasks = make_tasks(cfg.env.name, "train", n, seed=cfg.env.seed, **cfg.env.knobs)
    ro = run_rollouts(ScriptedActor(for_context(expert_for(cfg.env.name), cfg.context), fmt),
                      lambda: make_env(cfg.env.name), tasks, fmt, cfg.context, rows=n)
    from supo_jax.text.templates import FORCED_RETURN

    tool = [m.get("content", "") for r in ro for m in r.transcript if m.get("role") == "tool"]
    return dict(summarize(ro), cut_calls=sum("unterminated <tool_call>" in t for t in tool),
                forced_returns=sum(t == FORCED_RETURN for t in tool))


@pytest.mark.parametrize("family", FAMILIES)
def test_state_solves_every_family_supo_solves_with_its_block_budgeted(family):
    """`state` gives its <state> block a budget of its own (context.max_state_tokens) beside
    the call's: no reply is cut inside its call, and the expert solves whatever it solves under
    `supo` (tallest: 0 of 16 when the block shared the call's 48 tokens)."""
    supo, state = _expert(family, "supo"), _expert(family, "state")
    assert state["states_mean"] > 0, state
    assert state["success_rate"] >= supo["success_rate"], (supo, state)
    if supo["success_rate"] > 0:   # graph's default 16 nodes outgrow a 48-token state under both
        assert state["cut_calls"] == 0, state
    if family == "tallest":
        assert state["success_rate"] == 1.0, state


@pytest.mark.parametrize("family,size,reaches", [("reports", 16, "clear"),
                                                  ("sections", 8, "fold"),
                                                  ("records", 16, "clear"),
                                                  ("records", 16, "fold")])
def test_clear_and_fold_each_have_a_family_they_solve_where_full_does_not(family, size, reaches):
    """At W = 2048: 16 reports of ~100-200 tokens outgrow `full`, while `clear` (the agent's
    <state> blocks keep what the cleared results said) and `supo` finish; 8 sections of 6
    pages outgrow `full`, while `fold` (a branch a section, one return message each stays)
    finishes. `state` solves whatever `supo` solves."""
    sets = (f"env.knobs.size={size}", *WIDE)
    got = {m: _expert(family, m, 4, sets) for m in ("full", reaches, "supo", "state")}
    assert got[reaches]["success_rate"] >= 0.9, got[reaches]
    assert got["full"]["success_rate"] <= 0.1 and got["full"]["reasons"] == {
        "context_limit": 4}, got["full"]
    assert got["state"]["success_rate"] >= got["supo"]["success_rate"], got
    if reaches == "fold":   # one branch a section, none past them, none closed by the limit
        assert got["fold"]["forced_returns"] == 0, got
        if family == "sections":
            assert got["fold"]["folds_mean"] == size, got
    else:                   # every reply kept its state; old results cleared, never the newest
        assert got["clear"]["states_mean"] == got["clear"]["steps_mean"], got["clear"]
        assert got["clear"]["cleared_mean"] > 0 and got["clear"]["clear_exhausted_mean"] == 0


def test_clear_asks_for_state_blocks_and_counts_running_out_of_results_to_clear():
    """Under `clear` the prompt asks for <state> blocks, budgeted as under `state`. At the
    recipe's W = 446 the replies that stay outgrow L once every old result is cleared: the
    rollouts end at the limit and `clear_exhausted` says so."""
    from supo_jax.agent.context import ContextConfig

    c = ContextConfig("clear", 400, max_action_tokens=48, max_state_tokens=40)
    assert "<state></state>" in c.state_request and c.budget(100, summary=False) == 88
    assert ContextConfig("full", 400).state_request == ""
    got = _expert("reports", "clear", 4, ("env.knobs.size=8",))
    assert got["reasons"] == {"context_limit": 4} and got["clear_exhausted_mean"] >= 1, got
    assert got["states_mean"] > 0


def test_state_block_budget_is_its_own_setting_counted_in_w():
    """Set, the state block's budget sits beside the call's; sized from W (0, the default),
    a reply gets what L leaves beside the task's prompt and one observation turn, and a W that
    leaves a block no room stops the run at start-up naming context.working_context."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import start_state
    from supo_jax.config import load_config
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.rl.runs import env_tokenizer

    c = ContextConfig("state", 400, max_action_tokens=48, max_state_tokens=40)
    assert c.budget(100, summary=False) == 88 and c.budget(350, summary=False) == 50
    assert ContextConfig("supo", 400, max_action_tokens=48, max_state_tokens=40).budget(
        100, summary=False) == 48
    with pytest.raises(ValueError, match="context.max_state_tokens must be >= 0"):
        ContextConfig("state", 400, max_state_tokens=-1)
    cfg = load_config(None, ["env.name=fncall/graph", "context.manager=state"])
    fmt = ChatFormat(env_tokenizer(cfg))
    reset = make_env(cfg.env.name).reset(make_tasks(cfg.env.name, "train", 1, seed=0)[0])
    for w in (446, 1024):
        ctx = load_config(None, ["env.name=fncall/graph", "context.manager=state",
                                 f"context.working_context={w}"]).context
        st = start_state(fmt, ctx, reset)
        obs_turn = ctx.max_observation_tokens + len(fmt.turn("assistant", "tool", ""))
        assert st.reply_budget == ctx.limit(fmt) - 1 - len(st.prefix) - len(fmt.gen_prompt) - obs_turn
        assert ctx.budget(len(st.prefix) + 5, False, st.reply_budget) == st.reply_budget
    assert st.reply_budget > 500     # at W = 1024
    small = load_config(None, ["env.name=fncall/graph", "context.manager=state",
                               "context.working_context=360"]).context
    with pytest.raises(ValueError, match=r"leaves \d+ tokens for a reply's <state> block .* "
                                         r"raise context.working_context"):
        start_state(fmt, small, reset)


# the largest sizes `supo`'s expert solves at W = 1024 (benchmarks/results/capacity.json)
SUPO_REACH_1024 = {"tallest": 32, "count": 48, "pages": 32, "graph": 12, "chain": 32,
                   "listing": 24, "reports": 12, "records": 12, "sections": 6}


@pytest.mark.parametrize("family", FAMILIES)
def test_state_sized_from_w_solves_what_supo_solves_at_a_wider_w(family):
    """At W = 1024 (observations up to 256 tokens, 200 steps) the state block grows with W:
    graph's breadth-first search state (its visited set) no longer outgrows a fixed 48
    tokens (8 nodes was the limit), and `state` solves each family at supo's reach."""
    sets = (f"env.knobs.size={SUPO_REACH_1024[family]}", "context.working_context=1024",
            "context.max_observation_tokens=256", "context.max_steps=200")
    supo, state = _expert(family, "supo", 2, sets), _expert(family, "state", 2, sets)
    assert supo["success_rate"] == 1.0, supo
    assert state["success_rate"] == 1.0 and state["cut_calls"] == 0, state


def test_tasks_whose_prompt_does_not_fit_are_said_at_start_not_only_the_first(capsys):
    """fncall/graph under `state` at W = 406: the first task's prompt leaves room for a state
    block, later ones' do not (their rollouts would end at once as context_limit, trained on
    as failures): the start-up check renders a sample of tasks and says how many, in one
    line; a first task that does not fit stops the run, as before."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import start_state
    from supo_jax.config import load_config
    from supo_jax.envs import make_env, make_tasks
    from supo_jax.rl.runs import check_prompt_fits, env_tokenizer

    cfg = load_config(None, ["env.name=fncall/graph", "context.manager=state",
                             "context.working_context=406"])
    fmt = ChatFormat(env_tokenizer(cfg))
    first = make_tasks(cfg.env.name, "train", 1, seed=cfg.env.seed)[0]
    start_state(fmt, cfg.context, make_env(cfg.env.name).reset(first))    # the first fits
    check_prompt_fits(cfg, fmt)
    said = capsys.readouterr().out
    assert re.search(r"note: \d+ of the first 16 train tasks do not fit \(their rollouts end "
                     r"at once, as context_limit\): context.manager=state at W = 406 leaves", said)
    with pytest.raises(ValueError, match=r"context.manager=state at W = 380 leaves"):
        check_prompt_fits(load_config(None, ["env.name=fncall/graph", "context.manager=state",
                                             "context.working_context=380"]), fmt)


def test_an_actions_budget_beside_a_state_block_sized_from_w_is_w():
    """ContextConfig.action_tokens: max_action_tokens, plus max_state_tokens where a reply
    holds a <state> block; sized from W (max_state_tokens 0), W itself (it was
    max_action_tokens alone: `a + 0 or W` read as `(a + 0) or W`)."""
    from supo_jax.agent.context import ContextConfig

    assert ContextConfig("supo", 4096, max_action_tokens=256).action_tokens == 256
    assert ContextConfig("state", 4096, max_action_tokens=256,
                         max_state_tokens=64).action_tokens == 320
    assert ContextConfig("state", 4096, max_action_tokens=256).action_tokens == 4096
    assert ContextConfig("clear", 2048, max_action_tokens=48).action_tokens == 2048


def test_the_experts_ceiling_names_what_ran_out_and_cut_actions_are_a_config_error():
    """Before training (train, eval, rollout with a model): the scripted expert under the
    run's settings. fncall/count's own knobs at the recipe's W run out of summaries: one line
    says so; every action cut at its budget stops the command naming the setting."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.config import ConfigError, load_config
    from supo_jax.rl.runs import env_tokenizer
    from supo_jax.rl.trainer import expert_ceiling

    cfg = load_config(None, ["env.name=fncall/count"])
    fmt = ChatFormat(env_tokenizer(cfg))
    lines = []
    got = expert_ceiling(cfg, fmt, n=4, log=lines.append)
    assert got["expert_success_rate"] == 0.0 and got["expert_cut_actions"] == 0
    assert len(lines) == 1 and "summaries (context.max_summaries)" in lines[0], lines
    assert "it solves env.knobs.size=8 here" in lines[0], lines   # the knob to set
    lines.clear()
    cfg = load_config(None, ["env.name=fncall/count", "env.knobs.size=[5, 9]"])
    assert expert_ceiling(cfg, fmt, n=4, log=lines.append)["expert_success_rate"] == 1.0
    assert not lines
    cfg = load_config(None, ["context.manager=state", "context.max_action_tokens=8",
                             "context.max_state_tokens=8"])
    with pytest.raises(ConfigError, match=r"context.max_action_tokens \+ context.max_state_tokens"
                                          r" = 16: every action .* was cut"):
        expert_ceiling(cfg, ChatFormat(env_tokenizer(cfg)), n=2)


@pytest.mark.parametrize("manager", ["supo", "full", "truncate", "window", "frozen_summarizer",
                                     "clear", "state", "fold"])
def test_no_manager_cuts_every_action_of_the_expert_on_any_family(manager):
    """The manager x family matrix at the recipe's settings: the expert's ceiling runs under
    every manager (frozen_summarizer: the expert summarizes) and no cell has every action cut
    (that would stop a run with a config error). What each cell solves is a measurement."""
    from supo_jax.agent.render import ChatFormat
    from supo_jax.config import load_config
    from supo_jax.rl.runs import env_tokenizer
    from supo_jax.rl.trainer import expert_ceiling

    for family in FAMILIES:
        cfg = load_config(None, [f"env.name=fncall/{family}", f"context.manager={manager}"])
        got = expert_ceiling(cfg, ChatFormat(env_tokenizer(cfg)), n=2, log=lambda line: None)
        assert 0 < got["expert_actions"] and got["expert_cut_actions"] < got["expert_actions"]
        assert 0.0 <= got["expert_success_rate"] <= 1.0
