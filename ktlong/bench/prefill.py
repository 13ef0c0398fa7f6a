"""`ktlong bench prefill`: ktlong's chunked prefill vs transformers' one-shot forward.

Each measurement runs in a fresh subprocess so its peak RSS is its own; runtimes are interleaved
per context length. The model is a small random Llama built locally (no downloads). ktlong runs
once per `--chunk-sizes` entry, so chunk sizes compare side by side (speed and peak RSS). Both
prefill exactly (`prefill_window` 0): the same attention, so the times compare like with like.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ktlong.bench.rss import peak_rss
from ktlong.config import CHUNK_AUTO

BENCH_SHAPE = dict(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1408)


def _worker(runtime: str, model: str, n: int, threads: int, chunk: int) -> dict[str, Any]:
    import dataclasses

    import torch

    from ktlong.config import Settings
    from ktlong.model import load_model
    from ktlong.tinymodel import filler_text

    torch.set_num_threads(threads)
    lm = load_model(model, device="CPU", dtype="float32")
    ids = lm.tokenizer(filler_text(n, seed=0))["input_ids"][:n]
    assert len(ids) == n, "filler text too short"
    if runtime == "ktlong":
        from ktlong.engine import Session

        st = dataclasses.replace(
            Settings(),
            attention="DENSE",
            prefill_window=0,
            kv_type="BF16",
            chunk_size=chunk,
            max_seq_len=n + 16,
            threads_num=threads,
        )
        t0 = time.perf_counter()  # imports done, as for transformers below
        Session(lm, st).prefill(ids)
    else:
        from transformers import AutoModelForCausalLM

        stock = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa").eval()
        t0 = time.perf_counter()
        with torch.inference_mode():
            stock(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    dt = time.perf_counter() - t0
    rss = peak_rss()
    return {
        "runtime": runtime,
        "context": n,
        "chunk_size": chunk if runtime == "ktlong" else None,
        "prefill_s": dt,
        "prefill_tok_s": n / dt,
        "peak_rss_bytes": rss,
    }


def main(contexts: list[int], threads: int, as_json: bool, model: Path | None = None,
         chunk_sizes: tuple[int, ...] = (CHUNK_AUTO[False],)) -> None:
    from rich.console import Console
    from rich.table import Table

    from ktlong.tinymodel import make_model

    threads = threads or __import__("os").cpu_count() or 1
    tmp = None
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="ktlong-bench-")
        model = make_model(
            Path(tmp.name) / "model", "llama", max_positions=max(contexts) * 2, **BENCH_SHAPE
        )
    rows = []
    for n in contexts:
        for runtime, chunk in [("ktlong", c) for c in chunk_sizes] + [("transformers", 0)]:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ktlong.bench.prefill",
                    runtime,
                    str(model),
                    str(n),
                    str(threads),
                    str(chunk),
                ],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise RuntimeError(f"{runtime} at {n}: {out.stderr.strip().splitlines()[-1]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if as_json:
        print(json.dumps({"threads": threads, "model": BENCH_SHAPE, "rows": rows}))
        return
    table = Table(title=f"prefill, {threads} threads, random Llama {BENCH_SHAPE}")
    for col in ("context", "runtime", "tok/s", "seconds", "peak RSS (GB)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['context']:,}",
            r["runtime"] + (f" (chunk {r['chunk_size']})" if r["chunk_size"] else ""),
            f"{r['prefill_tok_s']:.0f}",
            f"{r['prefill_s']:.1f}",
            f"{r['peak_rss_bytes'] / 1e9:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":  # a worker: python -m ktlong.bench.prefill RUNTIME MODEL N THREADS CHUNK
    print(json.dumps(_worker(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))))
