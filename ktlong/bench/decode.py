"""`ktlong bench decode`: one layer's decode attention, block-sparse against exact dense.

InternLM2.5-7B shapes (32 query heads, 8 KV heads, head_dim 128, BF16 KV) and the default profile's
budget: block 128, init 128 tokens, local window 4096, 96 selected blocks chosen by scoring one Q8
anchor per block (SHARED; Q8 as the store keeps them; `--quest`: two, each block's min and max key,
scored by Quest's bound as the recall profile does). The sparse step is one `select_attend` call, as
the engine makes it: scoring, top-k and attention in one parallel region. Selection alone (scoring
and top-k, `select_blocks`) is timed too.
The same step with BF16 anchors (twice the anchor bytes) is timed beside it. Dense is timed by every
exact CPU path here (this kernel over all blocks, torch grouped matmul, torch SDPA) and the best is
reported. The KV (4.3 GB at 1M) is allocated once and its prefixes serve the shorter contexts. Each
round times every kernel path at every context once, each beside a sweep that measures the machine's
streaming read bandwidth, each after a cache flush (a real decode reads 32 layers of KV, so none of
it is cache-resident). Times are medians over the rounds; the two ratios the targets are about (time
at a context over time at the shortest one, KV read rate over streaming bandwidth) are taken within
each round, then their median, so a slow minute of the machine hits both sides of a ratio alike.
Torch paths, far slower, report their best run.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _rounds(fns: dict[tuple[int, str], Callable[[], object]], flush: Callable[[], object],
            repeats: int) -> dict[tuple[int, str], list[float]]:
    """Seconds of each fn in each of `repeats` rounds, each run after a flush. A round runs every
    fn once (every context, every path), so a slow minute of the machine hits them all alike."""
    for fn in fns.values():
        fn()  # warm-up: compile, allocate
    times: dict[tuple[int, str], list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            flush()
            times[key].append(_timed(fn))
    return times


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
    top = kernels.select_blocks(q, anchors, cand, SELECT, quest, True)
    return np.concatenate([np.arange(init_end, dtype=np.int32), top[0],
                           np.arange(local0, nb, dtype=np.int32)])[None]


class _Context:
    """One context length's KV prefixes, anchors and timed paths."""

    def __init__(self, n: int, k_all: np.ndarray, v_all: np.ndarray, anchors: np.ndarray,
                 q: np.ndarray) -> None:
        import torch

        from ktlong import kernels

        self.n, self.q, self.kernels = n, q, kernels
        nb = -(-n // BLOCK)
        shape = (HKV, nb, BLOCK, HEAD_DIM)
        self.k = k_all[:HKV * nb * BLOCK * HEAD_DIM].reshape(shape)  # [Hkv, nb, bs, d]
        self.v = v_all[:HKV * nb * BLOCK * HEAD_DIM].reshape(shape)
        quest = anchors.shape[2] == 2
        self.an = kernels.q8_encode(anchors[:, :nb], quest)  # [Hkv, nb, A, d + 4]
        self.an_bf16 = kernels.f32_to_kv(np.ascontiguousarray(anchors[:, :nb]), 1)  # [.., d]
        self.kt, self.vt = (torch.from_numpy(x.view(np.int16).reshape(HKV, -1, HEAD_DIM))
                            .view(torch.bfloat16)[:, :n] for x in (self.k, self.v))  # [Hkv, n, d]
        self.qt = torch.from_numpy(q).to(torch.bfloat16)
        self.empty = np.empty((HKV, 0, BLOCK, HEAD_DIM), np.uint16)
        # the views a KV store makes once per layer (KVStore.kernel_views)
        self.kv = kernels.layer_kv(self.empty, self.empty, self.k, self.v, 0, 1)
        self.an_view, self.an_bf16_view = (kernels.anchor_view(a) for a in (self.an, self.an_bf16))
        self.every = np.arange(nb, dtype=np.int32)[None]
        self.scale = HEAD_DIM ** -0.5

    def select(self) -> np.ndarray:
        return _select(self.kernels, self.q, self.an, self.n)

    def sparse(self) -> None:
        self._step(self.an_view)

    def sparse_bf16(self) -> None:
        self._step(self.an_bf16_view)

    def _step(self, anchors) -> None:
        """One decode step as the engine runs it: one `select_attend` call (scoring, top-k and
        the attention over init, chosen and local blocks), or every block when the budget covers
        them, on the layer's prepared views."""
        nb = self.every.shape[1]
        init_end, local0 = _candidates(self.n)
        if init_end == local0:
            self.kernels.attend_layer(self.kv, self.q, self.every, self.n, self.scale)
            return
        fixed = np.concatenate([np.arange(init_end, dtype=np.int32),
                                np.arange(local0, nb, dtype=np.int32)])
        self.kernels.select_attend_layer(
            self.kv, anchors, self.q, np.arange(init_end, local0, dtype=np.int32), SELECT,
            anchors.shape[2] == 2, True, fixed, self.n, self.scale)

    def dense(self) -> None:
        self.kernels.attend_layer(self.kv, self.q, self.every, self.n, self.scale)

    def dense_matmul(self) -> None:  # grouped: [Hkv, g, d] @ [Hkv, d, n]
        import torch

        s = torch.bmm(self.qt.view(HKV, HQ // HKV, HEAD_DIM), self.kt.transpose(1, 2)).float()
        torch.bmm(torch.softmax(s * self.scale, -1).to(torch.bfloat16), self.vt)

    def dense_sdpa(self) -> None:
        import torch

        torch.nn.functional.scaled_dot_product_attention(
            self.qt.view(1, HQ, 1, HEAD_DIM), self.kt[None], self.vt[None], enable_gqa=True)

    def row(self, times: dict[str, list[float]], stream_bytes: int, repeats: int) -> dict:
        """Figures at this context from its round times (seconds) and the torch paths' best."""
        n = self.n
        med = {name: float(np.median(t)) for name, t in times.items()}
        blocks = self.select()
        attended = int(np.minimum(BLOCK, n - blocks[0].astype(np.int64) * BLOCK).sum())
        first, last = _candidates(n)
        read = (2 * attended * HKV * HEAD_DIM * 2  # K, V
                + (last - first) * self.an[:, 0].nbytes)  # every candidate block's anchors
        paths = {"kernel": med["dense"] * 1e3,
                 "torch_matmul": _best_s(self.dense_matmul, repeats, TORCH_BUDGET_S) * 1e3,
                 "torch_sdpa": _best_s(self.dense_sdpa, repeats, TORCH_BUDGET_S) * 1e3}
        best = min(paths, key=paths.get)
        sparse_ms = med["sparse"] * 1e3
        # within each round: KV read rate over the streaming rate measured beside it
        kv_bw = np.median(read / np.array(times["sparse"]) /
                          (stream_bytes / np.array(times["stream"])))
        return {"context": n, "sparse_ms": sparse_ms, "dense_ms": paths[best],
                "speedup": paths[best] / sparse_ms,
                "speedup_vs_torch": min(paths["torch_matmul"], paths["torch_sdpa"]) / sparse_ms,
                "kv_read_gbps": read / sparse_ms / 1e6,
                "bandwidth_gbps": stream_bytes / med["stream"] / 1e9,
                "kv_vs_bandwidth": float(kv_bw),
                "select_ms": med["select"] * 1e3,
                "sparse_bf16_anchors_ms": med["sparse_bf16"] * 1e3,
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
    ctxs = [_Context(n, k_all, v_all, anchors, q) for n in contexts]
    fns: dict[tuple[int, str], Callable[[], object]] = {}
    for c in ctxs:
        fns.update({(c.n, "sparse"): c.sparse, (c.n, "select"): c.select,
                    (c.n, "sparse_bf16"): c.sparse_bf16,
                    (c.n, "dense"): c.dense, (c.n, "stream"): lambda: [_stream(a) for a in probe]})
    times = _rounds(fns, lambda: _stream(junk), repeats)
    stream_bytes = sum(a.nbytes for a in probe)
    rows = []
    for c in ctxs:
        own = {name: t for (n, name), t in times.items() if n == c.n}
        r = c.row(own, stream_bytes, repeats)
        # median over rounds of this context's sparse time / the shortest one's, same round
        r["vs_first"] = float(np.median(np.array(own["sparse"]) /
                                        np.array(times[contexts[0], "sparse"])))
        rows.append(r)
    return float(np.median([r["bandwidth_gbps"] for r in rows])), rows


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODEL = "one layer's attention at InternLM2.5-7B shapes (32 q / 8 KV heads, d 128, BF16 KV)"


def main(contexts: list[int], repeats: int, threads: int, as_json: bool,
         quest: bool = False, plot_file: Path | None = None, command: str = "") -> None:
    """Time one layer's sparse and dense decode attention at each context length and print;
    `plot_file`: also draw step time against context (PNG)."""
    from ktlong import kernels
    from ktlong.bench import plot as plotting

    if plot_file is not None:
        plotting.require()
    threads = kernels.configure_threads(threads)
    bandwidth, rows = _measure(sorted(contexts), repeats, quest)
    anchors = "quest" if quest else "one"
    data = {"bench": "decode", "command": command, "machine": plotting.machine(),
            "threads": threads, "model": MODEL, "repeats": repeats, "bandwidth_gbps": bandwidth,
            "anchors": anchors, "rows": rows}
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode attention, one layer (32 q heads, 8 KV heads, d 128, BF16 KV), "
                        f"{threads} threads, "
                        f"{'2 anchors (Quest)' if quest else '1 anchor'} per block, "
                        f"median of {repeats} rounds", box=box.SIMPLE_HEAD)
    for col in ("context", "sparse\nms", "select\nms", "BF16\nanch. ms", "dense\nms",
                "x\ntorch", "KV\nGB/s", "KV /\nbw", "vs\nfirst"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['context']:,}", f"{r['sparse_ms']:.2f}", f"{r['select_ms']:.2f}",
                      f"{r['sparse_bf16_anchors_ms']:.2f}", f"{r['dense_ms']:.1f}",
                      f"{r['speedup_vs_torch']:.1f}x", f"{r['kv_read_gbps']:.1f}",
                      f"{r['kv_vs_bandwidth']:.0%}", f"{r['vs_first']:.2f}")
    first, last = rows[0], rows[-1]
    console = Console()
    console.print(table)
    console.print("select: scoring and top-k alone (in sparse they overlap the attention); "
                  "BF16 anch.: the same step with BF16 anchors; dense: the fastest exact path "
                  "(our kernel over every block, torch grouped matmul, torch SDPA); x torch: "
                  "torch's best / sparse; KV / bw and vs first: medians of the ratios within "
                  "each round (--json has every figure)")
    console.print(f"streaming read bandwidth (median): {bandwidth:.1f} GB/s\n"
                  f"time at {last['context']:,} / time at {first['context']:,} "
                  f"(median over rounds of the ratio within a round): {last['vs_first']:.2f}x")


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """Step time against context, sparse and dense (left); the tokens a second that attention
    alone would allow a 32-layer model (right). Returns the figure."""
    from ktlong.bench import plot as plotting

    rows = sorted(data["rows"], key=lambda r: r["context"])
    xs = [r["context"] for r in rows]
    fig, axes = plotting.figure(2, size=(11, 4.8))
    ms, tps = axes[0]
    anchors = "2 anchors (Quest)" if data.get("anchors") == "quest" else "1 anchor"
    lines = (("sparse", "sparse_ms", "o-", f"sparse step ({anchors} per block)"),
             ("dense", "dense_ms", "s--", "dense (fastest exact path)"))
    for _, key, style, label in lines:
        ys = [r[key] for r in rows]
        ms.plot(xs, ys, style, label=label)
        tps.plot(xs, [1e3 / (32 * y) for y in ys], style, label=label)
    for ax in (ms, tps):
        plotting.context_axis(ax, xs)
        plotting.log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ms.set_ylabel("ms per decode step, one layer")
    ms.set_title("step time", fontsize=9)
    tps.set_ylabel("tok/s (attention alone, 32 layers)")
    tps.set_title("tokens per second if attention were all", fontsize=9)
    return plotting.finish(fig, path, "decode attention: sparse vs dense against context", data)
