"""Search suite in the spirit of BrowseComp-Plus (docs/SUPO.md §8), registered as "search".

A locally generated corpus (deterministic by (corpus_seed, corpus_size); default 2,000
pages) describes invented people, cities, companies and products, and the multi-hop
questions over it need several searches:

    "In which city was the founder of the company that makes Zorvex born?"
    = Zorvex -maker-> <company> -founder-> <person> -birthplace-> <city>   (3 hops)

Corpus. Entities (about 62% of the pages, a fifth of them "twins"):
    person   birthplace -> city, employer -> company;  birth_year, profession
    company  founder -> person, hq -> city;            founded_year
    product  maker -> company;                         launch_year
    city     mayor -> person;                          river, country
Every entity has exactly one page whose title is its exact name; the page opens with a
lead sentence (the search snippet, which states no fact a question asks about), then the
entity's facts (each relation is stated only on the page of the entity it starts from,
in one of two phrasings), then filler sentences mentioning random other entities.
Distractors: twins have a similar name (one vowel changed, or another company suffix /
product model) and a near-duplicate page (same lead and layout) with different facts;
"Confusion between A and B" pages (~6%) restate a twin's facts next to the name of the
entity it is confused with; news pages (~30%) mention several entities without any
relation facts. Questions follow a random path of `hops` functional relations (no entity
visited twice) from a start entity and end in a relation or an attribute, so the answer
(a name, a year, a profession, a river or a country) is unique. Eval questions start
from entities with index % 5 == 0, train questions from the others: disjoint splits.
Train and eval share the corpus (as BrowseComp-Plus has one fixed corpus).

Tools: search(query, k=5) ranks pages with BM25 (bm25s) over title + text and lists up
to k (1..MAX_K) hits as "[doc_id] title | snippet"; open(doc_id) shows the page cut to
the task's page_chars with a note when cut (the facts always fit: page_chars >= 400);
finish(answer) ends the episode with reward 1.0 iff normalize_answer(answer) ==
normalize_answer(gold) (lowercase, no punctuation, no articles a/an/the, single spaces).
Bad values (empty query, k out of range, unknown doc id) are error observations.

Corpus and index are built once per (corpus_seed, corpus_size) per process and shared
by all env instances (thread-safe LRU cache of CACHE_SIZE corpora). On one CPU core a
2,000-page corpus builds in ~0.5 s and a 10,000-page one in ~1.5 s; a search takes
~0.1-0.2 ms.

Probe. The hop chain is V_0 (start, named in the question), V_1, ..., V_hops (= answer);
hop i is done once the agent has opened the page of V_{i-1} (which states V_i). The
progress h is the largest h with the pages of V_0..V_{h-1} all opened. `probe(summary)`
is True iff the summary (its <summary> block if any, else the text; at most 20,000
characters) contains, case-insensitively as whole words, every resolved value V_1..V_h,
with h the progress before the last `act` (SUPO drops the overflowing action from the
summarizer's view, though the env ran it); so before any hop is done it is True. The
latest of them, V_h, is what the next hop needs (the name to search for), and the full
chain lets the agent check the path.

Expert (`expert_for("search")`, also via `supo_jax.envs.experts.expert_for`): parses the
question, and for each hop searches the current name, opens the page with that exact
title (retrying with a larger k when it is not listed) and reads the relation from the
page text; it reads only its working context (prompt, previous summary, tool messages
after it). Summaries carry `found=V_0 | V_1 | ... ; page=<doc id of the current page>`;
with probability summary_drop the latest resolved value (and page) is left out, so a
resumed expert redoes that hop (and the probe fails).

Modules: world.py (the invented world and its pages), index.py (BM25 retrieval, cached per
corpus), tasks.py (questions, answers), environment.py (SearchEnv), expert.py (SearchExpert).
"""
from supo_jax.envs.search.environment import SearchEnv
from supo_jax.envs.search.expert import SearchExpert, expert_for, read_fact
from supo_jax.envs.search.index import Corpus, get_corpus, tokenize
from supo_jax.envs.search.tasks import describe, generate_tasks, normalize_answer, parse_question
from supo_jax.envs.search.world import DEFAULT_K, DEFAULT_SIZE, MAX_K, World, build_world

__all__ = ["Corpus", "DEFAULT_K", "DEFAULT_SIZE", "MAX_K", "SearchEnv", "SearchExpert", "World",
           "build_world", "describe", "expert_for", "generate_tasks", "get_corpus",
           "normalize_answer", "parse_question", "read_fact", "tokenize"]
