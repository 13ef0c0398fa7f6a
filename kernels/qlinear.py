"""Quantised GGUF weights read in their block layout (ktlong/quant.py documents the layouts).

- `qgemv(w, qtype, x)`: y = W x for one input vector (decode), parallel over output rows. Each
  row's blocks are dequantised in registers and never stored.
- `dequant(w, qtype, k, r0, r1, c0, c1)`: a float32 tile W[r0:r1, c0:c1] (prefill multiplies tiles
  with torch) and `dequant_rows(w, qtype, k, ids)` (embedding lookups).

`w` is the tensor's raw bytes [N, row_bytes] uint8 (usually a read-only view of the mapped file);
`qtype` is ggml's type id. The sums of x over each 16 channels are computed once per call, so a
block's constant term (Q4_0's -8, K-quants' mins, Q6_K's -32) costs one multiply, not one per
weight.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._qvec import VNNI, cvt_fma, dp4, dp5, dp6, dp8x2, dp40x2, lanes2, lanes4, ld_f16, ld_u8
from ._simd import F32, FASTMATH, readonly, to_f32
from ._vec import vhsum, vzero
from .threads import use_threads

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14
BLOCK = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
RB = 8  # output rows per work item


@njit(fastmath=FASTMATH, cache=True)
def _xsums(x):
    """x [K] -> sums of each 16 channels [K / 16]."""
    n = x.shape[0] // 16
    s = np.empty(n, F32)
    for j in range(n):
        a = F32(0)
        for i in range(16):
            a += x[16 * j + i]
        s[j] = a
    return s


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _half(w, r, o):
    """The f16 at byte o of row r, as float32."""
    return to_f32(np.int16(np.uint16(w[r, o]) | (np.uint16(w[r, o + 1]) << np.uint16(8))))


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _scale_min(w, r, o, j):
    """6-bit scale and min of K-quant sub-block j (scale field at byte o)."""
    if j < 4:
        return F32(w[r, o + j] & 63), F32(w[r, o + j + 4] & 63)
    sc = (w[r, o + j + 4] & 15) | ((w[r, o + j - 4] >> 6) << 4)
    m = (w[r, o + j + 4] >> 4) | ((w[r, o + j] >> 6) << 4)
    return F32(sc), F32(m)


@njit(fastmath=FASTMATH, cache=True)
def _dot_q8_0(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 32):
        o, xo = b * 34, b * 32
        s = F32(0)
        for i in range(32):
            s += F32(np.int8(w[r, o + 2 + i])) * x[xo + i]
        acc += _half(w, r, o) * s
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q4_0(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 32):
        o, xo = b * 18, b * 32
        s = F32(0)
        for i in range(16):
            q = w[r, o + 2 + i]
            s += F32(q & 15) * x[xo + i] + F32(q >> 4) * x[xo + 16 + i]
        acc += _half(w, r, o) * (s - F32(8) * (xs[2 * b] + xs[2 * b + 1]))
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q4_k(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 256):
        o = b * 144
        d, dmin = _half(w, r, o), _half(w, r, o + 2)
        for c in range(4):
            qo, xo = o + 16 + 32 * c, b * 256 + 64 * c
            s0 = s1 = F32(0)
            for i in range(32):
                q = w[r, qo + i]
                s0 += F32(q & 15) * x[xo + i]
                s1 += F32(q >> 4) * x[xo + 32 + i]
            sc0, m0 = _scale_min(w, r, o + 4, 2 * c)
            sc1, m1 = _scale_min(w, r, o + 4, 2 * c + 1)
            j = b * 16 + 4 * c
            acc += d * (sc0 * s0 + sc1 * s1) - dmin * (
                m0 * (xs[j] + xs[j + 1]) + m1 * (xs[j + 2] + xs[j + 3]))
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q5_k(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 256):
        o = b * 176
        d, dmin = _half(w, r, o), _half(w, r, o + 2)
        for c in range(4):
            qo, ho, xo = o + 48 + 32 * c, o + 16, b * 256 + 64 * c
            s0 = s1 = F32(0)
            for i in range(32):
                q, h = w[r, qo + i], w[r, ho + i] >> (2 * c)
                s0 += F32((q & 15) | ((h & 1) << 4)) * x[xo + i]
                s1 += F32((q >> 4) | ((h & 2) << 3)) * x[xo + 32 + i]
            sc0, m0 = _scale_min(w, r, o + 4, 2 * c)
            sc1, m1 = _scale_min(w, r, o + 4, 2 * c + 1)
            j = b * 16 + 4 * c
            acc += d * (sc0 * s0 + sc1 * s1) - dmin * (
                m0 * (xs[j] + xs[j + 1]) + m1 * (xs[j + 2] + xs[j + 3]))
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q6_k(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 256):
        o = b * 210
        d = _half(w, r, o + 208)
        t = F32(0)
        for h in range(2):
            for c in range(4):
                lo, ho, xo = o + 64 * h + 32 * (c & 1), o + 128 + 32 * h, b * 256 + 128 * h + 32 * c
                ls, hs = 4 * (c >> 1), 2 * c
                s0 = s1 = F32(0)
                for i in range(16):
                    q0 = ((w[r, lo + i] >> ls) & 15) | (((w[r, ho + i] >> hs) & 3) << 4)
                    q1 = ((w[r, lo + 16 + i] >> ls) & 15) | (((w[r, ho + 16 + i] >> hs) & 3) << 4)
                    s0 += F32(q0) * x[xo + i]
                    s1 += F32(q1) * x[xo + 16 + i]
                j = b * 16 + 8 * h + 2 * c  # sub-block of 16 (and its x sum)
                sc0, sc1 = F32(np.int8(w[r, o + 192 + j - b * 16])), F32(
                    np.int8(w[r, o + 193 + j - b * 16]))
                t += sc0 * (s0 - F32(32) * xs[j]) + sc1 * (s1 - F32(32) * xs[j + 1])
        acc += d * t
    return acc


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _dot(w, qtype, r, x, xs):
    if qtype == Q4_K:
        return _dot_q4_k(w, r, x, xs)
    if qtype == Q6_K:
        return _dot_q6_k(w, r, x, xs)
    if qtype == Q8_0:
        return _dot_q8_0(w, r, x, xs)
    if qtype == Q5_K:
        return _dot_q5_k(w, r, x, xs)
    return _dot_q4_0(w, r, x, xs)


@njit(parallel=True, nogil=True, cache=True)
def _qgemv(w, qtype, x):
    # w [N, row_bytes] u8; x [K] f32 -> [N] f32
    n = w.shape[0]
    xs = _xsums(x)
    out = np.empty(n, F32)
    for it in prange((n + RB - 1) // RB):
        for r in range(it * RB, min(n, it * RB + RB)):
            out[r] = _dot(w, qtype, r, x, xs)
    return out


# AVX512-VNNI path: x is quantised to int8 per 32 channels (scale dx), each weight block's codes
# meet x's codes in vpdpbusd, and the int32 lanes are scaled by (weight scale x dx) in float32.
# A block's constant term (mins, code offsets) uses x's codes too (xq: dx x the codes' sum per 16
# channels), so the result is exactly W times the int8-rounded x (and Q8_0's +128 offset cancels).


@njit(fastmath=FASTMATH, cache=True)
def _quantise_x(x):
    """x [K] -> int8 codes [K], scale per 32 [K/32], dx x sum of codes per 16 [K/16]."""
    nb = x.shape[0] // 32
    q = np.empty(x.shape[0], np.int8)
    dx = np.empty(nb, F32)
    xq = np.empty(2 * nb, F32)
    for j in range(nb):
        m = F32(0)
        for i in range(32):
            m = max(m, abs(x[32 * j + i]))
        d = m / F32(127)
        inv = F32(127) / m if m > 0 else F32(0)
        s0 = s1 = 0
        for i in range(16):
            v0 = np.int8(np.int32(np.rint(x[32 * j + i] * inv)))
            v1 = np.int8(np.int32(np.rint(x[32 * j + 16 + i] * inv)))
            q[32 * j + i], q[32 * j + 16 + i] = v0, v1
            s0 += np.int32(v0)
            s1 += np.int32(v1)
        dx[j], xq[2 * j], xq[2 * j + 1] = d, d * F32(s0), d * F32(s1)
    return q, dx, xq


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _sm_at(a, j):
    """6-bit scale and min of K-quant sub-block j, scale field at address a."""
    if j < 4:
        return F32(ld_u8(a + j) & 63), F32(ld_u8(a + j + 4) & 63)
    sc = (ld_u8(a + j + 4) & 15) | ((ld_u8(a + j - 4) >> 6) << 4)
    m = (ld_u8(a + j + 4) >> 4) | ((ld_u8(a + j) >> 6) << 4)
    return F32(sc), F32(m)


@njit(fastmath=FASTMATH, cache=True)
def _vdot(qtype, wa, xa, dx, xq, k):
    """Row at address wa . x (codes at xa) for the VNNI path."""
    acc = vzero()
    corr = F32(0)  # the blocks' constant terms, subtracted at the end
    if qtype == Q4_K or qtype == Q5_K:
        five = qtype == Q5_K
        size = 176 if five else 144
        for b in range(k // 256):
            o = wa + b * size
            d, dmin = ld_f16(o), ld_f16(o + 2)
            for c in range(4):
                xo = xa + b * 256 + 64 * c
                if five:
                    p = dp5(vzero(), o + 48 + 32 * c, o + 16, 2 * c, xo)
                else:
                    p = dp4(vzero(), o + 16 + 32 * c, xo)
                sc0, m0 = _sm_at(o + 4, 2 * c)
                sc1, m1 = _sm_at(o + 4, 2 * c + 1)
                j = b * 8 + 2 * c
                acc = cvt_fma(p, lanes2(d * sc0 * dx[j], d * sc1 * dx[j + 1]), acc)
                corr += dmin * (m0 * (xq[2 * j] + xq[2 * j + 1])
                                + m1 * (xq[2 * j + 2] + xq[2 * j + 3]))
    elif qtype == Q6_K:
        for b in range(k // 256):
            o = wa + b * 210
            d = ld_f16(o + 208)
            for h in range(2):
                for pr in range(2):
                    xo = xa + b * 256 + 128 * h + 64 * pr
                    p = dp6(vzero(), o + 64 * h, 4 * pr, o + 128 + 32 * h, 4 * pr, xo)
                    s = o + 192 + 8 * h + 4 * pr  # 4 scales of 16 weights each
                    j = b * 8 + 4 * h + 2 * pr  # x block of 32
                    s0, s1 = d * F32(np.int8(ld_u8(s))), d * F32(np.int8(ld_u8(s + 1)))
                    s2, s3 = d * F32(np.int8(ld_u8(s + 2))), d * F32(np.int8(ld_u8(s + 3)))
                    acc = cvt_fma(p, lanes4(s0 * dx[j], s1 * dx[j], s2 * dx[j + 1],
                                            s3 * dx[j + 1]), acc)
                    i = 2 * j
                    corr += F32(32) * (s0 * xq[i] + s1 * xq[i + 1] + s2 * xq[i + 2]
                                       + s3 * xq[i + 3])
    elif qtype == Q8_0:
        for j in range(0, k // 32, 2):
            o = wa + j * 34
            d0, d1 = ld_f16(o), ld_f16(o + 34)
            p = dp8x2(vzero(), o + 2, o + 36, xa + 32 * j)
            acc = cvt_fma(p, lanes2(d0 * dx[j], d1 * dx[j + 1]), acc)
            corr += F32(128) * (d0 * (xq[2 * j] + xq[2 * j + 1])
                                + d1 * (xq[2 * j + 2] + xq[2 * j + 3]))
    else:  # Q4_0
        for j in range(0, k // 32, 2):
            o = wa + j * 18
            d0, d1 = ld_f16(o), ld_f16(o + 18)
            p = dp40x2(vzero(), o + 2, o + 20, xa + 32 * j)
            acc = cvt_fma(p, lanes2(d0 * dx[j], d1 * dx[j + 1]), acc)
            corr += F32(8) * (d0 * (xq[2 * j] + xq[2 * j + 1])
                              + d1 * (xq[2 * j + 2] + xq[2 * j + 3]))
    return vhsum(acc) - corr


@njit(parallel=True, nogil=True, cache=True)
def _qgemv_vnni(w, qtype, x):
    # w [N, row_bytes] u8; x [K] f32 (K a multiple of 64) -> [N] f32
    n, rb, k = w.shape[0], w.shape[1], x.shape[0]
    xc, dx, xq = _quantise_x(x)
    wa, xa = w.ctypes.data, xc.ctypes.data
    out = np.empty(n, F32)
    for it in prange((n + RB - 1) // RB):
        for r in range(it * RB, min(n, it * RB + RB)):
            out[r] = _vdot(qtype, wa + r * rb, xa, dx, xq, k)
    return out


@njit(fastmath=FASTMATH, cache=True)
def _decode_row(w, qtype, r, c0, c1, out, orow):
    """out[orow, :] = dequantised W[r, c0:c1] (c0, c1 on block boundaries)."""
    blk = 32 if qtype == Q4_0 or qtype == Q8_0 else 256
    for b in range(c0 // blk, c1 // blk):
        y0 = b * blk - c0
        if qtype == Q8_0:
            o = b * 34
            d = _half(w, r, o)
            for i in range(32):
                out[orow, y0 + i] = d * F32(np.int8(w[r, o + 2 + i]))
        elif qtype == Q4_0:
            o = b * 18
            d = _half(w, r, o)
            for i in range(16):
                q = w[r, o + 2 + i]
                out[orow, y0 + i] = d * F32(np.int32(q & 15) - 8)
                out[orow, y0 + 16 + i] = d * F32(np.int32(q >> 4) - 8)
        elif qtype == Q6_K:
            o = b * 210
            d = _half(w, r, o + 208)
            for h in range(2):
                for c in range(4):
                    lo, ho = o + 64 * h + 32 * (c & 1), o + 128 + 32 * h
                    ls, hs = 4 * (c >> 1), 2 * c
                    j = 8 * h + 2 * c
                    s0 = d * F32(np.int8(w[r, o + 192 + j]))
                    s1 = d * F32(np.int8(w[r, o + 193 + j]))
                    y = y0 + 128 * h + 32 * c
                    for i in range(32):
                        q = ((w[r, lo + i] >> ls) & 15) | (((w[r, ho + i] >> hs) & 3) << 4)
                        out[orow, y + i] = (s0 if i < 16 else s1) * F32(np.int32(q) - 32)
        else:  # Q4_K, Q5_K
            five = qtype == Q5_K
            o = b * (176 if five else 144)
            d, dmin = _half(w, r, o), _half(w, r, o + 2)
            for c in range(4):
                qo = o + (48 if five else 16) + 32 * c
                sc0, m0 = _scale_min(w, r, o + 4, 2 * c)
                sc1, m1 = _scale_min(w, r, o + 4, 2 * c + 1)
                a0, a1, z0, z1 = d * sc0, d * sc1, dmin * m0, dmin * m1
                y = y0 + 64 * c
                for i in range(32):
                    q = w[r, qo + i]
                    h0 = h1 = 0
                    if five:
                        hb = w[r, o + 16 + i] >> (2 * c)
                        h0, h1 = (hb & 1) << 4, (hb & 2) << 3
                    out[orow, y + i] = a0 * F32((q & 15) | h0) - z0
                    out[orow, y + 32 + i] = a1 * F32((q >> 4) | h1) - z1


@njit(parallel=True, nogil=True, cache=True)
def _dequant(w, qtype, rows, c0, c1):
    # rows [R] int64 row ids -> [R, c1 - c0] f32
    out = np.empty((rows.shape[0], c1 - c0), F32)
    for i in prange(rows.shape[0]):
        _decode_row(w, qtype, rows[i], c0, c1, out, i)
    return out


def _check(w: np.ndarray, qtype: int, k: int) -> np.ndarray:
    if qtype not in BLOCK:
        raise ValueError(f"unknown quant type {qtype}")
    blk, nbytes = BLOCK[qtype]
    if k % blk or w.ndim != 2 or w.shape[1] != k // blk * nbytes or w.dtype != np.uint8:
        raise ValueError(f"w must be [N, {k // blk * nbytes}] uint8 rows of {k} elements in "
                         f"type {qtype}, got {w.dtype} {w.shape}")
    return readonly(w)


def qgemv(w: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
    """y = W x: w [N, row_bytes] uint8 in `qtype`, x [K] float32 -> y [N] float32."""
    k = x.shape[0]
    w = _check(w, qtype, k)
    use_threads()
    if VNNI and k % 64 == 0:
        return _qgemv_vnni(w, qtype, readonly(x, F32))
    return _qgemv(w, qtype, readonly(x, F32))


def dequant(w: np.ndarray, qtype: int, k: int, r0: int, r1: int, c0: int = 0,
            c1: int | None = None) -> np.ndarray:
    """W[r0:r1, c0:c1] as float32 [r1 - r0, c1 - c0]; c0 and c1 on block boundaries."""
    c1 = k if c1 is None else c1
    w = _check(w, qtype, k)
    blk = BLOCK[qtype][0]
    if c0 % blk or c1 % blk or not 0 <= c0 <= c1 <= k or not 0 <= r0 <= r1 <= w.shape[0]:
        raise ValueError(f"tile [{r0}:{r1}, {c0}:{c1}] is outside the tensor or off its "
                         f"{blk}-element blocks")
    use_threads()
    return _dequant(w, qtype, np.arange(r0, r1, dtype=np.int64), c0, c1)


def dequant_rows(w: np.ndarray, qtype: int, k: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` [R] of W, dequantised: [R, K] float32 (embedding lookups)."""
    w = _check(w, qtype, k)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError("row id out of range")
    use_threads()
    return _dequant(w, qtype, ids, 0, k)


def qgemv_ref(w: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
    """float64 reference of `qgemv`: the `gguf` package's dequantisation, then a matmul."""
    import gguf

    wd = gguf.quants.dequantize(np.asarray(w), gguf.GGMLQuantizationType(qtype))
    return wd.astype(np.float64) @ np.asarray(x, np.float64)
