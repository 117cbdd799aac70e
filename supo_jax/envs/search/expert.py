"""The scripted search expert (registered for "search")."""
from __future__ import annotations

import random
import re

from supo_jax.envs.experts import register_expert
from supo_jax.envs.search.world import DEFAULT_K, FACTS, FACT_OF, MAX_K, WHAT
from supo_jax.envs.search.tasks import parse_question
from supo_jax.text.parsing import format_tool_call, quote
from supo_jax.text.reading import asks_for_state, continuation_marker, read_context
from supo_jax.text.templates import CONTINUATION

_RESULT = re.compile(r"^\[(\S+)\] (.*?) \| ", re.M)
_SEARCH_HEAD = re.compile(r"^Search results for (\".*\") \(top (\d+)\):")
_PAGE_HEAD = re.compile(r"^Page (\S+): (.*)$", re.M)
_FOUND = re.compile(r"\bfound\s*[=:]\s*([^;.\n]*)", re.I)
_PAGE_KEY = re.compile(r"\bpage\s*[=:]\s*\[?(d\d+)\b", re.I)
_QUESTION = re.compile(r"^Question: (.+\?)\s*$", re.M)
MAX_TRIES = 3  # searches per name without the exact title listed (k = 5, 10, 20) before giving up

def read_fact(value: str, name: str, text: str) -> str | None:
    """The `value` (relation or attribute) stated for entity `name` in a page text."""
    fact, groups = FACT_OF[value]
    n = re.escape(name)
    for (_, pattern), g in zip(FACTS[fact], groups):
        m = re.search(pattern.format(n=n), text)
        if m:
            return m.group(g).strip()
    return None

class SearchExpert:
    """Scripted policy for search tasks that reads only the working context.

    State: found = [V_0, ..., V_j] (the question's start name, then the values read so far),
    page = the doc id of the page of V_j once a search listed it, tries = searches for V_j
    whose results did not list it. The state starts from the question, is overwritten by
    the previous summary's found=/page= (found must start with the question's name), then
    advanced by the tool messages after it. summarize=True returns "<summary>...</summary>";
    with probability summary_drop the latest value of found (and page) is left out.
    """

    def __init__(self, summary_drop: float = 0.0, seed: int = 0,
                 continuation: str = CONTINUATION):
        self.summary_drop = summary_drop
        self.rng = random.Random(seed)
        self.marker = continuation_marker(continuation)
        self.dropped = 0

    def state(self, messages: list[dict]):
        prompt, summary, observations = read_context(messages, self.marker)
        m = _QUESTION.search(prompt)
        parsed = parse_question(m.group(1)) if m else None
        if parsed is None:
            raise ValueError(f"no search question in the prompt {quote(prompt)}")
        start, rels = parsed
        found, page, tries = [start], None, 0
        if summary is not None and (f := _FOUND.findall(summary)):
            items = [x.strip() for x in f[-1].split("|")]
            if items and items[0].lower() == start.lower() and all(items) and \
                    len(items) <= len(rels) + 1:
                found = [start] + items[1:]
                if (p := _PAGE_KEY.findall(summary)) and len(found) <= len(rels):
                    page = p[-1]
        for obs in observations:
            if len(found) > len(rels):
                break
            cur = found[-1]
            if (h := _SEARCH_HEAD.match(obs)) is not None:
                hit = [d for d, t in _RESULT.findall(obs) if t == cur]
                if hit:
                    page = hit[0]
                elif h.group(1) == quote(cur):
                    tries += 1
            elif (h := _PAGE_HEAD.match(obs)) is not None and h.group(2) == cur:
                value = read_fact(rels[len(found) - 1], cur, obs[h.end():])
                if value is not None:
                    found, page, tries = found + [value], None, 0
        return start, rels, found, page, tries

    def decide(self, rels, found, page, tries) -> tuple[str, str, dict]:
        if len(found) > len(rels):
            return f"The chain is resolved; the answer is {found[-1]}.", "finish", {
                "answer": found[-1]}
        cur, what = found[-1], WHAT[rels[len(found) - 1]]
        if page is not None:
            return f"Open the page of {cur} to find its {what}.", "open", {"doc_id": page}
        if tries >= MAX_TRIES:
            return f"The page of {cur} cannot be found.", "finish", {"answer": "unknown"}
        k = min(DEFAULT_K * 2 ** tries, MAX_K)
        args = {"query": cur} if k == DEFAULT_K else {"query": cur, "k": k}
        return f"Search for the page of {cur} to find its {what}.", "search", args

    def act(self, messages: list[dict], summarize: bool = False) -> str:
        start, rels, found, page, tries = self.state(messages)
        thought, name, args = self.decide(rels, found, page, tries)
        if not summarize:
            call = f"{thought}\n{format_tool_call(name, args)}"
            if asks_for_state(messages):   # context.manager=state: the state, then the call
                return f"<state>{self.summary_text(start, rels, found, page)}</state>\n{call}"
            return call
        if self.summary_drop > 0 and self.rng.random() < self.summary_drop and len(found) > 1:
            found, page = found[:-1], None
            self.dropped += 1
        return f"<summary>{self.summary_text(start, rels, found, page)}</summary>"

    @staticmethod
    def summary_text(start, rels, found, page) -> str:
        plan = " -> ".join([start] + [WHAT[r] for r in rels])
        done = len(found) - 1
        text = (f"Question chain: {plan}. Resolved {done} of {len(rels)} hops: "
                + " -> ".join(found) + ". ")
        if done < len(rels):
            text += f"Next: find the {WHAT[rels[done]]} of {found[-1]}"
            text += f" on page {page}. " if page else " by searching its name. "
        else:
            text += f"Next: answer {found[-1]}. "
        return text + f"State: found={' | '.join(found)}" + (
            f"; page={page}" if page and done < len(rels) else "")

def expert_for(env_name: str = "search", **kwargs) -> SearchExpert:
    """Expert for "search"; kwargs: summary_drop, seed, continuation."""
    if env_name != "search":
        raise ValueError(f"no search expert for {env_name!r}")
    return SearchExpert(**kwargs)

register_expert("search", expert_for)
