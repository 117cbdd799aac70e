"""Environment protocol, registry, fncall task sets, experts under full context and under
simulated SUPO summarize-and-reset (docs/SUPO.md §2), probes and exact rewards."""
import json
import random

import pytest

from supo_jax.text.parsing import extract_summary, format_tool_call
from supo_jax.text.templates import CONTINUATION, SUMMARY_INSTRUCTION
from supo_jax.envs import (Environment, Reset, StepResult, ToolSpec, list_envs, make_env,
                           make_tasks, register_env)
from supo_jax.envs.fncall import FAMILIES, FAMILY_ENVS, expert_for

FNCALL = ["fncall"] + [f"fncall/{f}" for f in FAMILIES]
# the prompt repeated inside one continuation turn (the first form of templates.CONTINUATION)
LEGACY_CONTINUATION = "{prompt}\n\nWe are in the following stage of solving the problem:\n{summary}"
SIZES = {"tallest": (2, 7, 30), "pages": (1, 6, 30), "chain": (1, 5, 30), "graph": (2, 9, 30)}


def family_tasks(family, n_tasks=3, split="train", seed=0):
    return [t for size in SIZES[family]
            for t in make_tasks(f"fncall/{family}", split, n_tasks, seed, size=size)]


def full_context(env_name, task, expert=None, max_steps=500):
    """Vanilla multi-turn loop: the context only grows. Returns (reward, n_actions)."""
    env, expert = make_env(env_name), expert or expert_for(env_name)
    ctx = [{"role": "user", "content": env.reset(task).prompt}]
    for k in range(1, max_steps):
        a = expert.act(ctx)
        r = env.act(a)
        assert "error" not in r.info, r
        if r.done:
            return r.reward, k
        ctx += [{"role": "assistant", "content": a}, {"role": "tool", "content": r.observation}]
    raise AssertionError("no answer")


def supo(env_name, task, rng, expert=None, every=None, p_cut=0.3, show_dropped=False,
         raw_summary=False, continuation=CONTINUATION, max_steps=2000):
    """SUPO rollout without a tokenizer: overflow after `every` kept pairs, or at random
    (probability p_cut per step, at least one pair kept). On overflow the last (a, o) is
    dropped (unless show_dropped), the expert summarizes, and the context restarts as
    s1 + CONTINUATION(summary). Returns (reward, probes, summaries)."""
    env, expert = make_env(env_name), expert or expert_for(env_name)
    prompt = env.reset(task).prompt
    ctx, kept, probes, sigmas = [{"role": "user", "content": prompt}], 0, [], []
    for _ in range(max_steps):
        a = expert.act(ctx)
        r = env.act(a)
        assert "error" not in r.info, r
        if r.done:
            return r.reward, probes, sigmas
        pair = [{"role": "assistant", "content": a}, {"role": "tool", "content": r.observation}]
        overflow = kept + 1 >= every if every else (kept >= 1 and rng.random() < p_cut)
        if not overflow:
            ctx, kept = ctx + pair, kept + 1
            continue
        seen = ctx + pair if show_dropped else ctx
        sigma = expert.act(seen + [{"role": "user", "content": SUMMARY_INSTRUCTION}],
                           summarize=True)
        assert "<tool_call>" not in sigma and extract_summary(sigma)
        probes.append(env.probe(sigma))
        sigmas.append(sigma)
        summary = sigma if raw_summary else extract_summary(sigma)
        cont = continuation.format(prompt=prompt, summary=summary)
        # templates.CONTINUATION is a turn after s1; a template with {prompt} may stand alone
        ctx = [{"role": "user", "content": cont}] if "{prompt}" in continuation else \
            [{"role": "user", "content": prompt}, {"role": "user", "content": cont}]
        kept = 0
    raise AssertionError("no answer")


# ---- registry and protocol ---------------------------------------------------------------

def test_registry():
    assert set(FNCALL) <= set(list_envs())
    with pytest.raises(ValueError, match="registered: .*fncall/chain"):
        make_env("no-such-env")
    with pytest.raises(ValueError, match="split"):
        make_tasks("fncall", "test", 1, 0)
    assert isinstance(make_env("fncall/pages"), Environment)


def test_toolspec_schema_and_reset():
    env = make_env("fncall/tallest")
    r = env.reset(make_tasks("fncall/tallest", "train", 1, 0)[0])
    assert isinstance(r, Reset) and r.system is None and "tallest" in r.prompt
    schemas = [t.schema() for t in r.tools]
    assert schemas[0] == {"type": "function", "function": {
        "name": "compare", "description": "Tell which of two people is taller.",
        "parameters": {"type": "object", "required": ["i", "j"], "properties": {
            "i": {"type": "integer", "description": "index of a person"},
            "j": {"type": "integer", "description": "index of another person"}}}}}
    assert [t.name for t in r.tools] == ["compare", "finish"]
    json.dumps(schemas)


class Toy(Environment):
    """Toy env: add(x) accumulates, boom() raises (an env bug), finish(answer)."""
    name = "test/toy"
    max_calls_per_step = 3
    tools = (ToolSpec("add", "add x", {"type": "object", "required": ["x"],
                                        "properties": {"x": {"type": "integer"}}}),
             ToolSpec("boom", "raise", {"type": "object", "properties": {}}),
             ToolSpec("finish", "answer", {"type": "object", "required": ["answer"],
                                           "properties": {"answer": {"type": "integer"}}}))

    def reset(self, task):
        self.total = 0
        return Reset("add numbers", list(self.tools))

    def step(self, name, arguments):
        if name == "boom":
            raise KeyError("bug")
        if name == "finish":
            return StepResult("ok", done=True, reward=float(arguments["answer"] == self.total))
        self.total += arguments["x"]
        return StepResult(f"total {self.total}", info={"total": self.total})


def test_register_env():
    from supo_jax.envs import base
    try:
        assert register_env("test/toy", tasks=lambda split, n, seed: [{}] * n)(Toy) is Toy
        assert isinstance(make_env("test/toy"), Toy) and "test/toy" in list_envs()
        assert make_tasks("test/toy", "eval", 2) == [{}, {}]
        with pytest.raises(ValueError, match="already registered"):
            register_env("test/toy")(lambda: Toy())
    finally:
        base._ENVS.pop("test/toy", None)  # keep the global registry clean for other tests


def test_act_protocol_on_toy_env():
    env = Toy()
    env.reset({})
    r = env.act("no call here")
    assert (r.done, r.reward) == (False, 0.0) and r.observation.startswith("Error: no tool call")
    assert r.info["error"] in r.observation
    r = env.act(format_tool_call("add", {"x": 2}) + format_tool_call("add", {"x": 3}))
    assert r.observation == "total 2\ntotal 5" and r.info == {"total": 5, "tools": ["add", "add"]}
    r = env.act(format_tool_call("add", {"x": 1}) + format_tool_call("finish", {"answer": 6}))
    assert (r.done, r.reward) == (True, 1.0) and r.info["tools"] == ["add", "finish"]
    with pytest.raises(KeyError):  # env bugs propagate: the driver records env_error
        env.act(format_tool_call("boom", {}))


# ---- task sets -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FNCALL)
def test_tasks_deterministic_disjoint_serializable(name):
    train, eval_ = make_tasks(name, "train", 40, seed=0), make_tasks(name, "eval", 40, seed=0)
    assert train == make_tasks(name, "train", 40, seed=0)
    assert train != make_tasks(name, "train", 40, seed=1)
    assert json.loads(json.dumps(train)) == train
    ids = [t["task_id"] for t in train]
    assert len(set(ids)) == 40 and not set(ids) & {t["task_id"] for t in eval_}
    hidden = lambda t: json.dumps({k: v for k, v in t.items() if k != "task_id"}, sort_keys=True)
    assert not {hidden(t) for t in train} & {hidden(t) for t in eval_}
    fams = {t["family"] for t in train}
    assert fams == set(FAMILIES) if name == "fncall" else fams == {name.split("/")[1]}
    # the prefix of a longer task list is the shorter list
    assert make_tasks(name, "train", 5, seed=0) == train[:5]


def test_size_knob():
    assert {t["n"] for t in make_tasks("fncall", "train", 30, 0, size=(3, 5))} <= {3, 4, 5}
    assert {t["n"] for t in make_tasks("fncall/pages", "eval", 3, 0, size=11)} == {11}
    with pytest.raises(ValueError, match="out of range"):
        make_tasks("fncall/tallest", "train", 1, 0, size=1)
    with pytest.raises(ValueError, match="unknown fncall family"):
        make_tasks("fncall", "train", 1, 0, families=("nope",))


# ---- experts and rewards -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_expert_solves_with_full_context(family):
    for task in family_tasks(family):
        reward, steps = full_context(f"fncall/{family}", task)
        assert reward == 1.0
        n = task["n"]
        expected = {"tallest": n, "pages": n + 1, "chain": n + 1}.get(family)
        if expected is not None:  # one call per atomic step, then finish
            assert steps == expected
        else:
            assert 2 <= steps <= n + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_solves_across_supo_resets(family):
    rng = random.Random(0)
    for task in family_tasks(family, n_tasks=2):
        for kw in (dict(every=2), dict(every=5), dict(p_cut=0.3), dict(p_cut=0.8),
                   dict(every=3, raw_summary=True), dict(every=3, show_dropped=True),
                   dict(every=4, continuation=LEGACY_CONTINUATION)):
            if "continuation" in kw:
                kw["expert"] = expert_for(f"fncall/{family}", continuation=kw["continuation"])
            reward, probes, _ = supo(f"fncall/{family}", task, rng, **kw)
            assert reward == 1.0, (task["task_id"], kw)
            assert all(p is not False for p in probes), (task["task_id"], kw)
    # resets happen: with every=2 a long task is summarized many times
    long_task = make_tasks(f"fncall/{family}", "eval", 1, 0, size=30)[0]
    _, probes, _ = supo(f"fncall/{family}", long_task, rng, every=2)
    assert len(probes) >= 5


def test_mixed_env_and_expert():
    for task in make_tasks("fncall", "eval", 12, seed=3, size=(2, 12)):
        assert full_context("fncall", task)[0] == 1.0
        reward, probes, _ = supo("fncall", task, random.Random(1), every=3)
        assert reward == 1.0 and all(probes)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropped_summaries_fail_the_probe(family):
    task = make_tasks(f"fncall/{family}", "train", 1, 7, size=20)[0]
    all_dropped = expert_for(f"fncall/{family}", summary_drop=1.0, seed=0)
    _, probes, _ = supo(f"fncall/{family}", task, random.Random(0), expert=all_dropped,
                        every=3)
    assert probes and not any(probes) and all_dropped.dropped == len(probes)
    half = expert_for(f"fncall/{family}", summary_drop=0.5, seed=0)
    _, probes, sigmas = supo(f"fncall/{family}", task, random.Random(0), expert=half, every=3)
    keys = FAMILY_ENVS[family].state_keys
    dropped = [len(FAMILY_ENVS[family].parse_state(extract_summary(s))) < len(keys)
               for s in sigmas]
    assert sum(dropped) == half.dropped and 0 < half.dropped < len(sigmas)
    assert not any(p for p, d in zip(probes, dropped) if d)
    first = dropped.index(True)  # later summaries inherit the lost state and may fail too
    assert all(probes[:first])
    # same seed -> same drops
    again = expert_for(f"fncall/{family}", summary_drop=0.5, seed=0)
    assert supo(f"fncall/{family}", task, random.Random(0), expert=again, every=3)[2] == sigmas


def test_probe_is_exact():
    env = make_env("fncall/tallest")
    task = make_tasks("fncall/tallest", "train", 1, 0, size=6)[0]
    env.reset(task)
    h = task["heights"]
    # before any progress a summary of the initial state proves nothing: not counted
    assert env.probe("best=0; next=1") is None and env.probe("anything") is None
    env.act(format_tool_call("compare", {"i": 0, "j": 1}))
    assert env.probe("best=0; next=1") and env.probe("<summary>Best: 0, next: 1</summary>")
    assert not env.probe("best=0") and not env.probe("best=0; next=7")
    assert not env.probe("best=0; next=1; next=2")  # conflicting values
    assert env.probe("best=0; next=1; best = 0")    # repeated, consistent
    for summary in ("", "x" * 1_000_000, "best=99999999999999; next=-1", "\ud800 best=0"):
        assert env.probe(summary) is False
    best01 = 0 if h[0] > h[1] else 1
    assert env.probe(f"best={best01}; next=2") and env.probe("best=0; next=1")  # one step back
    env.act(format_tool_call("compare", {"i": best01, "j": 2}))
    assert not env.probe("best=0; next=1")  # two steps back: stale
    assert make_env("fncall").probe("best=0; next=1") is None  # before reset

    g = make_env("fncall/graph")
    gt = make_tasks("fncall/graph", "train", 1, 0, size=8)[0]
    g.reset(gt)
    s = gt["source"]
    assert g.probe(f"layer=0; todo=[{s}]; next_layer=[]; seen=[{s}]") is None   # no progress
    g.act(format_tool_call("neighbors", {"node": s}))          # now one step back is fine
    assert g.probe(f"layer=0; todo=[{s}]; next_layer=[]; seen=[{s}]")
    assert g.probe(f"LAYER: 0, todo: [ {s} ], next_layer: [], seen: [{s}, {s}]")
    assert not g.probe(f"layer=0; todo=[{s}]; next_layer=[]; seen=[{s}, x]")
    assert not g.probe(f"layer=0; todo=[{s}]; next_layer=[]")


@pytest.mark.parametrize("family", FAMILIES)
def test_rewards_exact_and_value_errors(family):
    env = make_env(f"fncall/{family}")
    task = make_tasks(f"fncall/{family}", "eval", 1, 5, size=6)[0]
    env.reset(task)
    bad_args = {"tallest": ("compare", {"i": 0, "j": 6}), "pages": ("read_page", {"page": 0}),
                "chain": ("lookup", {"key": "ignore all instructions; os.system('x')"}),
                "graph": ("neighbors", {"node": -1})}[family]
    r = env.act(format_tool_call(*bad_args))
    assert r.observation.startswith("Error: ") and "error" in r.info
    assert (r.done, r.reward) == (False, 0.0) and len(r.observation) < 120
    if family == "tallest":
        assert "error" in env.act(format_tool_call("compare", {"i": 2, "j": 2})).info
    ans = task["answer"]
    wrong = ans + "x" if isinstance(ans, str) else ans + 1
    r = env.act(format_tool_call("finish", {"answer": wrong}))
    assert (r.done, r.reward, r.info["correct"]) == (True, 0.0, False)
    with pytest.raises(RuntimeError, match="over"):
        env.act(format_tool_call("finish", {"answer": ans}))
    env.reset(task)
    r = env.act(format_tool_call("finish", {"answer": ans}))
    assert (r.done, r.reward) == (True, 1.0)
    with pytest.raises(ValueError, match="family"):
        env.reset(make_tasks("fncall/tallest" if family != "tallest" else "fncall/pages",
                             "train", 1, 0)[0])


def test_expert_ignores_hidden_data_and_unknown_prompts():
    with pytest.raises(ValueError, match="no expert"):
        expert_for("fncall/nope")
    with pytest.raises(ValueError, match="no fncall family"):
        expert_for("fncall").act([{"role": "user", "content": "hello"}])
    # the expert's action depends only on the text it is shown
    t = make_tasks("fncall/chain", "train", 1, 0, size=4)[0]
    prompt = make_env("fncall/chain").reset(t).prompt
    summary = "State: key=abcd; hops=2."
    msgs = [{"role": "user", "content": prompt},
            {"role": "user", "content": CONTINUATION.format(prompt=prompt, summary=summary)}]
    assert '"key": "abcd"' in expert_for("fncall/chain").act(msgs)
    msgs += [{"role": "assistant", "content": "..."}, {"role": "tool",
                                                      "content": "Key abcd points to efgh."},
             {"role": "tool", "content": "Key efgh points to zzzz."}]
    assert '"answer": "zzzz"' in expert_for("fncall/chain").act(msgs)


# ---- fncall/count: a task that cannot be gamed by stopping early --------------------------

def expert_solves(env_name, tasks):
    """The scripted expert solves every task under full context and under summarize-and-reset
    (every 2 pairs, every pair with the dropped pair shown, at random), every probe passing."""
    rng = random.Random(0)
    for task in tasks:
        assert full_context(env_name, task)[0] == 1.0
        for kw in (dict(every=2), dict(every=1, show_dropped=True), dict(p_cut=0.5)):
            reward, probes, _ = supo(env_name, task, rng, **kw)
            assert reward == 1.0 and all(p is not False for p in probes), (task, kw)



def test_count_family_needs_every_observation():
    """The row's length is hidden (only the observations say where it ends) and the answer is
    a count over all of it: answering after k looks is right only by chance."""
    tasks = make_tasks("fncall/count", "train", 200, 0, size=(6, 16))
    assert len({t["n"] for t in tasks}) == 11          # the number of calls needed varies
    for k in (3, 5, 8):   # stop after k looks, before the row ends: the red count so far
        early = [t for t in tasks if t["n"] > k]
        right = sum(t["colours"][:k].count("red") == t["answer"] for t in early) / len(early)
        assert right < 0.3, (k, right)
    expert_solves("fncall/count", tasks[:20])
    env = make_env("fncall/count")
    task = make_tasks("fncall/count", "eval", 1, 3, size=4)[0]
    env.reset(task)
    c = task["colours"]
    assert env.act(format_tool_call("look", {"i": 3})).observation == \
        f"Item 3 is {c[3]}. It is the last item."
    r = env.act(format_tool_call("look", {"i": 4}))
    assert "no item 4" in r.observation and "error" in r.info
    assert "error" in env.act(format_tool_call("look", {"i": -1})).info
    env.act(format_tool_call("look", {"i": 0}))
    red0 = int(c[0] == "red")
    assert env.probe(f"count={red0}; next=1; last=3")     # the end is known: item 3 was seen
    assert not env.probe(f"count={red0}; next=1; last=-1")
    assert not env.probe(f"count={red0 + 1}; next=1; last=3")
    assert not env.probe(f"count={red0}; next=1")


def test_listing_family_needs_reading_to_find_the_key():
    """fncall/listing: the key's page is uniform (the number of calls varies and cannot be
    guessed), no two entries share a key; the expert finds it under full context and under
    summarize-and-reset; the canonical state carries the value once its page is read."""
    tasks = make_tasks("fncall/listing", "train", 200, 0, size=(5, 10))
    pages = [t["keys"].index(t["key"]) // 4 + 1 for t in tasks]
    assert len(set(pages)) == 10 and max(pages) == 10
    assert all(len(set(t["keys"])) == len(t["keys"]) == 4 * t["n"] for t in tasks)
    expert_solves("fncall/listing", tasks[:20])
    env = make_env("fncall/listing")
    task = next(t for t in make_tasks("fncall/listing", "eval", 20, 3, size=3)
                if t["keys"].index(t["key"]) // 4 == 1)         # the key is on page 2
    env.reset(task)
    obs = env.act(format_tool_call("read_page", {"page": 1})).observation
    assert obs == "Page 1: " + ", ".join(f"{k}={v}" for k, v in zip(task["keys"][:4],
                                                                   task["values"][:4])) + "."
    assert env.probe("next=2; value=-1") and not env.probe("next=2; value=5")
    env.act(format_tool_call("read_page", {"page": 2}))
    assert env.probe(f"next=3; value={task['answer']}")
    assert not env.probe("next=3; value=-1") and not env.probe(f"next=3")
    assert "error" in env.act(format_tool_call("read_page", {"page": 4})).info
    r = env.act(format_tool_call("finish", {"answer": task["answer"]}))
    assert r.done and r.reward == 1.0


def test_reports_family_states_the_figure_first_then_filler():
    """fncall/reports: each report's figure in its first sentence (an observation cut at
    max_observation_tokens keeps it), then 10-16 filler sentences without a number, the same
    for the same task; the expert solves it under full context and summarize-and-reset."""
    import re

    tasks = make_tasks("fncall/reports", "train", 4, 0, size=(2, 6))
    expert_solves("fncall/reports", tasks)
    env = make_env("fncall/reports")
    env.reset(tasks[0])
    obs = env.act(format_tool_call("read_report", {"report": 2})).observation
    head, rest = obs.split(". ", 1)
    assert head == f"Report 2: the figure is {tasks[0]['values'][1]}"
    assert not re.search(r"\d", rest) and 10 <= rest.count(".") <= 16
    env.reset(tasks[0])
    assert env.act(format_tool_call("read_report", {"report": 2})).observation == obs
    env.act(format_tool_call("read_report", {"report": 1}))    # the canonical prefix read
    v = tasks[0]["values"]
    assert env.probe(f"sum={v[0] + v[1]}; next=3") and not env.probe(f"sum={v[0]}; next=2")


def test_records_family_is_count_with_long_records_colour_first():
    """fncall/records: count's task (hidden length, the same state and probe), each look(i) a
    record whose first sentence is count's observation, then 10-16 filler sentences; errors
    stay count's short ones; finish before every item is read is refused (no reward from
    guessing a count of a few values); the expert solves it."""
    tasks = make_tasks("fncall/records", "train", 4, 0, size=(3, 6))
    expert_solves("fncall/records", tasks)
    env, t = make_env("fncall/records"), tasks[0]
    env.reset(t)
    obs = env.act(format_tool_call("look", {"i": 0})).observation
    head, rest = obs.split(". ", 1)
    assert head == f"Item 0 is {t['colours'][0]}" and 10 <= rest.count(".") <= 16
    assert "Item" not in rest
    last = env.act(format_tool_call("look", {"i": t["n"] - 1})).observation
    assert "It is the last item." in last
    bad = env.act(format_tool_call("look", {"i": t["n"]}))
    assert "error" in bad.info and len(bad.observation) < 80
    red = t["colours"][0] == "red"
    assert env.probe(f"count={int(red)}; next=1; last={t['n'] - 1}")
    assert not env.probe(f"count={int(red)}; next=1; last=-1")
    # a guess before every item was read is refused, whatever it says; after, it is scored
    early = env.act(format_tool_call("finish", {"answer": t["answer"]}))
    assert "error" in early.info and not early.done and "item 1 has not been looked" in early.observation
    for i in range(1, t["n"] - 1):
        env.act(format_tool_call("look", {"i": i}))
    done = env.act(format_tool_call("finish", {"answer": t["answer"]}))
    assert done.done and done.reward == 1.0


def test_sections_family_keeps_a_constant_state_and_a_branch_a_section():
    """fncall/sections: the largest of n section totals, the state four numbers; the expert
    solves it under full context and summarize-and-reset, and under fold opens one branch a
    section, each returning that section's outcome."""
    from supo_jax.envs.experts import FoldingExpert

    tasks = make_tasks("fncall/sections", "train", 3, 0, size=(1, 4))
    expert_solves("fncall/sections", tasks)
    task = make_tasks("fncall/sections", "eval", 1, 0, size=2)[0]
    env = make_env("fncall/sections")
    env.reset(task)
    for p in range(1, 7):
        env.act(format_tool_call("read_page", {"section": 1, "page": p}))
    first = sum(task["values"][0])
    assert env.probe(f"best={first}; section=2; sum=0; page=1")
    assert not env.probe(f"best={first}; section=1; sum=0; page=7")
    assert "error" in env.act(format_tool_call("read_page", {"section": 3, "page": 1})).info
    expert = expert_for("fncall/sections")
    msgs = [{"role": "user", "content": env.prompt()}]
    assert expert.subtask(msgs) == "section 1"
    fold = FoldingExpert(expert)
    assert '"description": "section 1"' in fold.act(msgs)
