"""`ktlong bench cache`: time to the first answer token with a prompt-cache hit vs a fresh prefill,
and decode speed from the memory-mapped entry vs from RAM. Each run is its own subprocess (so the
hit really starts cold: new process, model loaded, entry mapped), interleaved per context length.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_SHAPE = dict(layers=2, hidden=128, heads=8, kv_heads=2, head_dim=16, intermediate=256)


def _worker(mode: str, model: str, n: int, cache_dir: str) -> dict[str, Any]:
    import dataclasses

    from ktlong.config import Settings
    from ktlong.engine import Sampling
    from ktlong.model import load_model
    from ktlong.promptcache import open_document
    from ktlong.tinymodel import filler_text

    lm = load_model(model, device="CPU", dtype="float32")
    ids = lm.tokenizer(filler_text(n, seed=0))["input_ids"][:n]
    st = dataclasses.replace(Settings(), kv_type="BF16", max_seq_len=n + 256, chunk_size=4096,
                             anchor_type="MEAN", block_size=64, init_len=64, local_windows_len=256,
                             second_select_num=8)
    warm = Path(cache_dir) / "warmup"  # compile every kernel this path uses before timing
    for _ in range(2):
        w = open_document(lm, st, ids[:1024], use_cache=mode != "nocache", cache_dir=warm)
        list(w.session.generate(Sampling(max_new_tokens=4)))
    t0 = time.perf_counter()
    opened = open_document(lm, st, ids, use_cache=mode != "nocache", cache_dir=Path(cache_dir))
    steps = opened.session.generate(Sampling(max_new_tokens=33))
    next(steps)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    k = sum(1 for _ in steps)
    decode = k / (time.perf_counter() - t1)
    return {"mode": mode, "source": opened.source, "context": n, "ttft_s": ttft,
            "decode_tok_s": decode, "verify_s": opened.verify_s,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _run(mode: str, model: Path, n: int, cache_dir: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ktlong.bench.cache", mode, str(model), str(n),
                          cache_dir], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {n}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(contexts: list[int], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from ktlong.tinymodel import make_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-bench-") as tmp:
        model = make_model(Path(tmp) / "model", "llama", max_positions=max(contexts) * 2,
                           **BENCH_SHAPE)
        for n in contexts:
            cache_dir = str(Path(tmp) / f"cache-{n}")
            cold = _run("fill", model, n, cache_dir)  # prefill + write the entry
            hit = _run("hit", model, n, cache_dir)
            ram = _run("nocache", model, n, cache_dir)
            assert hit["source"] == "cache", "the second run did not hit the cache"
            rows.append({"context": n, "prefill_ttft_s": cold["ttft_s"], "hit_ttft_s": hit["ttft_s"],
                         "speedup": cold["ttft_s"] / hit["ttft_s"], "verify_s": hit["verify_s"],
                         "decode_mmap_tok_s": hit["decode_tok_s"],
                         "decode_ram_tok_s": ram["decode_tok_s"],
                         "hit_peak_rss_bytes": hit["peak_rss_bytes"],
                         "ram_peak_rss_bytes": ram["peak_rss_bytes"]})
    if as_json:
        print(json.dumps({"model": BENCH_SHAPE, "rows": rows}))
        return
    t = Table(title=f"prompt cache, random Llama {BENCH_SHAPE}, BF16 KV")
    for col in ("context", "first token: prefill", "first token: cache hit", "speedup",
                "checksum s", "decode tok/s mmap", "decode tok/s RAM"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['context']:,}", f"{r['prefill_ttft_s']:.2f} s", f"{r['hit_ttft_s']:.2f} s",
                  f"{r['speedup']:.0f}x", f"{r['verify_s']:.3f}", f"{r['decode_mmap_tok_s']:.1f}",
                  f"{r['decode_ram_tok_s']:.1f}")
    Console().print(t)


if __name__ == "__main__":  # a worker: python -m ktlong.bench.cache MODE MODEL N CACHE_DIR
    print(json.dumps(_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])))
