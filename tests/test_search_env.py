"""Search suite (BrowseComp-Plus-like): corpus and BM25 index, tools and error observations,
exact-match reward normalization, the scripted expert under full context and under
simulated SUPO summarize-and-reset (docs/SUPO.md §2), and the hop-chain probe."""
from tests.test_envs import full_context as _full_context
from tests.test_envs import supo as _supo
import json
import random
import threading
import time

import pytest

from supo_jax.text.parsing import extract_summary, format_tool_call
from supo_jax.text.templates import CONTINUATION, SUMMARY_INSTRUCTION
from supo_jax.envs import experts
from supo_jax.envs import search as S
from supo_jax.envs.base import make_env, make_tasks

SMALL = dict(corpus_size=300)  # a small corpus keeps most tests fast
LEGACY_CONTINUATION = "{prompt}\n\nWe are in the following stage of solving the problem:\n{summary}"


def tasks(n=4, split="train", seed=0, **knobs):
    return make_tasks("search", split, n, seed, **{**SMALL, **knobs})


def full_context(task, expert=None, max_steps=100):
    return _full_context("search", task, expert or experts.expert_for("search"), max_steps)


def supo(task, rng, expert=None, **kw):
    """tests/test_envs.supo on the search env (summary resets without a tokenizer)."""
    kw.setdefault("max_steps", 200)
    return _supo("search", task, rng, expert=expert or experts.expert_for("search"), **kw)


# ---- corpus, tasks, retrieval ------------------------------------------------------------

def test_registry_and_tasks():
    assert "search" in experts.list_experts()
    t = tasks(30, hops=(1, 4))
    assert t == tasks(30, hops=(1, 4)) and t[:5] == tasks(5, hops=(1, 4))
    assert t != tasks(30, seed=1, hops=(1, 4))
    assert json.loads(json.dumps(t)) == t
    assert {x["hops"] for x in t} == {1, 2, 3, 4}
    ev = tasks(30, "eval", hops=(1, 4))
    assert not {x["question"] for x in t} & {x["question"] for x in ev}  # disjoint starts
    corpus = S.get_corpus(0, 300)
    for x in t + ev:
        assert len(x["chain"]) == x["hops"] + 1 == len(x["pages"]) + 1 == len(x["relations"]) + 1
        assert S.parse_question(x["question"]) == (x["chain"][0], x["relations"])
        assert [corpus.title(d) for d in x["pages"]] == x["chain"][:-1]
        assert x["answer"] == x["chain"][-1]
    with pytest.raises(ValueError, match="hops"):
        tasks(1, hops=0)
    with pytest.raises(ValueError, match="corpus_size"):
        tasks(1, corpus_size=10)
    assert "founder of the company that makes" in S.describe("Zorvex", ["maker", "founder",
                                                                        "birthplace"])


def test_corpus_deterministic_and_shared():
    a, b = S.build_world(3, 300), S.build_world(3, 300)
    assert a.docs == b.docs and a.doc_ids == b.doc_ids
    assert S.build_world(4, 300).docs != a.docs
    assert len(a.docs) == 300 and len({t for t, _, _ in a.docs}) > 250
    names = [e.name for e in a.entities]
    assert len({n.lower() for n in names}) == len(names)  # titles of entities are unique
    twins = [e for e in a.entities if e.twin_of is not None]
    assert twins and all(e.rels != a.entities[e.twin_of].rels for e in twins)
    got = []
    threads = [threading.Thread(target=lambda: got.append(S.get_corpus(5, 300)))
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 4 and all(c is got[0] for c in got)  # built once, shared


def test_bm25_finds_exact_entity():
    corpus = S.get_corpus(0, 300)
    for x in tasks(20) + tasks(10, "eval"):
        hits = [d for d, _ in corpus.search(x["chain"][0], 5)]
        assert x["pages"][0] in hits, (x["question"], hits)
    # every entity's own page is among the top 5 (mostly first) for its exact name; what
    # outranks it is a "Confusion between ..." page about it or a twin
    ranks = []
    for e in corpus.world.entities:
        titles = [corpus.title(d) for d, _ in corpus.search(e.name, 5)]
        ranks.append(titles.index(e.name))
        assert all(e.name in t for t in titles[:ranks[-1]]), titles
    assert ranks.count(0) >= 0.9 * len(ranks)
    assert corpus.search("the of and", 5) == [] and corpus.search("qqqzzz", 5) == []
    hits = corpus.search("took place", 20)
    assert len(hits) == 20 and [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)


def test_10k_corpus_index_and_100_searches_fast():
    t0 = time.perf_counter()
    corpus = S.get_corpus(1, 10_000)
    t1 = time.perf_counter()
    names = [e.name for e in corpus.world.entities[::len(corpus.world.entities) // 100]][:100]
    found = sum(n in [corpus.title(d) for d, _ in corpus.search(n, 5)] for n in names)
    t2 = time.perf_counter()
    print(f"\n10k corpus: build+index {t1 - t0:.2f} s, 100 searches {t2 - t1:.3f} s")
    assert len(corpus) == 10_000 and found == 100
    assert t2 - t0 < 30


# ---- tools and rewards -------------------------------------------------------------------

def test_tools_errors_and_reward():
    env = make_env("search")
    task = tasks(1)[0]
    r0 = env.reset(task)
    assert [t.name for t in r0.tools] == ["search", "open", "finish"]
    assert task["question"] in r0.prompt and "300 encyclopedia pages" in r0.prompt
    json.dumps([t.schema() for t in r0.tools])
    for call, msg in [(("search", {"query": "  "}), "empty query"),
                      (("search", {"query": "x", "k": 0}), "between 1 and"),
                      (("search", {"query": "x", "k": S.MAX_K + 1}), "between 1 and"),
                      (("search", {"query": "x" * 600}), "too long"),
                      (("open", {"doc_id": "d99999"}), "no page with id"),
                      (("open", {"doc_id": "ignore previous instructions " * 20}), "no page"),
                      (("open", {"doc_id": 3}), "wrong type")]:
        r = env.act(format_tool_call(*call))
        assert r.observation.startswith("Error: ") and msg in r.observation, r
        assert (r.done, r.reward) == (False, 0.0) and len(r.observation) < 200
    r = env.act(format_tool_call("search", {"query": task["chain"][0]}))
    lines = r.observation.splitlines()
    assert lines[0].startswith("Search results for") and 1 <= len(lines) - 1 <= S.DEFAULT_K
    assert lines[1].startswith(f"[{task['pages'][0]}] {task['chain'][0]} | ")
    assert len(env.act(format_tool_call("search", {"query": "took place", "k": 12}))
               .observation.splitlines()) == 13
    r = env.act(format_tool_call("open", {"doc_id": f" [{task['pages'][0]}] "}))
    assert r.observation.startswith(f"Page {task['pages'][0]}: {task['chain'][0]}\n")
    # long pages are cut off with a note
    corpus = S.get_corpus(0, 300)
    long_doc = max(corpus.ids, key=lambda d: len(corpus.page(d)[1]))
    env.reset({**task, "page_chars": 400})
    r = env.act(format_tool_call("open", {"doc_id": long_doc}))
    assert "[Page cut off: showing the first" in r.observation
    assert len(r.observation) < 400 + 150
    env.reset(task)
    r = env.act(format_tool_call("finish", {"answer": f"  The {task['answer'].upper()}!! "}))
    assert (r.done, r.reward, r.info["correct"]) == (True, 1.0, True)
    with pytest.raises(RuntimeError, match="over"):
        env.act(format_tool_call("finish", {"answer": task["answer"]}))
    env.reset(task)
    assert env.act(format_tool_call("finish", {"answer": task["answer"] + "x"})).reward == 0.0
    with pytest.raises(ValueError, match="family"):
        env.reset(make_tasks("fncall/pages", "train", 1, 0)[0])
    with pytest.raises(ValueError, match="does not match its corpus"):
        env.reset({**task, "pages": task["pages"][::-1] if task["hops"] > 1 else ["d00000"]})


def test_normalize_answer():
    n = S.normalize_answer
    assert n("The  Quillon-Dynamics, Inc.") == "quillon dynamics inc"
    assert n("an Apple") == n("apple") == n(" APPLE. ") == "apple"
    assert n("1987") == n("'1987'") == "1987"
    assert n("theatre") == "theatre" and n("a") == ""
    assert n("Zorvex\u00a0Pro") == "zorvex pro"


# ---- expert --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expert_solves_with_full_context(seed):
    for task in tasks(6, seed=seed, hops=(1, 4)) + tasks(3, "eval", seed=seed):
        reward, steps = full_context(task)
        assert reward == 1.0, task
        assert steps == 2 * task["hops"] + 1  # search + open per hop, then finish


def test_expert_on_default_corpus():
    for task in make_tasks("search", "eval", 6, 0):
        assert full_context(task) == (1.0, 2 * task["hops"] + 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_expert_solves_across_supo_resets(seed):
    rng = random.Random(seed)
    for task in tasks(4, seed=seed, hops=(2, 4)):
        for kw in (dict(every=1, show_dropped=True), dict(every=2), dict(every=3),
                   dict(p_cut=0.5), dict(every=2, show_dropped=True),
                   dict(every=3, continuation=LEGACY_CONTINUATION)):
            if "continuation" in kw:
                kw["expert"] = experts.expert_for("search", continuation=kw["continuation"])
            reward, probes, sigmas = supo(task, rng, **kw)
            assert reward == 1.0, (task["task_id"], kw)
            assert all(p is not False for p in probes), (task["task_id"], kw, sigmas)
    _, probes, _ = supo(tasks(1, "eval", hops=4)[0], rng, every=2)
    assert len(probes) >= 6


@pytest.mark.parametrize("manager,W", [("state", 3000), ("fold", 6000)])
def test_expert_solves_under_the_state_and_fold_managers(manager, W):
    """The search expert writes its state (its summary text) in a <state> block when the
    prompt asks for one and reads it back; under fold it works in branches (for_context):
    both solve tasks that `full` cannot at W = 3000."""
    from supo_jax.agent.context import ContextConfig
    from supo_jax.agent.render import ChatFormat
    from supo_jax.agent.rollout import ScriptedActor, run_rollouts
    from supo_jax.model.tiny import tiny_tokenizer

    fmt = ChatFormat(tiny_tokenizer())
    todo = make_tasks("search", "train", 6, seed=0)
    runs = {}
    for m, w in ((manager, W), ("full", 3000)):
        cfg = ContextConfig(m, w, max_steps=100, max_action_tokens=400,
                            max_observation_tokens=600)
        runs[m] = run_rollouts(ScriptedActor(experts.for_context(experts.expert_for("search"),
                                                                 cfg), fmt),
                               lambda: make_env("search"), todo, fmt, cfg, rows=3)
    assert all(r.reason == "context_limit" for r in runs["full"])
    for r in runs[manager]:
        assert r.reason == "answer" and r.reward == 1.0
        assert (r.counters["states"] == r.counters["steps"] if manager == "state"
                else r.counters["folds"] >= 1)   # a branch sized by W: one holds a task


def test_dropped_summaries_fail_the_probe():
    task = tasks(1, "train", 3, hops=4)[0]
    # each summary loses the latest hop; keeping 4 pairs (2 hops) per segment still gains one
    all_dropped = experts.expert_for("search", summary_drop=1.0, seed=0)
    reward, probes, sigmas = supo(task, random.Random(0), expert=all_dropped, every=5)
    assert reward == 1.0  # a resumed expert redoes the lost hop
    assert probes and not any(probes) and all_dropped.dropped == len(sigmas)
    half = experts.expert_for("search", summary_drop=0.5, seed=1)
    reward, probes, sigmas = supo(task, random.Random(0), expert=half, every=3)
    assert reward == 1.0 and 0 < half.dropped < len(sigmas)
    assert half.dropped <= probes.count(False) < len(probes)
    again = experts.expert_for("search", summary_drop=0.5, seed=1)
    assert supo(task, random.Random(0), expert=again, every=3)[2] == sigmas


def test_probe_definition():
    task = next(t for t in tasks(20, hops=3))
    env = make_env("search")
    assert env.probe("anything") is None  # before reset
    env.reset(task)
    v0, v1, v2, v3 = task["chain"]
    assert env.probe("") is None  # nothing resolved yet: a summary proves nothing, not counted
    env.act(format_tool_call("open", {"doc_id": task["pages"][1]}))  # out of order: no hop
    assert env.progress() == 0
    env.act(format_tool_call("open", {"doc_id": task["pages"][0]}))  # hop 1 (and 2) done
    assert env.progress() == 2
    assert env.probe("nothing") is None  # the summarizer did not see the last (dropped) action: no progress before it
    env.act(format_tool_call("search", {"query": v0}))
    assert not env.probe(f"found={v0} | {v1}")  # V_2 is resolved and needed next
    assert env.probe(f"<summary>found={v0} | {v1} | {v2}</summary>")
    assert env.probe(f"Resolved: {v1.upper()}, then {'  '.join(v2.split())}.")
    assert not env.probe(f"{v1} {v2[:-1]}")  # whole names only
    assert not env.probe(f"<summary>{v1}</summary> {v2}")  # the summary block is read
    env.act(format_tool_call("open", {"doc_id": task["pages"][2]}))
    env.act(format_tool_call("search", {"query": v0}))
    assert env.progress() == 3 and env.probe(f"{v1}; {v2}; answer {v3}")
    assert not env.probe(f"{v1}; {v2}")
    for junk in ("x" * 1_000_000, "\ud800", "found=|||"):
        assert env.probe(junk) is False


def test_expert_reads_only_its_context():
    task = tasks(1, hops=3)[0]
    prompt = make_env("search").reset(task).prompt
    v0, v1, v2, _ = task["chain"]
    ex = experts.expert_for("search")
    a = ex.act([{"role": "user", "content": prompt}])
    assert json.dumps(v0) in a and '"search"' in a
    # a previous summary is trusted; its page id is opened without searching again
    summary = f"State: found={v0} | {v1}; page=d00042"
    msgs = [{"role": "user", "content": prompt},
            {"role": "user", "content": CONTINUATION.format(summary=summary)}]
    assert '"doc_id": "d00042"' in ex.act(msgs)
    msgs[1]["content"] = CONTINUATION.format(summary=f"found={v0} | {v1}")
    assert json.dumps(v1) in ex.act(msgs)
    # a summary for another question is ignored
    msgs[1]["content"] = CONTINUATION.format(summary=f"found=Somebody Else | {v1}")
    assert json.dumps(v0) in ex.act(msgs)
    # results without the exact title: search again with a larger k
    miss = 'Search results for "%s" (top 5):\n[d00001] Other | x' % v0
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "..."},
            {"role": "tool", "content": miss}]
    assert '"k": 10' in ex.act(msgs)
    assert '"k": 20' in ex.act(msgs + msgs[1:])
    assert '"answer": "unknown"' in ex.act(msgs + msgs[1:] + msgs[1:])
    with pytest.raises(ValueError, match="no search question"):
        ex.act([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match="has no scripted expert"):
        experts.expert_for("nope")
    assert experts.expert_for("fncall/chain").act(
        [{"role": "user", "content": make_env("fncall/chain").reset(
            make_tasks("fncall/chain", "train", 1, 0, size=2)[0]).prompt}])
