"""`ktlong bench serve`: time to the first token of `ktlong serve` with a long document in the
system message: the first request (prefill), a second one with another question (the live store's
prefix reused), and one after a restart (the prompt cache on disk mapped).

The server runs in this process on a free loopback port (uvicorn on a thread); requests are
streamed chat completions sent with urllib, as any OpenAI client sends them. Time to first token
is from sending the request to the first chunk with answer text (or the finish chunk).
"""
from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ktlong.config import Settings


def sse_chunks(resp: Any) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a streamed completion's server-sent events; an error chunk raises."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        yield chunk


def stream_ttft(url: str, model: str, messages: list[dict[str, str]],
                max_tokens: int) -> dict[str, Any]:
    """Send one streamed chat completion; (time to first token, answer, usage)."""
    body = json.dumps({"model": model, "messages": messages, "stream": True,
                       "max_tokens": max_tokens, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for chunk in sse_chunks(resp):
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                piece = c["delta"].get("content") or ""
                if ttft is None and (piece or c["finish_reason"]):
                    ttft = time.perf_counter() - t0
                text += piece
    return {"ttft_s": ttft, "answer": text, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def main(n_tokens: int, settings: Settings, model: Path | None, as_json: bool,
         command: str = "", max_tokens: int = 16) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from ktlong import demo, server
    from ktlong.bench import plot as plotting
    from ktlong.model import load_model

    server.require()
    d = demo.prepare(n_tokens)
    document = d.document.read_text(encoding="utf-8")
    questions = (d.questions * 3)[:3]
    lm = load_model(model or d.model, settings.device, weight_type=settings.weight_type)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-bench-serve-") as cache:
        runs = (("1st: prefill", 0), ("2nd: another question", 0),
                ("3rd, after a restart: disk cache", 1))
        srv = None
        for i, (label, restart) in enumerate(runs):
            if srv is None or restart:
                if srv is not None:
                    srv.stop()
                srv = server.Running(server.build(lm, settings, cache_dir=Path(cache)))
            msgs = [{"role": "system", "content": document},
                    {"role": "user", "content": questions[i]}]
            r = stream_ttft(srv.url, srv.server.model_id, msgs, max_tokens)
            rows.append({"request": label, "question": questions[i], **r,
                         "prefilled_tokens": srv.server.engine.last.get("prefilled_tokens")})
        if srv is not None:
            srv.stop()
    first = rows[0]["ttft_s"]
    for r in rows:
        r["speedup"] = first / r["ttft_s"] if r["ttft_s"] else 0.0
    data = {"bench": "serve", "command": command, "machine": plotting.machine(),
            "document_tokens": n_tokens, "threads": settings.threads_num or "auto",
            "model": str(model or "demo"), "rows": rows}
    if as_json:
        print(json.dumps(data))
        return data
    t = Table(title=f"ktlong serve: a {n_tokens:,}-token document in the system message")
    for col in ("request", "prompt tokens", "reused", "prefilled", "first token", "speed-up"):
        t.add_column(col, justify="left" if col == "request" else "right")
    for r in rows:
        t.add_row(r["request"], f"{r['prompt_tokens']:,}", f"{r['cached_tokens']:,}",
                  f"{r['prefilled_tokens']:,}", f"{r['ttft_s']:.3f} s", f"{r['speedup']:.0f}x")
    Console().print(t)
    return data
