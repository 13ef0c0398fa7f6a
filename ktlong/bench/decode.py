"""`ktlong bench decode`: one layer's decode attention, block-sparse against exact dense.

InternLM2.5-7B shapes (32 query heads, 8 KV heads, head_dim 128) and the default profile's
budget: block 128, init 128 tokens, local window 4096, 96 selected blocks chosen by scoring one Q8
anchor per block (SHARED; Q8 as the store keeps them; `--quest`: two, each block's min and max key,
scored by Quest's bound as the recall profile does). The sparse step is one `select_attend` call, as
the engine makes it: scoring, top-k and attention in one parallel region. Selection alone (scoring
and top-k, `select_blocks`) is timed too.
The KV is random, in each `--kv-type` format (BF16 by default; FP16; Q8_0 and Q4_0,
llama.cpp-style blocks of 32 codes with a float16 scale: random codes and one fixed scale,
`random_rows`), and every kv_type's paths are timed in the same rounds; each kv_type gives one row
per context, its KV bytes read counted in its own rows' bytes (BF16 256, Q8_0 136, Q4_0 72 a row
at d 128), and `vs_first_type` is the first kv_type's sparse step time over this one's at the same
context. The same step with BF16 anchors (twice the anchor bytes) is timed beside it. Dense is
timed by every exact CPU path here (this kernel over all blocks and, for BF16 KV only, torch
grouped matmul and torch SDPA) and the best is reported; the other kv_types report the kernel.
Each kv_type's KV (BF16 and FP16: 4.3 GB at 1M, Q8_0 2.3 GB, Q4_0 1.2 GB) is allocated once and
its prefixes serve the shorter contexts. Each round times every kernel path of every kv_type at
every context once, each context beside a sweep that measures the machine's streaming read
bandwidth, each run after a cache flush (a real decode reads 32 layers of KV, so none of it is
cache-resident). Times are medians over the rounds; the ratios the targets are about (time at a
context over time at the shortest one, KV read rate over streaming bandwidth, one kv_type's time
over another's) are taken within each round, then their median, so a slow minute of the machine
hits both sides of a ratio alike. Torch paths, far slower, report their best run.
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
KV_KINDS = {"BF16": 1, "FP16": 2, "Q8_0": 3, "Q4_0": 4}  # --kv-type -> the kernels' kv_kind
SCALES = {3: 1 / 64, 4: 1 / 4}  # synthetic block scale of Q8_0, Q4_0 rows: values within +-2


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


def _rounds(fns: dict[tuple, Callable[[], object]], flush: Callable[[], object],
            repeats: int) -> dict[tuple, list[float]]:
    """Seconds of each fn in each of `repeats` rounds, each run after a flush. A round runs every
    fn once (every context, every path), so a slow minute of the machine hits them all alike."""
    for fn in fns.values():
        fn()  # warm-up: compile, allocate
    times: dict[tuple, list[float]] = {key: [] for key in fns}
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
    """One kv_type's KV prefixes at one context length, its anchors and timed paths."""

    def __init__(self, n: int, kv_type: str, k_all: np.ndarray, v_all: np.ndarray,
                 anchors: np.ndarray, q: np.ndarray) -> None:
        from ktlong import kernels

        self.n, self.kv_type, self.q, self.kernels = n, kv_type, q, kernels
        self.kind = KV_KINDS[kv_type]
        nb = -(-n // BLOCK)
        row = _row(self.kind)  # elements of one stored row: d, or its bytes (quantised)
        shape = (HKV, nb, BLOCK, row)
        self.k = k_all[:HKV * nb * BLOCK * row].reshape(shape)  # [Hkv, nb, bs, row]
        self.v = v_all[:HKV * nb * BLOCK * row].reshape(shape)
        self.row_bytes = _row_bytes(self.kind)
        quest = anchors.shape[2] == 2
        self.an = kernels.q8_encode(anchors[:, :nb], quest)  # [Hkv, nb, A, d + 4]
        self.an_bf16 = kernels.f32_to_kv(np.ascontiguousarray(anchors[:, :nb]), 1)  # [.., d]
        if kv_type == "BF16":  # the torch paths: BF16 only
            import torch

            self.kt, self.vt = (torch.from_numpy(x.view(np.int16).reshape(HKV, -1, HEAD_DIM))
                                .view(torch.bfloat16)[:, :n] for x in (self.k, self.v))
            self.qt = torch.from_numpy(q).to(torch.bfloat16)  # kt, vt [Hkv, n, d]
        self.empty = np.empty((HKV, 0, BLOCK, row), k_all.dtype)
        # the views a KV store makes once per layer (KVStore.kernel_views)
        self.kv = kernels.layer_kv(self.empty, self.empty, self.k, self.v, 0, self.kind)
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
        """Figures at this context from its round times (seconds) and, for BF16 KV, the torch
        paths' best."""
        n = self.n
        med = {name: float(np.median(t)) for name, t in times.items()}
        blocks = self.select()
        attended = int(np.minimum(BLOCK, n - blocks[0].astype(np.int64) * BLOCK).sum())
        first, last = _candidates(n)
        read = (2 * attended * HKV * self.row_bytes  # K, V in this format's rows
                + (last - first) * self.an[:, 0].nbytes)  # every candidate block's anchors
        paths = {"kernel": med["dense"] * 1e3}
        if self.kv_type == "BF16":
            paths["torch_matmul"] = _best_s(self.dense_matmul, repeats, TORCH_BUDGET_S) * 1e3
            paths["torch_sdpa"] = _best_s(self.dense_sdpa, repeats, TORCH_BUDGET_S) * 1e3
        best = min(paths, key=paths.get)
        sparse_ms = med["sparse"] * 1e3
        torch_ms = min((ms for p, ms in paths.items() if p.startswith("torch")), default=None)
        # within each round: KV read rate over the streaming rate measured beside it
        kv_bw = np.median(read / np.array(times["sparse"]) /
                          (stream_bytes / np.array(times["stream"])))
        return {"kv_type": self.kv_type, "context": n, "sparse_ms": sparse_ms,
                "dense_ms": paths[best], "speedup": paths[best] / sparse_ms,
                "speedup_vs_torch": None if torch_ms is None else torch_ms / sparse_ms,
                "kv_read_gbps": read / sparse_ms / 1e6,
                "bandwidth_gbps": stream_bytes / med["stream"] / 1e9,
                "kv_vs_bandwidth": float(kv_bw),
                "select_ms": med["select"] * 1e3,
                "sparse_bf16_anchors_ms": med["sparse_bf16"] * 1e3,
                "attended_tokens": attended, "kv_row_bytes": self.row_bytes,
                "kv_read_bytes": read, "dense_path": best, "dense_paths_ms": paths}


def _row_bytes(kind: int) -> int:
    from ktlong.kernels import kvquant

    return kvquant.row_bytes(kind, HEAD_DIM)


def _row(kind: int) -> int:
    """Elements of one stored row: d (16-bit formats, uint16) or its bytes (quantised, uint8)."""
    return HEAD_DIM if kind in (1, 2) else _row_bytes(kind)


def random_rows(raw: np.ndarray, kind: int, d: int, seed: int) -> np.ndarray:
    """Fill rows raw [..., row_bytes] (C-contiguous uint8, the bytes of rows in kv_kind `kind`
    of d channels) with random values in place; returns raw. BF16 (or FP16): random 16-bit values
    (`_fill`); Q8_0 / Q4_0: random code bytes (`_fill` too) and every block's float16 scale set to
    SCALES[kind], so each value is within +-2."""
    from ktlong.kernels import kvquant

    _fill(raw.reshape(-1).view(np.uint32), seed)  # random bf16 pairs / random codes
    if kind in SCALES:
        nc = kvquant.code_bytes(kind, d)
        scale = np.frombuffer(np.float16(SCALES[kind]).tobytes(), np.uint8)
        raw[..., nc : nc + 2 * (d // kvquant.QBLOCK)] = np.tile(scale, d // kvquant.QBLOCK)
    return raw


def _kv(kv_type: str, nb_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Random K and V of nb_max blocks in kv_type's storage, flat (uint16 or uint8)."""
    kind = KV_KINDS[kv_type]
    shape = (HKV, nb_max, BLOCK, _row_bytes(kind))
    k, v = (random_rows(np.empty(shape, np.uint8), kind, HEAD_DIM, seed) for seed in (1, 2))
    dtype = np.uint16 if kind in (1, 2) else np.uint8
    return k.reshape(-1).view(dtype), v.reshape(-1).view(dtype)


def _measure(contexts: list[int], repeats: int, quest: bool,
             kv_types: list[str]) -> tuple[float, list[dict]]:
    rng = np.random.default_rng(0)
    nb_max = -(-max(contexts) // BLOCK)
    kv = {t: _kv(t, nb_max) for t in kv_types}  # each type's K, V at the longest context
    anchors = rng.standard_normal((HKV, nb_max, 2 if quest else 1, HEAD_DIM)).astype(np.float32)
    anchors.sort(axis=2)  # Quest's pair is (min, max)
    q = rng.standard_normal((HQ, HEAD_DIM)).astype(np.float32)
    k_first, v_first = kv[kv_types[0]]
    if k_first.nbytes + v_first.nbytes >= BANDWIDTH_BYTES:
        probe = [k_first.view(np.uint64), v_first.view(np.uint64)]
    else:
        probe = [np.ones(BANDWIDTH_BYTES // 8, np.uint64)]
    junk = np.ones(FLUSH_BYTES // 8, np.uint64)
    ctxs = {(t, n): _Context(n, t, *kv[t], anchors, q) for n in contexts for t in kv_types}
    fns: dict[tuple[str, int, str], Callable[[], object]] = {}
    for n in contexts:  # a round: every context's every kv_type, then its selection and stream
        for t in kv_types:
            c = ctxs[t, n]
            fns.update({(t, n, "sparse"): c.sparse, (t, n, "sparse_bf16"): c.sparse_bf16,
                        (t, n, "dense"): c.dense})
        fns[("", n, "select")] = ctxs[kv_types[0], n].select  # the same for every kv_type
        fns[("", n, "stream")] = lambda: [_stream(a) for a in probe]
    times = _rounds(fns, lambda: _stream(junk), repeats)
    stream_bytes = sum(a.nbytes for a in probe)
    rows = []
    for n in contexts:
        for t in kv_types:
            own = {name: ts for (tt, nn, name), ts in times.items() if nn == n and tt in (t, "")}
            r = ctxs[t, n].row(own, stream_bytes, repeats)
            sparse = np.array(own["sparse"])
            # medians over rounds of ratios within a round: this type's sparse time over its own
            # at the shortest context, and the first type's at this context over this type's
            r["vs_first"] = float(np.median(sparse / np.array(times[t, contexts[0], "sparse"])))
            r["vs_first_type"] = float(np.median(np.array(times[kv_types[0], n, "sparse"])
                                                 / sparse))
            rows.append(r)
    return float(np.median([r["bandwidth_gbps"] for r in rows])), rows


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODEL = "one layer's attention at InternLM2.5-7B shapes (32 q / 8 KV heads, d 128)"


def main(contexts: list[int], repeats: int, threads: int, as_json: bool,
         quest: bool = False, plot_file: Path | None = None, command: str = "",
         kv_types: list[str] | None = None) -> None:
    """Time one layer's sparse and dense decode attention at each context length, for each
    kv_type (default BF16), and print; `plot_file`: also draw step time against context (PNG)."""
    from ktlong import kernels
    from ktlong.bench import plot as plotting

    kv_types = list(kv_types or ["BF16"])
    bad = [t for t in kv_types if t not in KV_KINDS]
    if bad or len(set(kv_types)) != len(kv_types):
        raise ValueError(f"kv_types {kv_types}: each once, from {', '.join(KV_KINDS)}")
    if plot_file is not None:
        plotting.require()
    threads = kernels.configure_threads(threads)
    bandwidth, rows = _measure(sorted(contexts), repeats, quest, kv_types)
    anchors = "quest" if quest else "one"
    data = {"bench": "decode", "command": command, "machine": plotting.machine(),
            "threads": threads, "model": MODEL, "repeats": repeats, "bandwidth_gbps": bandwidth,
            "anchors": anchors, "kv_types": kv_types, "rows": rows}
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
        return
    print_table(data)


def print_table(data: dict[str, Any]) -> None:
    """The terminal table of `main`'s result: a row per context and kv_type."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    rows, bandwidth = data["rows"], data["bandwidth_gbps"]
    kv_types = data.get("kv_types") or ["BF16"]
    quest = data.get("anchors") == "quest"
    table = Table(title=f"decode attention, one layer (32 q heads, 8 KV heads, d 128), "
                        f"{data['threads']} threads, "
                        f"{'2 anchors (Quest)' if quest else '1 anchor'} per block, "
                        f"median of {data['repeats']} rounds", box=box.SIMPLE_HEAD,
                  padding=0, pad_edge=False)  # the box draws a space between columns
    for col in ("context", "KV", "sparse\nms", "select\nms", "BF16\nanch. ms", "dense\nms",
                "x\ntorch", "KV\nGB/s", "KV /\nbw", "vs\nfirst", f"vs\n{kv_types[0]}"):
        table.add_column(col, justify="right")
    for r in rows:
        torch_x = r["speedup_vs_torch"]
        table.add_row(f"{r['context']:,}", r.get("kv_type", "BF16"), f"{r['sparse_ms']:.2f}",
                      f"{r['select_ms']:.2f}", f"{r['sparse_bf16_anchors_ms']:.2f}",
                      f"{r['dense_ms']:.1f}", "" if torch_x is None else f"{torch_x:.1f}x",
                      f"{r['kv_read_gbps']:.1f}", f"{r['kv_vs_bandwidth']:.0%}",
                      f"{r['vs_first']:.2f}", f"{r.get('vs_first_type', 1.0):.2f}x")
    console = Console()
    console.print(table)
    console.print("KV: the stored K/V format; select: scoring and top-k alone (in sparse they "
                  "overlap the attention); BF16 anch.: the same step with BF16 anchors; dense: "
                  "the fastest exact path (our kernel over every block; with BF16 KV also torch "
                  "grouped matmul and torch SDPA); x torch: torch's best / sparse; vs first: time "
                  "over this KV's at the shortest context; vs "
                  f"{kv_types[0]}: {kv_types[0]}'s sparse time over this KV's; KV / bw and the "
                  "vs columns: medians of the ratios within each round (--json has every figure)")
    first, last = rows[0]["context"], rows[-1]["context"]
    ratios = ", ".join(f"{t} {r['vs_first']:.2f}x" for t in kv_types for r in rows
                       if r.get("kv_type", "BF16") == t and r["context"] == last)
    console.print(f"streaming read bandwidth (median): {bandwidth:.1f} GB/s\n"
                  f"time at {last:,} / time at {first:,} "
                  f"(median over rounds of the ratio within a round): {ratios}")


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """Step time against context: the sparse step of each kv_type and the first kv_type's dense
    (left); the tokens a second that attention alone would allow a 32-layer model (right).
    Returns the figure."""
    from ktlong.bench import plot as plotting

    rows = sorted(data["rows"], key=lambda r: r["context"])
    kv_types = data.get("kv_types") or ["BF16"]  # a result from before --kv-type: BF16
    xs = sorted({r["context"] for r in rows})
    fig, axes = plotting.figure(2, size=(11, 4.8))
    ms, tps = axes[0]
    anchors = "2 anchors (Quest)" if data.get("anchors") == "quest" else "1 anchor"
    several = len(kv_types) > 1
    lines = [(t, "sparse_ms", "o-", f"sparse step, {t} KV ({anchors} per block)" if several
              else f"sparse step ({anchors} per block)") for t in kv_types]
    lines.append((kv_types[0], "dense_ms", "s--", f"dense (fastest exact path, {kv_types[0]} KV)"
                  if several else "dense (fastest exact path)"))
    for kv, key, style, label in lines:
        pts = [(r["context"], r[key]) for r in rows if r.get("kv_type", "BF16") == kv]
        if not pts:
            continue
        x, ys = zip(*pts, strict=True)
        ms.plot(x, ys, style, label=label)
        tps.plot(x, [1e3 / (32 * y) for y in ys], style, label=label)
    for ax in (ms, tps):
        plotting.context_axis(ax, xs)
        plotting.log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ms.set_ylabel("ms per decode step, one layer")
    ms.set_title("step time", fontsize=9)
    tps.set_ylabel("tok/s (attention alone, 32 layers)")
    tps.set_title("tokens per second if attention were all", fontsize=9)
    return plotting.finish(fig, path, "decode attention: sparse vs dense against context "
                           f"({', '.join(kv_types)} KV)", data)
