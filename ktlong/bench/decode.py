"""`ktlong bench decode`: one layer's decode attention, block-sparse against exact dense.

InternLM2.5-7B shapes (32 query heads, 8 KV heads, head_dim 128, BF16 KV) and the default profile's
budget: block 128, init 128 tokens, local window 4096, 96 selected blocks chosen by scoring one
BF16 anchor per block (SHARED; BF16 as the store keeps them; `--quest`: two, each block's min and
max key, scored by Quest's bound as the recall profile does); scoring and top-k are inside the
sparse time. Dense is timed by every exact CPU path here (this kernel over all blocks, torch
grouped matmul, torch SDPA) and the best is reported. The KV (4.3 GB at 1M) is allocated once and
its prefixes serve the shorter contexts. Each round times every kernel path once, interleaved with
a sweep that measures the machine's streaming read bandwidth, each after a cache flush (a real
decode reads 32 layers of KV, so none of it is cache-resident); medians over the rounds are
reported, so a burst of background load hits the sparse, dense and bandwidth figures alike. Torch
paths, far slower, report their best run.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np
from numba import njit, prange

HQ, HKV, HEAD_DIM = 32, 8, 128
BLOCK, INIT, LOCAL, SELECT = 128, 128, 4096, 96
BANDWIDTH_BYTES = 1 << 30  # at least this much is streamed to measure bandwidth
FLUSH_BYTES = 512 << 20  # streamed before each timed run (> last-level cache)
TORCH_BUDGET_S = 3.0  # stop repeating a slow torch path after this long


@njit(parallel=True, nogil=True, cache=True)
def _fill(words, seed):
    """Random bf16 values, two per uint32 word [n]: random sign, exponent and mantissa with
    magnitudes in [2**-7, 2) (no subnormals, which would slow every FMA)."""
    n = words.shape[0]
    for c in prange(64):
        lo = c * n // 64
        part = words[lo:(c + 1) * n // 64]
        for i in range(part.shape[0]):
            x = np.uint64(lo + i) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
            x ^= x >> np.uint64(31)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(29)
            h = np.uint32(x & np.uint64(0x80FF80FF)) | np.uint32(0x3C003C00)
            h |= np.uint32((x >> np.uint64(40)) & np.uint64(0x00030003)) << np.uint32(8)
            part[i] = h


@njit(parallel=True, nogil=True, cache=True)
def _stream(words):
    """Sum of uint64 words [n]: a streaming read of the whole array."""
    n = words.shape[0]
    parts = np.zeros(64, np.uint64)
    for c in prange(64):
        part = words[c * n // 64:(c + 1) * n // 64]  # loop from 0 so it vectorises
        acc = np.uint64(0)
        for i in range(part.shape[0]):
            acc += part[i]
        parts[c] = acc
    return parts.sum()


def _rounds(fns: dict[str, Callable[[], object]], flush: Callable[[], object],
            repeats: int) -> dict[str, float]:
    """Median seconds of each fn over `repeats` interleaved rounds, each run after a flush."""
    for fn in fns.values():
        fn()  # warm-up: compile, allocate
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            flush()
            times[name].append(_timed(fn))
    return {name: float(np.median(t)) for name, t in times.items()}


def _best_s(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Fastest of up to `repeats` runs of a slow path, stopping once budget_s is spent."""
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        dt = _timed(fn)
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best


def _candidates(n: int) -> tuple[int, int]:
    """Blocks [first, last) that compete for the SELECT slots at context n (between the init
    blocks and the local window); empty when the budget covers every block."""
    if n <= INIT + LOCAL + SELECT * BLOCK:
        return 0, 0
    return -(-INIT // BLOCK), (n - LOCAL) // BLOCK


def _select(kernels, q, anchors, n: int) -> np.ndarray:
    """The profile's blocks for one decode step at context n: [1, k] int32. anchors
    [Hkv, nb, A, d]: A = 1 (default) or 2, min and max (Quest's bound, the recall profile)."""
    nb = -(-n // BLOCK)
    init_end, local0 = _candidates(n)
    if init_end == local0:
        return np.arange(nb, dtype=np.int32)[None]
    cand = np.arange(init_end, local0, dtype=np.int32)
    quest = anchors.shape[2] == 2
    top = kernels.topk_blocks(kernels.score_blocks(q, anchors, cand, quest, True), cand, SELECT)
    return np.concatenate([np.arange(init_end, dtype=np.int32), top[0],
                           np.arange(local0, nb, dtype=np.int32)])[None]


def _row(n: int, k_all: np.ndarray, v_all: np.ndarray, anchors: np.ndarray, q: np.ndarray,
         repeats: int, probe: list[np.ndarray], flush: Callable[[], object]) -> dict:
    """Sparse, dense and bandwidth figures at context n over prefixes of the preallocated KV."""
    import torch

    from ktlong import kernels

    nb = -(-n // BLOCK)
    k = k_all[:HKV * nb * BLOCK * HEAD_DIM].reshape(HKV, nb, BLOCK, HEAD_DIM)  # [Hkv, nb, bs, d]
    v = v_all[:HKV * nb * BLOCK * HEAD_DIM].reshape(HKV, nb, BLOCK, HEAD_DIM)
    an = kernels.f32_to_kv(np.ascontiguousarray(anchors[:, :nb]), 1)  # [Hkv, nb, A, d] BF16 bits
    kt, vt = (torch.from_numpy(x.view(np.int16).reshape(HKV, -1, HEAD_DIM)).view(torch.bfloat16)
              [:, :n] for x in (k, v))  # [Hkv, n, d]
    qt = torch.from_numpy(q).to(torch.bfloat16)
    empty = np.empty((HKV, 0, BLOCK, HEAD_DIM), np.uint16)
    every = np.arange(nb, dtype=np.int32)[None]
    scale = HEAD_DIM ** -0.5

    def sparse() -> None:
        blocks = _select(kernels, q, an, n)
        kernels.attend_blocks(q, empty, empty, k, v, 0, blocks, n, scale, 1)

    def dense_matmul() -> None:  # grouped: [Hkv, g, d] @ [Hkv, d, n]
        s = torch.bmm(qt.view(HKV, HQ // HKV, HEAD_DIM), kt.transpose(1, 2)).float() * scale
        torch.bmm(torch.softmax(s, -1).to(torch.bfloat16), vt)

    def dense_sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(
            qt.view(1, HQ, 1, HEAD_DIM), kt[None], vt[None], enable_gqa=True)

    med = _rounds({
        "sparse": sparse,
        "select": lambda: _select(kernels, q, an, n),
        "dense": lambda: kernels.attend_blocks(q, empty, empty, k, v, 0, every, n, scale, 1),
        "stream": lambda: [_stream(a) for a in probe],
    }, flush, repeats)
    blocks = _select(kernels, q, an, n)
    attended = int(np.minimum(BLOCK, n - blocks[0].astype(np.int64) * BLOCK).sum())
    first, last = _candidates(n)
    row = HKV * HEAD_DIM * 2  # bytes of one token's K (or V), or of one block's BF16 anchor
    read = 2 * attended * row + (last - first) * an.shape[2] * row  # attended K, V; anchors
    paths = {"kernel": med["dense"] * 1e3,
             "torch_matmul": _best_s(dense_matmul, repeats, TORCH_BUDGET_S) * 1e3,
             "torch_sdpa": _best_s(dense_sdpa, repeats, TORCH_BUDGET_S) * 1e3}
    best = min(paths, key=paths.get)
    sparse_ms = med["sparse"] * 1e3
    return {"context": n, "sparse_ms": sparse_ms, "dense_ms": paths[best],
            "speedup": paths[best] / sparse_ms,
            "speedup_vs_torch": min(paths["torch_matmul"], paths["torch_sdpa"]) / sparse_ms,
            "kv_read_gbps": read / sparse_ms / 1e6,
            "bandwidth_gbps": sum(a.nbytes for a in probe) / med["stream"] / 1e9,
            "select_ms": med["select"] * 1e3,
            "attended_tokens": attended, "kv_read_bytes": read, "dense_path": best,
            "dense_paths_ms": paths}


def _measure(contexts: list[int], repeats: int, quest: bool) -> tuple[float, list[dict]]:
    rng = np.random.default_rng(0)
    nb_max = -(-max(contexts) // BLOCK)
    size = HKV * nb_max * BLOCK * HEAD_DIM  # uint16 elements of K (or V) at the longest context
    k_all, v_all = np.empty(size, np.uint16), np.empty(size, np.uint16)
    _fill(k_all.view(np.uint32), 1)
    _fill(v_all.view(np.uint32), 2)
    anchors = rng.standard_normal((HKV, nb_max, 2 if quest else 1, HEAD_DIM)).astype(np.float32)
    anchors.sort(axis=2)  # Quest's pair is (min, max)
    q = rng.standard_normal((HQ, HEAD_DIM)).astype(np.float32)
    if k_all.nbytes + v_all.nbytes >= BANDWIDTH_BYTES:
        probe = [k_all.view(np.uint64), v_all.view(np.uint64)]
    else:
        probe = [np.ones(BANDWIDTH_BYTES // 8, np.uint64)]
    junk = np.ones(FLUSH_BYTES // 8, np.uint64)
    rows = [_row(n, k_all, v_all, anchors, q, repeats, probe, lambda: _stream(junk))
            for n in contexts]
    return float(np.median([r["bandwidth_gbps"] for r in rows])), rows


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(contexts: list[int], repeats: int, threads: int, as_json: bool,
         quest: bool = False) -> None:
    """Time one layer's sparse and dense decode attention at each context length and print."""
    from ktlong import kernels

    threads = kernels.configure_threads(threads)
    bandwidth, rows = _measure(sorted(contexts), repeats, quest)
    anchors = "quest" if quest else "one"
    if as_json:
        print(json.dumps({"bandwidth_gbps": bandwidth, "threads": threads, "anchors": anchors,
                          "rows": rows}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode attention, one layer (32 q heads, 8 KV heads, d 128, BF16 KV), "
                        f"{threads} threads, {anchors} anchor(s) per block, "
                        f"median of {repeats} rounds")
    for col in ("context", "attended", "sparse ms", "of which select", "dense ms", "dense path",
                "speedup", "vs torch", "KV read GB/s", "bandwidth GB/s", "KV / bandwidth"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['context']:,}", f"{r['attended_tokens']:,}", f"{r['sparse_ms']:.2f}",
                      f"{r['select_ms']:.2f}", f"{r['dense_ms']:.1f}", r["dense_path"],
                      f"{r['speedup']:.1f}x", f"{r['speedup_vs_torch']:.1f}x",
                      f"{r['kv_read_gbps']:.1f}", f"{r['bandwidth_gbps']:.1f}",
                      f"{r['kv_read_gbps'] / r['bandwidth_gbps']:.0%}")
    first, last = rows[0], rows[-1]
    console = Console()
    console.print(table)
    console.print(f"streaming read bandwidth (median): {bandwidth:.1f} GB/s\n"
                  f"time at {last['context']:,} / time at {first['context']:,}: "
                  f"{last['sparse_ms'] / first['sparse_ms']:.2f}x")
