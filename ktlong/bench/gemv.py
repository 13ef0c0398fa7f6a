"""`ktlong bench gemv`: the decode GEMV over GGUF-quantised weights, against memory bandwidth.

One decode step reads every weight once, so a GEMV is as fast as it streams the weight's bytes.
For each weight type, a set of Llama-3.1-8B-width matrices (attention q/o 4096x4096, ffn up/gate
14336x4096, ffn down 4096x14336; random blocks in the type's layout) totalling more than the
last-level cache many times over is multiplied by one vector each, as one layer of a decode step
does; the rate is the matrices' bytes over the time. Beside each, in the same round, the machine's
streaming read bandwidth is measured on as many bytes (the probe `bench decode` uses), and the
ratio is taken within the round, so a slow minute hits both sides alike. Medians over rounds.
"""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

SHAPES = ((4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336))  # [rows, k] of one layer
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16")
TARGET_BYTES = 768 << 20  # weight bytes per type: many times the last-level cache


def _random_rows(qtype: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of shape [rows, k] in `qtype`'s bytes [rows, row_bytes]; f16 scales kept
    finite and small so every block decodes to ordinary numbers."""
    from ktlong import quant

    t = quant.TYPES[qtype]
    if qtype == "F16":
        return (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(
            np.float16).view(np.uint8)
    # quantising random floats is slow in NumPy at this size: quantise a few rows, tile them
    seed = quant.quantize(rng.standard_normal((64, k), dtype=np.float32) * 0.02, qtype)
    reps = -(-rows // 64)
    out = np.tile(seed, (reps, 1))[:rows]
    assert out.shape == (rows, t.row_bytes(k))
    return np.ascontiguousarray(out)


def _matrices(qtype: str, rng: np.random.Generator) -> list[np.ndarray]:
    from ktlong import quant

    t = quant.TYPES[qtype]
    per_layer = sum(t.tensor_bytes(r, k) for r, k in SHAPES)
    layers = max(1, -(-TARGET_BYTES // per_layer))
    return [_random_rows(qtype, r, k, rng) for _ in range(layers) for r, k in SHAPES]


def _gemv_fn(qtype: str, mats: list[np.ndarray]):
    """A function running one GEMV per matrix through QuantLinear, as a decode step runs them."""
    from ktlong.weights import QuantLinear

    ks = [k for _ in range(len(mats) // len(SHAPES)) for _, k in SHAPES]
    lins = [QuantLinear(m, qtype, k) for m, k in zip(mats, ks, strict=True)]
    xs = {k: np.random.default_rng(1).standard_normal(k).astype(np.float32) for k in set(ks)}

    def run() -> None:
        for lin in lins:
            lin._gemv(xs[lin.in_features])
    return run


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(types: list[str], repeats: int) -> list[dict]:
    """Per type: weight GB/s of the GEMVs, the streaming bandwidth beside it, and their ratio."""
    from ktlong.bench.decode import _stream

    rng = np.random.default_rng(0)
    rows = []
    for qtype in types:
        mats = _matrices(qtype, rng)
        nbytes = sum(m.nbytes for m in mats)
        probe = np.ones(nbytes // 8, np.uint64)  # as many bytes, streamed
        fn = _gemv_fn(qtype, mats)
        fn()  # compile and fault the pages in
        _stream(probe)
        g, s = [], []
        for _ in range(repeats):
            g.append(_timed(fn))
            s.append(_timed(lambda p=probe: _stream(p)))
        ratios = [(nbytes / a) / (nbytes / b) for a, b in zip(g, s, strict=True)]
        rows.append(dict(
            type=qtype, weight_bytes=nbytes, matrices=len(mats),
            gemv_ms=1e3 * statistics.median(g), weight_gbps=nbytes / statistics.median(g) / 1e9,
            stream_gbps=nbytes / statistics.median(s) / 1e9,
            vs_bandwidth=statistics.median(ratios),
        ))
        del mats, probe
    return rows


def main(types: list[str], repeats: int, threads: int, as_json: bool) -> None:
    from ktlong import kernels

    threads = kernels.configure_threads(threads)
    rows = measure(types, repeats)
    if as_json:
        print(json.dumps({"threads": threads, "vnni": bool(kernels.qlinear.VNNI),
                          "int8_path": _int8_path(kernels), "rows": rows}))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode GEMV over 8B-width matrices, {threads} threads, "
                        f"median of {repeats} rounds", box=box.SIMPLE_HEAD)
    for col in ("type", "weights GB", "ms", "weights GB/s", "stream GB/s", "of bandwidth"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["type"], f"{r['weight_bytes'] / 1e9:.2f}", f"{r['gemv_ms']:.1f}",
                      f"{r['weight_gbps']:.1f}", f"{r['stream_gbps']:.1f}",
                      f"{r['vs_bandwidth']:.0%}")
    Console().print(table)
    Console().print(f"int8 activations: {_int8_path(kernels) or 'no (float32)'}")


def _int8_path(kernels) -> str | None:
    """Which int8 GEMV path this CPU takes (Q5 types stay float32 on AVX2)."""
    return "AVX512-VNNI" if kernels.qlinear.VNNI else "AVX2" if kernels.qlinear.AVX2 else None
