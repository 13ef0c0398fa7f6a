"""`ktlong serve`'s engine gives a request the same KV, and with greedy settings the same answer,
whatever it served before: another document, the same request again, another question on the
same document. The tiny model in BF16 KV: a different split of the prompt shows in the rows."""
from __future__ import annotations

import threading

import pytest
import torch

from ktlong.engine import Sampling
from ktlong.model import load_model
from ktlong.serving import CACHE_MIN_TOKENS, Engine, Job, Renderer
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

ST = dict(attention="DENSE", kv_type="BF16", max_new_tokens=6, max_seq_len=8192, chunk_size=512)


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


def ask(engine: Engine, r: Renderer, doc: str, question: str):  # type: ignore[no-untyped-def]
    """(answer text, the prompt's K rows of every layer) of one request on `engine`."""
    done, text, errors = threading.Event(), [], []

    def emit(ev):  # type: ignore[no-untyped-def]
        if ev[0] == "text":
            text.append(ev[1])
        elif ev[0] == "error":
            errors.append(ev[1])
        if ev[0] in ("end", "error"):
            done.set()

    prompt = r.chat([{"role": "system", "content": doc}, {"role": "user", "content": question}])
    engine.submit(Job(prompt, Sampling(max_new_tokens=6), emit))
    assert done.wait(300)
    assert not errors, errors
    store = engine.session.store
    n = len(prompt.ids)
    rows = [store.token_range(li, 0, n)[0].clone() for li in range(store.shape.n_layers)]
    return "".join(text), rows


@pytest.mark.parametrize("doc_tokens", [600, 1400])  # under and over CACHE_MIN_TOKENS
def test_a_request_gets_the_kv_and_answer_it_gets_alone(lm, tmp_path, doc_tokens):
    r = Renderer(lm.tokenizer)
    a, b = filler_text(doc_tokens, seed=3), filler_text(doc_tokens, seed=4)
    prefix = r.chat([{"role": "system", "content": a}, {"role": "user", "content": "x"}]).prefix
    assert prefix > 0 and (prefix >= CACHE_MIN_TOKENS) == (doc_tokens > 1000)
    alone = {}
    for doc, q in ((a, "Where is the key?"), (a, "Why?")):
        e = Engine(lm, settings(**ST), cache_dir=tmp_path / f"alone-{len(alone)}")
        alone[doc, q] = ask(e, r, doc, q)
        e.close()
    e = Engine(lm, settings(**ST), cache_dir=tmp_path / "busy")  # its own cache: no disk hits
    ask(e, r, b, "Where is the key?")  # another document first: only the template is shared
    for doc, q in ((a, "Where is the key?"), (a, "Where is the key?"), (a, "Why?"),
                   (a, "Where is the key?")):  # then again, another question, the first again
        text, rows = ask(e, r, doc, q)
        want_text, want_rows = alone[doc, q]
        assert text == want_text
        assert all(torch.equal(x, y) for x, y in zip(rows, want_rows, strict=True))
    e.close()
