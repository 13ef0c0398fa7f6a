"""`ktlong serve` under load, on the tiny model: six clients at once and one that leaves after its
first chunk (ktlong/bench/load.py, as `ktlong bench load` runs it), and request bodies past the
size limit."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from ktlong import server as server_mod  # noqa: E402
from ktlong.bench.load import run_load  # noqa: E402
from ktlong.model import load_model  # noqa: E402
from ktlong.tinymodel import filler_text  # noqa: E402

from .models import hf_model, settings  # noqa: E402

ST = dict(attention="DENSE", kv_type="BF16", max_new_tokens=4096, max_seq_len=8192)


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


def test_six_clients_and_one_that_leaves_get_their_answers_alone(lm, tmp_path):
    docs = [(f"doc{i}", filler_text(300 + 40 * i, seed=20 + i)) for i in range(6)]
    srv = server_mod.build(lm, settings(**ST), use_cache=False)
    with server_mod.Running(srv) as r:
        out = run_load(r.url, srv.model_id, docs, filler_text(500, seed=99), max_tokens=12,
                       drop_tokens=4000)
        assert httpx.get(f"{r.url}/health").json()["busy"] is False
    assert all(row["equal"] for row in out["clients"]), out["clients"]
    assert all(row["answer"] for row in out["clients"])
    h = out["health"]
    assert h["failures"] == 0 and h["polls"] >= 3
    assert h["max_ms"] < 1000, h  # the event loop never waits for the engine
    # the leaver asked for 4,000 tokens: had its job gone on, the others would have waited for it
    assert out["overhead_s"] < max(2.0, out["alone_sum_s"]), out


def test_a_body_past_the_limit_is_refused_with_413(lm, monkeypatch):
    srv = server_mod.build(lm, settings(**ST), use_cache=False)
    monkeypatch.setattr(server_mod, "MAX_BODY", 1 << 20)
    with server_mod.Running(srv) as r:
        url = f"{r.url}/v1/chat/completions"
        big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (2 << 20) \
            + b'"}]}'
        said = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
        assert said.status_code == 413
        assert "over 1 MiB" in said.json()["error"]["message"]

        def chunks():  # no Content-Length: refused as it streams in
            yield b'{"model": "x", "messages": [{"role": "user", "content": "'
            for _ in range(40):
                yield b"a" * (64 << 10)
            yield b'"}]}'

        said = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
        assert said.status_code == 413
        ok = httpx.post(url, json={"model": srv.model_id, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200  # the server goes on
