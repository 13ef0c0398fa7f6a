"""Synthetic long documents with hidden facts, shared by training, the demo and `bench accuracy`.

A document is a haystack with facts put at chosen depths, each with its question and answer. The
haystack is filler (random sentences over a fixed word list; what the demo model was trained on)
or, with `haystack="prose"`, a story told by a small grammar (ktlong.demo.prose); neither holds
a digit. `haystack="real"` is text the project did not write (license texts, Python's own
documentation: ktlong.bench.prose), for real models; `"licenses"` is the license texts alone
(legal prose, ~60K tokens, repeated past that), where a small model is not drawn into the
technical text around (asked for the pass key amid Python's documentation, SmolLM2-135M
describes a Python feature). The facts:
- passkey: "The pass key is 71432. Remember it. 71432 is the pass key." (InfiniteBench's wording)
- kv: records "The value of key amber is 40591." with distinct random keys; one is asked for.
  Several records per document, so the others are distractors (kv-retrieval).
- needle: "The best thing to do in Lisbon is to paint the old boat." (needle-in-a-haystack)
- multineedle: MULTI_NEEDLES needles of that form, distinct cities and activities, at depths
  spread evenly over the document; one of them is asked for (multi-key needle-in-a-haystack).

Everything is reproducible from a seed: `make_sample(seed, ...)` returns the same document, facts
and questions on every machine (Python's `random.Random` only).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ktlong.demo import prose

TASKS = ("passkey", "kv", "needle")  # the training mix, the demo and the bench's default
ALL_TASKS = (*TASKS, "multineedle")  # what `bench accuracy --tasks` may ask
HAYSTACKS = ("filler", "prose", "real", "licenses")
MULTI_NEEDLES = 4  # needles in a multineedle document

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
    kind: str  # passkey | kv | needle | multineedle
    sentence: str  # as written in the document
    question: str
    answer: str  # the reference answer the model is trained to give
    value: str  # what a correct answer must contain (pass key digits, the value, the activity)
    depth: float  # 0 = start of the document, 1 = its end

    @property
    def lead(self) -> str:
        """The answer's first words, up to the value ("The pass key is"): what a benchmark may
        start the answer with, so that a pretrained model only has to write the value."""
        return self.answer[: self.answer.index(" is ") + 3]


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


def needle_fact(rng: random.Random, depth: float, city: str,
                taken: Sequence[str] = ()) -> Fact:
    """A needle in `city`; its activity is none of `taken` (the document's other needles')."""
    act = f"to {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    while act in taken:
        act = f"to {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return Fact("needle", f"The best thing to do in {city} is {act}.",
                f"What is the best thing to do in {city}?",
                f"The best thing to do in {city} is {act}.", act, depth)


def multineedle_facts(rng: random.Random, depth: float, k: int = MULTI_NEEDLES,
                      taken: Sequence[Fact] = ()) -> list[Fact]:
    """`k` needles with distinct cities and activities (none of the `taken` needles' either),
    at depth, depth + 1/k, ... (mod 1); the first, at `depth`, is the one to ask about."""
    cities = rng.sample([c for c in CITIES if not any(c in f.question for f in taken)], k)
    acts = [f.value for f in taken]
    out = []
    for j, city in enumerate(cities):
        f = needle_fact(rng, (depth + j / k) % 1.0, city, acts)
        f.kind = "multineedle"
        acts.append(f.value)
        out.append(f)
    return out


WORDS_PER_TOKEN = 0.82  # filler words per token with the demo tokenizer (re-measured in tests)


def make_sample(seed: int, n_tokens: int, task: str | None = None, depth: float | None = None,
                n_records: int | None = None, count: Callable[[str], int] | None = None,
                repeat_p: float = 0.0, haystack: str = "filler") -> Sample:
    """A document of about `n_tokens` tokens with hidden facts.

    task None: a random mix (training and the demo); one of ALL_TASKS: that task only, with the
    asked fact at `depth` (random if None). kv documents hold `n_records` records (default one
    per 2K tokens, at least 4), spread at random depths; needle documents hold 1-3 needles with
    different cities; multineedle documents MULTI_NEEDLES. `count` (text -> tokens) refines the
    length when given. `repeat_p`: chance that a filler sentence repeats an earlier one
    (training: copy signal). `haystack`: "filler" or "prose" (see HAYSTACKS).
    """
    rng = random.Random(seed)
    facts: list[Fact] = []
    if task is None:
        kinds = [k for k in TASKS if rng.random() < 0.6] or [rng.choice(TASKS)]
    else:
        if task not in ALL_TASKS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(ALL_TASKS)}")
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
        elif kind == "multineedle":
            needles = multineedle_facts(rng, d)
            facts += needles
            asked.append(needles[0])
        else:
            cities = rng.sample(CITIES, 1 if task else rng.randint(1, 3))
            needles = [needle_fact(rng, rng.random(), c) for c in cities]
            needles[0].depth = d
            facts += needles
            asked += [needles[0]] if task else [rng.choice(needles)]
    rng.shuffle(asked)
    facts.sort(key=lambda f: f.depth)
    doc = _fill(rng, facts, n_tokens, count, repeat_p, haystack)
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
               n_records: int | None = None, count: Callable[[str], int] | None = None,
               haystack: str = "filler") -> Sample:
    """One document holding one asked fact per task in `depths` (task -> depth of that fact).

    kv documents hold `n_records` records (default one per 2K tokens, at least 4); the asked
    record sits at its depth, the others at random depths. multineedle adds MULTI_NEEDLES needles
    spread evenly from its depth, cities and activities distinct from the needle task's. `asked`
    follows the order of `depths`. `haystack`: "filler" or "prose" (see HAYSTACKS).
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
            needles = [x for x in facts if x.kind == "multineedle"]
            cities = [c for c in CITIES if not any(c in x.question for x in needles)]
            f = needle_fact(rng, d, rng.choice(cities), [x.value for x in needles])
            facts.append(f)
        elif kind == "multineedle":
            needles = multineedle_facts(rng, d, taken=[x for x in facts if x.kind == "needle"])
            f = needles[0]
            facts += needles
        else:
            raise ValueError(f"unknown task {kind!r}; known: {', '.join(ALL_TASKS)}")
        asked.append(f)
    facts.sort(key=lambda f: f.depth)
    doc = _fill(rng, facts, n_tokens, count, haystack=haystack)
    return Sample(doc, facts, asked)


def _fill(rng: random.Random, facts: list[Fact], n_tokens: int,
          count: Callable[[str], int] | None, repeat_p: float = 0.0,
          haystack: str = "filler") -> str:
    if haystack == "prose":
        return _fill_prose(rng, facts, n_tokens, count)
    if haystack in ("real", "licenses"):
        return _fill_real(rng, facts, n_tokens, count, licenses_only=haystack == "licenses")
    if haystack != "filler":
        raise ValueError(f"unknown haystack {haystack!r}; known: {', '.join(HAYSTACKS)}")
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


def _fill_prose(rng: random.Random, facts: list[Fact], n_tokens: int,
                count: Callable[[str], int] | None) -> str:
    """A story of about `n_tokens` tokens with the facts inserted between its sentences. With
    `count`, up to three corrections, each at the words per token measured on the document
    (prose words cost more tokens than filler's, and how many depends on the tokenizer)."""
    story = prose.Story(rng).sentences()
    sentences: list[str] = []
    ends: list[bool] = []  # sentence i ends its paragraph

    def add(words: float) -> None:
        while words > 8:
            s, end = next(story)
            sentences.append(s)
            ends.append(end)
            words -= s.count(" ") + 1

    fact_tokens = sum(len(f.sentence.split()) for f in facts) / WORDS_PER_TOKEN
    add(max(0, n_tokens - fact_tokens) * prose.WORDS_PER_TOKEN)
    doc = _assemble_paragraphs(sentences, ends, facts)
    for _ in range(3 if count is not None else 0):
        have = count(doc)
        extra = (n_tokens - have) * len(doc.split()) / max(1, have)
        if abs(extra) <= 8:
            break
        while extra < -8 and sentences:
            extra += sentences.pop().count(" ") + 1
            ends.pop()
        add(extra)
        doc = _assemble_paragraphs(sentences, ends, facts)
    return doc


def _fill_real(rng: random.Random, facts: list[Fact], n_tokens: int,
               count: Callable[[str], int] | None, licenses_only: bool = False) -> str:
    """Text the project did not write (ktlong.bench.prose: the license texts Debian ships,
    Python's own documentation; `licenses_only`: the license texts), its sections shuffled by
    `rng`, about `n_tokens` tokens (never more with `count`), each fact a paragraph of its own
    at its depth."""
    from ktlong.bench import prose as real

    pool = list(real.sections(licenses_only))
    if not pool:
        from ktlong.errors import KtlongError

        raise KtlongError(f"no prose found for this haystack ({real.LICENSES} is missing)",
                          hint="use --haystack real or filler on this machine")
    rng.shuffle(pool)
    paras = [p.strip() for s in pool for p in s.split("\n\n") if p.strip()]
    size = count or (lambda t: len(t) // 4)
    want = n_tokens - sum(size(f.sentence) + 1 for f in facts)
    taken: list[str] = []
    have = 0
    while have < want:
        taken.append(paras[len(taken) % len(paras)])
        have += size(taken[-1]) + 1  # + the blank line between paragraphs
    doc = _with_facts(taken, facts)
    while count is not None and len(taken) > 1 and count(doc) > n_tokens:
        taken.pop()
        doc = _with_facts(taken, facts)
    return doc


def _with_facts(paras: Sequence[str], facts: Sequence[Fact]) -> str:
    """The paragraphs with each fact put at the paragraph break nearest its depth (by length:
    real paragraphs run from a line to pages)."""
    import bisect
    from itertools import accumulate

    ends = [0, *accumulate(len(p) + 2 for p in paras)]  # chars before paragraph i
    at: dict[int, list[str]] = {}
    for f in facts:
        x = f.depth * ends[-1]
        i = bisect.bisect_left(ends, x)
        i = i if i == 0 or (i < len(ends) and ends[i] - x < x - ends[i - 1]) else i - 1
        at.setdefault(i, []).append(f.sentence)
    out: list[str] = []
    for i in range(len(paras) + 1):
        out += at.get(i, [])
        if i < len(paras):
            out.append(paras[i])
    return "\n\n".join(out)


def _assemble_paragraphs(sentences: Sequence[str], ends: Sequence[bool],
                         facts: Sequence[Fact]) -> str:
    """Sentences with each fact inserted at its depth, a paragraph ending where `ends` says."""
    at: dict[int, list[str]] = {}
    for f in facts:
        at.setdefault(round(f.depth * len(sentences)), []).append(f.sentence)
    paras: list[str] = []
    cur: list[str] = []
    for i in range(len(sentences) + 1):
        cur += at.get(i, [])
        if i < len(sentences):
            cur.append(sentences[i])
            if ends[i]:
                paras.append(" ".join(cur))
                cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n".join(paras)


def demo_sample(seed: int = 0, n_tokens: int = 32768,
                count: Callable[[str], int] | None = None) -> Sample:
    """The `chat --demo` document: a pass key, key-value records and a needle at random depths."""
    rng = random.Random(seed)
    depths = {t: rng.uniform(0.1, 0.9) for t in TASKS}
    return make_mixed(rng.randrange(2**31), n_tokens, depths, count=count)


def is_correct(fact: Fact, answer: str) -> bool:
    """A reply is right when it contains the fact's value, whitespace runs counted as one space
    (a model may break a line inside the sentence it copies)."""
    return " ".join(fact.value.split()) in " ".join(answer.split())
