"""The chat page of `ktlong serve` over HTTP (no browser): the page itself, the upload, the read
and the chat paths it uses, the passages beside an answer, the API key, the first byte.

tests/test_chatpage_browser.py drives the same page in headless Chromium. Dense attention + FP32
KV make answers exact, so what the page is sent must equal `Session.generate` on the ids `ktlong
chat -f` would feed.
"""
from __future__ import annotations

import json
import re
import socket
import time
from importlib import resources
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from ktlong import chatpage, passages  # noqa: E402
from ktlong import server as server_mod  # noqa: E402
from ktlong.attnmap import StepRecord  # noqa: E402
from ktlong.conversation import Conversation  # noqa: E402
from ktlong.model import load_model  # noqa: E402
from ktlong.tinymodel import filler_text  # noqa: E402

from . import docfiles  # noqa: E402
from .models import greedy_text, hf_model, settings  # noqa: E402

NEW = 8
ST = dict(attention="DENSE", max_new_tokens=NEW, max_seq_len=8192)
DOC = filler_text(700, seed=11) + " The pass key is 7312. " + filler_text(300, seed=12)


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


@pytest.fixture(scope="module")
def srv(lm):
    with server_mod.Running(server_mod.build(lm, settings(**ST), use_cache=False)) as r:
        yield r


def greedy(lm, ids: list[int], n: int = NEW) -> str:  # type: ignore[no-untyped-def]
    return greedy_text(lm, settings(**ST), ids, n)


def upload(r, data: bytes, name: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{r.url}/api/documents", params={"name": name}, content=data, timeout=60)


def sse(resp: httpx.Response) -> list[str]:
    return [line for line in resp.iter_lines() if line]


# --- the page ------------------------------------------------------------------------------------

def test_the_page_is_one_packaged_file_that_needs_nothing_from_elsewhere(srv) -> None:
    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    packaged = (resources.files("ktlong") / "web" / "index.html").read_bytes()
    assert r.content == packaged
    page = r.text
    assert '<input type="file"' in page and "<textarea" in page
    assert 'dataset.role = "assistant"' in page  # each answer's element: data-role="assistant"
    # offline: no script, style, font or image from another address
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"""@import|url\(\s*["']?(https?:)?//|fetch\(\s*["']https?:""", page)
    assert "/v1/chat/completions" in page and "/api/documents" in page


def test_the_first_byte_comes_within_a_second_of_listening(lm) -> None:
    from .chatpage_driver import first_byte

    srv = server_mod.build(lm, settings(**ST), use_cache=False)
    with server_mod.Running(srv) as r:  # returns once uvicorn listens
        sock = socket.create_connection(("127.0.0.1", r.port))
        fb, whole, data = first_byte(sock, r.port)
    assert data.startswith(b"HTTP/1.1 200") and b"<textarea" in data
    assert fb < 1.0 and whole < 1.0, (fb, whole)


def test_info_says_what_the_page_shows(srv) -> None:
    info = httpx.get(srv.url + "/api/info").json()
    assert info["model"] == srv.server.model_id and info["max_seq_len"] == 8192
    assert info["arch"] == "llama" and info["max_upload"] == chatpage.MAX_UPLOAD
    assert info["served_document"] is False and info["busy"] is False


# --- uploads -------------------------------------------------------------------------------------

FORMATS = [
    ("notes.txt", DOC.encode(), "text"),
    ("notes.md", ("# Notes\n\n" + DOC).encode(), "markdown"),
    ("notes.pdf", docfiles.pdf([[DOC[i:i + 80] for i in range(0, 2000, 80)],
                                [DOC[i:i + 80] for i in range(2000, len(DOC), 80)]]), "pdf"),
    ("notes.html", f"<html><body><p>{DOC}</p></body></html>".encode(), "html"),
    ("notes.docx", docfiles.docx(docfiles.docx_paragraph(DOC)), "docx"),
    ("notes.epub", docfiles.epub([docfiles.xhtml("One", f"<p>{DOC}</p>")]), "epub"),
]


@pytest.mark.parametrize("name,data,kind", FORMATS, ids=[f[0] for f in FORMATS])
def test_an_upload_is_read_by_ktlongs_own_readers(srv, lm, name, data, kind) -> None:
    from ktlong.documents import from_bytes

    r = upload(srv, data, name)
    assert r.status_code == 200, r.text
    got = r.json()
    want = from_bytes(data, name, suffix="." + name.rsplit(".", 1)[1])
    assert got["kind"] == kind and got["name"] == name and got["chars"] == len(want.text)
    doc = srv.server.documents.get(got["id"])
    assert doc.renderer.document == want.text and "7312" in want.text
    # the prefix is the chat's: template head + document, as `ktlong chat -f` lays it out
    assert got["tokens"] == len(Conversation(lm.tokenizer, want.text).document_ids())
    assert got["pages"] == (2 if kind == "pdf" else 1 if kind == "epub" else None)


def test_bad_uploads_are_one_clear_error(srv, monkeypatch) -> None:
    r = upload(srv, b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 64, "old.doc")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_document" and "Word 97-2003" in err["message"]
    assert "\n" not in err["message"]
    r = upload(srv, b"", "empty.txt")
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    monkeypatch.setattr(chatpage, "MAX_UPLOAD", 1000)
    r = upload(srv, b"x" * 5000, "big.txt")
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    r = upload(srv, b"../../etc/passwd", "../../secret.txt")  # only the base name is kept
    assert r.status_code == 200 and r.json()["name"] == "secret.txt"
    assert httpx.post(f"{srv.url}/api/documents/nope/read").status_code == 404


def test_a_document_longer_than_max_seq_len_is_refused_at_upload(lm) -> None:
    srv = server_mod.build(lm, settings(**{**ST, "max_seq_len": 512}), use_cache=False)
    with server_mod.Running(srv) as r:
        resp = upload(r, DOC.encode(), "long.txt")
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


# --- read, then ask ------------------------------------------------------------------------------

def test_read_streams_progress_and_the_question_reuses_it(srv, lm) -> None:
    got = upload(srv, DOC.encode(), "doc.txt").json()
    with httpx.stream("POST", f"{srv.url}/api/documents/{got['id']}/read", timeout=120) as r:
        events = [json.loads(line[len("data: "):]) for line in sse(r)]
    progress, end = events[:-1], events[-1]
    assert progress and all(e["total"] == got["tokens"] for e in progress)
    assert [e["done"] for e in progress] == sorted(e["done"] for e in progress)
    assert progress[-1]["done"] == got["tokens"]
    # the time left: none before enough is known, then a number that reaches 0 at the end
    assert progress[0]["eta_s"] is None and progress[-1]["eta_s"] == 0
    assert end["done"] is True and end["prompt_tokens"] == got["tokens"]
    assert end["context_tokens"] == got["tokens"] and end["prefill_s"] >= 0

    msgs = [{"role": "user", "content": "What is the pass key?"}]
    body = {"model": srv.server.model_id, "messages": msgs,
            "ktlong": {"document": got["id"], "passages": 2}}
    out = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120).json()
    ids = Conversation(lm.tokenizer, DOC).prompt_ids(msgs[0]["content"])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= got["tokens"] - 1
    assert out["choices"][0]["message"]["content"] == greedy(lm, ids)
    extra = out["ktlong"]
    n_out = out["usage"]["completion_tokens"]  # the last one is not fed (yet)
    assert len(ids) + n_out - 1 <= extra["stats"]["context_tokens"] <= len(ids) + n_out
    assert extra["stats"]["decode_tok_s"] > 0 and extra["stats"]["max_seq_len"] == 8192
    check_passages(extra["passages"], DOC, got["tokens"])

    # streamed: the same answer, then one "ktlong.answer" event before [DONE]
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        lines = sse(r)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["object"] == "ktlong.answer" and last["choices"] == []
    assert last["ktlong"]["passages"] == extra["passages"]
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in lines[:-2] if line.startswith("data: "))
    assert text == out["choices"][0]["message"]["content"]


def check_passages(found: list[dict], doc: str, doc_tokens: int) -> None:
    assert 1 <= len(found) <= 2
    flat = " ".join(doc.split())
    shares = [p["share"] for p in found]
    assert shares == sorted(shares, reverse=True) and all(0 < s <= 1 for s in shares)
    for p in found:
        assert 0 <= p["start"] < p["end"] <= doc_tokens
        assert " ".join(p["text"].split()) in flat  # the document's own words, in order


def test_the_ktlong_object_is_checked(srv) -> None:
    base = {"model": srv.server.model_id, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (([], "ktlong"), ({"passages": 99}, "ktlong.passages"),
                         ({"passages": True}, "ktlong.passages"),
                         ({"document": 5}, "ktlong.document"),
                         ({"document": "unknown"}, "ktlong.document")):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**base, "ktlong": extra})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(f"{srv.url}/v1/completions", json={
        "model": srv.server.model_id, "prompt": "hi", "ktlong": {"document": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ktlong.document"
    # OpenAI clients that send no "ktlong" get no "ktlong" field
    out = httpx.post(f"{srv.url}/v1/chat/completions", json=base, timeout=60).json()
    assert "ktlong" not in out


# --- what the answer read ------------------------------------------------------------------------

def test_token_scores_equal_a_plain_softmax_over_the_tokens_read() -> None:
    rng = np.random.default_rng(0)
    Hq, Hkv, d, bs, n = 4, 2, 8, 4, 37
    keys = {layer: rng.standard_normal((Hkv, n, d)).astype(np.float32) for layer in (0, 1)}
    records = []
    for layer in (0, 1):
        for t in (30, 37):
            blocks = np.array([[0, 2, 5, (t - 1) // bs], [1, 2, 6, (t - 1) // bs]], np.int32)
            records.append(StepRecord(layer, t, rng.standard_normal((Hq, d)).astype(np.float32),
                                      blocks))
    fetched = []

    def fetch(layer: int, a: int, b: int) -> np.ndarray:
        fetched.append((a, b))
        return keys[layer][:, a:b]

    got = passages.token_scores(records, fetch, 0.35, bs, n)
    want = np.zeros(n)
    for r in records:
        for h in range(Hq):
            row = r.blocks[h * 2 // Hq]  # SEPARATE: KV head h // 2's row of blocks
            tok = np.array([t for t in range(r.n_tokens) if t // bs in set(row.tolist())])
            s = keys[r.layer][h // 2, tok] @ r.q[h] * 0.35
            p = np.exp(s - s.max())
            want[tok] += p / p.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.sum() == pytest.approx(len(records) * Hq, rel=1e-5)
    read = {t for a, b in fetched for t in range(a, b)}  # only the blocks some step read
    assert read and all(t // bs in {0, 1, 2, 5, 6, 7, 8, 9} for t in read)


def test_top_passages_are_the_blocks_the_selection_attended(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    Hkv, d, bs, n = 1, 16, 8, 96
    k = rng.standard_normal((Hkv, n, d)).astype(np.float32) * 0.1
    st = SimpleNamespace(init_len=8, local_windows_len=16, block_size=bs)
    store = SimpleNamespace(shape=SimpleNamespace(block_size=bs),
                            key_range=lambda layer, a, b: __import__("torch").from_numpy(
                                k[:, a:b].copy()))
    session = SimpleNamespace(store=store, dropped=0, settings=st, tokens=list(range(n)))
    q = (k[0, 43] * 400).reshape(1, d)  # block 5 (tokens 40-47) takes nearly all the mass
    every = np.arange(n // bs, dtype=np.int32)[None]
    records = [StepRecord(0, n, q, every)]
    got = passages.top_passages(session, records, 1.0, (4, 90), lambda ids: f"<{ids[0]}-{ids[-1]}>",
                                k=1)
    assert [(p.start, p.end, p.text) for p in got] == [(36, 44, "<40-47>")]
    assert got[0].share > 0.9
    # the first block's document tokens count; the template head before them (the sink) not
    q5 = (k[0, 5] * 400).reshape(1, d)
    got = passages.top_passages(session, [StepRecord(0, n, q5, every)], 1.0, (4, 90),
                                lambda ids: f"<{ids[0]}-{ids[-1]}>", k=1)
    assert [(p.start, p.end, p.text) for p in got] == [(0, 4, "<4-7>")] and got[0].share > 0.9
    q2 = (k[0, 2] * 400).reshape(1, d)
    got = passages.top_passages(session, [StepRecord(0, n, q2, every)], 1.0, (4, 90),
                                lambda ids: "", k=3)
    assert sum(p.share for p in got) < 0.1
    # a block the step did not read scores nothing, whatever its keys
    records = [StepRecord(0, n, q, np.array([[0, 1, 2, 3, 9, 10, 11]], np.int32))]
    got = passages.top_passages(session, records, 1.0, (4, 90), lambda ids: "", k=3)
    assert all(not (p.start <= 43 - 4 < p.end) for p in got)
    # the local window (blocks 10, 11 here) is read at every step: the selection's picks first
    assert all(p.end + 4 <= (n - 16) for p in got)


# --- the API key ---------------------------------------------------------------------------------

def test_the_api_key_protects_the_page(lm) -> None:
    srv = server_mod.build(lm, settings(**ST), api_key="s3cret", use_cache=False)
    with server_mod.Running(srv) as r:
        page = httpx.get(r.url + "/")
        assert page.status_code == 401 and 'type="password"' in page.text
        assert "<textarea" not in page.text
        for path in ("/api/info", "/v1/models"):
            assert httpx.get(r.url + path).status_code == 401
        assert upload(r, b"text", "a.txt").status_code == 401
        bad = httpx.post(r.url + "/login", data={"key": "wrong"})
        assert bad.status_code == 401 and "not the server&#x27;s key" in bad.text
        assert "set-cookie" not in bad.headers
        good = httpx.post(r.url + "/login", data={"key": "s3cret"})
        assert good.status_code == 303 and good.headers["location"] == "/"
        cookie = good.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "s3cret" not in cookie
        jar = {chatpage.COOKIE: good.cookies[chatpage.COOKIE]}
        assert "<textarea" in httpx.get(r.url + "/", cookies=jar).text
        assert httpx.get(r.url + "/api/info", cookies=jar).json()["model"] == srv.model_id
        assert httpx.get(r.url + "/v1/models", cookies=jar).status_code == 200
        forged = {chatpage.COOKIE: "0" * 64}
        assert httpx.get(r.url + "/api/info", cookies=forged).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert httpx.get(r.url + "/", headers=bearer).status_code == 200


def test_the_serve_note_names_the_page(lm, monkeypatch, capsys) -> None:
    """`ktlong serve` says where the page is (its address, before it listens)."""
    import uvicorn

    from ktlong import model as model_mod

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **kw: lm)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: time.sleep(0))
    server_mod.run(hf_model("llama"), None, settings(**ST), host="127.0.0.1", port=8123,
                   use_cache=False)
    err = capsys.readouterr().err
    assert "the chat page at http://127.0.0.1:8123/" in err
