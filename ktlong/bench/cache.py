"""`ktlong bench cache`: time to the first answer token with a prompt-cache hit vs a fresh prefill,
and decode speed from the memory-mapped entry vs the same entry copied into RAM (interleaved
rounds in one process, medians). Prefill and hit each run in a fresh subprocess, so the hit
really starts cold: new process, model loaded, entry checked and mapped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ktlong.bench.rss import peak_rss

BENCH_SHAPE = dict(layers=2, hidden=128, heads=8, kv_heads=2, head_dim=16, intermediate=256)


def _worker(mode: str, model: str, n: int, cache_dir: str) -> dict[str, Any]:
    import dataclasses

    from ktlong.config import Settings
    from ktlong.engine import Sampling
    from ktlong.model import load_model
    from ktlong.promptcache import open_document
    from ktlong.tinymodel import filler_text
    from ktlong.warmup import work_clock

    lm = load_model(model, device="CPU", dtype="float32")
    ids = lm.tokenizer(filler_text(n, seed=0))["input_ids"][:n]
    st = dataclasses.replace(
        Settings(),
        kv_type="BF16",
        max_seq_len=n + 256,
        chunk_size=4096,
        anchor_type="MEAN",
        block_size=64,
        init_len=64,
        local_windows_len=256,
        second_select_num=8,
    )
    warm = Path(cache_dir) / "warmup"  # compile every kernel this path uses before timing
    for _ in range(2):
        w = open_document(lm, st, ids[:1024], cache_dir=warm)
        list(w.session.generate(Sampling(max_new_tokens=4)))
    t0 = work_clock()  # perf_counter less compile time
    opened = open_document(lm, st, ids, cache_dir=Path(cache_dir))
    next(opened.session.generate(Sampling(max_new_tokens=1)))
    ttft = work_clock() - t0
    out = {
        "mode": mode,
        "source": opened.source,
        "context": n,
        "ttft_s": ttft,
        "verify_s": opened.verify_s,
        "peak_rss_bytes": peak_rss(),
    }
    if opened.source == "cache":  # decode A/B: the same entry mapped vs copied into RAM
        out.update(_decode_ab(opened.session, lm, st))
    return out


def _decode_ab(
    mapped: Any, lm: Any, st: Any, rounds: int = 6, tokens: int = 16
) -> dict[str, float]:
    """Median decode tok/s from the memory-mapped store and from a RAM copy, interleaved."""
    import statistics

    import numpy as np

    from ktlong.engine import Sampling, Session
    from ktlong.kvstore import KVStore
    from ktlong.warmup import work_clock

    src = mapped.store
    ram = KVStore(
        src.shape,
        src.capacity,
        base=([np.array(a) for a in src.k_base], [np.array(a) for a in src.v_base]),
        base_anchors=[a[:, : src.n_anchored[i]] for i, a in enumerate(src.anchors)],
        nb_base=src.nb_base,
    )
    n_base = src.nb_base * src.shape.block_size
    for layer in range(src.shape.n_layers):  # the tail tokens past the mapped blocks
        ram.write(layer, *src.token_range(layer, n_base, len(mapped.tokens)))
    sessions = {"mmap": mapped, "ram": Session(lm, st, store=ram, tokens=mapped.tokens)}
    start = {k: len(s.tokens) for k, s in sessions.items()}
    last = mapped.tokens[-1]  # re-fed each round: every round starts from the same state
    speed: dict[str, list[float]] = {"mmap": [], "ram": []}
    for r in range(rounds):
        for k in ("mmap", "ram") if r % 2 == 0 else ("ram", "mmap"):  # alternate: no order bias
            s = sessions[k]
            s.truncate(start[k] - 1)
            s.prefill([last])
            t = work_clock()
            got = sum(1 for _ in s.generate(Sampling(max_new_tokens=tokens)))
            speed[k].append(got / (work_clock() - t))
    return {
        "decode_mmap_tok_s": statistics.median(speed["mmap"]),
        "decode_ram_tok_s": statistics.median(speed["ram"]),
    }


def _run(mode: str, model: Path, n: int, cache_dir: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ktlong.bench.cache", mode, str(model), str(n), cache_dir],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {n}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(contexts: list[int], as_json: bool, plot_file: Path | None = None,
         command: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    from ktlong.bench import plot as plotting
    from ktlong.tinymodel import make_model

    if plot_file is not None:
        plotting.require()

    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-bench-") as tmp:
        model = make_model(
            Path(tmp) / "model", "llama", max_positions=max(contexts) * 2, **BENCH_SHAPE
        )
        for n in contexts:
            cache_dir = str(Path(tmp) / f"cache-{n}")
            cold = _run("fill", model, n, cache_dir)  # prefill + write the entry
            hit = _run("hit", model, n, cache_dir)
            assert hit["source"] == "cache", "the second run did not hit the cache"
            rows.append(
                {
                    "context": n,
                    "prefill_ttft_s": cold["ttft_s"],
                    "hit_ttft_s": hit["ttft_s"],
                    "speedup": cold["ttft_s"] / hit["ttft_s"],
                    "verify_s": hit["verify_s"],
                    "decode_mmap_tok_s": hit["decode_mmap_tok_s"],
                    "decode_ram_tok_s": hit["decode_ram_tok_s"],
                    "hit_peak_rss_bytes": hit["peak_rss_bytes"],
                }
            )
    data = {"bench": "cache", "command": command, "machine": plotting.machine(),
            "threads": "auto (idle cores)", "model": BENCH_SHAPE, "rows": rows}
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
        return
    t = Table(title=f"prompt cache, random Llama {BENCH_SHAPE}, BF16 KV")
    for col in (
        "context",
        "first token: prefill",
        "first token: cache hit",
        "speedup",
        "checksum s",
        "decode tok/s mmap",
        "decode tok/s RAM",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r['context']:,}",
            f"{r['prefill_ttft_s']:.2f} s",
            f"{r['hit_ttft_s']:.2f} s",
            f"{r['speedup']:.0f}x",
            f"{r['verify_s']:.3f}",
            f"{r['decode_mmap_tok_s']:.1f}",
            f"{r['decode_ram_tok_s']:.1f}",
        )
    Console().print(t)


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """Time to the first token per context: a fresh prefill's bar beside a cache hit's, each
    labelled with its seconds, the speedup under each pair. Returns the figure."""
    from ktlong.bench import plot as plotting

    rows = sorted(data["rows"], key=lambda r: r["context"])
    fig, axes = plotting.figure(size=(7.5, 4.8))
    ax = axes[0][0]
    xs = np.arange(len(rows))
    w = 0.38
    for dx, key, label, colour in ((-w / 2, "prefill_ttft_s", "fresh prefill", "tab:orange"),
                                   (w / 2, "hit_ttft_s", "prompt-cache hit", "tab:blue")):
        ys = [r[key] for r in rows]
        bars = ax.bar(xs + dx, ys, w, label=label, color=colour)
        ax.bar_label(bars, [f"{y:.0f} s" if y >= 10 else f"{y:.1f} s" if y >= 1 else
                            f"{y:.2g} s" for y in ys], fontsize=8, padding=2)
    plotting.log_y(ax)
    top = max(max(r["prefill_ttft_s"], r["hit_ttft_s"]) for r in rows)
    bottom = min(min(r["prefill_ttft_s"], r["hit_ttft_s"]) for r in rows)
    ax.set_ylim(bottom / 2, top * 4)  # room for the labels and the legend
    speedups = [r["prefill_ttft_s"] / r["hit_ttft_s"] for r in rows]
    ax.set_xticks(xs, [f"{plotting.tokens(r['context'])}\nhit "
                       f"{f'{x:.0f}' if x >= 10 else f'{x:.1f}'}x faster"
                       for r, x in zip(rows, speedups, strict=True)])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return plotting.finish(fig, path, "prompt cache: time to first token, hit vs fresh prefill",
                           data)


RSS_SHAPE = dict(layers=2, hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2048)


def _rss_worker(model: str, cache_dir: str, n: int) -> dict[str, Any]:
    """Decode 32 tokens from a cache entry of `n` tokens, three times from the same state: with
    the page cache cold (the blocks come from disk), then warm with the mapped pages bounded
    (to two steps' reads, as an entry larger than half the free memory is), then warm with them
    left mapped. Peak RSS of each."""
    import dataclasses

    from ktlong.config import Settings
    from ktlong.engine import Sampling
    from ktlong.model import load_model
    from ktlong.promptcache import HEADER_ROOM, open_cache, open_document
    from ktlong.warmup import warm_up, work_clock

    peak_rss(reset=True)
    lm = load_model(model, device="CPU", dtype="float32")
    st = dataclasses.replace(Settings(), kv_type="BF16", max_seq_len=n + 256, anchor_type="MEAN")
    (entry,) = open_cache(st, Path(cache_dir)).entries()
    ids = np.memmap(entry.path, np.int32, "r", HEADER_ROOM, (n,)).tolist()
    warm_up(lm, st)  # the session's kernels, compiled or loaded before the timing
    before = peak_rss()
    t0 = time.perf_counter()
    opened = open_document(lm, st, ids, cache_dir=Path(cache_dir))
    out: dict[str, Any] = {"source": opened.source, "entry_bytes": entry.size, "tokens": n,
                           "rss_before_bytes": before, "open_s": time.perf_counter() - t0}
    s, cap = opened.session, opened.session.store.step_cap  # bounded as an entry past RAM is
    for mode, c in (("cold", cap), ("bounded", cap), ("unbounded", 1 << 62)):
        s.truncate(n)  # the same state for both runs
        s.prefill([ids[-1]])
        s.store.release_mapped()
        s.store.map_cap = c
        peak_rss(reset=True)
        t = work_clock()
        steps = sum(1 for _ in s.generate(Sampling(max_new_tokens=32)))
        out[mode] = {"decode_s": work_clock() - t, "steps": steps,
                     "peak_rss_bytes": peak_rss()}
    out["attended_share"] = s.policy.attended_share()
    out["map_cap_bytes"] = cap
    return out


def rss_check(gb: float, as_json: bool) -> None:
    """Write a synthetic entry of about `gb` GB (random K, V: no prefill), then decode from it
    in a fresh process: peak RSS should stay far below the entry's size."""
    import dataclasses

    from ktlong.config import Settings
    from ktlong.engine import Session
    from ktlong.model import load_model
    from ktlong.promptcache import content_key, open_cache
    from ktlong.tinymodel import make_model

    with tempfile.TemporaryDirectory(prefix="ktlong-bench-") as tmp:
        per_tok = 2 * RSS_SHAPE["layers"] * RSS_SHAPE["kv_heads"] * RSS_SHAPE["head_dim"] * 2
        n = int(gb * 1e9 / per_tok) // 128 * 128
        model = make_model(Path(tmp) / "model", "llama", max_positions=2 * n, **RSS_SHAPE)
        lm = load_model(model, device="CPU", dtype="float32")
        st = dataclasses.replace(Settings(), kv_type="BF16", max_seq_len=n + 256,
                                 anchor_type="MEAN")
        s = Session(lm, st)
        rng = np.random.default_rng(0)
        for layer in range(RSS_SHAPE["layers"]):  # random bf16 bits, block by block
            for a in (s.store.k_tail[layer], s.store.v_tail[layer]):
                for b in range(0, a.shape[1], 1024):
                    x = rng.standard_normal(a[:, b:b + 1024].shape, dtype=np.float32)
                    a[:, b:b + 1024] = (x.view(np.uint32) >> 16).astype(np.uint16)
            s.store.lengths[layer] = n
        s.tokens = rng.integers(10, lm.spec.vocab_size, n).tolist()
        open_cache(st, Path(tmp) / "cache").store(s, content_key(lm.spec, st))
        del s
        out = subprocess.run([sys.executable, "-m", "ktlong.bench.cache", "rss", str(model),
                              str(n), str(Path(tmp) / "cache")], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1])
        r = json.loads(out.stdout.strip().splitlines()[-1])
    if as_json:
        print(json.dumps({"bench": "cache-rss", **r}))
        return
    print(f"entry {r['entry_bytes'] / 1e9:.2f} GB ({r['tokens']:,} tokens, {r['source']}), "
          f"{r['rss_before_bytes'] / 1e9:.2f} GB RSS before opening it; each step reads "
          f"{100 * r['attended_share']:.1f}% of the blocks")
    label = {"cold": "page cache cold, bounded", "bounded": "page cache warm, bounded",
             "unbounded": "page cache warm, unbounded"}
    for mode in ("cold", "bounded", "unbounded"):
        m = r[mode]
        cap = f" (map_cap {r['map_cap_bytes'] / 1e9:.2f} GB)" if mode != "unbounded" else ""
        print(f"  {label[mode]}{cap}: {m['steps']} tokens in {m['decode_s']:.1f} s "
              f"({m['steps'] / m['decode_s']:.1f} tok/s), peak RSS "
              f"{m['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":  # a worker: python -m ktlong.bench.cache MODE MODEL N CACHE_DIR
    if sys.argv[1] == "rss":
        print(json.dumps(_rss_worker(sys.argv[2], sys.argv[4], int(sys.argv[3]))))
    else:
        print(json.dumps(_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])))
