"""`ktlong serve`: the OpenAI-compatible server on a tiny model, in-process on a free port.

Driven with the official `openai` client (streamed and not) and raw HTTP (httpx) for what a
client library would not send. Dense attention + FP32 KV (tests/models.settings) make answers
exact, so a served answer must equal `Session.generate` on the same ids, token for token,
whether the prefix came from a prefill, the live store or the prompt cache on disk.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from ktlong import server as server_mod  # noqa: E402
from ktlong.engine import Sampling, Session  # noqa: E402
from ktlong.model import load_model  # noqa: E402
from ktlong.serving import CACHE_MIN_TOKENS, Renderer, StopText  # noqa: E402
from ktlong.tinymodel import filler_text  # noqa: E402

from .models import hf_model, settings  # noqa: E402

NEW = 8  # tokens per answer
DOC = filler_text(1400, seed=7)  # ~1,600 tokens: over CACHE_MIN_TOKENS, so the disk path runs
ST = dict(attention="DENSE", max_new_tokens=NEW, max_seq_len=8192)


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


@pytest.fixture(scope="module")
def srv(lm, tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    with server_mod.Running(server_mod.build(lm, settings(**ST), cache_dir=cache)) as r:
        yield r


def client(r, key: str = "none"):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key=key, max_retries=0, timeout=120)


def chat_ids(lm, msgs: list[dict[str, str]]) -> list[int]:  # type: ignore[no-untyped-def]
    """The ids any client of this template expects: the whole text rendered, then tokenized."""
    text = lm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy(lm, ids: list[int], n: int = NEW, **kw) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(text, finish_reason) of a fresh Session on `ids`, as the server should answer."""
    s = Session(lm, settings(**{**ST, **kw}))
    s.prefill(ids)
    text, finish = "", "length"
    for step in s.generate(Sampling(max_new_tokens=n)):
        if step.token_id in lm.eos_ids:
            finish = "stop"
            break
        text += step.text
    return text, finish


def doc_msgs(question: str, doc: str = DOC) -> list[dict[str, str]]:
    return [{"role": "system", "content": doc}, {"role": "user", "content": question}]


class PrefillSpy:
    """Counts the ids every Session.prefill is asked for (the worker thread's too)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        real = Session.prefill

        def prefill(s, ids, *a, **kw):  # type: ignore[no-untyped-def]
            self.calls.append(len(ids))
            return real(s, ids, *a, **kw)

        monkeypatch.setattr(Session, "prefill", prefill)

    def take(self) -> int:
        n, self.calls = sum(self.calls), []
        return n


# --- answers -------------------------------------------------------------------------------------

def test_chat_answer_equals_session_generate_and_prefix_is_prefilled_once(lm, srv,
                                                                          monkeypatch) -> None:
    spy = PrefillSpy(monkeypatch)
    c = client(srv)
    model = srv.server.model_id
    system_ids = Renderer(lm.tokenizer).chat(doc_msgs("x")).prefix  # ids of the system message
    assert system_ids >= CACHE_MIN_TOKENS
    for i, q in enumerate(("What is the pass key?", "Which city is north?", "Why?")):
        msgs = doc_msgs(q)
        ids = chat_ids(lm, msgs)
        out = c.chat.completions.create(model=model, messages=msgs)  # type: ignore[arg-type]
        prefilled = spy.take()
        want, finish = greedy(lm, ids)
        spy.take()
        assert out.choices[0].message.content == want
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].finish_reason == finish
        assert out.usage.prompt_tokens == len(ids)
        assert finish == "stop" or out.usage.completion_tokens == NEW
        cached = out.usage.prompt_tokens_details.cached_tokens
        if i == 0:
            assert prefilled >= len(ids) - 1  # the document, read once
        else:  # the same system message: only the question is read
            assert prefilled < 30, prefilled
            assert cached >= system_ids
            assert cached + prefilled == len(ids)
    health = httpx.get(f"{srv.url}/health").json()
    assert health["last"]["prefilled_tokens"] < 30

    # a restart: a new engine finds the document in the prompt cache on disk and maps it
    cache = srv.server.engine.cache_dir
    msgs = doc_msgs("Where is the needle?")
    with server_mod.Running(server_mod.build(lm, settings(**ST), cache_dir=cache)) as r2:
        out = client(r2).chat.completions.create(model=model, messages=msgs)  # type: ignore[arg-type]
        assert spy.take() < 30
        assert r2.server.engine.session.store.nb_base > 0  # the cached blocks are mapped
        assert out.usage.prompt_tokens_details.cached_tokens >= system_ids - 1
        # another document cuts into the mapped prefix: a new session, and it still answers right
        other = doc_msgs("What is the pass key?", filler_text(1300, seed=11))
        out2 = client(r2).chat.completions.create(model=model, messages=other)  # type: ignore[arg-type]
    assert out.choices[0].message.content == greedy(lm, chat_ids(lm, msgs))[0]
    assert out2.choices[0].message.content == greedy(lm, chat_ids(lm, other))[0]


def test_a_final_assistant_message_is_continued(lm, srv) -> None:
    """An answer begun by the client (the last message the assistant's, as llama.cpp's server
    and Ollama take it): the model writes on from its last word, and the reply holds only what
    it wrote. An empty one is answered as if it were not there."""
    msgs = [{"role": "user", "content": "Which city is north?"},
            {"role": "assistant", "content": "The city is"}]
    text = lm.tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text.endswith("The city is")
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    p = Renderer(lm.tokenizer).chat(msgs)
    assert p.ids == ids and p.after == len(lm.tokenizer("The city is",
                                                        add_special_tokens=False)["input_ids"])
    out = client(srv).chat.completions.create(model=srv.server.model_id, messages=msgs)  # type: ignore[arg-type]
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == greedy(lm, ids)[0]
    empty = [msgs[0], {"role": "assistant", "content": ""}]
    out = client(srv).chat.completions.create(model=srv.server.model_id, messages=empty)  # type: ignore[arg-type]
    assert out.choices[0].message.content == greedy(lm, chat_ids(lm, msgs[:1]))[0]


def test_stream_chunks_as_openai_sends_them(lm, srv) -> None:
    msgs = [{"role": "user", "content": "Tell me about the river."}]
    want, finish = greedy(lm, chat_ids(lm, msgs))
    stream = client(srv).chat.completions.create(
        model=srv.server.model_id, messages=msgs, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0  # include_usage
    *body, last = [ch for ch in chunks if ch.choices]
    assert last.choices[0].finish_reason == finish and not last.choices[0].delta.content
    assert all(ch.choices[0].finish_reason is None for ch in body)
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == want

    # the wire format itself: `data: {json}` events, then `data: [DONE]`
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": srv.server.model_id, "messages": msgs, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    datas = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events)
    assert datas[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert datas[-1]["choices"][0]["delta"] == {}
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in datas) == want


def test_completions_stop_strings_and_sampling(lm, srv) -> None:
    c, model = client(srv), srv.server.model_id
    prompt = "The copper lantern by the harbour"
    ids = lm.tokenizer(prompt)["input_ids"]
    want, _ = greedy(lm, ids, n=24)
    out = c.completions.create(model=model, prompt=prompt, max_tokens=24)
    assert out.object == "text_completion" and out.choices[0].text == want
    parts = list(c.completions.create(model=model, prompt=prompt, max_tokens=24, stream=True))
    assert "".join(p.choices[0].text for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "length"

    # a stop string: the answer ends before its first occurrence, streamed or not
    stop = want[len(want) // 2: len(want) // 2 + 3]
    cut = want[: want.find(stop)]
    out = c.completions.create(model=model, prompt=prompt, max_tokens=24, stop=[stop, "zzzz"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    parts = list(c.completions.create(model=model, prompt=prompt, max_tokens=24, stop=stop,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts) == cut
    assert parts[-1].choices[0].finish_reason == "stop"

    # sampling: the same seed gives the same answer; max_tokens bounds it
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=1.5, top_p=0.9, seed=3)
    a, b = c.completions.create(**kw), c.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens <= 12
    assert c.models.list().data[0].id == model


def test_stop_text_holds_back_a_partial_stop() -> None:
    t = StopText(["END", "xy"])
    assert t.feed("abcE") == ("abc", False)  # "E" may start END
    assert t.feed("N") == ("", False)
    assert t.feed("Dmore") == ("", True)
    t = StopText(["END"])
    assert t.feed("aEx") == ("aEx", False)
    assert (t.feed("E"), t.flush()) == (("", False), "E")


def test_prompt_file_prefix_matches_chat(lm) -> None:
    """With --prompt-file the document opens the first user message, tokenized as `ktlong chat`
    tokenizes it: `ktlong prefill` entries serve too."""
    from ktlong.conversation import Conversation

    r = Renderer(lm.tokenizer, DOC)
    p = r.chat([{"role": "user", "content": "Which city?"}])
    assert p.ids[: p.prefix] == Conversation(lm.tokenizer, DOC).document_ids()
    assert p.ids == Conversation(lm.tokenizer, DOC).prompt_ids("Which city?")


def test_the_served_document_starts_after_the_system_messages(lm) -> None:
    """A client's system message comes before the -f document: the session is told where the
    document starts (question_first_block reads the document's first tokens again, not the
    system message's), as `ktlong chat --system` tells it."""
    from ktlong.conversation import Conversation

    doc, system = "Alpha beta gamma delta. " + filler_text(40, seed=5), "Zulu yankee xray."
    p = Renderer(lm.tokenizer, doc).chat([{"role": "system", "content": system},
                                          {"role": "user", "content": "Which city?"}])
    assert p.head == Conversation(lm.tokenizer, doc, system).head_ids()
    e = server_mod.Engine(lm, settings(**ST), use_cache=False)
    try:
        e.run(p)
        s = e.session
        assert s is not None and s.template_head == p.head
        start = s._doc_start()
        assert "Alpha" in lm.tokenizer.decode(p.ids[start:start + 4])
        assert "Zulu" in lm.tokenizer.decode(p.ids[:start])
    finally:
        e.close()


# --- the engine: one at a time, disconnects -------------------------------------------------------

def test_health_shows_busy_and_queued(lm, srv, monkeypatch) -> None:
    gate, entered = threading.Event(), threading.Event()
    real = Session.prefill

    def held(s, ids, *a, **kw):  # type: ignore[no-untyped-def]
        entered.set()
        assert gate.wait(60)
        return real(s, ids, *a, **kw)

    monkeypatch.setattr(Session, "prefill", held)
    model = srv.server.model_id
    results: list[str] = []

    def ask(q: str) -> None:
        out = client(srv).chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], max_tokens=3)
        results.append(out.choices[0].finish_reason)

    threads = [threading.Thread(target=ask, args=(q,)) for q in ("one", "two")]
    threads[0].start()
    assert entered.wait(30)
    threads[1].start()
    deadline = time.monotonic() + 30
    while (h := httpx.get(f"{srv.url}/health").json())["queued"] < 1:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert h["busy"] is True and h["queued"] == 1
    gate.set()
    for t in threads:
        t.join(60)
    assert len(results) == 2
    h = httpx.get(f"{srv.url}/health").json()
    assert (h["busy"], h["queued"]) == (False, 0)


def test_client_leaving_mid_stream_frees_the_engine(lm, tmp_path) -> None:
    endless = dataclasses.replace(lm, eos_ids=())  # no EOS: only the client can stop it
    srv = server_mod.build(endless, settings(**ST), cache_dir=tmp_path)
    with server_mod.Running(srv) as r:
        body = {"model": srv.model_id, "messages": [{"role": "user", "content": "go"}],
                "stream": True, "max_tokens": 6000}
        with httpx.stream("POST", f"{r.url}/v1/chat/completions", json=body, timeout=60) as resp:
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: ")
                if got >= 5:
                    break  # leaving the block closes the connection
        deadline = time.monotonic() + 30
        while (h := httpx.get(f"{r.url}/health").json())["busy"]:
            assert time.monotonic() < deadline, "the engine kept generating"
            time.sleep(0.05)
        assert h["last"]["finish_reason"] == "cancelled"
        assert h["last"]["completion_tokens"] < 6000
        out = client(r).chat.completions.create(
            model=srv.model_id, messages=[{"role": "user", "content": "again"}], max_tokens=4)
        assert out.usage.completion_tokens == 4


def test_client_leaving_mid_prefill_stops_it_and_the_store_stays_whole(lm, monkeypatch) -> None:
    from ktlong import serving

    srv = server_mod.build(lm, settings(**ST), use_cache=False)
    real = serving.Engine._progress

    def stalled(self, job):  # type: ignore[no-untyped-def]
        report = real(self, job)

        def progress(done: int, total: int) -> None:
            report(done, total)  # raises Cancelled once the client has left
            job.cancel.wait(30)  # the prefill stalls here until then

        return progress

    with server_mod.Running(srv) as r:
        c = client(r)
        c.chat.completions.create(model=srv.model_id, max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}])
        monkeypatch.setattr(serving.Engine, "_progress", stalled)
        monkeypatch.setattr(serving, "PROGRESS_EVERY_S", 0.0)
        msgs = doc_msgs("Which city?")
        body = {"model": srv.model_id, "messages": msgs, "stream": True}
        with httpx.stream("POST", f"{r.url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith(": prefill"):
                    break  # a comment while the document is read; then the client leaves
        deadline = time.monotonic() + 30
        while httpx.get(f"{r.url}/health").json()["busy"]:
            assert time.monotonic() < deadline, "the prefill went on"
            time.sleep(0.05)
        monkeypatch.undo()
        s = srv.engine.session
        assert len(s.tokens) < len(chat_ids(lm, msgs)) - 1  # it stopped partway
        assert set(s.store.lengths) == {len(s.tokens)}  # partial layers were cut back
        out = c.chat.completions.create(model=srv.model_id, messages=msgs)  # type: ignore[arg-type]
    assert out.choices[0].message.content == greedy(lm, chat_ids(lm, msgs))[0]


def test_serve_command_reads_the_document_at_start(lm, tmp_path) -> None:
    """`ktlong serve` itself, as a subprocess: -f read before the first request, --name."""
    import socket
    import subprocess
    import sys

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sets = [a for k, v in {**ST, "kv_type": "FP32", "block_size": 16, "threads_num": 2}.items()
            for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktlong", "serve", "-m", str(hf_model("llama")), "-f", str(doc),
         "--port", str(port), "--name", "tiny", "--cache-dir", str(tmp_path / "cache"), *sets],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                health = httpx.get(f"{url}/health").json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        head = Renderer(lm.tokenizer, DOC).chat([{"role": "user", "content": ""}]).prefix
        assert health["context_tokens"] == head and health["model"] == "tiny"
        r = type("R", (), {"url": url})
        out = client(r).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Which city?"}])
        assert out.usage.prompt_tokens_details.cached_tokens >= head
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "serving tiny at" in err


# --- context shift: a chat longer than max_seq_len (overflow SHIFT) -----------------------------

CAP = 512  # max_seq_len of the shift tests
SHORT_DOC = filler_text(80, seed=3)  # ~100 tokens: the system message, never dropped
QS = [f"Question {i}: {filler_text(30, seed=200 + i)}?" for i in range(60)]


def kept(msgs: list[dict[str, str]], dropped: int) -> list[dict[str, str]]:
    """`msgs` without their `dropped` oldest non-system messages (what the server answered)."""
    gone = [i for i, m in enumerate(msgs) if m["role"] != "system"][:dropped]
    return [m for i, m in enumerate(msgs) if i not in gone]


def talk(r, msgs: list[dict[str, str]], stream: bool, **kw) -> tuple[str, str, dict, int]:  # type: ignore[no-untyped-def]
    """One chat request with the openai client: (text, finish_reason, usage as a dict, the
    X-Ktlong-Dropped-Messages header)."""
    c = client(r).chat.completions.with_raw_response
    raw = c.create(model=r.server.model_id, messages=msgs, stream=stream,  # type: ignore[arg-type]
                   **({"stream_options": {"include_usage": True}} if stream else {}), **kw)
    header = int(raw.headers[server_mod.DROPPED_HEADER])
    if not stream:
        out = raw.parse()
        return (out.choices[0].message.content, out.choices[0].finish_reason,
                out.usage.model_dump(), header)
    chunks = list(raw.parse())
    body = [ch for ch in chunks if ch.choices]
    text = "".join(ch.choices[0].delta.content or "" for ch in body)
    return text, body[-1].choices[0].finish_reason, chunks[-1].usage.model_dump(), header


def check_store(lm, srv, msgs: list[dict[str, str]], usage: dict) -> list[int]:  # type: ignore[no-untyped-def]
    """The live store holds the kept messages' prompt and the answer (but its last token), and
    every layer as many tokens; returns the kept prompt's ids."""
    doc = srv.server.renderer.document  # -f: it opens the first kept user message
    rest = kept(msgs, usage["dropped_messages"])
    ids = Renderer(lm.tokenizer, doc).chat(rest).ids if doc else chat_ids(lm, rest)
    s = srv.server.engine.session
    assert len(ids) <= usage["prompt_tokens"]  # a mid-answer shift may have dropped more since
    assert s.tokens[: len(ids)] == ids
    assert len(s.tokens) == len(ids) + usage["completion_tokens"] - 1
    assert set(s.store.lengths) == {len(s.tokens)} and len(s.tokens) <= CAP
    return ids


@pytest.mark.parametrize("stream, document", [(False, False), (True, False), (False, True)],
                         ids=["json", "stream", "prompt-file"])
def test_a_chat_three_times_past_max_seq_len_keeps_answering(lm, tmp_path, stream,
                                                             document) -> None:
    """2 layers: every answer has its full length, the store matches the kept conversation (the
    system message, or the -f document, never dropped) and the kept turns' K,V were moved, not
    prefilled again; where nothing was moved (here: a new server) the answer is a fresh
    Session's on the kept messages, token for token."""
    endless = dataclasses.replace(lm, eos_ids=())  # every answer is max_tokens long
    doc = SHORT_DOC if document else ""
    st = settings(**{**ST, "max_seq_len": CAP})
    msgs = [] if document else [{"role": "system", "content": SHORT_DOC}]

    def full(m: list[dict[str, str]]) -> list[int]:
        return Renderer(lm.tokenizer, doc).chat(m).ids if document else chat_ids(lm, m)

    total, moved, drops = 0, 0, []
    with server_mod.Running(server_mod.build(endless, st, doc, cache_dir=tmp_path)) as r:
        for q in QS:
            msgs.append({"role": "user", "content": q})
            text, finish, usage, header = talk(r, msgs, stream, max_tokens=NEW)
            assert (finish, usage["completion_tokens"]) == ("length", NEW) and text
            assert header == usage["dropped_messages"] <= len(msgs) - 1 - (not document)
            ids = check_store(endless, r, msgs, usage)
            assert len(ids) + NEW <= CAP  # room for the answer was kept before it began
            last = httpx.get(f"{r.url}/health").json()["last"]
            assert last["dropped_messages"] == usage["dropped_messages"]
            if usage["dropped_messages"]:
                drops.append(usage["dropped_messages"])
                assert usage["dropped_tokens"] == len(full(msgs)) - len(ids)
            if last["moved_tokens"]:
                moved += 1
                assert usage["prompt_tokens_details"]["cached_tokens"] >= last["moved_tokens"]
            elif usage["dropped_messages"]:  # recomputed: exact
                assert text == greedy(endless, ids)[0]
            msgs.append({"role": "assistant", "content": text})
            total = len(full(msgs[:-1])) + NEW
            if total > 3 * CAP:
                break
    assert total > 3 * CAP, "the conversation never got 3x past max_seq_len"
    assert len(drops) >= 5 and drops == sorted(drops) and drops[-1] >= 10
    assert moved >= 3  # the kept turns' K,V were moved, not prefilled again

    # a new server has no store to shift: it prefills the kept messages and answers as a fresh
    # Session does
    msgs.append({"role": "user", "content": "And the pass key?"})
    with server_mod.Running(server_mod.build(endless, st, doc, use_cache=False)) as r:
        text, _, usage, _ = talk(r, msgs, stream, max_tokens=NEW)
        ids = check_store(endless, r, msgs, usage)
        assert httpx.get(f"{r.url}/health").json()["last"]["moved_tokens"] == 0
    assert usage["dropped_messages"] >= drops[-1] and text == greedy(endless, ids)[0]


def test_answers_after_a_shift_equal_a_fresh_prefill_of_the_kept_messages(tmp_path) -> None:
    """One layer, dense, float32 KV: the shifted store's logits equal a fresh prefill's
    (tests/test_shift.py: 1e-4 of the largest logit), so every served answer, moved or not,
    is a fresh Session's on the kept messages, token for token."""
    lm1 = load_model(hf_model("llama", qk_scale=4.0, layers=1, head_dim=32), device="CPU",
                     dtype="float32")
    lm1 = dataclasses.replace(lm1, eos_ids=())
    srv = server_mod.build(lm1, settings(**{**ST, "max_seq_len": CAP}), cache_dir=tmp_path)
    msgs = [{"role": "system", "content": SHORT_DOC}]
    moved = 0
    with server_mod.Running(srv) as r:
        for q in QS[:24]:
            msgs.append({"role": "user", "content": q})
            text, finish, usage, _ = talk(r, msgs, False, max_tokens=NEW)
            ids = check_store(lm1, r, msgs, usage)
            assert text == greedy(lm1, ids)[0]
            moved += httpx.get(f"{r.url}/health").json()["last"]["moved_tokens"] > 0
            msgs.append({"role": "assistant", "content": text})
    assert usage["dropped_messages"] >= 10 and moved >= 3


def test_a_long_answer_drops_more_turns_as_it_goes(lm, tmp_path) -> None:
    """max_tokens past the room kept before the answer (settings.max_new_tokens): the answer
    fills the store, older turns go mid-answer (make_room) and it runs to max_tokens; with no
    older turn left it ends with "length" as before."""
    endless = dataclasses.replace(lm, eos_ids=())
    srv = server_mod.build(endless, settings(**{**ST, "max_seq_len": CAP}), cache_dir=tmp_path)
    msgs = [{"role": "system", "content": SHORT_DOC}]
    with server_mod.Running(srv) as r:
        for q in QS[:6]:  # ~420 tokens of turns
            msgs.append({"role": "user", "content": q})
            text, *_ = talk(r, msgs, False, max_tokens=NEW)
            msgs.append({"role": "assistant", "content": text})
        msgs.append({"role": "user", "content": QS[6]})
        before = srv.renderer.fit(msgs, CAP - NEW).dropped
        text, finish, usage, header = talk(r, msgs, False, max_tokens=200)
        assert (finish, usage["completion_tokens"]) == ("length", 200)
        assert usage["dropped_messages"] > before and header == usage["dropped_messages"]
        check_store(endless, r, msgs, usage)

        # streamed: the header has the count before the answer, usage the final one, and an SSE
        # comment tells the shift as it happens
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": QS[7]}]
        body = {"model": srv.model_id, "messages": msgs, "stream": True, "max_tokens": 200,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{r.url}/v1/chat/completions", json=body,
                          timeout=120) as resp:
            header = int(resp.headers[server_mod.DROPPED_HEADER])
            raw = resp.read().decode()
        events = [e for e in raw.split("\n\n") if e]
        assert any(e.startswith(": context full: the oldest") for e in events), raw
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 200 and usage["dropped_messages"] > header
        check_store(endless, r, msgs, usage)

        # one question, nothing older to drop: the store fills and the answer ends
        one = [{"role": "system", "content": SHORT_DOC}, {"role": "user", "content": QS[0]}]
        text, finish, usage, header = talk(r, one, False, max_tokens=1000)
        assert finish == "length" and usage["completion_tokens"] < 1000
        assert usage["dropped_messages"] == header == 0
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CAP  # the store is full
        s = srv.engine.session
        assert len(s.tokens) == CAP and set(s.store.lengths) == {CAP}


def test_overflow_stop_and_what_cannot_fit_keep_the_400(lm, tmp_path) -> None:
    msgs = [{"role": "system", "content": SHORT_DOC}]
    srv = server_mod.build(lm, settings(**{**ST, "max_seq_len": CAP, "overflow": "STOP"}),
                           cache_dir=tmp_path)
    with server_mod.Running(srv) as r:
        for q in QS:
            msgs.append({"role": "user", "content": q})
            resp = httpx.post(f"{r.url}/v1/chat/completions", timeout=60, json={
                "model": srv.model_id, "messages": msgs, "max_tokens": NEW})
            if resp.status_code != 200:
                break
            out = resp.json()
            assert out["usage"]["dropped_messages"] == 0
            assert resp.headers[server_mod.DROPPED_HEADER] == "0"
            msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        else:
            pytest.fail("the conversation never filled the context")
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert len(chat_ids(lm, msgs)) > CAP

    # SHIFT: when the system message and the last question alone are too long, still the 400;
    # a raw completion prompt has no turns to drop
    srv = server_mod.build(lm, settings(**{**ST, "max_seq_len": CAP}), cache_dir=tmp_path)
    with server_mod.Running(srv) as r:
        big = msgs[:-1] + [{"role": "user", "content": filler_text(500, seed=9)}]
        resp = httpx.post(f"{r.url}/v1/chat/completions", timeout=60, json={
            "model": srv.model_id, "messages": big, "max_tokens": NEW})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["code"] == "context_length_exceeded"
        assert f"without its {len(big) - 2} oldest messages" in err["message"]
        resp = httpx.post(f"{r.url}/v1/completions", timeout=60, json={
            "model": srv.model_id, "prompt": filler_text(500, seed=9), "max_tokens": NEW})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        # the SHIFT server answers the conversation the STOP one refused
        out = client(r).chat.completions.create(model=srv.model_id, messages=msgs,  # type: ignore[arg-type]
                                                max_tokens=NEW)
        assert out.usage.dropped_messages > 0 and out.choices[0].finish_reason


def test_locret_serves_a_document_longer_than_max_seq_len(lm, tmp_path) -> None:
    """Under attention LOCRET the document counts as the rows it keeps: a 1,600-token document
    is served with max_seq_len 1,024, and the answer is a session's that read the document,
    then the question; the same server without LOCRET refuses it."""
    st = {**ST, "attention": "LOCRET", "prefill": "DENSE", "locret_scores": "ATTENTION",
          "locret_budget": 256, "locret_stabilisers": 32, "chunk_size": 128, "max_seq_len": 1024}
    msgs = doc_msgs("What is the pass key?")
    ids = chat_ids(lm, msgs)
    prefix = server_mod.Renderer(lm.tokenizer).chat(msgs).prefix
    assert len(ids) > 1024 and prefix >= CACHE_MIN_TOKENS
    s = Session(lm, settings(**st))
    s.prefill(ids[:prefix])  # the server reads the document first (it goes to the prompt cache)
    s.prefill(ids[prefix:])
    want = "".join(step.text for step in s.generate(Sampling(max_new_tokens=NEW)))
    assert len(s.store.lengths) and max(s.store.lengths) <= 1024 < len(s.tokens)
    for kind in ("LOCRET", "DENSE"):
        srv = server_mod.build(lm, settings(**{**st, "attention": kind}), cache_dir=tmp_path)
        with server_mod.Running(srv) as r:
            resp = httpx.post(f"{r.url}/v1/chat/completions", timeout=120, json={
                "model": srv.model_id, "messages": msgs, "max_tokens": NEW})
            raw = httpx.post(f"{r.url}/v1/completions", timeout=120, json={
                "model": srv.model_id, "prompt": DOC, "max_tokens": 2})
        if kind == "DENSE":
            assert resp.status_code == raw.status_code == 400
            assert resp.json()["error"]["code"] == "context_length_exceeded"
            continue
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["dropped_messages"] == 0
        assert out["choices"][0]["message"]["content"] == want
        assert raw.status_code == 200, raw.text  # a raw prompt read at once within the budget


def test_fit_drops_whole_turns_never_system_or_the_last_question(lm) -> None:
    r = Renderer(lm.tokenizer)
    msgs = [{"role": "system", "content": SHORT_DOC}, {"role": "assistant", "content": "Hi."}]
    for q in QS[:5]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": "Yes."}]
    msgs += [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QS[5]}]
    full = r.chat(msgs)
    assert r.fit(msgs, len(full.ids)) == server_mod.Fitted(full)
    sizes = []
    for limit in range(len(full.ids) - 1, 0, -25):
        f = r.fit(msgs, limit)
        k = f.dropped
        rest = [m for m in msgs if m["role"] != "system"]
        assert k % 2 == 1  # the greeting, then user + assistant pairs: whole turns
        assert rest[k]["role"] == "user" and k <= len(rest) - 1
        assert f.prompt == r.chat(kept(msgs, k))  # both system messages stay
        assert f.dropped_tokens == len(full.ids) - len(f.prompt.ids)
        fewer = r.chat(kept(msgs, k - 2)) if k > 1 else full
        assert len(fewer.ids) > limit  # the fewest turns that fit
        assert len(f.prompt.ids) <= limit or k == len(rest) - 1
        sizes.append(k)
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 11


# --- bad requests: a 4xx with an OpenAI error body, never a 500 ----------------------------------

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    (b"\xff\xfe", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({**GOOD, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"messages": GOOD["messages"]}, 400, "model", "missing_required"),
    ({**GOOD, "temperature": 5}, 400, "temperature", "invalid_value"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({**GOOD, "max_tokens": 2.5}, 400, "max_tokens", "invalid_value"),
    ({**GOOD, "seed": "x"}, 400, "seed", "invalid_value"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({**GOOD, "stop": 3}, 400, "stop", "invalid_value"),
    ({**GOOD, "n": 2}, 400, "n", "invalid_value"),
    ({**GOOD, "stream": "yes"}, 400, "stream", "invalid_value"),
    ({**GOOD, "messages": []}, 400, "messages", "invalid_value"),
    ({**GOOD, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_value"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "invalid_value"),
    ({**GOOD, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages",
     "context_length_exceeded"),
])
def test_bad_chat_requests(srv, body, status, param, code) -> None:
    if isinstance(body, dict) and param != "model":
        body = {**body, "model": srv.server.model_id}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{srv.url}/v1/chat/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert "Traceback" not in err["message"]
    if code == "context_length_exceeded":
        assert "max_seq_len is 8,192" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
])
def test_bad_completion_requests(srv, body, param) -> None:
    resp = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": srv.server.model_id})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_unknown_route_and_method(srv) -> None:
    for resp, status in ((httpx.get(f"{srv.url}/v1/nothing"), 404),
                         (httpx.get(f"{srv.url}/v1/chat/completions"), 405)):
        assert resp.status_code == status and set(resp.json()["error"]) == {
            "message", "type", "param", "code"}


def test_api_key(lm, tmp_path) -> None:
    srv = server_mod.build(lm, settings(**ST), api_key="sekrit", cache_dir=tmp_path)
    with server_mod.Running(srv) as r:
        assert client(r, "sekrit").models.list().data[0].id == srv.model_id
        with pytest.raises(openai.AuthenticationError):
            client(r, "wrong").models.list()
        resp = httpx.post(f"{r.url}/v1/chat/completions", json={**GOOD, "model": srv.model_id})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{r.url}/health").status_code == 200  # health needs no key


def test_help_is_light_and_a_missing_extra_is_one_line(monkeypatch) -> None:
    import subprocess
    import sys

    from typer.testing import CliRunner

    from ktlong.cli import app

    code = ("import sys\nfrom ktlong.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('HEAVY', [m for m in ('torch', 'numba', 'fastapi') if m in sys.modules])")
    for args in (["serve", "--help"], ["bench", "serve", "--help"]):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip().endswith("HEAVY []"), out.stderr
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the extra is not installed
    r = CliRunner().invoke(app, ["serve", "--demo"])
    assert r.exit_code == 2
    assert "error: ktlong serve needs FastAPI and uvicorn (uvicorn is missing)" in r.output
    assert "pip install 'ktlong[serve]'" in r.output


def test_bench_serve_reuses_the_prefix(lm, capsys) -> None:
    from ktlong.bench import serve as bench

    data = bench.main(2048, settings(**ST), hf_model("llama"), as_json=True, max_tokens=4)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == data
    first, second, restart = data["rows"]
    assert first["cached_tokens"] == 0 and first["prefilled_tokens"] == first["prompt_tokens"]
    for r in (second, restart):  # the system message is not read again
        assert r["prefilled_tokens"] < 30 and r["cached_tokens"] > 1900
        assert r["ttft_s"] > 0 and r["speedup"] == first["ttft_s"] / r["ttft_s"]
