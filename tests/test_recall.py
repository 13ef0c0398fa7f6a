"""Recall (ktlong/recall.py): the passages a LOCRET chat re-reads before each question."""
from __future__ import annotations

import numpy as np
import pytest

from ktlong.documents import Document
from ktlong.model import load_model
from ktlong.recall import COMMON, SIDE, STRIDE, passages
from ktlong.tinymodel import filler_text

from .models import hf_model, settings
from .test_chat import UI


def _window_scores(doc: np.ndarray, question: list[int]) -> np.ndarray:
    """Reference: each two-segment window's score, token by token in plain Python loops."""
    n_seg = (len(doc) + STRIDE - 1) // STRIDE
    segs = [set(doc[i * STRIDE:(i + 1) * STRIDE].tolist()) for i in range(n_seg)]
    out = np.zeros(n_seg)
    for t in set(question):
        df = sum(t in s for s in segs)
        if df == 0 or np.log(n_seg / df) < np.log(COMMON):
            continue
        for i in range(n_seg):
            if t in segs[i] or (i + 1 < n_seg and t in segs[i + 1]):
                out[i] += np.log(n_seg / df)
    return out


def test_passages_take_the_best_windows_with_their_neighbours():
    rng = np.random.default_rng(0)
    doc = rng.integers(10, 40, 4000)  # common tokens: each in most segments
    doc[1234:1237] = [500, 501, 502]  # the fact
    doc[3000] = 501  # one of its words elsewhere, alone
    q = [500, 501, 502, 11, 12]
    spans = passages(doc, q, budget=400)
    ref = _window_scores(doc, q)
    best = int(np.argmax(ref))
    a, z = best * STRIDE - SIDE, (best + 2) * STRIDE + SIDE
    assert (a, z) in spans and a <= 1234 and 1237 <= z
    assert sum(y - x for x, y in spans) <= 400
    assert spans == sorted(spans)
    assert all(y1 <= x2 for (_, y1), (x2, _) in zip(spans, spans[1:], strict=False))
    assert any(x <= 3000 < y for x, y in spans)  # the lone word's window came next
    # a window left out that scores above a chosen one overlaps a chosen passage
    chosen = [(x + SIDE) // STRIDE for x, _ in spans]
    floor = min(ref[chosen])
    for w in np.flatnonzero(ref > floor):
        a, z = w * STRIDE - SIDE, (w + 2) * STRIDE + SIDE
        assert w in chosen or any(a < y and x < z for x, y in spans)


def test_passages_ignore_common_words_and_respect_budget_and_skip():
    rng = np.random.default_rng(1)
    doc = rng.integers(10, 40, 3000)
    assert passages(doc, [11, 12, 13], budget=1000) == []  # only common words
    assert passages(doc, [777], budget=1000) == []  # not in the document
    doc[1000:1003] = [700, 701, 702]
    assert passages(doc, [700, 701], budget=2 * STRIDE + 2 * SIDE - 1) == []  # no room
    assert passages(doc, [700, 701], budget=0) == []
    assert len(passages(doc, [700, 701], budget=2 * STRIDE + 2 * SIDE)) == 1
    doc[40:43] = [600, 601, 602]
    # the first window holding the fact (from the segment before its own), clipped at 0
    assert passages(doc, [600, 601], budget=1000) == [(0, (40 // STRIDE + 1) * STRIDE + SIDE)]
    assert passages(doc, [600, 601], budget=1000, skip=100) == []  # in the template's head


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


FACT = "The zebra museum stands in Quito, beside the violet harbour."
QUESTION = "Where does the zebra museum stand?"


def _loop(lm, **kw):  # type: ignore[no-untyped-def]
    from ktlong.chat import ChatLoop

    doc = filler_text(600, seed=9) + " " + FACT + " " + filler_text(900, seed=10)
    st = settings(**{"attention": "LOCRET", "prefill": "DENSE", "locret_scores": "RECENT",
                     "locret_budget": 128, "locret_stabilisers": 16, "chunk_size": 64,
                     "init_len": 16, "max_new_tokens": 3, **kw})
    loop = ChatLoop(lm, st, Document("doc.txt", doc, len(doc)), UI())
    loop.open()
    return loop


def test_a_locret_chat_rereads_the_passage_holding_the_questions_words(lm):
    loop = _loop(lm, locret_recall=256)
    s = loop.session
    assert s.dropped > 0  # the fact's tokens were evicted
    list(loop.ask(QUESTION))
    asked = loop.conv.turns[-1].question
    assert asked.endswith("\n\n" + QUESTION) and "zebra museum" in asked[: -len(QUESTION)]
    n_passage = len(lm.tokenizer(asked, add_special_tokens=False)["input_ids"])
    assert n_passage <= 256 + 3 * len(lm.tokenizer(QUESTION)["input_ids"])
    assert "re-reading" in loop.ui.text()[1]
    assert len(s.tokens) - s.dropped == s.store.length  # the store holds what was read
    list(loop.ask("what is in the city"))  # no rare word: read through what was kept alone
    assert loop.conv.turns[-1].question == "what is in the city"


def test_recall_off_or_nothing_dropped_asks_the_question_alone(lm):
    loop = _loop(lm, locret_recall=0)
    list(loop.ask(QUESTION))
    assert loop.conv.turns[-1].question == QUESTION
    loop = _loop(lm, locret_recall=256, locret_budget=4096)  # the whole document was kept
    assert loop.session.dropped == 0
    list(loop.ask(QUESTION))
    assert loop.conv.turns[-1].question == QUESTION


def test_bench_accuracy_asks_a_locret_profile_after_the_questions_passages(tmp_path, monkeypatch):
    """`bench accuracy` builds a LOCRET profile's prompts as the chat does: the passages the
    question's words point to, then the question (recall.prefix), once the budget dropped part
    of the document; a profile with recall off asks the question alone."""
    from ktlong import recall
    from ktlong.demo import accuracy

    calls: list[str] = []
    real = recall.prefix

    def spy(tok, doc, question, budget, skip=0):  # type: ignore[no-untyped-def]
        text, n = real(tok, doc, question, budget, skip)
        calls.append(question)
        assert n and text.endswith("\n\n") and budget == 256
        return text, n

    monkeypatch.setattr(recall, "prefix", spy)
    on = tmp_path / "small-locret.yaml"
    on.write_text("attention: LOCRET\nlocret_scores: RECENT\nprefill: dense\n"
                  "locret_budget: 256\nlocret_stabilisers: 32\nlocret_recall: 256\n")
    off = tmp_path / "small-locret-off.yaml"
    off.write_text(on.read_text().replace("locret_recall: 256", "locret_recall: 0"))
    recs = accuracy.run(None, [1024], 1, [str(on), str(off)],
                        task_names=["passkey"])
    assert calls == ["What is the pass key?"]  # the first profile's one question, only
    assert {r.profile for r in recs} == {str(on), str(off)}
