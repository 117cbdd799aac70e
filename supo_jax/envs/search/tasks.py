"""Multi-hop questions over the world, and answer normalization."""
from __future__ import annotations

import random
import re
import unicodedata

from supo_jax.envs.search.world import (ASK, ATTRIBUTES, DEFAULT_PAGE_CHARS, DEFAULT_SIZE,
                                         DESCRIBE, MAX_HOPS, MIN_PAGE_CHARS, RELATIONS, World)
from supo_jax.envs.search.index import get_corpus

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lowercase, punctuation removed (Unicode P*/S* categories), articles a/an/the
    removed, whitespace collapsed (SQuAD-style exact match)."""
    s = unicodedata.normalize("NFKC", str(s)).lower()
    s = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in s)
    return " ".join(_ARTICLES.sub(" ", s).split())

def describe(start: str, relations: list[str]) -> str:
    """The question for a path: relations[:-1] nest as descriptions, relations[-1] asks."""
    x = start
    for rel in relations[:-1]:
        x = DESCRIBE[rel] + x
    return ASK[relations[-1]].format(x=x)

def parse_question(question: str) -> tuple[str, list[str]] | None:
    """(start name, relations) of a question made by `describe`; None if it is not one."""
    for rel, pattern in ASK.items():
        pre, post = pattern.split("{x}")
        if question.startswith(pre) and question.endswith(post) and \
                len(question) > len(pre) + len(post):
            x, rels = question[len(pre):len(question) - len(post)], [rel]
            while True:
                for r, p in DESCRIBE.items():
                    if x.startswith(p) and len(x) > len(p):
                        x, rels = x[len(p):], [r] + rels
                        break
                else:
                    return x, rels
    return None

def _sample_path(world: World, rng: random.Random, start: int, hops: int):
    """Random path of `hops` steps from entity `start` without revisiting, or None."""
    ents, path, seen, cur = world.entities, [], {start}, start
    for h in range(hops):
        kind = ents[cur].kind
        opts = [r for r, (src, _) in RELATIONS.items()
                if src == kind and ents[cur].rels[r] not in seen]
        if h == hops - 1:
            opts += [a for a, k in ATTRIBUTES.items() if k == kind]
        if not opts:
            return None
        rel = rng.choice(sorted(opts))
        path.append(rel)
        if rel in RELATIONS:
            cur = ents[cur].rels[rel]
            seen.add(cur)
    return path

def _walk(world: World, start: int, path: list[str]) -> tuple[list[str], list[int]]:
    """(values V_0..V_hops, entity indices of V_0..V_{hops-1})."""
    ents, cur, values, chain = world.entities, start, [world.entities[start].name], []
    for rel in path:
        chain.append(cur)
        if rel in RELATIONS:
            cur = ents[cur].rels[rel]
            values.append(ents[cur].name)
        else:
            values.append(ents[cur].attrs[rel])
    return values, chain

def generate_tasks(split: str, n: int, seed: int = 0, corpus_size: int = DEFAULT_SIZE,
                   corpus_seed: int = 0, hops: int | tuple[int, int] = (2, 3),
                   page_chars: int = DEFAULT_PAGE_CHARS) -> list[dict]:
    """n questions over corpus (corpus_seed, corpus_size); hops: int or inclusive range.
    Each task has its own RNG seeded by its task_id "search:<split>:<seed>:<index>"
    (plus the corpus), so a longer list extends a shorter one.

    Task dict: {"task_id", "family": "search", "question", "answer", "hops", "relations",
    "chain" (V_0..V_hops), "pages" (doc ids of V_0..V_{hops-1}), "corpus_seed",
    "corpus_size", "page_chars"} (JSON-serializable).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    lo, hi = (hops, hops) if isinstance(hops, int) else tuple(hops)
    if not 1 <= lo <= hi <= MAX_HOPS:
        raise ValueError(f"hops {hops} out of range [1, {MAX_HOPS}]")
    if not MIN_PAGE_CHARS <= page_chars:
        raise ValueError(f"page_chars must be at least {MIN_PAGE_CHARS}")
    world = get_corpus(corpus_seed, corpus_size).world
    starts = [e.idx for e in world.entities if (e.idx % 5 == 0) == (split == "eval")]
    tasks = []
    for i in range(n):
        task_id = f"search:{split}:{seed}:{i}"
        rng = random.Random(f"{task_id}:{corpus_seed}:{corpus_size}")
        h = rng.randint(lo, hi)
        for _ in range(1000):
            start = rng.choice(starts)
            path = _sample_path(world, rng, start, h)
            if path is not None:
                break
        else:
            raise ValueError(f"no {h}-hop question found in corpus ({corpus_seed}, {corpus_size})")
        values, chain = _walk(world, start, path)
        tasks.append({"task_id": task_id, "family": "search",
                      "question": describe(values[0], path), "answer": values[-1], "hops": h,
                      "relations": path, "chain": values,
                      "pages": [world.doc_ids[world.page_of[c]] for c in chain],
                      "corpus_seed": corpus_seed, "corpus_size": corpus_size,
                      "page_chars": page_chars})
    return tasks
