"""BFCL's environments: every rollout and scoring replay has a world of its own; a call that
would run for minutes ends its rollout at the step's deadline, and the batch goes on; and
the handling of calls that follows BFCL's executor (each call checked on its own, a reply
ending a turn is no tool call) or departs from it as docs/ENVIRONMENTS.md says."""
import importlib.util
import time

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bfcl_eval") is None,
    reason="bfcl-eval is not installed (pip install --no-deps bfcl-eval==2026.3.23; CI does)")

TRAVEL = "multi_turn_long_context_151"      # TravelAPI in its long scenario
EXTRA_CARD = "1234567812345678"             # one of the long scenario's extra cards
MATH = "multi_turn_base_15"                 # GorillaFileSystem and MathAPI


def _call(name, **arguments):
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _episode(category, task_id, actions, **knobs):
    """The observations of one episode of `actions`, ended by text replies; its reward."""
    from supo_jax.envs import make_env

    env = make_env(f"bfcl/{category}")
    env.reset({"task_id": task_id, **knobs})
    seen = [env.act(a).observation for a in actions]
    while not (res := env.act("Done.")).done:
        seen.append(res.observation)
    return seen, res.reward, res.info


def _mutables(root) -> dict[int, str]:
    """id -> path of every mutable object reachable from root (attributes, items)."""
    out, stack = {}, [("", root)]
    while stack:
        path, o = stack.pop()
        if id(o) in out or isinstance(o, (str, bytes, int, float, bool, type(None), type)):
            continue
        if isinstance(o, dict):
            out[id(o)] = path
            stack += [(f"{path}[{k!r}]", v) for k, v in o.items()]
        elif isinstance(o, (list, set, tuple)):
            if not isinstance(o, tuple):
                out[id(o)] = path
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(o)]
        elif hasattr(o, "__dict__"):
            out[id(o)] = path
            stack += [(f"{path}.{k}", v) for k, v in vars(o).items()]
    return out


def test_a_task_run_twice_in_one_process_sees_the_same_world():
    """A purchase on a long scenario's extra card in one rollout leaves the next rollout of
    the task (same process) the card as it was: same observations, same verdict."""
    insure = _call("purchase_insurance", access_token="abc123xyz", insurance_type="comprehensive",
                   booking_id="booking_901", insurance_cost=400.0, card_id=EXTRA_CARD)
    balance = _call("get_credit_card_balance", access_token="abc123xyz", card_id=EXTRA_CARD)
    first = _episode("long_context", TRAVEL, [balance, insure, balance])
    assert '"card_balance": 5000.0' in first[0][0] and '"card_balance": 4600.0' in first[0][2]
    assert _episode("long_context", TRAVEL, [balance, insure, balance]) == first


def test_two_worlds_of_a_task_share_no_mutable_object():
    from supo_jax.envs.bfcl.data import CATEGORIES, entries, new_instances

    for category in CATEGORIES:
        for task_id in sorted(entries(category))[::7] + [TRAVEL] * (category == "long_context"):
            entry = entries(category)[task_id]
            worlds = new_instances(entry, category), new_instances(entry, category)  # alive: ids
            a, b = _mutables(worlds[0]), _mutables(worlds[1])
            shared = [a[i] for i in a.keys() & b.keys()]
            assert not shared, (category, task_id, shared[:3])


def test_where_isolation_departs_from_bfcl_checker():
    """docs/ENVIRONMENTS.md: bfcl-eval's checker passes a model that also spends on one of
    the long scenario's extra cards (its model and ground-truth instances hold the same card
    object); here its state differs from the ground truth's and fails."""
    import copy

    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    from supo_jax.envs.bfcl import verdict
    from supo_jax.envs.bfcl.data import entries, ground_truth

    truth = ground_truth("long_context")[TRAVEL]
    extra = ("purchase_insurance(access_token='abc123xyz', insurance_type='comprehensive', "
             f"booking_id='booking_901', insurance_cost=400.0, card_id='{EXTRA_CARD}')")
    calls = [[truth[0] + [extra]], [truth[1]], [truth[2]]]
    cards = copy.deepcopy(long_context.CREDIT_CARD_EXTENSION)
    try:
        theirs = multi_turn_checker(calls, truth, dict(entries("long_context")[TRAVEL]),
                                    "multi_turn_long_context", "supo_isolation_check")
    finally:   # their instances spent on the module's own card: put it back
        long_context.CREDIT_CARD_EXTENSION.clear()
        long_context.CREDIT_CARD_EXTENSION.update(cards)
    assert theirs["valid"]
    assert verdict("long_context", TRAVEL, calls)["error_type"] == (
        "multi_turn:instance_state_mismatch")


def _slow_or_expert(slow_action):
    from supo_jax.envs.bfcl.data import entries
    from supo_jax.envs.bfcl.environment import BFCLExpert, turn_text

    expert = BFCLExpert("base")
    first = turn_text(entries("base")[MATH], 0)

    class Actor:
        """The slow action on MATH, the ground truth elsewhere."""
        def act(self, messages, summarize=False):
            if any(m["content"] == first for m in messages[:2]):
                return slow_action
            return expert.act(messages, summarize)
    return Actor()


def test_a_call_that_runs_for_minutes_ends_its_rollout_at_the_deadline():
    """logarithm at 10^5 digits runs for minutes (and held the GIL and every BFCL rollout of
    the process with it): its worker is killed at call_timeout_s, its rollout ends at 0, the
    other rows of the batch finish as usual."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.model.tiny import tiny_tokenizer

    fmt = ChatFormat(tiny_tokenizer(template="qwen"))
    cfg = ContextConfig(manager="full", working_context=1_000_000, max_steps=400,
                        max_action_tokens=8192, max_observation_tokens=1_000_000)
    slow = _call("logarithm", value=10, base=3, precision=100_000)
    others = ["multi_turn_base_1", "multi_turn_base_2", "multi_turn_base_3"]
    tasks = [{"task_id": t, "family": "bfcl/base", "call_timeout_s": 2.0}
             for t in [MATH] + others]
    t0 = time.perf_counter()
    ro = run_rollouts(ScriptedActor(_slow_or_expert(slow), fmt), lambda: make_env("bfcl/base"),
                      tasks, fmt, cfg, rows=4, env_timeout_s=60.0)
    assert time.perf_counter() - t0 < 20.0
    assert ro[0].reward == 0.0 and "ran past 2 s" in ro[0].env_info["stopped"]
    assert [(r.reward, r.reason) for r in ro[1:]] == [(1.0, "answer")] * 3


def test_arguments_keep_their_declared_types_and_sizes():
    """What BFCL's docs declare is checked before anything runs: a string where a number is
    declared, a string past MAX_STRING, an integer past MAX_INT; each refused call is an
    error line, the others run."""
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.arguments import MAX_INT, MAX_STRING

    env = make_env("bfcl/base")
    env.reset({"task_id": MATH})
    res = env.act(_call("multiply", a="xy", b=10 ** 9) + _call("add", a=1, b=2)
                  + _call("touch", file_name="x" * (MAX_STRING + 1))
                  + _call("add", a=MAX_INT + 1, b=0))
    lines = res.observation.split("\n")
    assert lines[0] == 'Error: wrong type for argument "a" of multiply: expected float, got string'
    assert lines[1] == '{"result": 3}' and "too long" in lines[2] and "too large" in lines[3]
    assert env.calls == [[["add(a=1, b=2)"]]] and res.info == {"tools": ["add"]}


def test_one_bad_call_does_not_refuse_the_others():
    """As BFCL's executor runs every call of a step: an unknown function, a missing or an
    unknown argument are error lines in their place; the valid calls run and are recorded;
    a step with no valid call is an error observation (not a tool call)."""
    from supo_jax.envs import make_env

    env = make_env("bfcl/base")
    env.reset({"task_id": "multi_turn_base_0"})
    res = env.act(_call("nope") + _call("cd", folder="document") + _call("cd") + _call("ls", x=1)
                  + _call("ls"))
    lines = res.observation.split("\n")
    assert lines[0].startswith("Error: unknown tool") and lines[2].startswith("Error: missing")
    assert lines[1] == '{"current_working_directory": "document"}'
    assert lines[3].startswith("Error: unexpected argument") and lines[4].startswith("{")
    assert env.calls == [[["cd(folder='document')", "ls()"]]]
    bad = env.act(_call("cd"))
    assert bad.observation.startswith("Error: missing") and "error" in bad.info


def test_seed_oss_values_are_read_as_declared():
    from supo_jax.envs import make_env

    env = make_env("bfcl/base")
    env.call_formats = ("hermes", "seed_oss")
    env.reset({"task_id": MATH})
    res = env.act("<seed:tool_call><function=power><parameter=base>2</parameter>"
                  "<parameter=exponent>3</parameter></function></seed:tool_call>")
    assert res.observation == '{"result": 8}'


def test_a_reply_ending_a_turn_is_no_tool_call():
    """The user turn that follows a reply says tool_call False (rollout.py counts it so)."""
    from supo_jax.envs import make_env

    env = make_env("bfcl/base")
    env.reset({"task_id": "multi_turn_base_0"})
    assert "tool_call" not in env.act(_call("ls")).info
    nxt = env.act("Done.")
    assert nxt.role == "user" and nxt.info["tool_call"] is False


def test_tool_calls_count_the_calls_not_the_replies():
    """The scripted expert on a base task (one action a turn holding that turn's calls): the
    rollout's tool_calls are its actions that call tools; the replies that end its turns are
    not counted (7 before: every reply counted)."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl.data import ground_truth
    from supo_jax.envs.experts import expert_for
    from supo_jax.model.tiny import tiny_tokenizer

    fmt = ChatFormat(tiny_tokenizer())
    cfg = ContextConfig(manager="full", working_context=1_000_000, max_steps=400,
                        max_action_tokens=8192, max_observation_tokens=1_000_000)
    [r] = run_rollouts(ScriptedActor(expert_for("bfcl/base"), fmt), lambda: make_env("bfcl/base"),
                       [{"task_id": "multi_turn_base_0", "family": "bfcl/base"}], fmt, cfg,
                       rows=1)
    assert r.counters["tool_calls"] == sum(bool(t) for t in ground_truth("base")[
        "multi_turn_base_0"])


def test_departures_kept_from_bfcl_executor():
    """docs/ENVIRONMENTS.md keeps two: a malformed action (not calls at all) costs a step with
    an error observation where BFCL ends the turn; the 21st step of a turn ends the episode
    at reward 0 as an answer (BFCL's force-quit fails the task)."""
    from supo_jax.envs import make_env

    env = make_env("bfcl/base")
    env.reset({"task_id": "multi_turn_base_0"})
    bad = env.act('<tool_call>{"name": "ls", </tool_call>')
    assert bad.role == "tool" and not bad.done and bad.observation.startswith("Error: malformed")
    for _ in range(19):
        assert not env.act(_call("ls")).done
    quit_ = env.act(_call("ls"))
    assert quit_.done and quit_.reward == 0.0 and quit_.info["force_quit"]


@pytest.fixture
def pool(monkeypatch):
    """A pool of 4 BFCL workers of this test's own (none started), killed after it."""
    from supo_jax.envs.bfcl import worker

    mine = worker._Pool(4)
    monkeypatch.setattr(worker, "_POOL", mine)
    yield mine
    deadline = time.monotonic() + worker.START_TIMEOUT_S     # starts still under way
    while mine.live > len(mine.idle) and time.monotonic() < deadline:
        time.sleep(0.05)
    for w in mine.idle:
        w.kill()


def test_queueing_for_a_worker_is_no_timeout(pool, monkeypatch):
    """32 rollouts at once on 4 workers that take 3 s to start, under a 3 s environment
    deadline: the wait for a worker is bounded by queue_timeout_s and ends its rollout as
    "queued", never as a timeout; the starts go on, and the next
    32 rollouts run on the workers they started."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.envs import make_env
    from supo_jax.envs.bfcl import worker
    from supo_jax.model.tiny import tiny_tokenizer

    class SlowStart(worker._Worker):
        def __init__(self):
            time.sleep(3.0)
            super().__init__()

    class OneCall:      # ls as the first action, then a reply per turn
        def act(self, messages, summarize=False):
            return "Done." if any(m["role"] == "assistant" for m in messages) else _call("ls")

    monkeypatch.setattr(worker, "_Worker", SlowStart)
    fmt = ChatFormat(tiny_tokenizer(template="qwen"))
    cfg = ContextConfig(manager="full", working_context=1_000_000, max_steps=40,
                        max_action_tokens=8192, max_observation_tokens=1_000_000)
    tasks = [{"task_id": "multi_turn_base_0", "family": "bfcl/base", "call_timeout_s": 1.0,
              "queue_timeout_s": 1.5}] * 32
    rollouts = lambda: run_rollouts(ScriptedActor(OneCall(), fmt), lambda: make_env("bfcl/base"),
                                    tasks, fmt, cfg, rows=32, env_timeout_s=3.0)
    first = [(r.reason, r.transcript[-1]["content"]) for r in rollouts()]
    queued = [r for r in first if r[0] != "answer"]
    assert queued and all(r == "queued" and "no BFCL simulator worker was free" in e
                          for r, e in queued), first
    deadline = time.monotonic() + 60
    while len(pool.idle) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.reason for r in rollouts()] == ["answer"] * 32


def test_a_call_leaves_no_module_state_to_the_next_request(pool):
    """A worker serves one rollout after another: MathAPI's logarithm sets mpmath's precision
    for the whole process; the next request, another task's on the same worker, computes at
    the default. (No BFCL call reads it unset; a world holding an mpf does.)"""
    import pickle

    import mpmath

    from supo_jax.envs.bfcl import worker
    from supo_jax.envs.bfcl.data import entries, world_bytes

    pool.size = 1
    math_world = world_bytes(entries("base")[MATH], "base")
    log = ("logarithm", {"value": 10, "base": 3, "precision": 50})
    worker.run(("step", math_world, [log]), 10.0, 10.0)
    _, [root] = worker.run(("step", pickle.dumps({"mpf": mpmath.mpf(2)}), [("sqrt", {})]),
                           10.0, 10.0)
    assert root == "1.4142135623731"
