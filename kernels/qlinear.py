"""Quantised GGUF weights read in their block layout (ktlong/quant.py documents the layouts).

- `qgemv(w, qtype, x, out=None)`: y = W x for one input vector (decode), parallel over output
  rows (into `out` when given). Each row's blocks are dequantised in registers and never stored.
  `qgemv2(w, w2, qtype, x)`: two matrices of one input in one call.
- `dequant(w, qtype, k, r0, r1, c0, c1)`: a float32 tile W[r0:r1, c0:c1] (prefill multiplies tiles
  with torch) and `dequant_rows(w, qtype, k, ids)` (embedding lookups).

`w` is the tensor's raw bytes [N, row_bytes] uint8 (usually a read-only view of the mapped file);
`qtype` is ggml's type id. A block's constant term (Q4_0's -8, Q5_0's -16, Q4_1 / Q5_1 / K-quants'
mins, Q6_K's -32) costs one multiply by a sum of x computed once per call, not one per weight.

With AVX512-VNNI (`_qgemv_vnni`) x is rounded to int8 once per call and laid out for the steps of
kernels/_qvec.py; a K-quant row is read on its own, start to end, as one stream (x's codes and
tables come from L1), 32-block rows two at a time, with a software prefetch AHEAD bytes on. With
AVX2 (`_qgemv_avx2`) x is rounded the same way and the steps of kernels/_qavx2.py take a row at a
time (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K).
Otherwise `_qgemv` works in float32, a row at a time: W codes at a time are widened to float32
lanes in registers (`vbits`, `vsbytes`) and meet x in one `fma`; each block's vector is scaled
into the row's accumulator, summed once at its end (Q5_0, Q5_1 and Q5_K go element by element).
`int8_path` says which a type takes; `qgemv_ref` is the NumPy reference of all.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._qavx2 import (
    AVX2,
    q4_0_step8,
    q4_0_step8_1,
    q4_1_step8,
    q4_1_step8_1,
    q4k_step8,
    q6k_step8,
    q8_0_step8,
    q8_0_step8_1,
)
from ._qvec import VNNI, absmax16, codes16, ldv, q4k_step, q5k_step, q6k_step, step32
from ._simd import F32, FASTMATH, readonly, to_bf16, to_f32
from ._vec import (
    W,
    hsum4,
    load_f16,
    prefetch,
    vbits,
    vfma,
    vhsum,
    vload,
    vsbytes,
    vsplat,
    vzero,
)
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
def _dot_q8_0(ra, x2):
    """Row at address ra . x2 [1, K]: Q8_0."""
    acc = vzero()
    for b in range(x2.shape[1] // 32):
        o = ra + 34 * b
        s = vzero()
        for t in range(0, 32, W):
            s = vfma(vsbytes(o + 2 + t), vload(x2, 0, 32 * b + t), s)
        acc = vfma(vsplat(load_f16(o)), s, acc)
    return vhsum(acc)


@njit(fastmath=FASTMATH, cache=True)
def _dot_q4_01(ra, x2, xs, one):
    """Row at address ra . x2 [1, K]: Q4_0, or with `one` Q4_1 (xs: x's sums per 16)."""
    nb = 20 if one else 18
    acc = vzero()
    rest = F32(0)  # the blocks' constant terms
    for b in range(x2.shape[1] // 32):
        o = ra + nb * b
        qo = o + (4 if one else 2)
        s = vzero()
        for t in range(0, 16, W):
            s = vfma(vbits(qo + t, 0, 15), vload(x2, 0, 32 * b + t), s)
            s = vfma(vbits(qo + t, 4, 15), vload(x2, 0, 32 * b + 16 + t), s)
        d = load_f16(o)
        acc = vfma(vsplat(d), s, acc)
        xsb = xs[2 * b] + xs[2 * b + 1]
        rest += load_f16(o + 2) * xsb if one else F32(-8) * d * xsb
    return vhsum(acc) + rest


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
def _dot_q4_k(wr, ra, x2, xs):
    """Row wr [row_bytes] (at address ra) . x2 [1, K]: Q4_K."""
    acc = vzero()
    rest = F32(0)  # the sub-blocks' mins
    for b in range(x2.shape[1] // 256):
        o = 144 * b
        d, dmin = load_f16(ra + o), load_f16(ra + o + 2)
        for c in range(4):
            qo, xo = ra + o + 16 + 32 * c, b * 256 + 64 * c
            s0, s1 = vzero(), vzero()
            for t in range(0, 32, W):
                s0 = vfma(vbits(qo + t, 0, 15), vload(x2, 0, xo + t), s0)
                s1 = vfma(vbits(qo + t, 4, 15), vload(x2, 0, xo + 32 + t), s1)
            sc0, m0 = _scale_min1(wr, o + 4, 2 * c)
            sc1, m1 = _scale_min1(wr, o + 4, 2 * c + 1)
            acc = vfma(vsplat(d * sc0), s0, vfma(vsplat(d * sc1), s1, acc))
            j = b * 16 + 4 * c
            rest -= dmin * (m0 * (xs[j] + xs[j + 1]) + m1 * (xs[j + 2] + xs[j + 3]))
    return vhsum(acc) + rest


@njit(fastmath=FASTMATH, cache=True)
def _dot_q5_k(w, r, x, xs):
    """Q5_K, element by element (a fifth bit per value from qh)."""
    acc = F32(0)
    for b in range(x.shape[0] // 256):
        o = b * 176
        d, dmin = _half(w, r, o), _half(w, r, o + 2)
        for c in range(4):
            qo, xo = o + 48 + 32 * c, b * 256 + 64 * c
            s0 = s1 = F32(0)
            for i in range(32):
                q = w[r, qo + i]
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
def _dot_q6_k(wr, ra, x2, xs):
    """Row wr [row_bytes] (at address ra) . x2 [1, K]: Q6_K."""
    acc = vzero()
    rest = F32(0)  # the codes' -32
    sixteen = vsplat(F32(16))
    for b in range(x2.shape[1] // 256):
        o = 210 * b
        d = load_f16(ra + o + 208)
        for h in range(2):
            for c in range(4):
                lo, hi = ra + o + 64 * h + 32 * (c & 1), ra + o + 128 + 32 * h
                xo, ls, hs = b * 256 + 128 * h + 32 * c, 4 * (c >> 1), 2 * c
                s0, s1 = vzero(), vzero()
                for t in range(0, 16, W):
                    q0 = vfma(vbits(hi + t, hs, 3), sixteen, vbits(lo + t, ls, 15))
                    q1 = vfma(vbits(hi + 16 + t, hs, 3), sixteen, vbits(lo + 16 + t, ls, 15))
                    s0 = vfma(q0, vload(x2, 0, xo + t), s0)
                    s1 = vfma(q1, vload(x2, 0, xo + 16 + t), s1)
                j = 8 * h + 2 * c  # sub-block of 16 (and its x sum)
                sc0 = d * F32(np.int8(wr[o + 192 + j]))
                sc1 = d * F32(np.int8(wr[o + 193 + j]))
                acc = vfma(vsplat(sc0), s0, vfma(vsplat(sc1), s1, acc))
                rest -= F32(32) * (sc0 * xs[b * 16 + j] + sc1 * xs[b * 16 + j + 1])
    return vhsum(acc) + rest


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _dot(w, qtype, r, x, x2, xs):
    ra = w.ctypes.data + r * w.strides[0]
    if qtype == Q4_K:
        return _dot_q4_k(w[r], ra, x2, xs)  # one row view a row, for its scale bytes
    if qtype == Q6_K:
        return _dot_q6_k(w[r], ra, x2, xs)
    if qtype == Q8_0:
        return _dot_q8_0(ra, x2)
    if qtype == Q5_K:
        return _dot_q5_k(w, r, x, xs)
    if qtype == Q5_0 or qtype == Q5_1:
        return _dot_q5_01(w, r, x, xs, qtype == Q5_1)
    return _dot_q4_01(ra, x2, xs, qtype == Q4_1)


@njit(fastmath=FASTMATH, cache=True)
def _float_rows(w, qtype, r0, r1, x, x2, xs, out):
    # rows [r0, r1) of the float path into out: one compiled body for the serial and the
    # parallel caller (with the dot inlined into each, the copy Numba loaded from its cache for
    # the parallel region rounded differently from the serial loop)
    for r in range(r0, r1):
        out[r] = _dot(w, qtype, r, x, x2, xs)


@njit(parallel=True, nogil=True, cache=True)
def _qgemv(w, qtype, x, serial=False):
    # w [N, row_bytes] u8; x [K] f32 -> [N] f32. `serial`: on the calling thread alone
    n = w.shape[0]
    xs = _xsums(x)
    x2 = x.reshape(1, x.shape[0])  # [1, K]: rows of W lanes for vload
    out = np.empty(n, F32)
    if serial:
        _float_rows(w, qtype, 0, n, x, x2, xs, out)
        return out
    for it in prange((n + RB - 1) // RB):
        _float_rows(w, qtype, it * RB, min(n, it * RB + RB), x, x2, xs, out)
    return out


# AVX512-VNNI path (as llama.cpp's): x is rounded to int8, per 32 channels for the 32-blocks (Q8_0,
# Q4_0, Q4_1, Q5_0, Q5_1) and per 256 for the K-quants; each block's codes meet x's codes in
# vpdpbusd (kernels/_qvec.py has the steps). Constant terms (mins, code offsets) use the sums of x's
# codes, so the result is exactly W times the int8-rounded x. A thread reads its item's rows in
# order, each a stream the prefetchers follow: K-quant rows one at a time (four at once, sharing
# x's loads, were four short streams and read 0.75-0.8x as fast from memory; two, 0.7-0.87x), and
# 32-block rows two at a time, whose short steps cost about what x's loads do (one row at a time:
# 0.7-0.95x at 8B widths).
AHEAD = 8192  # bytes: how far on in its row a step prefetches (2 threads, 8B-width Q4_K / Q6_K
# from memory: 1.25x / 1.28x the four-row tiles; 4 KB and 16 KB are within 2%)
SERIAL_BYTES = 1 << 17  # smaller weights run on the calling thread alone: a parallel region
# costs ~2 us while the kernels' threads spin (kernels/__init__.py), ~45 us to wake them once
# asleep; a matrix this size takes ~5 us on one core
_K45_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # Q4_K / Q5_K: x's sub-blocks of 32 as the step reads them


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _x_scale(xa, n):
    """x's scale (largest |x| / 127) over the n float32 at address xa, and 127 / largest |x|
    (0 for all zeros)."""
    m = F32(0)
    for i in range(0, n, 16):
        m = max(m, absmax16(xa + 4 * i))
    return m / F32(127), F32(127) / m if m > 0 else F32(0)


@njit(fastmath=FASTMATH, cache=True)
def _quantise_x(x, group):
    """x [K] -> int8 codes [K] (x / its scale, rounded half to even), scale per `group`
    channels [K/group], codes' sums per 16 [K/16] and per 32 [K/32] (int32)."""
    k = x.shape[0]
    q = np.empty(k, np.int8)
    dx = np.empty(k // group, F32)
    s16 = np.empty(k // 16, np.int32)
    s32 = np.empty(k // 32, np.int32)
    xa, qa = x.ctypes.data, q.ctypes.data
    for j in range(k // group):
        dx[j], inv = _x_scale(xa + 4 * group * j, group)
        for h in range(group * j // 16, group * (j + 1) // 16):
            s16[h] = codes16(qa + 16 * h, xa + 64 * h, inv)
    for j in range(k // 32):
        s32[j] = s16[2 * j] + s16[2 * j + 1]
    return q, dx, s16, s32


@njit(fastmath=FASTMATH, cache=True)
def _x_tables(x, qtype):
    """x [K] -> what the steps read (_qvec.step32, q4k_step ...): x's codes (as `_quantise_x`
    rounds them) in the order a step takes them [K rounded up to 128] int8, a float32 and an
    int32 table. 32-blocks: per group of four blocks 32 floats (x's scale of each block in 4
    lanes, then Q4_1 / Q5_1's dx x code sum of each block) and 32 ints (the blocks' constant terms);
    K-quants: x's scale per super-block and 16 ints per super-block. One pass, no other array."""
    k = x.shape[0]
    kq = qtype == Q4_K or qtype == Q5_K or qtype == Q6_K
    group = 256 if kq else 32
    ng = (k // 32 + 3) // 4  # groups of four 32-blocks
    codes = np.empty(k, np.int8) if kq else np.zeros(128 * ng, np.int8)
    tf = np.empty(k // 256, F32) if kq else np.zeros(32 * ng, F32)
    ti = np.zeros(16 * (k // 256) if kq else 32 * ng, np.int32)
    off = 128 if qtype == Q8_0 else 8 if qtype == Q4_0 else 16  # the codes' offset (Q8_0's +128)
    xa, qa = x.ctypes.data, codes.ctypes.data
    for j in range(k // group):
        dx, inv = _x_scale(xa + 4 * group * j, group)
        total = np.int32(0)
        for h in range(group * j // 16, group * (j + 1) // 16):  # 16 codes at a time
            c32 = h // 2
            if qtype == Q8_0 or qtype == Q6_K:
                dst = 16 * h
            elif kq:
                dst = 256 * (c32 // 8) + 32 * _K45_ORDER[c32 % 8] + 16 * (h % 2)
            else:  # elements 0-15 of blocks 0-3 of a group, then their 16-31
                dst = 128 * (c32 // 4) + 64 * (h % 2) + 16 * (c32 % 4)
            s = codes16(qa + dst, xa + 64 * h, inv)
            if qtype == Q6_K:
                ti[h] = -32 * s
            elif kq:
                ti[16 * (c32 // 8) + c32 % 8] -= s
            total += s
        if kq:
            tf[j] = dx
            continue
        g, b = j // 4, j % 4
        if qtype == Q8_0:
            ti[32 * g + 16 * (b // 2) + 8 * (b % 2)] = -off * total
        else:
            ti[32 * g + 4 * b] = -off * total
        for i in range(4):
            tf[32 * g + 4 * b + i] = dx
        tf[32 * g + 16 + b] = dx * F32(total)
    return codes, tf, ti


AVX2_TYPES = (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)  # the AVX2 int8 path's types (Q5s: float path)


@njit(fastmath=FASTMATH, cache=True)
def _rows8(w, qtype, r0, r1, codes, dx, s16, s32, out):
    """out[r0:r1] = W[r0:r1] . x, AVX2 int8 steps (kernels/_qavx2.py) a row at a time; x as
    `_quantise_x` rounds it (codes, scale per group dx, code sums per 16 and per 32)."""
    rb = w.shape[1]
    wa = w.ctypes.data  # taken here, inside the caller's loop (see rows_k)
    for r in range(r0, r1):
        ra = wa + r * rb
        if qtype == Q4_K:
            out[r] = _row8(Q4_K, ra, rb, codes, dx, s16, s32)
        elif qtype == Q6_K:
            out[r] = _row8(Q6_K, ra, rb, codes, dx, s16, s32)
        elif qtype == Q8_0:
            out[r] = _row8(Q8_0, ra, rb, codes, dx, s16, s32)
        elif qtype == Q4_1:
            out[r] = _row8(Q4_1, ra, rb, codes, dx, s16, s32)
        else:
            out[r] = _row8(Q4_0, ra, rb, codes, dx, s16, s32)


def _row8(qtype, ra, rb, codes, dx, s16, s32):
    """The row at address ra (rb bytes) . x, compiled once per type (`qtype` a literal)."""


@overload(_row8, prefer_literal=True, jit_options={"fastmath": FASTMATH}, inline="always")
def _row8_impl(qtype, ra, rb, codes, dx, s16, s32):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value
    nb = BLOCK[q][1]
    if q in (Q4_K, Q6_K):  # a super-block a step; its code sums per 32 (Q4_K) or 16 (Q6_K)
        step, per = (q4k_step8, 32) if q == Q4_K else (q6k_step8, 64)

        def row_k(qtype, ra, rb, codes, dx, s16, s32):
            xa, sa = codes.ctypes.data, (s32 if q == Q4_K else s16).ctypes.data
            acc = vzero()
            for b in range(rb // nb):
                acc = step(acc, ra + nb * b, xa + 256 * b, sa + per * b, dx[b])
            return vhsum(acc)
        return row_k
    two, one = {Q8_0: (q8_0_step8, q8_0_step8_1), Q4_0: (q4_0_step8, q4_0_step8_1),
                Q4_1: (q4_1_step8, q4_1_step8_1)}[q]

    def row_b32(qtype, ra, rb, codes, dx, s16, s32):  # two blocks a step, an odd one alone
        xa, fa, ia = codes.ctypes.data, dx.ctypes.data, s32.ctypes.data
        nblk = rb // nb
        acc = vzero()
        for b in range(0, nblk - 1, 2):
            acc = two(acc, ra + nb * b, xa + 32 * b, fa + 4 * b, ia + 4 * b)
        if nblk % 2:
            b = nblk - 1
            acc = one(acc, ra + nb * b, xa + 32 * b, fa + 4 * b, ia + 4 * b)
        return vhsum(acc)
    return row_b32


@njit(parallel=True, nogil=True, cache=True)
def _qgemv_avx2(w, qtype, x, out, serial):
    # w [N, row_bytes] u8; x [K] f32; out [N] f32. `serial`: all on the calling thread
    n = w.shape[0]
    codes, dx, s16, s32 = _quantise_x(x, 256 if qtype == Q4_K or qtype == Q6_K else 32)
    if serial:
        _rows8(w, qtype, 0, n, codes, dx, s16, s32, out)
        return
    for it in prange((n + RB - 1) // RB):
        _rows8(w, qtype, it * RB, min(n, it * RB + RB), codes, dx, s16, s32, out)


def int8_path(qtype: int, k: int) -> bool:
    """Whether `qgemv` rounds x to int8 for this type and width on this CPU (else float32)."""
    if VNNI:
        return k % (256 if qtype in (Q4_K, Q5_K, Q6_K) else 64) == 0
    return AVX2 and qtype in AVX2_TYPES


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _prefetch1(a, o, n):
    """Prefetch bytes o .. o + n of the stream at address a, AHEAD bytes on."""
    for i in range(o + AHEAD, o + AHEAD + n, 64):
        prefetch(a + i)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _lane_sum(c):
    """The lane sum of a row's accumulator (hsum4's tree: the sums the four-row tiles gave)."""
    y, _, _, _ = hsum4(c, c, c, c)
    return y


def _rows(qtype, w, r0, r1, codes, tf, ti, out):
    """out[r0:r1] = W[r0:r1] . x (x as `_x_tables` left it): K-quants a row at a time, 32-blocks
    two rows at a time. Compiled once per type (`qtype` a literal): a loop of that type's steps."""


@overload(_rows, prefer_literal=True, jit_options={"fastmath": FASTMATH})
def _rows_impl(qtype, w, r0, r1, codes, tf, ti, out):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value
    nb = BLOCK[q][1]  # bytes per block
    if q in (Q4_K, Q5_K, Q6_K):
        step = {Q4_K: q4k_step, Q5_K: q5k_step, Q6_K: q6k_step}[q]

        def rows_k(qtype, w, r0, r1, codes, tf, ti, out):
            rb = w.shape[1]
            # raw addresses taken here, inside the caller's loop: Numba frees an array after its
            # last use, so addresses taken before the loop could point at memory `out` reuses
            wa, xa, ia = w.ctypes.data, codes.ctypes.data, ti.ctypes.data
            for r in range(r0, r1):
                a = wa + r * rb
                c = vzero()
                for b in range(rb // nb):  # super-blocks
                    o, t = nb * b, xa + 256 * b
                    _prefetch1(a, o, nb)
                    c = step(c, a + o, ldv(t), ldv(t + 64), ldv(t + 128), ldv(t + 192), tf[b],
                             ldv(ia + 64 * b))
                out[r] = _lane_sum(c)
        return rows_k
    full, tail = step32(q, False), step32(q, True)

    def rows_32(qtype, w, r0, r1, codes, tf, ti, out):
        n, rb = w.shape[0], w.shape[1]
        wa, xa, fa, ia = w.ctypes.data, codes.ctypes.data, tf.ctypes.data, ti.ctypes.data
        nblk = rb // nb
        for r in range(r0, r1, 2):  # two rows (past the last row: the last row again)
            a0, a1 = wa + r * rb, wa + min(r + 1, n - 1) * rb
            c0 = c1 = vzero()
            for g in range((nblk + 3) // 4):  # groups of four blocks; the last may be two
                o, t = 4 * nb * g, 128 * g  # byte offsets: the rows', x's codes' and tables'
                x1, x2 = ldv(xa + t), ldv(xa + t + 64)
                sx, f2, i1, i2 = ldv(fa + t), ldv(fa + t + 64), ldv(ia + t), ldv(ia + t + 64)
                _prefetch1(a0, o, 4 * nb)
                _prefetch1(a1, o, 4 * nb)
                if 4 * g + 4 <= nblk:
                    c0 = full(c0, a0 + o, x1, x2, sx, f2, i1, i2)
                    c1 = full(c1, a1 + o, x1, x2, sx, f2, i1, i2)
                else:
                    c0 = tail(c0, a0 + o, x1, x2, sx, f2, i1, i2)
                    c1 = tail(c1, a1 + o, x1, x2, sx, f2, i1, i2)
            y0, y1, _, _ = hsum4(c0, c1, c1, c1)
            out[r] = y0
            if r + 1 < r1:
                out[r + 1] = y1
    return rows_32


@njit(fastmath=FASTMATH, cache=True)
def _item(w, qtype, r0, r1, codes, tf, ti, out):
    """Rows r0:r1 of out. One branch per type."""
    if qtype == Q4_1:
        _rows(Q4_1, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q8_0:
        _rows(Q8_0, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q5_0:
        _rows(Q5_0, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q4_K:
        _rows(Q4_K, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q6_K:
        _rows(Q6_K, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q4_0:
        _rows(Q4_0, w, r0, r1, codes, tf, ti, out)
    elif qtype == Q5_1:
        _rows(Q5_1, w, r0, r1, codes, tf, ti, out)
    else:
        _rows(Q5_K, w, r0, r1, codes, tf, ti, out)


@njit(parallel=True, nogil=True, cache=True)
def _qgemv_vnni(w, w2, qtype, x, out, out2, rows_per_item, serial):
    # w [N, row_bytes], w2 [N2, row_bytes] u8 (N2 may be 0); x [K] f32 (K a multiple of 64, or
    # of 256 for K-quants); out [N], out2 [N2] f32; rows_per_item rows a work item. `serial`: all
    # on the calling thread (no parallel region). Two matrices of one input share x's rounding
    # and one parallel region (q and k, gate and up of a decode step).
    n, n2 = w.shape[0], w2.shape[0]
    codes, tf, ti = _x_tables(x, qtype)
    if serial:
        _item(w, qtype, 0, n, codes, tf, ti, out)
        if n2:
            _item(w2, qtype, 0, n2, codes, tf, ti, out2)
        return
    m = (n + rows_per_item - 1) // rows_per_item
    for it in prange(m + (n2 + rows_per_item - 1) // rows_per_item):
        if it < m:
            r0 = it * rows_per_item
            _item(w, qtype, r0, min(n, r0 + rows_per_item), codes, tf, ti, out)
        else:
            r0 = (it - m) * rows_per_item
            _item(w2, qtype, r0, min(n2, r0 + rows_per_item), codes, tf, ti, out2)


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
def _dequant(w, qtype, rows, c0, c1, out, serial):
    # rows [R] int64 row ids -> out [R, c1 - c0] f32 (or uint16 bf16 bits). `serial`: all on the
    # calling thread (a decode step's embedding row: no parallel region)
    if serial:
        for i in range(rows.shape[0]):
            _decode_row(w[rows[i]], qtype, c0, c1, out[i])
        return out
    for i in prange(rows.shape[0]):
        _decode_row(w[rows[i]], qtype, c0, c1, out[i])
    return out


_U8, _F32 = np.dtype(np.uint8), np.dtype(F32)  # dtypes compare faster with dtypes than types


def _check(w: np.ndarray, qtype: int, k: int) -> np.ndarray:
    if qtype not in BLOCK:
        raise ValueError(f"unknown quant type {qtype}")
    blk, nbytes = BLOCK[qtype]
    if k % blk or w.ndim != 2 or w.shape[1] != k // blk * nbytes or w.dtype != _U8:
        raise ValueError(f"w must be [N, {k // blk * nbytes}] uint8 rows of {k} elements in "
                         f"type {qtype}, got {w.dtype} {w.shape}")
    return readonly(w)


def _out(out: np.ndarray | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, F32)
    if (not isinstance(out, np.ndarray) or out.dtype != _F32 or out.shape != (n,)
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape ({n},)")
    return out


def _rows_per_item(n: int, threads: int) -> int:
    """Rows a work item of the VNNI path takes: about 8 items a thread (dynamic schedule), 16
    to 256 rows each, an even number (32-block rows go in pairs)."""
    return max(16, min(256, n // (8 * threads) // 2 * 2))


def qgemv(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = W x: w [N, row_bytes] uint8 in `qtype`, x [K] float32 -> y [N] float32. `out`: a
    C-contiguous float32 [N] array to write y into (and return), so that a caller can reuse one."""
    k = x.shape[0]
    w = _check(w, qtype, k)
    out = _out(out, w.shape[0])
    threads = use_threads()
    serial = threads == 1 or w.nbytes < SERIAL_BYTES
    if not int8_path(qtype, k):
        out[:] = _qgemv(w, qtype, readonly(x, _F32), serial)
    elif VNNI:
        _qgemv_vnni(w, w[:0], qtype, readonly(x, _F32), out, out[:0],
                    _rows_per_item(w.shape[0], threads), serial)
    else:
        _qgemv_avx2(w, qtype, readonly(x, _F32), out, serial)
    return out


def qgemv2(w: np.ndarray, w2: np.ndarray, qtype: int,
           x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W x, W2 x) for two matrices of one type and width: on the VNNI path x is rounded once and
    both run in one parallel region (a small model's per-call cost is a good part of a GEMV);
    elsewhere two `qgemv` calls."""
    k = x.shape[0]
    w, w2 = _check(w, qtype, k), _check(w2, qtype, k)
    if not (VNNI and int8_path(qtype, k)):
        return qgemv(w, qtype, x), qgemv(w2, qtype, x)
    out, out2 = np.empty(w.shape[0], F32), np.empty(w2.shape[0], F32)
    threads = use_threads()
    serial = threads == 1 or w.nbytes + w2.nbytes < SERIAL_BYTES
    _qgemv_vnni(w, w2, qtype, readonly(x, _F32), out, out2,
                _rows_per_item(w.shape[0] + w2.shape[0], threads), serial)
    return out, out2


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
    return _dequant(w, qtype, np.arange(r0, r1, dtype=np.int64), c0, c1, out, False)


def dequant_rows(w: np.ndarray, qtype: int, k: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` [R] of W, dequantised: [R, K] float32 (embedding lookups)."""
    w = _check(w, qtype, k)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError("row id out of range")
    out = np.empty((ids.shape[0], k), F32)
    serial = ids.shape[0] * w.shape[1] < SERIAL_BYTES
    if not serial:
        use_threads()
    return _dequant(w, qtype, ids, 0, k, out, serial)


def qgemv_ref(w: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
    """float64 reference of `qgemv`: the `gguf` package's dequantisation, then a matmul."""
    import gguf

    wd = gguf.quants.dequantize(np.asarray(w), gguf.GGMLQuantizationType(qtype))
    return wd.astype(np.float64) @ np.asarray(x, np.float64)
