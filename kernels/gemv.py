"""Matrix-vector product over 16-bit weights: the linear layers of a one-token forward.

Decode reads every weight once per token, so its linear layers are bound by memory traffic; keeping
the weights in 16 bits halves it (and lets a small model's weights stay in the last-level cache).
BF16 and FP16 are widened to float32 in registers (the same loads as the KV kernels, `vload2`), so
no float32 copy of a weight ever exists. Each work item takes RB output rows, one at a time: a
row is one stream that the prefetchers follow, with a software prefetch AHEAD bytes on (four
rows at once, sharing x's loads, were four streams and read 0.86-0.88x as fast from memory).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit, prange

from ._simd import F32, FASTMATH, kv_to_f64, readonly, readonly_bytes
from ._vec import W, hsum4, packed_channels, prefetch, row_addr, vfma, vload, vload2, vzero

RB = 16  # output rows per work item
AHEAD = 8192  # bytes: how far on in its row a channel group prefetches (BF16 8B-width matrices
# from memory: 1.16x the four-row tiles on two threads, 1.13x on one; 4 KB within 1%)


@njit(fastmath=FASTMATH, cache=True)
def _rows(w, xp, out, r0, r1):
    """out[0, r] = w[r] . x for r in r0..r1."""
    k = w.shape[3]
    ng = xp.shape[1] // (2 * W)
    gb = 2 * W * w.itemsize  # bytes of a channel group
    for r in range(r0, r1):
        a = row_addr(w, r, 0, 0)
        acc = vzero()
        for gi in range(ng):
            for line in range((gi * gb + 63) // 64, (gi * gb + gb + 63) // 64):
                prefetch(a + AHEAD + 64 * line)
            c = gi * 2 * W
            xe, xo = vload(xp, 0, c), vload(xp, 0, c + W)
            e, o = vload2(w, a, k, gi)
            acc = vfma(xe, e, vfma(xo, o, acc))
        y, _, _, _ = hsum4(acc, acc, acc, acc)
        out[0, r] = y


@njit(nogil=True, cache=True)
def _pack(x, perm):
    """x [K] -> [1, P] in packed channel order (perm[p] = channel, -1 = zero padding)."""
    xp = np.zeros((1, perm.shape[0]), F32)
    for p in range(perm.shape[0]):
        if perm[p] >= 0:
            xp[0, p] = x[perm[p]]
    return xp


@njit(parallel=True, nogil=True, cache=True)
def _gemv(wb, kind, x, perm):
    # wb [N, 1, 1, K*size] uint8 (weights); x [K] f32; perm [P] -> out [N] f32
    n = wb.shape[0]
    xp = _pack(x, perm)  # [1, P]
    out = np.empty((1, n), F32)
    for it in prange((n + RB - 1) // RB):
        r0, r1 = it * RB, min(n, it * RB + RB)
        if kind == 1:
            _rows(wb.view(np.uint16), xp, out, r0, r1)
        elif kind == 2:
            _rows(wb.view(np.int16), xp, out, r0, r1)
        else:
            _rows(wb.view(F32), xp, out, r0, r1)
    return out[0]


@lru_cache(maxsize=32)
def _perm(k: int, kind: int) -> np.ndarray:
    """Packed position -> input channel (-1 = zero padding) for K inputs (see _vec.py)."""
    return readonly(packed_channels(k, kind))


def gemv(w: np.ndarray, x: np.ndarray, kind: int) -> np.ndarray:
    """y = w @ x for one input vector.

    w [N, K] C-contiguous: float32 for kind 0 (FP32), 2-byte bits for kind 1 (BF16, K even) and
    2 (FP16); x [K] float32. Returns y [N] float32, accumulated in float32.
    """
    size = 4 if kind == 0 else 2
    if w.ndim != 2 or not w.flags.c_contiguous or w.dtype.itemsize != size:
        raise ValueError(f"w must be a C-contiguous [N, K] array of {size}-byte elements for "
                         f"kind {kind}, got {w.dtype} {w.shape}")
    n, k = w.shape
    if kind == 1 and k % 2:
        raise ValueError("BF16 weights need an even number of inputs")
    if x.shape != (k,):
        raise ValueError(f"x must be [{k}], got {x.shape}")
    return _gemv(readonly_bytes(w.reshape(n, 1, 1, k)), kind, readonly(x, F32), _perm(k, kind))


def gemv_ref(w: np.ndarray, x: np.ndarray, kind: int) -> np.ndarray:
    """float64 NumPy reference of `gemv`."""
    return kv_to_f64(w, kind) @ np.asarray(x, np.float64)
