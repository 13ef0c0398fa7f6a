"""`ktlong bench load`: `ktlong serve` under concurrent clients, against each request alone.

Each document goes in a system message with the same question (greedy). First every request is
sent alone, one after another; then all of them at once, plus one client that leaves after its
answer's first chunk (asking for many tokens, so an engine that went on with it would hold every
other client back), while `/health` is polled. Reported: whether every answer under load equals its
answer alone, each client's time to first token and to the end, how long the dropped client's
job kept the engine, `/health`'s latency under load and the process's peak memory.

The server runs in this process on a free loopback port, as in `ktlong bench serve`; clients are
threads streaming with urllib, as any OpenAI client does.
"""
from __future__ import annotations

import json
import resource
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ktlong.bench.serve import sse_chunks
from ktlong.config import Settings

QUESTION = "In one sentence: what does this license allow?"
DOCUMENTS = ("Apache-2.0", "LGPL-3", "CC0-1.0", "Artistic", "GPL-1", "MPL-2.0")
DROPPED = "GPL-2"  # the client that leaves after its first chunk
LICENSES = Path("/usr/share/common-licenses")


def stream(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
           leave_after_first: bool = False) -> dict[str, Any]:
    """One streamed chat completion: its text, time to first token and to the end (seconds
    from sending); with `leave_after_first` the connection is closed at the first text chunk."""
    body = json.dumps({"model": model, "messages": messages, "stream": True,
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text = None, ""
    resp = urllib.request.urlopen(req, timeout=3600)
    try:
        for chunk in sse_chunks(resp):
            for c in chunk["choices"]:
                piece = c["delta"].get("content") or ""
                if ttft is None and (piece or c["finish_reason"]):
                    ttft = time.perf_counter() - t0
                text += piece
            if leave_after_first and ttft is not None:
                break
    finally:
        resp.close()  # the socket goes: the server sees the client leave
    return {"answer": text, "ttft_s": ttft, "end_s": time.perf_counter() - t0}


class HealthPoller(threading.Thread):
    """GET /health every `interval` seconds until stopped; keeps each answer's latency."""

    def __init__(self, url: str, interval: float = 0.1) -> None:
        super().__init__(name="health-poller", daemon=True)
        self.url, self.interval = url, interval
        self.latencies: list[float] = []
        self.failures = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=30) as r:
                    json.load(r)
                self.latencies.append(time.perf_counter() - t0)
            except OSError:
                self.failures += 1
            self.done.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [float("nan")]
        return {"polls": len(self.latencies), "failures": self.failures,
                "p50_ms": 1e3 * statistics.median(lat),
                "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                "max_ms": 1e3 * lat[-1]}


def run_load(url: str, model: str, documents: list[tuple[str, str]], dropped: str,
             max_tokens: int, drop_tokens: int = 4096) -> dict[str, Any]:
    """Alone, then together with a client that leaves (see the module's doc)."""
    def msgs(doc: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": doc}, {"role": "user", "content": QUESTION}]

    alone = [stream(url, model, msgs(text), max_tokens) for _, text in documents]
    together: list[dict[str, Any] | None] = [None] * len(documents)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            together[i] = stream(url, model, msgs(documents[i][1]), max_tokens)
        except BaseException as e:  # reported below, not lost in a thread
            errors.append(e)

    poller = HealthPoller(url)
    poller.start()
    t0 = time.perf_counter()
    leaver = stream(url, model, msgs(dropped), drop_tokens, leave_after_first=True)
    left_at = time.perf_counter() - t0
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(documents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    poller.done.set()
    poller.join()
    if errors:
        raise errors[0]
    rows = [{"document": name, "equal": b["answer"] == a["answer"], "answer": b["answer"],
             "alone_ttft_s": a["ttft_s"], "alone_end_s": a["end_s"], "load_ttft_s": b["ttft_s"],
             "load_end_s": b["end_s"]}
            for (name, _), a, b in zip(documents, alone, together, strict=True)]
    alone_s = sum(a["end_s"] for a in alone)
    return {"clients": rows, "all_equal": all(r["equal"] for r in rows),
            "dropped": {"left_after_s": left_at, "answer": leaver["answer"]},
            "load_wall_s": wall, "alone_sum_s": alone_s,
            # what the load took beyond the same requests alone, the leaver's first chunk included
            "overhead_s": wall - alone_s - left_at,
            "health": poller.summary(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(model: Path, settings: Settings, files: list[str], as_json: bool, command: str,
         max_tokens: int = 24) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from ktlong import server
    from ktlong.bench import plot as plotting
    from ktlong.documents import read_document
    from ktlong.errors import KtlongError
    from ktlong.model import load_model

    server.require()
    names = files or [str(LICENSES / n) for n in (*DOCUMENTS, DROPPED)]
    if len(names) < 2:
        raise KtlongError("bench load needs two documents or more (the last is the leaver's)")
    docs = [(Path(n).name, read_document(n).text) for n in names]
    lm = load_model(model, settings.device, weight_type=settings.weight_type)
    srv = server.build(lm, settings, use_cache=False)
    with server.Running(srv) as r:
        result = run_load(r.url, srv.model_id, docs[:-1], docs[-1][1], max_tokens)
    result.update(model=str(model), threads=settings.threads_num, max_tokens=max_tokens,
                  command=command, machine=plotting.machine())
    if as_json:
        print(json.dumps(result, indent=1))
        return result
    t = Table(title=f"ktlong serve, {len(docs) - 1} clients at once and one that leaves "
                    f"({Path(model).name}, greedy, {max_tokens} tokens)")
    for col in ("document", "same as alone", "alone: first token / end s",
                "load: first token / end s"):
        t.add_column(col)
    for row in result["clients"]:
        t.add_row(row["document"], "yes" if row["equal"] else "NO",
                  f"{row['alone_ttft_s']:.1f} / {row['alone_end_s']:.1f}",
                  f"{row['load_ttft_s']:.1f} / {row['load_end_s']:.1f}")
    c = Console()
    c.print(t)
    h = result["health"]
    c.print(f"/health under load: {h['polls']} polls, p50 {h['p50_ms']:.1f} ms, p99 "
            f"{h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms, {h['failures']} failed")
    c.print(f"the load took {result['load_wall_s']:.1f} s; the same requests alone "
            f"{result['alone_sum_s']:.1f} s (+{result['overhead_s']:.1f} s); peak RSS "
            f"{result['peak_rss_bytes'] / 2**30:.2f} GiB")
    return result
