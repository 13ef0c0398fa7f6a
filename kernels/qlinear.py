"""Quantised GGUF weights read in their block layout (ktlong/quant.py documents the layouts).

- `qgemv(w, qtype, x)`: y = W x for one input vector (decode), parallel over output rows. Each
  row's blocks are dequantised in registers and never stored.
- `dequant(w, qtype, k, r0, r1, c0, c1)`: a float32 tile W[r0:r1, c0:c1] (prefill multiplies tiles
  with torch) and `dequant_rows(w, qtype, k, ids)` (embedding lookups).

`w` is the tensor's raw bytes [N, row_bytes] uint8 (usually a read-only view of the mapped file);
`qtype` is ggml's type id. The sums of x over each 16 channels are computed once per call, so a
block's constant term (Q4_0's -8, Q5_0's -16, Q4_1 / Q5_1 / K-quants' mins, Q6_K's -32) costs one
multiply, not one per weight.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._qvec import (
    VNNI,
    cvt_fma,
    dot_q6_scales,
    dot_scales,
    dp4,
    dp5,
    dp6,
    dp8x2,
    dp40x2,
    dp50x2,
    k4_lanes,
    lanes2,
    ld_f16,
    ld_u32,
    q6_lanes,
    vadd_i32,
    vmul_i32,
)
from ._simd import F32, FASTMATH, readonly, to_bf16, to_f32
from ._vec import vhsum, vsplat, vzero
from .threads import use_threads

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
         Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
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
def _half1(w, o):
    """The f16 at byte o of row w [row_bytes], as float32."""
    return to_f32(np.int16(np.uint16(w[o]) | (np.uint16(w[o + 1]) << np.uint16(8))))


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _u32(w, o):
    """The little-endian uint32 at byte o of row w [row_bytes] (Q5_0 / Q5_1's qh)."""
    return (np.uint32(w[o]) | (np.uint32(w[o + 1]) << np.uint32(8))
            | (np.uint32(w[o + 2]) << np.uint32(16)) | (np.uint32(w[o + 3]) << np.uint32(24)))


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _scale_min1(w, o, j):
    """6-bit scale and min of K-quant sub-block j (scale field at byte o of row w)."""
    if j < 4:
        return F32(w[o + j] & 63), F32(w[o + j + 4] & 63)
    sc = (w[o + j + 4] & 15) | ((w[o + j - 4] >> 6) << 4)
    m = (w[o + j + 4] >> 4) | ((w[o + j] >> 6) << 4)
    return F32(sc), F32(m)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _half(w, r, o):
    """The f16 at byte o of row r, as float32."""
    return _half1(w[r], o)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _scale_min(w, r, o, j):
    """6-bit scale and min of K-quant sub-block j (scale field at byte o of row r)."""
    return _scale_min1(w[r], o, j)


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
def _dot_q4_1(w, r, x, xs):
    acc = F32(0)
    for b in range(x.shape[0] // 32):
        o, xo = b * 20, b * 32
        s = F32(0)
        for i in range(16):
            q = w[r, o + 4 + i]
            s += F32(q & 15) * x[xo + i] + F32(q >> 4) * x[xo + 16 + i]
        acc += _half(w, r, o) * s + _half(w, r, o + 2) * (xs[2 * b] + xs[2 * b + 1])
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q5_01(w, r, x, xs, one):
    """Q5_0 (x = d * (q - 16)), or with `one` Q5_1 (x = d * q + m); bit 4 of q from qh."""
    acc = F32(0)
    for b in range(x.shape[0] // 32):
        o, xo = b * (24 if one else 22), b * 32
        ho = o + (4 if one else 2)  # qh, then qs
        h = _u32(w[r], ho)
        s = F32(0)
        for i in range(16):
            q = w[r, ho + 4 + i]
            q0 = (q & 15) | (((h >> i) & 1) << 4)
            q1 = (q >> 4) | (((h >> (i + 16)) & 1) << 4)
            s += F32(q0) * x[xo + i] + F32(q1) * x[xo + 16 + i]
        xsum = xs[2 * b] + xs[2 * b + 1]
        if one:
            acc += _half(w, r, o) * s + _half(w, r, o + 2) * xsum
        else:
            acc += _half(w, r, o) * (s - F32(16) * xsum)
    return acc


@njit(fastmath=FASTMATH, cache=True)
def _dot_q45_k(w, r, x, xs, five):
    """Q4_K, or with `five` Q5_K (a fifth bit per value from qh)."""
    acc = F32(0)
    for b in range(x.shape[0] // 256):
        o = b * (176 if five else 144)
        d, dmin = _half(w, r, o), _half(w, r, o + 2)
        for c in range(4):
            qo, xo = o + (48 if five else 16) + 32 * c, b * 256 + 64 * c
            s0 = s1 = F32(0)
            for i in range(32):
                q = w[r, qo + i]
                h0 = h1 = 0
                if five:
                    h = w[r, o + 16 + i] >> (2 * c)
                    h0, h1 = (h & 1) << 4, (h & 2) << 3
                s0 += F32((q & 15) | h0) * x[xo + i]
                s1 += F32((q >> 4) | h1) * x[xo + 32 + i]
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
        return _dot_q45_k(w, r, x, xs, False)
    if qtype == Q6_K:
        return _dot_q6_k(w, r, x, xs)
    if qtype == Q8_0:
        return _dot_q8_0(w, r, x, xs)
    if qtype == Q5_K:
        return _dot_q45_k(w, r, x, xs, True)
    if qtype == Q4_1:
        return _dot_q4_1(w, r, x, xs)
    if qtype == Q5_0 or qtype == Q5_1:
        return _dot_q5_01(w, r, x, xs, qtype == Q5_1)
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


# AVX512-VNNI path (as llama.cpp's): x is rounded to int8, per 32 channels for the 32-blocks (Q8_0,
# Q4_0, Q4_1, Q5_0, Q5_1) and per 256 for the K-quants; each block's codes meet x's codes in
# vpdpbusd. 32-blocks scale the int32 lanes by (block scale x dx) in float32; a K-quant super-block
# sums its sub-blocks' lanes times their integer scales in int32, then scales once. Constant terms
# (mins, code offsets) use the sums of x's codes, so the result is exactly W times the int8-rounded
# x.
_M6, _M4, _M2 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x03030303)


@njit(fastmath=FASTMATH, cache=True)
def _quantise_x(x, group):
    """x [K] -> int8 codes [K], scale per `group` channels [K/group], codes' sums per 16 [K/16]
    and per 32 [K/32] (int32)."""
    k = x.shape[0]
    q = np.empty(k, np.int8)
    dx = np.empty(k // group, F32)
    s16 = np.empty(k // 16, np.int32)
    s32 = np.empty(k // 32, np.int32)
    for j in range(k // group):
        m = F32(0)
        for i in range(group):
            m = max(m, abs(x[group * j + i]))
        dx[j] = m / F32(127)
        inv = F32(127) / m if m > 0 else F32(0)
        for i in range(group):
            q[group * j + i] = np.int8(np.int32(np.rint(x[group * j + i] * inv)))
    for j in range(k // 16):
        t = np.int32(0)
        for i in range(16):
            t += np.int32(q[16 * j + i])
        s16[j] = t
    for j in range(k // 32):
        s32[j] = s16[2 * j] + s16[2 * j + 1]
    return q, dx, s16, s32


@njit(fastmath=FASTMATH, cache=True)
def _vdot_k(qtype, wa, xa, dx, s16a, s32a, k):
    """Row at address wa (Q4_K, Q5_K, Q6_K) . x (codes at xa, one scale per 256)."""
    acc = vzero()
    corr = F32(0)
    for b in range(k // 256):
        xo, dd = xa + 256 * b, dx[b]
        if qtype == Q6_K:
            o = wa + 210 * b
            l0, l1, l2, l3 = q6_lanes(o + 192)
            p0 = dp6(vzero(), o, 0, o + 128, 0, xo)  # weights 0-63 of the super-block
            p1 = dp6(vzero(), o, 4, o + 128, 4, xo + 64)
            p2 = dp6(vzero(), o + 64, 0, o + 160, 0, xo + 128)
            p3 = dp6(vzero(), o + 64, 4, o + 160, 4, xo + 192)
            d = ld_f16(o + 208) * dd
            corr += d * F32(32 * dot_q6_scales(o + 192, s16a + 64 * b))  # the codes' -32
        else:
            five = qtype == Q5_K
            o = wa + (176 if five else 144) * b
            u0, u1, u2 = ld_u32(o + 4), ld_u32(o + 8), ld_u32(o + 12)
            sc_lo, m_lo = np.uint32(u0 & _M6), np.uint32(u1 & _M6)
            sc_hi = np.uint32((u2 & _M4) | (((u0 >> np.uint32(6)) & _M2) << np.uint32(4)))
            m_hi = np.uint32(((u2 >> np.uint32(4)) & _M4)
                             | (((u1 >> np.uint32(6)) & _M2) << np.uint32(4)))
            l0, l1, l2, l3 = k4_lanes(sc_lo, sc_hi)
            if five:
                p0 = dp5(vzero(), o + 48, o + 16, 0, xo)
                p1 = dp5(vzero(), o + 80, o + 16, 2, xo + 64)
                p2 = dp5(vzero(), o + 112, o + 16, 4, xo + 128)
                p3 = dp5(vzero(), o + 144, o + 16, 6, xo + 192)
            else:
                p0 = dp4(vzero(), o + 16, xo)
                p1 = dp4(vzero(), o + 48, xo + 64)
                p2 = dp4(vzero(), o + 80, xo + 128)
                p3 = dp4(vzero(), o + 112, xo + 192)
            d = ld_f16(o) * dd
            corr += ld_f16(o + 2) * dd * F32(dot_scales(m_lo, m_hi, s32a + 32 * b))  # the mins
        t = vadd_i32(vadd_i32(vmul_i32(p0, l0), vmul_i32(p1, l1)),
                     vadd_i32(vmul_i32(p2, l2), vmul_i32(p3, l3)))
        acc = cvt_fma(t, vsplat(d), acc)
    return vhsum(acc) - corr


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _vdot_pairs(qtype, nb, wa, xa, dx, s32, k):
    """Row at address wa (a 32-block type of nb bytes a block) . x (codes at xa, one scale per
    32). Two blocks a step; a block's constant term is c * dx * (sum of its 32 x codes). Inlined
    with a constant qtype: one loop per type, no type test inside it."""
    acc = vzero()
    corr = F32(0)
    for j in range(0, k // 32, 2):
        o, xo = wa + j * nb, xa + 32 * j
        d0, d1 = ld_f16(o), ld_f16(o + nb)
        if qtype == Q8_0:
            p = dp8x2(vzero(), o + 2, o + 36, xo)
            c0, c1 = F32(128) * d0, F32(128) * d1  # the +128 that made the codes unsigned
        elif qtype == Q4_0:
            p = dp40x2(vzero(), o + 2, o + 20, xo)
            c0, c1 = F32(8) * d0, F32(8) * d1
        elif qtype == Q4_1:
            p = dp40x2(vzero(), o + 4, o + 24, xo)
            c0, c1 = -ld_f16(o + 2), -ld_f16(o + 22)  # the mins (added)
        elif qtype == Q5_0:  # qh at 2, qs at 6
            p = dp50x2(vzero(), o + 6, o + 28, o + 2, o + 24, xo)
            c0, c1 = F32(16) * d0, F32(16) * d1
        else:  # Q5_1: m at 2, qh at 4, qs at 8
            p = dp50x2(vzero(), o + 8, o + 32, o + 4, o + 28, xo)
            c0, c1 = -ld_f16(o + 2), -ld_f16(o + 26)
        acc = cvt_fma(p, lanes2(d0 * dx[j], d1 * dx[j + 1]), acc)
        corr += c0 * dx[j] * F32(s32[j]) + c1 * dx[j + 1] * F32(s32[j + 1])
    return vhsum(acc) - corr


@njit(fastmath=FASTMATH, cache=True)
def _vdot_32(qtype, wa, xa, dx, s32, k):
    """Row at address wa (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) . x (codes at xa, one scale per 32)."""
    if qtype == Q8_0:
        return _vdot_pairs(Q8_0, 34, wa, xa, dx, s32, k)
    if qtype == Q4_0:
        return _vdot_pairs(Q4_0, 18, wa, xa, dx, s32, k)
    if qtype == Q4_1:
        return _vdot_pairs(Q4_1, 20, wa, xa, dx, s32, k)
    if qtype == Q5_0:
        return _vdot_pairs(Q5_0, 22, wa, xa, dx, s32, k)
    return _vdot_pairs(Q5_1, 24, wa, xa, dx, s32, k)


@njit(parallel=True, nogil=True, cache=True)
def _qgemv_vnni(w, qtype, x):
    # w [N, row_bytes] u8; x [K] f32 (K a multiple of 64) -> [N] f32
    n, rb, k = w.shape[0], w.shape[1], x.shape[0]
    kq = qtype == Q4_K or qtype == Q5_K or qtype == Q6_K
    xc, dx, s16, s32 = _quantise_x(x, 256 if kq else 32)
    out = np.empty(n, F32)
    for it in prange((n + RB - 1) // RB):
        # raw addresses taken here, inside the loop: Numba frees an array after its last use,
        # so addresses taken before the loop could point at memory `out` (or anything) reuses
        wa, xa, s16a, s32a = w.ctypes.data, xc.ctypes.data, s16.ctypes.data, s32.ctypes.data
        for r in range(it * RB, min(n, it * RB + RB)):
            if kq:
                out[r] = _vdot_k(qtype, wa + r * rb, xa, dx, s16a, s32a, k)
            else:
                out[r] = _vdot_32(qtype, wa + r * rb, xa, dx, s32, k)
    return out


def _put(out, j, v):
    """out[j] = v: float32 as it is, or rounded to bf16 bits in a uint16 row."""


@overload(_put, inline="always")
def _put_impl(out, j, v):
    if out.dtype == types.uint16:
        def put_bf16(out, j, v):
            out[j] = to_bf16(F32(v))
        return put_bf16

    def put_f32(out, j, v):
        out[j] = v
    return put_f32


@njit(fastmath=FASTMATH, cache=True)
def _decode_row(w, qtype, c0, c1, out):
    """out [c1 - c0] = dequantised row w [row_bytes] over columns c0:c1 (on block boundaries);
    out float32, or uint16 for bf16 bits. One-dimensional views, a loop per type: the inner
    loops vectorise."""
    if qtype == Q8_0:
        for b in range(c0 // 32, c1 // 32):
            o, y = b * 34, b * 32 - c0
            d = _half1(w, o)
            for i in range(32):
                _put(out, y + i, d * F32(np.int8(w[o + 2 + i])))
    elif qtype == Q4_0:
        for b in range(c0 // 32, c1 // 32):
            o, y = b * 18, b * 32 - c0
            d = _half1(w, o)
            for i in range(16):
                q = w[o + 2 + i]
                _put(out, y + i, d * F32(np.int32(q & 15) - 8))
                _put(out, y + 16 + i, d * F32(np.int32(q >> 4) - 8))
    elif qtype == Q4_1:
        for b in range(c0 // 32, c1 // 32):
            o, y = b * 20, b * 32 - c0
            d, m = _half1(w, o), _half1(w, o + 2)
            for i in range(16):
                q = w[o + 4 + i]
                _put(out, y + i, d * F32(q & 15) + m)
                _put(out, y + 16 + i, d * F32(q >> 4) + m)
    elif qtype == Q5_0 or qtype == Q5_1:
        one = qtype == Q5_1
        for b in range(c0 // 32, c1 // 32):
            o, y = b * (24 if one else 22), b * 32 - c0
            ho = o + (4 if one else 2)  # qh, then qs
            d, h = _half1(w, o), _u32(w, ho)
            m = _half1(w, o + 2) if one else F32(0)
            for i in range(16):
                q = w[ho + 4 + i]
                q0 = np.int32((q & 15) | (((h >> i) & 1) << 4))
                q1 = np.int32((q >> 4) | (((h >> (i + 16)) & 1) << 4))
                if one:
                    _put(out, y + i, d * F32(q0) + m)
                    _put(out, y + 16 + i, d * F32(q1) + m)
                else:  # no + m: keeps d * 0's sign, as the reference
                    _put(out, y + i, d * F32(q0 - 16))
                    _put(out, y + 16 + i, d * F32(q1 - 16))
    elif qtype == Q6_K:
        for b in range(c0 // 256, c1 // 256):
            o, y0 = b * 210, b * 256 - c0
            d = _half1(w, o + 208)
            for h in range(2):
                for c in range(4):
                    lo, ho = o + 64 * h + 32 * (c & 1), o + 128 + 32 * h
                    ls, hs = 4 * (c >> 1), 2 * c
                    j = 8 * h + 2 * c
                    y = y0 + 128 * h + 32 * c
                    for half in range(2):
                        sc = d * F32(np.int8(w[o + 192 + j + half]))
                        for i in range(16 * half, 16 * half + 16):
                            q = ((w[lo + i] >> ls) & 15) | (((w[ho + i] >> hs) & 3) << 4)
                            _put(out, y + i, sc * F32(np.int32(q) - 32))
    else:  # Q4_K, Q5_K (a fifth bit per value from qh)
        five = qtype == Q5_K
        for b in range(c0 // 256, c1 // 256):
            o, y0 = b * (176 if five else 144), b * 256 - c0
            d, dmin = _half1(w, o), _half1(w, o + 2)
            for c in range(4):
                qo = o + (48 if five else 16) + 32 * c
                sc0, m0 = _scale_min1(w, o + 4, 2 * c)
                sc1, m1 = _scale_min1(w, o + 4, 2 * c + 1)
                a0, a1, z0, z1 = d * sc0, d * sc1, dmin * m0, dmin * m1
                y = y0 + 64 * c
                for i in range(32):
                    q = w[qo + i]
                    h0 = h1 = 0
                    if five:
                        hb = w[o + 16 + i] >> (2 * c)
                        h0, h1 = (hb & 1) << 4, (hb & 2) << 3
                    _put(out, y + i, a0 * F32((q & 15) | h0) - z0)
                    _put(out, y + 32 + i, a1 * F32((q >> 4) | h1) - z1)


@njit(parallel=True, nogil=True, cache=True)
def _dequant(w, qtype, rows, c0, c1, out):
    # rows [R] int64 row ids -> out [R, c1 - c0] f32 (or uint16 bf16 bits)
    for i in prange(rows.shape[0]):
        _decode_row(w[rows[i]], qtype, c0, c1, out[i])
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
    if VNNI and k % (256 if qtype in (Q4_K, Q5_K, Q6_K) else 64) == 0:
        return _qgemv_vnni(w, qtype, readonly(x, F32))
    return _qgemv(w, qtype, readonly(x, F32))


def dequant(w: np.ndarray, qtype: int, k: int, r0: int, r1: int, c0: int = 0,
            c1: int | None = None, bf16: bool = False,
            out: np.ndarray | None = None) -> np.ndarray:
    """W[r0:r1, c0:c1] as float32 [r1 - r0, c1 - c0], or with `bf16` as bf16 bits (uint16,
    rounded to nearest even); c0 and c1 on block boundaries. `out`: a C-contiguous buffer of
    at least that many elements of that dtype to write into (a reused buffer spares the page
    faults of a fresh one)."""
    c1 = k if c1 is None else c1
    w = _check(w, qtype, k)
    blk = BLOCK[qtype][0]
    if c0 % blk or c1 % blk or not 0 <= c0 <= c1 <= k or not 0 <= r0 <= r1 <= w.shape[0]:
        raise ValueError(f"tile [{r0}:{r1}, {c0}:{c1}] is outside the tensor or off its "
                         f"{blk}-element blocks")
    use_threads()
    dtype, shape = np.uint16 if bf16 else F32, (r1 - r0, c1 - c0)
    if out is None:
        out = np.empty(shape, dtype)
    else:
        if out.dtype != dtype or not out.flags.c_contiguous or out.size < shape[0] * shape[1]:
            raise ValueError(f"out must be a C-contiguous {np.dtype(dtype)} buffer of at least "
                             f"{shape[0] * shape[1]} elements")
        out = out.reshape(-1)[: shape[0] * shape[1]].reshape(shape)
    return _dequant(w, qtype, np.arange(r0, r1, dtype=np.int64), c0, c1, out)


def dequant_rows(w: np.ndarray, qtype: int, k: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` [R] of W, dequantised: [R, K] float32 (embedding lookups)."""
    w = _check(w, qtype, k)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError("row id out of range")
    use_threads()
    return _dequant(w, qtype, ids, 0, k, np.empty((ids.shape[0], k), F32))


def qgemv_ref(w: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
    """float64 reference of `qgemv`: the `gguf` package's dequantisation, then a matmul."""
    import gguf

    wd = gguf.quants.dequantize(np.asarray(w), gguf.GGMLQuantizationType(qtype))
    return wd.astype(np.float64) @ np.asarray(x, np.float64)
