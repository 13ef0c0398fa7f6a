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
