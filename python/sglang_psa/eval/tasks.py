"""Seeded long-context tasks with exact-match answers (RULER-style, generated, not downloaded).

Every task is a `Task(prompt, question, answers, max_new_tokens)`: the model
reads `prompt` (a long document with the facts hidden at seeded depths),
then `question`; it is correct when every string of `answers` appears in its
output. Lengths are hit in model tokens by measuring sentences with the
tokenizer, so "8K" means 8K tokens of this model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SUBJECTS = [
    "The river",
    "A quiet village",
    "The old library",
    "Our committee",
    "The harbor",
    "A young painter",
    "The mountain road",
    "The orchestra",
    "A small bakery",
    "The research team",
    "The garden",
    "An early train",
    "The museum",
    "A fisherman",
]
VERBS = [
    "remembered",
    "described",
    "discovered",
    "ignored",
    "celebrated",
    "measured",
    "repaired",
    "visited",
    "questioned",
    "admired",
    "planned",
    "recorded",
]
OBJECTS = [
    "the long winter",
    "a forgotten map",
    "the morning market",
    "an unusual storm",
    "the annual festival",
    "a broken bridge",
    "the northern lights",
    "a sealed letter",
    "the autumn harvest",
    "a copper kettle",
    "the evening tide",
    "a narrow staircase",
]
TAILS = [
    "before anyone noticed.",
    "with great patience.",
    "as the bells rang.",
    "while the rain continued.",
    "in the usual way.",
    "without saying a word.",
    "for the third time that year.",
    "under a pale sky.",
    "as if nothing had changed.",
    "to everyone's surprise.",
]
CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Hanoi",
    "Quito",
    "Dublin",
    "Kraków",
    "Porto",
    "Tbilisi",
    "Accra",
    "Bergen",
    "Cusco",
    "Riga",
    "Tunis",
    "Zagreb",
    "Halifax",
    "Perth",
]
NAMES = [
    "Amara",
    "Bruno",
    "Chidi",
    "Dagny",
    "Elif",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kaito",
    "Leila",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quentin",
    "Rosa",
    "Soren",
    "Tamar",
]
JOBS = [
    "carpenter",
    "pilot",
    "chemist",
    "librarian",
    "baker",
    "surgeon",
    "architect",
    "violinist",
    "gardener",
    "journalist",
    "astronomer",
    "tailor",
]
WORDS = [
    "apple",
    "button",
    "candle",
    "dolphin",
    "engine",
    "feather",
    "guitar",
    "hammer",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "marble",
    "needle",
    "orange",
    "pencil",
    "quilt",
    "rocket",
    "saddle",
    "ticket",
    "umbrella",
    "violin",
    "wallet",
    "yogurt",
    "zipper",
    "anchor",
    "basket",
    "cactus",
    "drum",
    "easel",
]


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str  # the long document (and the instruction that precedes it)
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int

    def score(self, output: str) -> bool:
        out = output.lower()
        return all(a.lower() in out for a in self.answers)


class Builder:
    """Fills a document to a token budget, inserting needles at given depths."""

    def __init__(self, count_tokens: Callable[[str], int], rng: random.Random):
        self.count, self.rng = count_tokens, rng

    def filler(self) -> str:
        r = self.rng
        return f"{r.choice(SUBJECTS)} {r.choice(VERBS)} {r.choice(OBJECTS)} {r.choice(TAILS)}"

    def document(
        self, n_tokens: int, needles: list[str], make_filler: Callable[[], str] | None = None
    ) -> str:
        make_filler = make_filler or self.filler
        budget = n_tokens - sum(self.count(" " + s) for s in needles)
        sentences: list[str] = []
        used = 0
        while used < budget:
            s = make_filler()
            used += self.count(" " + s)
            sentences.append(s)
        for needle in needles:  # seeded depths, never at the very start or end
            pos = self.rng.randint(max(1, len(sentences) // 20), max(1, len(sentences) * 19 // 20))
            sentences.insert(pos, needle)
        return " ".join(sentences)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def niah(b: Builder, n_tokens: int, n_keys: int) -> Task:
    rng = b.rng
    keys = rng.sample(CITIES, n_keys)
    values = {k: _number(rng) for k in keys}
    needles = [f"The special magic number for {k} is {values[k]}." for k in keys]
    doc = b.document(n_tokens, needles)
    target = rng.choice(keys)
    return Task(
        f"niah_{n_keys}key",
        _intro("special magic numbers") + doc,
        f"What is the special magic number for {target}? Answer with the number only.",
        (values[target],),
        16,
    )


def niah_multivalue(b: Builder, n_tokens: int, n_values: int = 4) -> Task:
    rng = b.rng
    key = rng.choice(CITIES)
    values = [_number(rng) for _ in range(n_values)]
    needles = [f"One of the special magic numbers for {key} is {v}." for v in values]
    doc = b.document(n_tokens, needles)
    return Task(
        "niah_multivalue",
        _intro("special magic numbers") + doc,
        f"List all the special magic numbers for {key}, separated by commas.",
        tuple(values),
        48,
    )


def variable_tracking(b: Builder, n_tokens: int, hops: int = 3) -> Task:
    rng = b.rng
    names = [
        "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)
    ]
    value = str(rng.randint(10000, 99999))
    needles = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)
    ]
    doc = b.document(n_tokens, [])
    # Chain order must be kept: insert the hops at increasing depths.
    sents = doc.split(". ")
    cuts = sorted(rng.sample(range(1, len(sents)), len(needles)))
    for offset, (cut, needle) in enumerate(zip(cuts, needles)):
        sents.insert(cut + offset, needle.rstrip("."))
    doc = ". ".join(sents)
    return Task(
        "variable_tracking",
        _intro("variable assignments") + doc,
        f"Which variables are assigned the value {value}, directly or through other "
        "variables? List their names, separated by commas.",
        tuple(names),
        48,
    )


def common_words(b: Builder, n_tokens: int, n_top: int = 3) -> Task:
    """Frequent-word aggregation: a numbered word list where a few words repeat often."""
    rng = b.rng
    top = rng.sample(WORDS, n_top)
    rest = [w for w in WORDS if w not in top]
    counter = iter(range(1, 10**9))

    def item() -> str:
        w = rng.choice(top) if rng.random() < 0.3 else rng.choice(rest)
        return f"{next(counter)}. {w}"

    doc = b.document(n_tokens, [], make_filler=item)
    return Task(
        "common_words",
        "Below is a numbered list of words. Memorize it.\n" + doc,
        f"What are the {n_top} most common words in the list above? Answer with the "
        "words only, separated by commas.",
        tuple(top),
        32,
    )


def doc_qa(b: Builder, n_tokens: int) -> Task:
    """QA over a long document of person facts; one person's city is asked."""
    rng = b.rng
    people = rng.sample(NAMES, 12)
    facts = {p: (rng.choice(CITIES), rng.choice(JOBS)) for p in people}
    needles = [f"{p} is a {job} who lives in {city}." for p, (city, job) in facts.items()]
    doc = b.document(n_tokens, needles)
    target = rng.choice(people)
    return Task(
        "doc_qa",
        _intro("facts about people") + doc,
        f"In which city does {target} live? Answer with the city only.",
        (facts[target][0],),
        16,
    )


def chat_text(tok, document: str, question: str) -> str:
    """The prompt text a chat model reads: `document` and `question` as one user turn
    through the tokenizer's chat template, ending where the assistant's answer starts
    (`document`, a blank line, `question` and "Answer:" where there is no template)."""
    return chat_turns_text(tok, [document + "\n\n" + question])


def chat_turns_text(tok, turns: list[str]) -> str:
    """The prompt text of a conversation: `turns` alternate user and assistant messages,
    a user's first and last, through the tokenizer's chat template, ending where the next
    assistant answer starts. Without a template, each user message is followed by
    "\nAnswer:" and its answer (after a space) and a blank line. Either way the prompt of
    a conversation is, byte for byte, the start of the prompt of its continuation (the
    same turns, an answer and a new user message)."""
    if len(turns) % 2 != 1:
        raise ValueError(f"a conversation ends with a user message: got {len(turns)} turns")
    if getattr(tok, "chat_template", None):
        roles = ("user", "assistant")
        return tok.apply_chat_template(
            [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)],
            tokenize=False,
            add_generation_prompt=True,
        )
    done = "".join(f"{u}\nAnswer: {a}\n\n" for u, a in zip(turns[0:-1:2], turns[1::2]))
    return done + turns[-1] + "\nAnswer:"


def _intro(what: str) -> str:
    return f"A long text is given below. Some {what} are hidden in it. Memorize them.\n"


GENERATORS: dict[str, Callable[[Builder, int], Task]] = {
    "niah_1key": lambda b, n: niah(b, n, 1),
    "niah_4key": lambda b, n: niah(b, n, 4),
    "niah_8key": lambda b, n: niah(b, n, 8),
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "doc_qa": doc_qa,
}


def make_tasks(
    kinds: list[str], n_tokens: int, n_per_kind: int, seed: int, count_tokens: Callable[[str], int]
) -> list[Task]:
    """`n_per_kind` tasks of each kind, each reproducible from (seed, kind, index)."""
    tasks = []
    for kind in kinds:
        if kind not in GENERATORS:
            raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(GENERATORS)}")
        for i in range(n_per_kind):
            rng = random.Random(f"{seed}/{kind}/{i}/{n_tokens}")
            tasks.append(GENERATORS[kind](Builder(count_tokens, rng), n_tokens))
    return tasks


def fact_document(
    b: Builder, n_tokens: int, n_numbers: int, n_people: int, keys: list[str] = CITIES
) -> tuple[str, list[Task]]:
    """A document of `n_tokens` with `n_numbers` magic numbers (for distinct cities of
    `keys`) and `n_people` person facts (distinct names, each living in a distinct city
    that is not a magic-number key) hidden at seeded depths, and one question about each
    fact (magic numbers first): a document asked many different questions."""
    rng = b.rng
    cities = rng.sample(keys, n_numbers)
    numbers = [str(rng.randint(1_000_000, 9_999_999)) for _ in cities]
    people = rng.sample(NAMES, n_people)
    homes = rng.sample([c for c in CITIES if c not in cities], n_people)
    needles = [f"The special magic number for {c} is {n}." for c, n in zip(cities, numbers)]
    needles += [f"{p} is a {rng.choice(JOBS)} who lives in {h}." for p, h in zip(people, homes)]
    doc = "A long text is given below. Some facts are hidden in it. Memorize them.\n" + b.document(
        n_tokens, needles
    )
    questions = [
        Task(
            "magic_number",
            doc,
            f"What is the special magic number for {c}? Answer with the number only.",
            (n,),
            12,
        )
        for c, n in zip(cities, numbers)
    ]
    questions += [
        Task(
            "person_city", doc, f"In which city does {p} live? Answer with the city only.", (h,), 12
        )
        for p, h in zip(people, homes)
    ]
    return doc, questions


def demo_document(count_tokens, n_tokens: int, seed: int) -> tuple[str, list[Task]]:
    """The demos' document (CPU demo and server demo): two magic numbers and two person
    facts hidden in `n_tokens` of filler, and the 4 questions about them."""
    return fact_document(Builder(count_tokens, random.Random(seed)), n_tokens, 2, 2)
