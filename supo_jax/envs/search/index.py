"""Retrieval over the pages: a BM25 index (bm25s) per (corpus_seed, corpus_size), cached."""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

import numpy as np

from supo_jax.envs.search.world import CACHE_SIZE, DEFAULT_SIZE, build_world

_TOKEN = re.compile(r"[a-z0-9]+")
_STOP = frozenset(("a an and are as at be but by for if in into is it no not of on or such "
                   "that the their then there these they this to was will with").split())

def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOP]

class Corpus:
    """A generated corpus with its BM25 index (bm25s). Read-only after construction."""

    def __init__(self, seed: int, size: int):
        import bm25s
        self.seed, self.size = seed, size
        self.world = build_world(seed, size)
        self.ids = self.world.doc_ids
        self.id_index = {d: i for i, d in enumerate(self.ids)}
        vocab: dict[str, int] = {}
        # the title counts twice (a title boost)
        corpus_ids = [[vocab.setdefault(t, len(vocab))
                       for t in tokenize(f"{title}\n{title}\n{text}")]
                      for title, _, text in self.world.docs]
        self.bm25 = bm25s.BM25()
        self.bm25.index((corpus_ids, vocab), create_empty_token=False, show_progress=False)
        self.vocab = vocab

    def __len__(self):
        return len(self.ids)

    def title(self, doc_id: str) -> str | None:
        i = self.id_index.get(doc_id)
        return None if i is None else self.world.docs[i][0]

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Top-k (doc id, score) with score > 0; ties broken by doc id."""
        ids = [self.vocab[t] for t in tokenize(query) if t in self.vocab]
        if not ids:
            return []
        scores = self.bm25.get_scores_from_ids(ids)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        # the k-th score may be tied with documents outside `top`: take all of them
        kth = scores[top].min()
        cand = np.nonzero(scores >= kth)[0]
        order = cand[np.lexsort((cand, -scores[cand]))][:k]
        return [(self.ids[i], float(scores[i])) for i in order if scores[i] > 0]

    def page(self, doc_id: str) -> tuple[str, str]:
        title, _, text = self.world.docs[self.id_index[doc_id]]
        return title, text

    def snippet(self, doc_id: str) -> str:
        return self.world.docs[self.id_index[doc_id]][1]

_CACHE: OrderedDict = OrderedDict()
_CACHE_LOCK = threading.Lock()
_BUILD_LOCKS: dict = {}

def get_corpus(seed: int = 0, size: int = DEFAULT_SIZE) -> Corpus:
    """The corpus and index of (seed, size), built once per process (thread-safe)."""
    key = (int(seed), int(size))
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        lock = _BUILD_LOCKS.setdefault(key, threading.Lock())
    with lock:  # one build per key; other keys are not blocked
        with _CACHE_LOCK:
            if key in _CACHE:
                return _CACHE[key]
        try:
            corpus = Corpus(*key)
        except BaseException:
            with _CACHE_LOCK:
                _BUILD_LOCKS.pop(key, None)
            raise
        with _CACHE_LOCK:
            _CACHE[key] = corpus
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
            _BUILD_LOCKS.pop(key, None)
        return corpus
