"""The search environment (search / open / finish), registered as "search"."""
from __future__ import annotations

import re

from supo_jax.envs.base import Environment, Reset, StepResult, ToolSpec, error_result, register_env
from supo_jax.envs.search.world import DEFAULT_K, MAX_K, MAX_QUERY_CHARS
from supo_jax.envs.search.index import get_corpus
from supo_jax.envs.search.tasks import generate_tasks, normalize_answer
from supo_jax.text.parsing import extract_summary, quote
from supo_jax.text.reading import MAX_SUMMARY_CHARS

def _params(required, **props) -> dict:
    return {"type": "object", "required": list(required),
            "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()}}

SEARCH_TOOL = ToolSpec(
    "search", "Search the pages with BM25 keyword matching; lists the k best pages as "
              "[doc_id] title | opening line.",
    _params(["query"], query=("string", "keywords, e.g. a name"),
            k=("integer", f"number of results, 1 to {MAX_K} (default {DEFAULT_K})")))
OPEN_TOOL = ToolSpec("open", "Show the text of a page (long pages are cut off).",
                     _params(["doc_id"], doc_id=("string", "a page id from search results")))
FINISH_TOOL = ToolSpec("finish", "Submit the final answer (a name, a year or a word). "
                                 "Ends the task.",
                       _params(["answer"], answer=("string", "the answer")))
_PROMPT = ("Answer a question by searching a collection of {size} encyclopedia pages about "
           "people, companies, products and cities. search(query, k) lists the ids, titles and "
           "opening lines of the k best-matching pages; open(doc_id) shows a page. Every "
           "person, company, product and city has exactly one page titled with its exact "
           "name; other pages may be about similarly named entities or mix up their facts, so "
           "trust the page whose title is exactly the name. Make one call per turn and call "
           "finish with the answer. If asked to summarize, state the chain of names resolved "
           "so far, e.g. found=<name in the question> | <first name found> | ...; and the id "
           "of the page to read next as page=<doc id>.\n\nQuestion: {question}")

class SearchEnv(Environment):
    """One question over a shared generated corpus."""
    name = "search"
    tools = (SEARCH_TOOL, OPEN_TOOL, FINISH_TOOL)

    def __init__(self):
        self._task = None
        self._done = False

    def reset(self, task: dict) -> Reset:
        if task.get("family") != "search":
            raise ValueError(f"search cannot run a task of family {task.get('family')!r}")
        self._corpus = get_corpus(task["corpus_seed"], task["corpus_size"])
        for value, doc in zip(task["chain"], task["pages"]):
            if self._corpus.title(doc) != value:
                raise ValueError(f"task {task['task_id']} does not match its corpus (page {doc} "
                                 f"is not {value!r}): made by another version of the generator?")
        self._task, self._done = task, False
        self._opened: set[str] = set()
        self._trace = [0]
        return Reset(prompt=_PROMPT.format(size=len(self._corpus), question=task["question"]),
                     tools=list(self.tools))

    def step(self, name: str, arguments: dict) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        if name == "finish":
            self._done = True
            gold = normalize_answer(self._task["answer"])
            correct = normalize_answer(arguments["answer"]) == gold
            return StepResult("Answer submitted.", done=True, reward=float(correct),
                              info={"correct": correct})
        if name == "search":
            return self._search(arguments["query"], arguments.get("k", DEFAULT_K))
        return self._open(arguments["doc_id"])

    def _search(self, query: str, k: int) -> StepResult:
        if not query.strip():
            return error_result("empty query: search for some keywords, e.g. a name")
        if len(query) > MAX_QUERY_CHARS:
            return error_result(f"query too long ({len(query)} characters; limit "
                                f"{MAX_QUERY_CHARS})")
        if not 1 <= k <= MAX_K:
            return error_result(f"k must be between 1 and {MAX_K}")
        hits = self._corpus.search(query, k)
        head = f"Search results for {quote(query)} (top {k}):"
        if not hits:
            return StepResult(f"{head}\nNo page matches.", info={"hits": 0})
        lines = [f"[{d}] {self._corpus.title(d)} | {self._corpus.snippet(d)}" for d, _ in hits]
        return StepResult("\n".join([head] + lines), info={"hits": len(hits)})

    def _open(self, doc_id: str) -> StepResult:
        d = doc_id.strip().strip("[]").strip()
        if d not in self._corpus.id_index:
            return error_result(f"no page with id {quote(doc_id, 40)}; use an id from search "
                                f"results, like {self._corpus.ids[0]}")
        self._opened.add(d)
        title, text = self._corpus.page(d)
        limit = self._task["page_chars"]
        if len(text) > limit:
            cut = text.rfind(" ", 0, limit + 1)
            shown = text[:cut if cut > limit // 2 else limit]
            text = (f"{shown}\n[Page cut off: showing the first {len(shown)} of {len(text)} "
                    "characters.]")
        return StepResult(f"Page {d}: {title}\n{text}")

    def progress(self) -> int:
        """Hops completed: the largest h with the pages of V_0..V_{h-1} all opened."""
        h, pages = 0, self._task["pages"]
        while h < len(pages) and pages[h] in self._opened:
            h += 1
        return h

    def act(self, text: str) -> StepResult:
        result = super().act(text)
        if self._task is not None:
            self._trace.append(self.progress())
        return result

    def probe(self, summary: str) -> bool | None:
        """Whether the summary names every value resolved so far; None before any hop is
        resolved (nothing to carry: it would read perfect without progress)."""
        if self._task is None or not isinstance(summary, str):
            return None
        h = self._trace[-2] if len(self._trace) > 1 else self._trace[-1]
        if h == 0:
            return None
        summary = summary[:MAX_SUMMARY_CHARS]
        text = " ".join((extract_summary(summary) or summary).lower().split())
        return all(_contains(text, v) for v in self._task["chain"][1:h + 1])

def _contains(text: str, value: str) -> bool:
    v = " ".join(value.lower().split())
    return re.search(rf"(?<!\w){re.escape(v)}(?!\w)", text) is not None

register_env("search", tasks=generate_tasks)(SearchEnv)
