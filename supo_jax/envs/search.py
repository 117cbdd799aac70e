"""Search suite in the spirit of BrowseComp-Plus (SUPO.md §8), registered as "search".

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
"""
from __future__ import annotations

import random
import re
import threading
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from supo_jax.envs.base import (Environment, Reset, StepResult, ToolSpec, error_result,
                                register_env)
from supo_jax.envs.experts import register_expert
from supo_jax.text.parsing import extract_summary, format_tool_call, quote
from supo_jax.text.reading import MAX_SUMMARY_CHARS, continuation_marker, read_context
from supo_jax.text.templates import CONTINUATION

DEFAULT_SIZE = 2_000
MIN_SIZE, MAX_SIZE = 100, 1_000_000
DEFAULT_PAGE_CHARS = 800
MIN_PAGE_CHARS = 400
DEFAULT_K, MAX_K = 5, 20
MAX_HOPS = 6
CACHE_SIZE = 4
TWIN_RATE = 0.2          # share of the entities of each kind that are twins of another
SNIPPET_CHARS = 160
MAX_QUERY_CHARS = 500

KINDS = ("city", "company", "product", "person")
KIND_SHARE = {"city": 0.05, "company": 0.12, "product": 0.15, "person": 0.30}
KIND_MIN = {"city": 4, "company": 6, "product": 6, "person": 10}
# relation -> (from kind, to kind); attribute -> kind
RELATIONS = {"maker": ("product", "company"), "founder": ("company", "person"),
             "hq": ("company", "city"), "birthplace": ("person", "city"),
             "employer": ("person", "company"), "mayor": ("city", "person")}
ATTRIBUTES = {"launch_year": "product", "founded_year": "company", "birth_year": "person",
              "profession": "person", "river": "city", "country": "city"}
# inner descriptions "the ... of <x>" (relations only) and final questions
DESCRIBE = {"maker": "the company that makes ", "founder": "the founder of ",
            "hq": "the headquarters city of ", "birthplace": "the birthplace of ",
            "employer": "the employer of ", "mayor": "the mayor of "}
ASK = {"maker": "Which company makes {x}?", "founder": "Who founded {x}?",
       "hq": "In which city is {x} headquartered?", "birthplace": "In which city was {x} born?",
       "employer": "Which company does {x} work for?", "mayor": "Who is the mayor of {x}?",
       "launch_year": "In which year was {x} launched?",
       "founded_year": "In which year was {x} founded?",
       "birth_year": "In which year was {x} born?",
       "profession": "What is the profession of {x}?",
       "river": "Which river flows through {x}?", "country": "In which country is {x}?"}
WHAT = {"maker": "maker", "founder": "founder", "hq": "headquarters city",
        "birthplace": "birthplace", "employer": "employer", "mayor": "mayor",
        "launch_year": "launch year", "founded_year": "founding year",
        "birth_year": "birth year", "profession": "profession", "river": "river",
        "country": "country"}

# ---- names ---------------------------------------------------------------------------------
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "b", "d", "k", "l", "m", "n", "r", "s", "t", "br", "dr", "gr", "st", "tr",
           "th", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "", "", "", "", "n", "l", "r", "s", "m", "nd")
_COMPANY_SUFFIXES = ("Dynamics", "Labs", "Works", "Industries", "Systems", "Foundry",
                     "Holdings", "Group", "Collective", "Partners", "Mills", "Studios")
_MODELS = ("Pro", "Mini", "Max", "Lite", "Air", "Plus", "One", "Nova", "Prime", "Go")
_PROFESSIONS = ("architect", "surveyor", "botanist", "engineer", "cartographer",
                "economist", "pharmacist", "historian", "geologist", "translator",
                "violinist", "astronomer", "carpenter", "journalist", "illustrator")
_FLUFF = ("an unusual collection of antique maps", "early experiments with tidal clocks",
          "a long-running column on winter gardening", "restoring old sailing boats",
          "an annual kite festival", "a stubborn rivalry with a local choir",
          "hand-painted signage", "a widely copied logo", "a famous lemon cake recipe",
          "an archive of handwritten letters", "quiet, careful craftsmanship",
          "a series of public lectures on bridges", "a striking red facade",
          "a habit of planting chestnut trees", "a short-lived radio programme",
          "a lighthouse-shaped emblem", "a decades-old chess tournament",
          "a collection of mechanical toys", "an early adoption of solar lamps",
          "a popular winter market")
_NOT_NAMES = frozenset(("a an and are as at be but by for if in into is it no not of on or "
                        "such that the their then there these they this to was will with "
                        "city river made born mayor works founded pro max one go air").split())


class _Names:
    """Unique invented names (case-insensitively unique across the whole corpus)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def stem(self, syllables: int) -> str:
        r = self.rng
        while True:
            s = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS)
                        for _ in range(syllables))
            if len(s) >= 3 and s not in _NOT_NAMES:
                return s.capitalize()

    def take(self, name: str) -> str | None:
        key = name.lower()
        if key in self.used:
            return None
        self.used.add(key)
        return name

    def new(self, kind: str, first_names: list[str]) -> str:
        r = self.rng
        while True:
            if kind == "person":
                name = f"{r.choice(first_names)} {self.stem(r.choice((2, 2, 3)))}"
            elif kind == "company":
                name = f"{self.stem(r.choice((2, 2, 3)))} {r.choice(_COMPANY_SUFFIXES)}"
            elif kind == "product":
                name = self.stem(2) + (f" {r.choice(_MODELS)}" if r.random() < 0.4 else "")
            else:
                name = self.stem(r.choice((2, 2, 3)))
            if self.take(name):
                return name

    def mutate(self, word: str) -> str:
        """One vowel of a word changed."""
        pos = [i for i, c in enumerate(word) if c.lower() in _VOWELS]
        i = self.rng.choice(pos)
        v = self.rng.choice([x for x in _VOWELS if x != word[i].lower()])
        return word[:i] + (v.upper() if word[i].isupper() else v) + word[i + 1:]

    def twin(self, kind: str, name: str) -> str:
        r = self.rng
        for _ in range(100):
            words = name.split(" ")
            if kind == "company" and r.random() < 0.5:
                words[-1] = r.choice([s for s in _COMPANY_SUFFIXES if s != words[-1]])
            elif kind == "product" and r.random() < 0.5:
                words = words[:1] + [r.choice([m for m in _MODELS if m not in words])]
            else:
                j = len(words) - 1 if kind == "person" else 0
                words[j] = self.mutate(words[j])
            if self.take(" ".join(words)):
                return " ".join(words)
        return self.new(kind, [name.split(" ")[0]])


# ---- world and pages ----------------------------------------------------------------------
@dataclass
class Entity:
    idx: int
    kind: str
    name: str
    rels: dict = field(default_factory=dict)    # relation -> entity index
    attrs: dict = field(default_factory=dict)   # attribute -> str value
    lead: str = ""                               # the page's opening sentence
    style: int = 0                              # page layout seed (shared by twins)
    twin_of: int | None = None


# fact phrasings: (template, regex with {n} = re.escape(name) -> groups), per fact
_S = r"(?:^|(?<=[.!?])\s+)"   # sentence start
_V = r"([^.\n]+?)"            # a name or value (names hold no dots)
FACTS = {
    "maker": [("{n} is made by {maker}.", _S + r"{n} is made by " + _V + r"\."),
              ("{n} is a product of {maker}.", _S + r"{n} is a product of " + _V + r"\.")],
    "launch": [("{n} was launched in {launch_year}.", _S + r"{n} was launched in (\d{{4}})\."),
               ("{n} first went on sale in {launch_year}.",
                _S + r"{n} first went on sale in (\d{{4}})\.")],
    "founded": [("{n} was founded in {founded_year} by {founder}.",
                 _S + r"{n} was founded in (\d{{4}}) by " + _V + r"\."),
                ("{founder} founded {n} in {founded_year}.",
                 _S + _V + r" founded {n} in (\d{{4}})\.")],
    "hq": [("{n} is headquartered in {hq}.", _S + r"{n} is headquartered in " + _V + r"\."),
           ("The headquarters of {n} are in {hq}.",
            _S + r"The headquarters of {n} are in " + _V + r"\.")],
    "born": [("{n} was born in {birthplace} in {birth_year}.",
              _S + r"{n} was born in " + _V + r" in (\d{{4}})\."),
             ("{n} was born in {birth_year} in {birthplace}.",
              _S + r"{n} was born in (\d{{4}}) in " + _V + r"\.")],
    "job": [("{n} works for {employer} as {a_profession}.",
             _S + r"{n} works for " + _V + r" as an? ([a-z]+)\."),
            ("{n} is {a_profession} at {employer}.", _S + r"{n} is an? ([a-z]+) at " + _V + r"\.")],
    "mayor": [("The mayor of {n} is {mayor}.", _S + r"The mayor of {n} is " + _V + r"\."),
              ("{mayor} is the mayor of {n}.", _S + _V + r" is the mayor of {n}\.")],
    "place": [("{n} lies on the {river} river in {country}.",
               _S + r"{n} lies on the ([A-Za-z]+) river in ([A-Za-z]+)\."),
              ("{n} is a city in {country} on the banks of the {river} river.",
               _S + r"{n} is a city in ([A-Za-z]+) on the banks of the ([A-Za-z]+) river\.")],
}
# value -> (fact, index of the regex group per phrasing)
FACT_OF = {"maker": ("maker", (1, 1)), "launch_year": ("launch", (1, 1)),
           "founded_year": ("founded", (1, 2)), "founder": ("founded", (2, 1)),
           "hq": ("hq", (1, 1)), "birthplace": ("born", (1, 2)), "birth_year": ("born", (2, 1)),
           "employer": ("job", (1, 2)), "profession": ("job", (2, 1)),
           "mayor": ("mayor", (1, 1)), "river": ("place", (1, 2)), "country": ("place", (2, 1))}
KIND_FACTS = {"product": ("maker", "launch"), "company": ("founded", "hq"),
              "person": ("born", "job"), "city": ("mayor", "place")}
_FILLER = ("In {y}, {n} was mentioned in a regional newsletter next to {o}.",
           "In {y}, {n} hosted a small delegation that included {o}.",
           "In {y}, a museum exhibit paired {n} with {o}.",
           "In {y}, {n} appeared in a documentary about {o}.",
           "In {y}, {n} received a letter of thanks from {o}.",
           "In {y}, a survey ranked {n} just behind {o}.",
           "Archival records about {n} are incomplete for the years before {y}.",
           "Several photographs of {n} from {y} survive in private collections.",
           "Critics writing in {y} compared {n} unfavourably with {o}.")
_EVENTS = ("Harvest fair", "Trade summit", "Rowing regatta", "Charity auction",
           "Lantern festival", "Science fair", "Book week", "Film night", "Jazz weekend",
           "City marathon", "Flower show", "Robotics contest")
_NEWS = ("{p} gave a short speech at the opening.", "{c} sponsored the main stage.",
         "Visitors queued to try out {d}.", "{p} and {q} were seen talking near the entrance.",
         "A stand run by {c} handed out samples of {d}.", "Local papers quoted {p} at length.",
         "Organisers thanked {c} and {e} for their support.")


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _values(world: list[Entity], e: Entity) -> dict:
    v = {k: world[i].name for k, i in e.rels.items()}
    v.update(e.attrs)
    if "profession" in v:
        v["a_profession"] = _article(v["profession"])
    return v


def _fact_sentences(world, e: Entity, rng: random.Random) -> list[str]:
    v, out = _values(world, e), []
    for fact in KIND_FACTS[e.kind]:
        template, _ = FACTS[fact][rng.randrange(2)]
        out.append(template.format(n=e.name, **v))
    rng.shuffle(out)
    return out


def _entity_page(world, e: Entity, by_kind, rng: random.Random) -> str:
    style = random.Random(e.style)
    facts = _fact_sentences(world, e, style)
    filler = []
    for _ in range(style.randint(2, 9)):
        o = world[rng.choice(by_kind[rng.choice(KINDS)])].name
        if o == e.name:
            continue
        filler.append(style.choice(_FILLER).format(y=rng.randint(1900, 2020), n=e.name, o=o))
    return f"{e.lead} {' '.join(facts)}\n\n{' '.join(filler)}"


@dataclass
class World:
    entities: list[Entity]
    by_kind: dict
    docs: list[tuple[str, str, str]]      # (title, lead/snippet, text) in doc-id order
    page_of: list[int]                    # entity index -> doc index
    doc_ids: list[str]


def _build_world(seed: int, size: int) -> World:
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"corpus_size {size} out of range [{MIN_SIZE}, {MAX_SIZE}]")
    rng = random.Random(f"search-corpus:{seed}:{size}")
    names = _Names(rng)
    first_names = [names.stem(2) for _ in range(max(20, size // 20))]
    countries = []
    while len(countries) < 10:
        c = names.stem(2) + rng.choice(("ia", "land", "or", "ana"))
        if names.take(c):
            countries.append(c)
    counts = {k: max(KIND_MIN[k], round(size * KIND_SHARE[k])) for k in KINDS}
    world: list[Entity] = []
    by_kind = {k: [] for k in KINDS}
    for kind in KINDS:
        n_twin = round(counts[kind] * TWIN_RATE)
        base = []
        for _ in range(counts[kind] - n_twin):
            e = Entity(len(world), kind, names.new(kind, first_names), lead=rng.choice(_FLUFF),
                       style=rng.getrandbits(48))
            world.append(e)
            base.append(e)
        for orig in rng.sample(base, n_twin):
            world.append(Entity(len(world), kind, names.twin(kind, orig.name), lead=orig.lead,
                                style=orig.style, twin_of=orig.idx))
        by_kind[kind] = [e.idx for e in world if e.kind == kind]
    position = {i: p for k in KINDS for p, i in enumerate(by_kind[k])}
    rivers = []
    while len(rivers) < max(4, counts["city"] // 2):
        r = names.stem(2)
        if names.take(r):
            rivers.append(r)
    for e in world:
        for rel, (src, dst) in RELATIONS.items():
            if src == e.kind:
                e.rels[rel] = rng.choice(by_kind[dst])
        if e.kind == "product":
            e.attrs = {"launch_year": str(rng.randint(1960, 2023))}
        elif e.kind == "company":
            e.attrs = {"founded_year": str(rng.randint(1850, 2015))}
        elif e.kind == "person":
            e.attrs = {"birth_year": str(rng.randint(1930, 2000)),
                       "profession": rng.choice(_PROFESSIONS)}
        else:
            e.attrs = {"river": rng.choice(rivers), "country": rng.choice(countries)}
        if e.twin_of is not None:  # a twin conflicts with its original on every relation
            orig = world[e.twin_of]
            for rel, i in e.rels.items():
                if i == orig.rels[rel]:
                    dst = by_kind[RELATIONS[rel][1]]
                    e.rels[rel] = dst[(position[i] + 1) % len(dst)]
    for e in world:
        kind = "a product line" if e.kind == "product" else "a " + e.kind
        e.lead = f"{e.name} is {kind} known for {e.lead}."
    # pages
    docs = []  # (title, lead, text, entity index or -1)
    for e in world:
        docs.append((e.name, e.lead, _entity_page(world, e, by_kind, rng), e.idx))
    twins = [e for e in world if e.twin_of is not None]
    n_conf = min(len(twins), round(size * 0.06))
    n_news = size - len(docs) - n_conf
    if n_news < 0:
        raise ValueError(f"corpus_size {size} is too small")
    for e in rng.sample(twins, n_conf):
        orig = world[e.twin_of]
        a, b = (orig, e) if rng.random() < 0.5 else (e, orig)
        facts = _fact_sentences(world, e, rng)
        text = (f"{a.name} and {b.name} are often confused. Readers writing about {orig.name} "
                f"sometimes quote facts that belong to {e.name}. For the record: "
                + " ".join(facts) + f" None of this applies to {orig.name}.")
        docs.append((f"Confusion between {a.name} and {b.name}", text.split(". ")[0] + ".",
                     text, -1))
    pick = lambda kind: world[rng.choice(by_kind[kind])].name
    for _ in range(n_news):
        city, event, year = pick("city"), rng.choice(_EVENTS), rng.randint(1950, 2023)
        lead = f"The {event.lower()} in {city} took place in {year}."
        body = [rng.choice(_NEWS).format(p=pick("person"), q=pick("person"), c=pick("company"),
                                         e=pick("company"), d=pick("product"))
                for _ in range(rng.randint(2, 6))]
        docs.append((f"{event} in {city} ({year})", lead, lead + " " + " ".join(body), -1))
    rng.shuffle(docs)
    width = max(5, len(str(size - 1)))
    doc_ids = [f"d{i:0{width}d}" for i in range(len(docs))]
    page_of = [0] * len(world)
    for d, (_, _, _, ent) in enumerate(docs):
        if ent >= 0:
            page_of[ent] = d
    return World(world, by_kind, [(t, s[:SNIPPET_CHARS], x) for t, s, x, _ in docs], page_of,
                 doc_ids)


# ---- retrieval ----------------------------------------------------------------------------
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
        self.world = _build_world(seed, size)
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


# ---- answers ------------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lowercase, punctuation removed (Unicode P*/S* categories), articles a/an/the
    removed, whitespace collapsed (SQuAD-style exact match)."""
    s = unicodedata.normalize("NFKC", str(s)).lower()
    s = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in s)
    return " ".join(_ARTICLES.sub(" ", s).split())


# ---- questions ----------------------------------------------------------------------------
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


# ---- environment --------------------------------------------------------------------------
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


# ---- expert ------------------------------------------------------------------------------
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
            return f"{thought}\n{format_tool_call(name, args)}"
        if self.summary_drop > 0 and self.rng.random() < self.summary_drop and len(found) > 1:
            found, page = found[:-1], None
            self.dropped += 1
        plan = " -> ".join([start] + [WHAT[r] for r in rels])
        done = len(found) - 1
        text = (f"Question chain: {plan}. Resolved {done} of {len(rels)} hops: "
                + " -> ".join(found) + ". ")
        if done < len(rels):
            text += f"Next: find the {WHAT[rels[done]]} of {found[-1]}"
            text += f" on page {page}. " if page else " by searching its name. "
        else:
            text += f"Next: answer {found[-1]}. "
        text += f"State: found={' | '.join(found)}" + (f"; page={page}" if page and done < len(rels)
                                                       else "")
        return f"<summary>{text}</summary>"


def expert_for(env_name: str = "search", **kwargs) -> SearchExpert:
    """Expert for "search"; kwargs: summary_drop, seed, continuation."""
    if env_name != "search":
        raise ValueError(f"no search expert for {env_name!r}")
    return SearchExpert(**kwargs)


register_expert("search", expert_for)
