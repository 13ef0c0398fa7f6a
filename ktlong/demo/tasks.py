"""Synthetic long documents with hidden facts, shared by training, the demo and `bench accuracy`.

A document is filler prose (random sentences over a fixed word list, no digits) with facts put
at chosen depths, each with its question and answer:
- passkey: "The pass key is 71432. Remember it. 71432 is the pass key." (InfiniteBench's wording)
- kv: records "The value of key amber is 40591." with distinct random keys; one is asked for.
  Several records per document, so the others are distractors (kv-retrieval).
- needle: "The best thing to do in Lisbon is to paint the old boat." (needle-in-a-haystack)

Everything is reproducible from a seed: `make_sample(seed, ...)` returns the same document, facts
and questions on every machine (Python's `random.Random` only).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TASKS = ("passkey", "kv", "needle")

FILLER = (
    "the a of and to in is was that for on with as by at from it this be are or an have not "
    "which all were when there can more if out so what up about into them than then its grass "
    "sky sun moon tree trees hill hills road roads wind rain snow cloud clouds sea shore wave "
    "waves bird birds song songs light dark long short old new small large warm cold green blue "
    "grey white black red golden soft slow fast still quiet bright deep high low far near "
    "morning evening night day days week year years season spring autumn field fields farm "
    "house houses door window wall roof garden path paths bridge well stream forest wood "
    "leaf leaves flower flowers stone stones sand dust fire smoke bread milk cup table chair "
    "book books letter letters word words page story stories people man woman child children "
    "friend friends king queen town village market street walk walked walks ran runs came "
    "went goes saw sees looked looks heard hears told tells said says made makes took takes "
    "gave gives found finds kept keeps left leaves stood sat slept dreamed thought knew "
    "always never often sometimes again once later soon before after while during through "
    "over under between along across around behind beyond every each some many few most other "
    "same such only even just also very much little great good fine plain simple strange "
    "their his her our your my we they he she you one two three first last next"
).split()
KEYS = (
    "amber falcon cedar maple orchid harbor willow ember tundra canyon lagoon meteor nebula "
    "quartz saffron thistle violet walnut zephyr basalt cobalt dahlia fennel garnet hazel iris "
    "jasper kestrel lotus marble nutmeg onyx pepper quill raven sorrel topaz umber velvet "
    "wren yarrow zinnia acorn birch clover dune elm fern glacier heron ivy juniper kelp "
    "lilac mango nectar olive pebble quince reed sage tulip urchin vapor wisp yew "
    "anchor badger comet delta eagle fjord geyser hornet igloo jackal koala lemur "
    "magnet narwhal otter panda quasar rocket salmon tiger unicorn viper walrus yak zebra"
).split()
CITIES = (
    "Lisbon Oslo Cairo Lima Quito Hanoi Dakar Kyoto Perth Tunis Riga Sofia Accra Doha Baku "
    "Dublin Porto Nairobi Bergen Havana Malta Vienna Prague Seville Madras Tbilisi Bogota "
    "Manila Zurich Geneva Lyon Turin Naples Krakow Gdansk Tallinn Vilnius Minsk Odessa Ankara"
).split()
VERBS = ("paint", "visit", "climb", "watch", "sail", "draw", "find", "cross", "feed", "read",
         "mend", "follow", "photograph", "sketch", "ride")
OBJECTS = ("the old boat", "the red tower", "a quiet lighthouse", "the night market",
           "the copper bell", "a hidden garden", "the stone bridge", "the silver train",
           "a paper kite", "the northern lights", "the city walls", "an empty theatre",
           "the flower hall", "a painted ferry", "the clock museum", "the glass dome")


@dataclass
class Fact:
    kind: str  # passkey | kv | needle
    sentence: str  # as written in the document
    question: str
    answer: str  # the reference answer the model is trained to give
    value: str  # what a correct answer must contain (pass key digits, the value, the activity)
    depth: float  # 0 = start of the document, 1 = its end


@dataclass
class Sample:
    document: str
    facts: list[Fact]  # every fact hidden in the document, in document order
    asked: list[Fact] = field(default_factory=list)  # the ones to ask about, in asking order


def _digits(rng: random.Random, n: int = 5) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def filler_sentence(rng: random.Random) -> str:
    n = rng.randint(6, 16)
    words = [rng.choice(FILLER) for _ in range(n)]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def passkey_fact(rng: random.Random, depth: float) -> Fact:
    key = _digits(rng)
    return Fact("passkey", f"The pass key is {key}. Remember it. {key} is the pass key.",
                "What is the pass key?", f"The pass key is {key}.", key, depth)


def kv_fact(rng: random.Random, depth: float, key: str) -> Fact:
    value = _digits(rng)
    return Fact("kv", f"The value of key {key} is {value}.", f"What is the value of key {key}?",
                f"The value of key {key} is {value}.", value, depth)


def needle_fact(rng: random.Random, depth: float, city: str) -> Fact:
    act = f"to {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return Fact("needle", f"The best thing to do in {city} is {act}.",
                f"What is the best thing to do in {city}?",
                f"The best thing to do in {city} is {act}.", act, depth)


WORDS_PER_TOKEN = 0.82  # filler words per token with the demo tokenizer (re-measured in tests)


def make_sample(seed: int, n_tokens: int, task: str | None = None, depth: float | None = None,
                n_records: int | None = None, count: Callable[[str], int] | None = None,
                repeat_p: float = 0.0) -> Sample:
    """A document of about `n_tokens` tokens with hidden facts.

    task None: a random mix (training and the demo); "passkey" | "kv" | "needle": that task only,
    with the asked fact at `depth` (random if None). kv documents hold `n_records` records
    (default one per 2K tokens, at least 4), spread at random depths; needle documents hold 1-3
    needles with different cities. `count` (text -> tokens) refines the length when given.
    `repeat_p`: chance that a filler sentence repeats an earlier one (training: copy signal).
    """
    rng = random.Random(seed)
    facts: list[Fact] = []
    if task is None:
        kinds = [k for k in TASKS if rng.random() < 0.6] or [rng.choice(TASKS)]
    else:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        kinds = [task]
    asked: list[Fact] = []
    for kind in kinds:
        d = depth if depth is not None and task is not None else rng.random()
        if kind == "passkey":
            f = passkey_fact(rng, d)
            facts.append(f)
            asked.append(f)
        elif kind == "kv":
            n = n_records or (max(4, n_tokens // 2048) if task else rng.randint(1, 12))
            keys = rng.sample(KEYS, min(n, len(KEYS)))
            recs = [kv_fact(rng, rng.random(), k) for k in keys]
            recs[0].depth = d
            facts += recs
            asked += [recs[0]] if task else rng.sample(recs, rng.randint(1, min(3, len(recs))))
        else:
            cities = rng.sample(CITIES, 1 if task else rng.randint(1, 3))
            needles = [needle_fact(rng, rng.random(), c) for c in cities]
            needles[0].depth = d
            facts += needles
            asked += [needles[0]] if task else [rng.choice(needles)]
    rng.shuffle(asked)
    facts.sort(key=lambda f: f.depth)
    doc = _fill(rng, facts, n_tokens, count, repeat_p)
    return Sample(doc, facts, asked)


def _assemble(sentences: Sequence[str], facts: Sequence[Fact]) -> str:
    """Filler sentences with each fact inserted at its depth; paragraphs every ~6 sentences."""
    out: list[str] = []
    at = {}
    for f in facts:
        at.setdefault(round(f.depth * len(sentences)), []).append(f.sentence)
    for i in range(len(sentences) + 1):
        out += at.get(i, [])
        if i < len(sentences):
            out.append(sentences[i])
    paras, cur = [], []
    for i, s in enumerate(out):
        cur.append(s)
        if (i + 1) % 6 == 0:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n".join(paras)


def make_mixed(seed: int, n_tokens: int, depths: dict[str, float],
               n_records: int | None = None, count: Callable[[str], int] | None = None) -> Sample:
    """One document holding one fact per task in `depths` (task -> depth of the asked fact).

    kv documents hold `n_records` records (default one per 2K tokens, at least 4); the asked
    record sits at its depth, the others at random depths. `asked` follows the order of `depths`.
    """
    rng = random.Random(seed)
    facts: list[Fact] = []
    asked: list[Fact] = []
    for kind, d in depths.items():
        if kind == "passkey":
            f = passkey_fact(rng, d)
            facts.append(f)
        elif kind == "kv":
            n = n_records or max(4, n_tokens // 2048)
            recs = [kv_fact(rng, rng.random(), k) for k in rng.sample(KEYS, min(n, len(KEYS)))]
            f = recs[0]
            f.depth = d
            facts += recs
        elif kind == "needle":
            f = needle_fact(rng, d, rng.choice(CITIES))
            facts.append(f)
        else:
            raise ValueError(f"unknown task {kind!r}; known: {', '.join(TASKS)}")
        asked.append(f)
    facts.sort(key=lambda f: f.depth)
    doc = _fill(rng, facts, n_tokens, count)
    return Sample(doc, facts, asked)


def _fill(rng: random.Random, facts: list[Fact], n_tokens: int,
          count: Callable[[str], int] | None, repeat_p: float = 0.0) -> str:
    fact_tokens = sum(len(f.sentence.split()) for f in facts) / WORDS_PER_TOKEN
    n_words = max(0, n_tokens - fact_tokens) * WORDS_PER_TOKEN
    sentences: list[str] = []
    words = 0
    while words < n_words:
        again = repeat_p and sentences and rng.random() < repeat_p
        s = rng.choice(sentences[-4:]) if again else filler_sentence(rng)
        sentences.append(s)
        words += s.count(" ") + 1
    doc = _assemble(sentences, facts)
    if count is not None:  # one correction pass: drop or add filler to land near n_tokens
        extra = int((n_tokens - count(doc)) * WORDS_PER_TOKEN)
        while extra < -8 and sentences:
            extra += sentences.pop().count(" ") + 1
        while extra > 8:
            s = filler_sentence(rng)
            sentences.append(s)
            extra -= s.count(" ") + 1
        doc = _assemble(sentences, facts)
    return doc


def demo_sample(seed: int = 0, n_tokens: int = 32768,
                count: Callable[[str], int] | None = None) -> Sample:
    """The `chat --demo` document: a pass key, key-value records and a needle at random depths."""
    rng = random.Random(seed)
    depths = {t: rng.uniform(0.1, 0.9) for t in TASKS}
    return make_mixed(rng.randrange(2**31), n_tokens, depths, count=count)


def is_correct(fact: Fact, answer: str) -> bool:
    """A reply is right when it contains the fact's value (and, for kv, no other value first)."""
    return fact.value in answer
