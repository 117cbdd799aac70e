"""Bring your own environment: the README's example file as written, experts as an optional
public API (StateExpert), demonstrations as chat-messages JSONL, knobs that belong to their
environment, env.imports from the working directory, one tokenizer for every command."""
import functools
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from supo_jax.agent.context import ContextConfig as _ContextConfig
from supo_jax.agent.render import ChatFormat
from supo_jax.agent.rollout import ScriptedActor, run_rollouts
from supo_jax.config import ConfigError, apply_overrides, load_config
from supo_jax.configs.cpu_recipe import config as cpu_recipe
from supo_jax.envs import make_env, make_tasks
from supo_jax.envs import experts as E
from supo_jax.model.tiny import tiny_tokenizer
from supo_jax.rl.sft import assistant_text, conversation_segments, jsonl_segments
from supo_jax.text.parsing import extract_summary

from tests.readme_helpers import (DOCS, EXAMPLE, README, example_dir, user_shell_cores,
                                  user_shell_env)

# W is small in these tests: the reserve rule keeps a full summary request within W (the paper's
# L = 0.95 W leaves too little room there); tests/test_context_bound.py covers both rules
ContextConfig = functools.partial(_ContextConfig, trigger_rule="reserve")

COMMAND = re.search(r"\n    (supo-jax train --set 'env.imports=\[\"my_envs.redcount\"\]'[^\n]*)\n",
                    README).group(1)


@pytest.fixture
def rc_dir(tmp_path, monkeypatch):
    """The README's example as my_envs/redcount.py in a fresh working directory; registrations
    and imports are undone afterwards."""
    with example_dir(tmp_path, monkeypatch):
        yield tmp_path


def test_readme_example_registers_env_and_expert_from_the_working_directory(rc_dir):
    assert str(rc_dir) not in sys.path
    cfg = apply_overrides(cpu_recipe(), ['env.imports=["my_envs.redcount"]', "env.name=redcount"])
    assert cfg.env.knobs == {} and cfg.env.eval_knobs == {}   # fncall/tallest's knobs dropped
    fmt = ChatFormat(tiny_tokenizer(template="compact"))
    tasks = make_tasks("redcount", "train", 12)
    ctx = ContextConfig("supo", 800, max_summaries=8, max_steps=60, max_action_tokens=64,
                        max_summary_tokens=60, max_observation_tokens=16)
    ro = run_rollouts(ScriptedActor(E.expert_for("redcount"), fmt), lambda: make_env("redcount"),
                      tasks, fmt, ctx)
    assert [r.reward for r in ro] == [1.0] * 12, [(r.reason, r.counters) for r in ro]
    assert sum(r.counters["summaries"] >= 1 for r in ro) >= 4   # the scan survives summaries
    # the right count is rewarded only after every card was read (a guess is not)
    env, task = make_env("redcount"), tasks[0]
    env.reset(task)
    assert env.step("finish", {"answer": sum(task["red"])}).reward == 0.0
    env.reset(task)
    for i in range(task["cards"]):
        env.step("read", {"i": i})
    assert env.step("finish", {"answer": sum(task["red"]) + 1}).reward == 0.0
    env.reset(task)
    for i in range(task["cards"] + 1):   # reading past the end costs nothing but a turn
        env.step("read", {"i": i})
    assert env.step("finish", {"answer": sum(task["red"])}).reward == 1.0


def test_readme_command_is_the_one_documented_and_rollout_cli_runs_it(rc_dir):
    assert COMMAND == ("supo-jax train --set 'env.imports=[\"my_envs.redcount\"]' "
                       "--set env.name=redcount --set train.run_dir=runs/redcount")
    out = rc_dir / "r.jsonl"
    r = subprocess.run([sys.executable, "-m", "supo_jax.cli", "rollout", "--env", "redcount",
                        "--set", 'env.imports=["my_envs.redcount"]', "--policy", "scripted",
                        "--num", "4", "--out", str(out)], capture_output=True, text=True,
                       cwd=rc_dir, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"success_rate\s+1\.0", r.stdout)
    # its output, as sft.demos, gives the rows the rollouts trained on (summaries included)
    from supo_jax.agent.rollout import Rollout
    from supo_jax.rl.runs import env_tokenizer
    cfg = load_config(None, ['env.imports=["my_envs.redcount"]', "env.name=redcount"])
    fmt = ChatFormat(env_tokenizer(cfg))
    recs = [Rollout.from_json(json.loads(line)) for line in out.read_text().splitlines()]
    assert sum(x.counters["summaries"] for x in recs) >= 2
    tools = [t.schema() for t in make_env("redcount").reset(make_tasks("redcount", "train", 1)[0]).tools]
    assert jsonl_segments(fmt, str(out), tools, ctx=cfg.context) == [
        s for x in recs for s in x.segments]
    # the task needs summaries: under `full` at the same W the expert solves none
    before = sorted(p.name for p in rc_dir.iterdir())
    assert "r.jsonl" in before
    r = subprocess.run("supo-jax rollout --env redcount --set 'env.imports=[\"my_envs.redcount\"]' "
                       "--policy scripted --context full --num 16", shell=True,
                       capture_output=True, text=True, cwd=rc_dir, env=user_shell_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^success_rate\s+(\S+)$", r.stdout, re.M).group(1) == "0.0"
    assert re.search(r"^summary_state_share\s+-$", r.stdout, re.M)   # no probe: no figure
    assert sorted(p.name for p in rc_dir.iterdir()) == before   # no --out: nothing written


def test_knobs_belong_to_their_environment():
    assert apply_overrides(cpu_recipe(), ["env.name=fncall/count"]).env.knobs == {}
    cfg = apply_overrides(cpu_recipe(), ["env.knobs.size=[3, 4]", "env.name=fncall/count"])
    assert cfg.env.knobs == {"size": [3, 4]}
    assert apply_overrides(cpu_recipe(), ["env.knobs.size=[3, 4]"]).env.knobs == {"size": [3, 4]}
    with pytest.raises(ConfigError, match=r"env\.knobs\.sise: .*takes no knob 'sise' "
                                          r"\(it takes: families, size\)"):
        apply_overrides(cpu_recipe(), ["env.knobs.sise=3"])
    with pytest.raises(ConfigError, match=r"env\.eval_knobs\.bogus"):
        apply_overrides(cpu_recipe(), ["env.name=search", "env.eval_knobs.bogus=1"])
    with pytest.raises(ConfigError, match=r"sft\.steps=0, .*train\.sft_warm_start=false"):
        apply_overrides(cpu_recipe(), ["sft.steps=0"])     # was an IndexError after the demos
    apply_overrides(cpu_recipe(), ["sft.steps=0", "train.sft_warm_start=false"])


def test_a_knob_the_task_generator_rejects_fails_at_start(rc_dir):
    sets = ['env.imports=["my_envs.redcount"]', "env.name=redcount"]
    assert apply_overrides(cpu_recipe(), sets + ["env.knobs.size=9"]).env.knobs == {"size": 9}
    with pytest.raises(ConfigError, match=r"env\.knobs=\{'size': \[5, 9\]\}: the task generator "
                                          r"of 'redcount' fails with them \(TypeError: "):
        apply_overrides(cpu_recipe(), sets + ["env.knobs.size=[5, 9]"])
    with pytest.raises(ConfigError, match=r"env\.eval_knobs=\{'size': 'x'\}"):
        apply_overrides(cpu_recipe(), sets + ["env.eval_knobs.size=x"])


def test_no_expert_is_a_clear_error_and_a_model_policy_needs_none(rc_dir, tmp_path, capsys):
    (rc_dir / "my_envs" / "noexp.py").write_text(EXAMPLE.split("# Optional:")[0].replace(
        'register_env("redcount"', 'register_env("redcount_noexp"'))
    sets = ['env.imports=["my_envs.noexp"]', "env.name=redcount_noexp"]
    with pytest.raises(ConfigError, match="has no scripted expert.*sft.demos=PATH"):
        apply_overrides(cpu_recipe(), sets)
    cfg = apply_overrides(cpu_recipe(), sets + ["train.sft_warm_start=false"])
    from supo_jax.rl.runs import env_corpus, env_tokenizer
    corpus = "\n".join(env_corpus(cfg, n=2))
    assert "There are 1" in corpus and '"name": "read"' in corpus and "card 1 is " in corpus
    assert len(env_tokenizer(cfg)) <= cfg.model.tiny_vocab + 64
    from supo_jax.cli import main
    rc = main(["rollout", "--env", "redcount_noexp", "--set", 'env.imports=["my_envs.noexp"]',
               "--policy", "scripted", "--num", "2", "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "--policy scripted: environment 'redcount_noexp' has no scripted expert" in err[0]


def test_state_expert_round_trips_its_summary_and_drops_keys_on_purpose():
    class Ex(E.StateExpert):
        def start(self, prompt):
            return {"n": 3, "seen": []}

        def update(self, s, obs):
            return {**s, "seen": s["seen"] + [obs]}

        def decide(self, s):
            return ("more", "look", {"i": len(s["seen"])}) if len(s["seen"]) < s["n"] else \
                ("done", "finish", {"answer": len(s["seen"])})

    ex = Ex("toy")
    msgs = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "x"}]
    assert ex.act(msgs) == 'more\n<tool_call>\n{"name": "look", "arguments": {"i": 1}}\n</tool_call>'
    summary = ex.act(msgs, summarize=True)
    assert summary.startswith("<summary>State: ") and summary.endswith("</summary>")
    cont = ContextConfig("supo", 100).continuation.format(summary=summary[9:-10])
    resumed = [{"role": "user", "content": "task"}, {"role": "user", "content": cont},
               {"role": "assistant", "content": "b"}, {"role": "tool", "content": "y"}]
    assert ex.state_of(resumed) == {"n": 3, "seen": ["x", "y"]}
    dropper = Ex("toy", summary_drop=1.0)
    s = dropper.act(msgs, summarize=True)
    assert dropper.dropped == 1 and len(dropper.parse_summary(s)) == 1
    assert Ex("toy").parse_summary("no state here") == {}


def test_chat_messages_demonstrations_with_standard_tool_calls(tmp_path):
    fmt = ChatFormat(tiny_tokenizer())
    call = {"type": "function", "function": {"name": "inc", "arguments": "{}"}}
    msg = {"role": "assistant", "content": "Once.", "tool_calls": [call]}
    assert assistant_text(msg) == 'Once.\n<tool_call>\n{"name": "inc", "arguments": {}}\n</tool_call>'
    assert assistant_text({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "finish", "arguments": {"answer": 1}}}]}).startswith("<tool_call>")
    demo = {"messages": [{"role": "user", "content": "Call inc once."}, msg,
                         {"role": "tool", "content": "count=1"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "finish",
                                                       "arguments": {"answer": 1}}}]}]}
    p = tmp_path / "demos.jsonl"
    p.write_text(json.dumps(demo) + "\n\n" + json.dumps({"messages": [{"role": "assistant"}]}) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl:3: bad demonstration"):
        jsonl_segments(fmt, str(p))
    p.write_text(json.dumps(demo) + "\n")
    tools = [{"type": "function", "function": {"name": "inc", "description": "add one",
                                                "parameters": {}}},
             {"type": "function", "function": {"name": "finish", "parameters": {
                 "type": "object", "properties": {"answer": {"type": "integer"}},
                 "required": ["answer"]}}}]
    [seg] = jsonl_segments(fmt, str(p), default_tools=tools)
    trained = fmt.decode([t for t, m in zip(seg.tokens, seg.mask) if m])
    assert '"name": "inc"' in trained and '"answer": 1' in trained and "count=1" not in trained
    assert len(jsonl_segments(fmt, str(p), tools, max_len=len(seg) - 1)) == 1   # fits a row
    bad = [({"conversations": demo["messages"]}, r'"messages" list expected, got keys '
                                                   r"\['conversations'\]"),
           ({"messages": [demo["messages"][0], {"role": "assistant", "tool_calls": [
               {"function": {"name": "inc", "arguments": '{"n": 1'}}]}]},
            r"tool call 'inc': its arguments string is not JSON"),
           ({"messages": [demo["messages"][0], {"role": "assistant", "tool_calls": [
               {"function": {"name": "look", "arguments": {}}}]}]},
            r"a tool call the rollout loop would reject: unknown tool .look.; valid tools: "
            r"finish, inc"),
           ({"messages": [demo["messages"][0], {"role": "assistant", "tool_calls": [
               {"function": {"name": "finish", "arguments": {"answr": 1}}}]}]},
            r"missing required argument .answer. for finish"),
           ({"messages": [demo["messages"][0], {"role": "function", "content": "x"}]},
            r"a message of role 'function': roles are system, user, assistant, tool"),
           ({"messages": [demo["messages"][0], {"role": "assistant", "summary": True,
                                                "content": "State: 0."}]},
            r"a summary turn before any action")]
    for d, err in bad:
        p.write_text(json.dumps(demo) + "\n" + json.dumps(d) + "\n")
        with pytest.raises(ValueError, match=r"demos.jsonl:2: bad demonstration \(.*" + err):
            jsonl_segments(fmt, str(p), tools)
    p.write_text(json.dumps(demo) + "\n")
    with pytest.raises(ValueError, match=rf"demos.jsonl:1: a demonstration, {len(seg)} tokens"
                                         rf", where a training row holds at most {len(seg) - 1} .*"
                                         "context.working_context"):
        jsonl_segments(fmt, str(p), tools, max_len=len(seg) - 2)
    assert "add one" in fmt.decode(list(seg.tokens))   # the default tools are in the prompt
    assert [seg] == conversation_segments(fmt, demo["messages"], tools)
    with pytest.raises(ConfigError, match="sft.demos='nope.jsonl': no such file"):
        apply_overrides(cpu_recipe(), ["sft.demos=nope.jsonl"])


def test_every_command_builds_the_same_tokenizer():
    cfg = load_config(None, ["env.name=fncall/count"])
    from supo_jax.rl.runs import env_tokenizer
    a, b = env_tokenizer(cfg), env_tokenizer(cfg)
    assert a.get_vocab() == b.get_vocab() and len(a) > 600   # model.tiny_vocab (1024), not 512


# docs/ENVIRONMENTS.md's short run of that command: every part of it (an SFT on the expert's
# demonstrations, two RL steps, evaluations, checkpoint, export) in about a minute. The full command
# runs in the Quickstart's test (tests/test_readme.py: the same path on fncall/tallest, with its
# learning checked); redcount's own runs are in experiments/LOG.md (2026-11-28)
CHECK = re.search(r"\n    (supo-jax train --set 'env.imports=\[\"my_envs.redcount\"\]'[^\n]*"
                  r"train.steps=[^\n]*)\n", DOCS["ENVIRONMENTS.md"]).group(1)


@pytest.mark.long
def test_environment_check_command_verbatim(rc_dir):
    """docs/ENVIRONMENTS.md's short run of the README's command, as written, from the
    directory holding my_envs/: its table, its metrics and its export."""
    assert CHECK.startswith(COMMAND.replace("runs/redcount", "runs/redcount_check") + " --set ")
    r = subprocess.run(CHECK, shell=True, cwd=rc_dir, env=user_shell_env(), capture_output=True,
                       text=True, timeout=600, preexec_fn=user_shell_cores)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m: [float(x) for x in re.search(rf"^{m}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                                             r.stdout, re.M).groups()]
            for m in ("success_rate", "overlong_rate")}
    assert all(0.0 <= x <= 1.0 for v in rows.values() for x in v), rows
    run = rc_dir / "runs" / "redcount_check"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2], metrics
    # the RL steps train (after a short SFT a step may still find no group with an advantage)
    assert any(m["updates"] >= 1 and np.isfinite(m["loss"]) for m in steps), steps
    assert sum("eval/success_rate" in m for m in metrics) == 2      # before and after
    ev = json.loads((run / "eval.json").read_text())
    assert ev["sft_demo_success"] == 1.0 and ev["sft_loss_last"] < ev["sft_loss_first"]
    assert ev["expert_success_rate"] == 1.0 and ev["expert_cut_actions"] == 0   # its ceiling
    assert (run / "hf" / "config.json").exists() and (run / "checkpoints").is_dir()


BOOM = '''
from supo_jax.envs.base import register_env
from supo_jax.envs.experts import register_expert
from my_envs.redcount import RedCount, RedCountExpert, tasks

@register_env("redcount_boom", tasks=tasks)
class Boom(RedCount):
    def reset(self, task):
        if task["red"][0]:
            raise OSError("no deck today")
        return super().reset(task)

    def step(self, name, args):
        if name == "read" and args["i"] == 1 and sum(self.task["red"]) % 2 == 0:
            raise RuntimeError("card 1 exploded")
        return super().step(name, args)

register_expert("redcount_boom", RedCountExpert)
'''


def test_an_environment_that_raises_fails_its_rollouts_not_the_command(rc_dir):
    """Exceptions in a user's reset / step: the tiny tokenizer's corpus skips what the expert
    could not reach (it used to raise out of every command), the rollouts that hit them end as
    env_error, env_error_rate counts them and each kind of error is printed once."""
    from supo_jax.rl.runs import env_corpus
    from supo_jax.rl.trainer import _REPORTED_ERRORS, report_env_errors

    (rc_dir / "my_envs" / "boom.py").write_text(BOOM)
    cfg = apply_overrides(cpu_recipe(), ['env.imports=["my_envs.boom"]', "env.name=redcount_boom"])
    corpus = "\n".join(env_corpus(cfg))
    assert "card 0 is blue." in corpus and "There are 1" in corpus
    fmt = ChatFormat(tiny_tokenizer(template="compact"))
    tasks = make_tasks("redcount_boom", "train", 24)
    ctx = ContextConfig("supo", 800, max_summaries=8, max_steps=60, max_action_tokens=64,
                        max_summary_tokens=60, max_observation_tokens=16)
    ro = run_rollouts(ScriptedActor(E.expert_for("redcount_boom"), fmt),
                      lambda: make_env("redcount_boom"), tasks, fmt, ctx)
    bad = {"reset": [t["red"][0] for t in tasks],
           "step": [not t["red"][0] and sum(t["red"]) % 2 == 0 for t in tasks]}
    assert any(bad["reset"]) and any(bad["step"])
    for r, rs, st in zip(ro, bad["reset"], bad["step"]):
        assert r.reason == ("env_error" if rs or st else "answer"), (r.reason, r.transcript[-1])
    from supo_jax.agent.rollout import summarize
    assert summarize(ro)["env_error_rate"] == (sum(bad["reset"]) + sum(bad["step"])) / len(ro)
    _REPORTED_ERRORS.clear()
    lines = []
    report_env_errors(ro, log=lines.append)
    report_env_errors(ro, log=lines.append)          # the same errors again: not reprinted
    assert len(lines) == 2, lines
    assert any("OSError('no deck today')" in x for x in lines)
    assert any("RuntimeError('card 1 exploded')" in x for x in lines)


def test_summary_turns_split_a_demonstration_as_supo_splits_a_rollout(tmp_path):
    """A rollout's transcript (as `supo-jax rollout --out` writes it) and the same conversation
    written by hand with summary turns give exactly the rows SUPO trained on."""
    fmt = ChatFormat(tiny_tokenizer(template="compact"))
    ctx = ContextConfig("supo", 700, max_summaries=8, max_steps=60, max_action_tokens=60,
                        max_summary_tokens=60, max_observation_tokens=40)
    tasks = make_tasks("fncall/count", "train", 6, size=[7, 9])
    ro = run_rollouts(ScriptedActor(E.expert_for("fncall/count"), fmt),
                      lambda: make_env("fncall/count"), tasks, fmt, ctx)
    won = [r for r in ro if r.reward > 0]
    assert len(won) >= 4 and all(r.counters["summaries"] >= 1 for r in won)
    assert any(m.get("dropped") for r in won for m in r.transcript)
    tools = [t.schema() for t in make_env("fncall/count").reset(tasks[0]).tools]
    p = tmp_path / "rollouts.jsonl"
    p.write_text("".join(json.dumps(r.to_json()) + "\n" for r in ro))
    assert jsonl_segments(fmt, str(p), tools, ctx=ctx) == [s for r in won for s in r.segments]
    p.write_text("".join(json.dumps(dict(r.to_json(), reward=0.0)) + "\n" for r in ro))
    with pytest.raises(ValueError, match=rf"none of its {len(ro)} rollouts has a positive reward"):
        jsonl_segments(fmt, str(p), tools, ctx=ctx)
    p.write_text("".join(json.dumps(r.to_json()) + "\n" for r in ro))
    # by hand: no summary instruction, no continuation, no tags, the dropped pair left out
    r = max(won, key=lambda r: r.counters["summaries"])
    by_hand = [dict(m, content=extract_summary(m["content"])) if m.get("summary") else m
               for m in r.transcript if not (m.get("dropped") or m.get("continuation")
                                             or m["content"] == ctx.summary_instruction)]
    assert len(by_hand) < len(r.transcript) - 2 * r.counters["summaries"]
    assert conversation_segments(fmt, by_hand, tools, ctx) == r.segments
    # a row too long names itself; a summary turn with tool calls is an error
    p.write_text(json.dumps({"messages": by_hand, "tools": tools}) + "\n")
    longest = max(len(s.tokens) for s in r.segments)
    with pytest.raises(ValueError, match=rf"rollouts.jsonl:1: row \d+ of {len(r.segments)} of a "
                                         rf"demonstration, {longest} tokens.*summary turns"):
        jsonl_segments(fmt, str(p), max_len=longest - 2, ctx=ctx)
    bad = by_hand[:2] + [{"role": "assistant", "summary": True, "content": "x",
                          "tool_calls": [{"function": {"name": "finish", "arguments": {}}}]}]
    with pytest.raises(ValueError, match="a summary turn cannot make tool calls"):
        conversation_segments(fmt, bad, tools, ctx)


def test_an_environment_probe_gives_summary_state_share(rc_dir):
    """README: an environment's optional probe(summary) feeds summary_state_share (nan
    without one)."""
    from supo_jax.agent.rollout import summarize
    from supo_jax.envs.base import register_env

    apply_overrides(cpu_recipe(), ['env.imports=["my_envs.redcount"]', "env.name=redcount"])
    from my_envs.redcount import RedCount, RedCountExpert, tasks

    class Probed(RedCount):
        def reset(self, task):
            self.read = 0
            return super().reset(task)

        def step(self, name, args):
            if name == "read":
                self.read = max(self.read, args["i"] + 1)
            return super().step(name, args)

        def probe(self, summary):   # the next card, before or after the last read
            return any(f'"next": {n},' in summary for n in (self.read - 1, self.read))

    register_env("redcount_probed", tasks=tasks)(Probed)
    E.register_expert("redcount_probed", RedCountExpert)
    fmt = ChatFormat(tiny_tokenizer(template="compact"))
    ctx = ContextConfig("supo", 800, max_summaries=8, max_steps=60, max_action_tokens=64,
                        max_summary_tokens=60, max_observation_tokens=16)
    out = {}
    for name in ("redcount", "redcount_probed"):
        ro = run_rollouts(ScriptedActor(E.expert_for(name), fmt), lambda: make_env(name),
                          make_tasks(name, "train", 8), fmt, ctx)
        assert sum(r.counters["summaries"] for r in ro) >= 4
        out[name] = summarize(ro)["summary_state_share"]
    assert out["redcount"] != out["redcount"] and out["redcount_probed"] == 1.0


def test_the_shipped_example_runs_from_the_repository_root(tmp_path):
    """my_envs/redcount.py ships with the repository: the docs' env.imports finds it from the
    root, as the README's command is run in a fresh clone."""
    from tests.readme_helpers import ROOT

    out = tmp_path / "r.jsonl"
    p = subprocess.run([sys.executable, "-m", "supo_jax.cli", "rollout", "--env", "redcount",
                        "--set", 'env.imports=["my_envs.redcount"]', "--policy", "scripted",
                        "--context", "supo", "--num", "2", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(x) for x in open(out)]
    assert [r["reason"] for r in rows] == ["answer", "answer"]
