"""BFCL multi-turn (supo_jax.envs.bfcl) against bfcl-eval itself: the verdict of `score` on
ground-truth and altered call sequences of every category equals bfcl-eval's
multi_turn_checker's (which evaluates the call strings of the dataset; `score` never does),
on all 800 tasks."""
import importlib.util
import itertools
import json
import random

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None,
    reason="bfcl-eval is not installed (pip install --no-deps bfcl-eval==2026.3.23; CI does)")

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
_RUN = itertools.count()


def _bfcl_verdict(category, task_id, calls):
    """bfcl-eval's runner's decision: the turn-count check, then multi_turn_checker (with a
    model name of its own per call: its executor keeps instances in module globals by name)."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    from supo_jax.envs.bfcl.data import entries, ground_truth

    truth = ground_truth(category)[task_id]
    if len(calls) != len(truth):
        return False
    decoded = [[s for s in turn if s] for turn in calls]     # the runner drops empty steps
    res = multi_turn_checker(decoded, truth, dict(entries(category)[task_id]),
                             f"multi_turn_{category}", f"supo_check_{next(_RUN)}")
    return bool(res["valid"])


def _changed(call: str) -> str:
    """The call with its first argument's value changed to another literal."""
    from supo_jax.envs.bfcl import parse_call

    name, args, kwargs = parse_call(call)
    alter = lambda v: (not v if isinstance(v, bool) else "x" + v if isinstance(v, str)
                       else v + 1 if isinstance(v, (int, float)) else v[:-1] if v else [0])
    if args:
        args = [alter(args[0])] + args[1:]
    elif kwargs:
        k = next(iter(kwargs))
        kwargs = {**kwargs, k: alter(kwargs[k])}
    return f"{name}(" + ", ".join([repr(a) for a in args]
                                  + [f"{k}={v!r}" for k, v in kwargs.items()]) + ")"


def _alterations(truth, rng):
    """Call sequences near the ground truth: as is (one step a turn), each turn's calls one a
    step, one call dropped, an argument changed, a turn emptied, a call repeated, two turns
    swapped, one turn too few."""
    steps = lambda turns: [[t] if t else [] for t in turns]
    out = {"truth": steps(truth), "one_call_a_step": [[[c] for c in t] for t in truth]}
    busy = [i for i, t in enumerate(truth) if t]
    if busy:
        i = rng.choice(busy)
        j = rng.randrange(len(truth[i]))
        out["dropped"] = steps([t if k != i else t[:j] + t[j + 1:] for k, t in enumerate(truth)])
        changed = _changed(truth[i][j])
        out["argument"] = steps([t if k != i else t[:j] + [changed] + t[j + 1:]
                                 for k, t in enumerate(truth)])
        out["emptied"] = steps([t if k != i else [] for k, t in enumerate(truth)])
        out["repeated"] = steps([t if k != i else t + [t[j]] for k, t in enumerate(truth)])
    if len(truth) > 1:
        a, b = rng.sample(range(len(truth)), 2)
        sw = list(truth)
        sw[a], sw[b] = sw[b], sw[a]
        out["swapped"] = steps(sw)
    out["short"] = steps(truth[:-1])
    return out


@pytest.mark.parametrize("category", CATEGORIES)
def test_score_agrees_with_bfcl_checker(category):
    from supo_jax.envs.bfcl import score
    from supo_jax.envs.bfcl.data import ground_truth

    rng = random.Random(category)
    ids = sorted(ground_truth(category))
    assert len(ids) == 200
    kinds = {}
    for tid in ids:
        for kind, calls in _alterations(ground_truth(category)[tid], rng).items():
            mine, theirs = score(category, tid, calls), _bfcl_verdict(category, tid, calls)
            assert mine == theirs, (category, tid, kind, calls)
            kinds.setdefault(kind, []).append(mine)
    assert all(kinds["truth"]) and not any(kinds["short"])
    # the alterations exercise both verdicts
    assert not all(kinds["dropped"]) and not all(kinds["argument"])


def test_every_ground_truth_call_parses_and_passes():
    """All 800 tasks' ground truth: every call parses as a literal call, and the sequence
    passes `score` (one step a turn)."""
    from supo_jax.envs.bfcl import parse_call, score
    from supo_jax.envs.bfcl.data import ground_truth

    for category in CATEGORIES:
        for tid, truth in ground_truth(category).items():
            for turn in truth:
                for call in turn:
                    parse_call(call)
            assert score(category, tid, [[t] if t else [] for t in truth]), (category, tid)


def test_calls_are_never_evaluated():
    """Text that is not a call of a function by name with literal arguments is refused
    before anything runs; names BFCL refuses are refused; unknown names are errors."""
    from supo_jax.envs.bfcl.calls import Simulators, parse_call
    from supo_jax.envs.bfcl.data import entries

    for bad in ["__import__('os').system('true')", "ls(a=open('/etc/passwd').read())",
                "cd(folder=x)", "(lambda: 1)()", "ls(**{'a': True})", "ls(a=True) + 1",
                "x" * 10_000 + "(", "\udcff(1)"]:
        with pytest.raises(ValueError):
            parse_call(bad)
    sims = Simulators.fresh(entries("base")["multi_turn_base_0"], "base")
    assert sims.run("__import__('os').system('true')").startswith("Error during execution:")
    assert sims.run("exit()") == "Error during execution: Function call exit is not allowed."
    assert sims.run("nope(a=1)") == "Error during execution: name 'nope' is not defined"
    assert sims.run("ls(a=True)").startswith('{"current_directory_content"')


def _fmt():
    from supo_jax.agent.render import ChatFormat
    from supo_jax.model.tiny import tiny_tokenizer
    return ChatFormat(tiny_tokenizer(template="qwen"))


@pytest.mark.slow
def test_ground_truth_replays_at_one_in_every_category():
    """The scripted expert (each turn's ground-truth calls in one action, then a reply)
    through the environments under `full` with room for every history: all 800 tasks pass
    BFCL's verdict, the reward of every rollout."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.environment import split_ids
    from supo_jax.envs.experts import expert_for

    fmt = _fmt()
    cfg = ContextConfig(manager="full", working_context=1_000_000, max_steps=400,
                        max_action_tokens=8192, max_observation_tokens=1_000_000,
                        trigger_rule="paper")
    for category in CATEGORIES:
        name = f"bfcl/{category}"
        train, test = split_ids(category, "train"), split_ids(category, "eval")
        assert len(train) == 160 and len(test) == 40 and not set(train) & set(test)
        tasks = [{"task_id": i, "family": name, "category": category} for i in train + test]
        ro = run_rollouts(ScriptedActor(expert_for(name), fmt), lambda: make_env(name), tasks,
                          fmt, cfg, rows=16)
        failed = [(r.task_id, r.reason) for r in ro if r.reward != 1.0 or r.reason != "answer"]
        assert not failed, (category, failed[:5])
        # each rollout records its executed calls in BFCL's decoded form (what `supo-jax
        # rollout --out` writes), which bfcl-eval's own checker passes
        from supo_jax.agent.rollout import Rollout
        for r in ro[:10]:
            calls = Rollout.from_json(json.loads(json.dumps(r.to_json()))).env_info["calls"]
            assert _bfcl_verdict(category, r.task_id, calls), (category, r.task_id)


@pytest.mark.parametrize("manager", ["state", "fold"])
def test_ground_truth_replays_under_the_state_and_fold_managers(manager):
    """context.manager=state: the expert begins every reply with a state block naming its
    task and turn ("BFCL <id> turn <k> done") and, reading it back (the context is s1 and
    the latest turn), passes 40 tasks of every category, tasks that share a first question
    included (told apart by the next user turn). fold: the expert works in branches
    (for_context) and passes them too: a user request that arrives inside a branch stays in
    view after the fold."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.data import entries
    from supo_jax.envs.bfcl.environment import split_ids
    from supo_jax.envs.experts import FoldingExpert, expert_for, for_context

    fmt = _fmt()
    cfg = ContextConfig(manager=manager, working_context=1_000_000, max_steps=400,
                        max_action_tokens=8192, max_observation_tokens=1_000_000,
                        max_state_tokens=8192)
    for category in CATEGORIES:
        name = f"bfcl/{category}"
        ids = split_ids(category, "train")[:40]
        first = lambda i: entries(category)[i]["question"][0][0]["content"]
        assert any(first(i) == first(j) for i in ids for j in entries(category) if j != i)
        tasks = [{"task_id": i, "family": name, "category": category} for i in ids]
        # fold: branches of four calls (unsized: at this W one branch would hold a task)
        expert = (FoldingExpert(expert_for(name), continuation=cfg.continuation)
                  if manager == "fold" else for_context(expert_for(name), cfg))
        ro = run_rollouts(ScriptedActor(expert, fmt),
                          lambda: make_env(name), tasks, fmt, cfg, rows=16)
        failed = [(r.task_id, r.reason) for r in ro if r.reward != 1.0 or r.reason != "answer"]
        assert not failed, (category, failed[:5])
        if manager == "state":
            assert all(r.counters["states"] == r.counters["steps"] for r in ro)
        else:
            assert sum(r.counters["folds"] > 1 for r in ro) >= 20


@pytest.mark.long
def test_ground_truth_replays_under_supo_at_8k_on_long_context():
    """SUPO at W = 8192 with a real tokenizer (SmolLM2-135M-Instruct's; BFCL's docs in the
    system prompt, ~5.4K tokens): every long_context task still passes, a third of them
    after summarizing (62% of these histories exceed 8K tokens under `full`)."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.environment import split_ids
    from supo_jax.envs.experts import expert_for
    from supo_jax.model.policy import load_tokenizer
    from supo_jax.model.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"no SmolLM2 GGUF: {e}")
    fmt = ChatFormat(load_tokenizer(path))
    cfg = ContextConfig(manager="supo", working_context=8192, max_summaries=20, max_steps=400,
                        max_action_tokens=2048, max_summary_tokens=64,
                        max_observation_tokens=2048, trigger_rule="paper", summary_role="system")
    name = "bfcl/long_context"
    tasks = [{"task_id": i, "family": name, "category": "long_context"}
             for sp in ("train", "eval") for i in split_ids("long_context", sp)]
    ro = run_rollouts(ScriptedActor(expert_for(name), fmt), lambda: make_env(name), tasks, fmt,
                      cfg, rows=16)
    failed = [(r.task_id, r.reason) for r in ro if r.reward != 1.0 or r.reason != "answer"]
    assert not failed, failed[:5]
    assert sum(r.counters["summaries"] > 0 for r in ro) >= 50
    assert max(r.counters["max_context"] for r in ro) <= 8192


def test_bad_calls_are_error_observations_and_text_ends_the_turn():
    from supo_jax.envs import make_env

    env = make_env("bfcl/base")
    env.reset({"task_id": "multi_turn_base_0"})
    bad = env.act('<tool_call>{"name": "cd", "arguments": {"nope": 1}}</tool_call>')
    assert not bad.done and bad.role == "tool" and bad.observation.startswith("Error:")
    assert env.calls == [[]]                              # nothing ran, nothing recorded
    ok = env.act('<tool_call>{"name": "cd", "arguments": {"folder": "document"}}</tool_call>')
    assert ok.observation == '{"current_working_directory": "document"}'
    assert env.calls == [[["cd(folder='document')"]]]
    nxt = env.act("Moved.")
    assert nxt.role == "user" and not nxt.done and nxt.observation.startswith("Perform a detailed")
    for _ in range(3):
        last = env.act("ok")
    assert last.done and last.reward == 0.0              # turns without the calls fail


def test_a_summary_restart_keeps_the_current_user_turn():
    """After a user turn arrived (role "user"), a summary restart's context is the initial
    prompt, the continuation with the summary, then that user turn."""
    from supo_jax.agent.context import ContextConfig, Turn, after_action, after_summary
    from supo_jax.agent.rollout import _start

    fmt = _fmt()
    cfg = ContextConfig(manager="supo", working_context=4096, max_summaries=2, max_steps=50,
                        trigger_rule="paper")
    state = _start(fmt, cfg, None, "first request", [])
    act = lambda text: Turn(tuple(fmt.encode(text)) + (fmt.stop_id,), (0.0,) * (
        len(fmt.encode(text)) + 1), text)
    state = after_action(cfg, fmt, state, act("calling"), "result", False)
    state = after_action(cfg, fmt, state, act("done"), "second request", False, role="user")
    assert state.user_turn == "second request" and state.messages[-1]["role"] == "user"
    state = after_action(cfg, fmt, state, act("calling again"), "result 2", False)
    restarted = after_summary(cfg, fmt, state, act("<summary>did the first</summary>"))
    assert [m["role"] for m in restarted.messages][-2:] == ["user", "user"]
    assert restarted.messages[-1]["content"] == "second request"
    assert "did the first" in restarted.messages[-2]["content"]
    tail = tuple(fmt.turn("user", "user", "second request"))
    assert restarted.tokens[-len(tail):] == tail
    assert restarted.tokens[:len(state.prefix)] == state.prefix


@pytest.mark.parametrize("role", ["system", "user"])
def test_expert_summary_names_the_turn_whatever_the_instruction_role(role):
    """A summary request ends the messages with its instruction, a user message under
    context.summary_role=user: the expert's summary names the current turn, not one more."""
    from supo_jax.envs.bfcl.data import entries
    from supo_jax.envs.bfcl.environment import BFCLExpert, turn_text

    tid, entry = next((i, e) for i, e in entries("base").items() if len(e["question"]) >= 3)
    expert = BFCLExpert("base")
    messages = [{"role": "user", "content": turn_text(entry, 0)}]
    for k in (1, 2):
        messages += [{"role": "assistant", "content": expert.act(messages)},
                     {"role": "tool", "content": "{}"},
                     {"role": "assistant", "content": expert.act(messages)},
                     {"role": "user", "content": turn_text(entry, k)}]
    messages.append({"role": role, "content": "Context full. Summarize the state."})
    assert expert.act(messages, summarize=True) == f"<summary>BFCL {tid} turn 2 done</summary>"


@pytest.mark.slow
@pytest.mark.parametrize("category", ["long_context"])
def test_trains_and_evaluates_with_the_project_commands(category, tmp_path):
    """`supo-jax train` on bfcl/<category> with the tiny policy: an SFT warm start on the
    ground truth (its demonstrations succeed), an RL step under SUPO, the final eval; then
    `supo-jax eval` on the run directory at two summary caps. The category whose
    demonstrations need summaries (they hold what a plain category's do, and restarts): the
    trainer does nothing per category, and every category's environment is replayed whole
    above (ground truth under full, supo, state and fold) and fuzzed (tests/test_fuzz.py)."""
    import math
    import os

    from supo_jax import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sets = [f"env.name=bfcl/{category}", "env.knobs={}", "env.eval_tasks=1",
            "sft.num_demos=2", "sft.steps=1", "sft.batch_rows=2",
            "context.working_context=4096", "context.max_steps=40",
            "context.max_action_tokens=256", "context.max_observation_tokens=512",
            "context.max_summary_tokens=64", "train.steps=1", "rollout.tasks_per_step=1",
            "rollout.rows=2", f"train.run_dir={tmp_path}"]
    if category == "long_context":     # its demos outgrow the context: summaries restart them
        sets += ["context.working_context=8192", "context.max_observation_tokens=2048",
                 "context.max_summaries=8"]
    args = ["--config", os.path.join(root, "experiments", "configs", "tiny_test.py")]
    for s in sets:
        args += ["--set", s]
    assert cli.main(["train", *args]) in (0, None)
    ev = json.load(open(tmp_path / "eval.json"))
    assert ev["sft_demo_success"] == 1.0 and math.isfinite(ev["sft_loss_last"])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    step = [r for r in rows if "loss" in r]
    assert [r["step"] for r in step] == [1] and step[0]["rollouts"] == 2
    assert math.isfinite(step[0]["loss"]) and "success_rate" in ev["eval"]
    assert cli.main(["eval", *args, "--max-summaries", "0,3"]) in (0, None)
    caps = json.load(open(tmp_path / "eval_scaling.json"))
    assert [c["max_summaries"] for c in caps] == [0, 3]
    assert all(0.0 <= c["success_rate"] <= 1.0 for c in caps)
