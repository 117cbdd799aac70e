"""The invented world: names, entities and their encyclopedia pages."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

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

def build_world(seed: int, size: int) -> World:
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
