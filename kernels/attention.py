"""Exact decode attention of one query token over selected KV blocks, with log-sum-exp partials.

Work is split over (KV head x part of the block list); parts merge by log-sum-exp. Each item walks
its blocks in chunks of CH rows: scores for 4 query heads x 4 rows per register tile (each K/V row
is read once from memory for the whole GQA group), an online softmax per chunk, then p @ V in the
same tiles. A group of g heads takes g // 4 such tiles and, for the last g % 4 heads, tiles of
that many (no padded rows: g = 3, 7 do no work for a fourth or eighth head). With AVX2's 16
registers (W = 8) a 4 x 4 tile spills its accumulators every channel group: scores take tiles of
up to 4 heads x 2 rows and p @ V a pass per channel group for up to 4 heads. Scores are in log2
units (q is pre-scaled by scale * log2(e)) for the exp2 polynomial.
Queries and outputs use the packed channel order of `packed_channels` (see _vec.py).

With shifts (one per block, in blocks), a block is read as if it sat that many blocks later: its
chunks use the query turned back by the shift (RoPE: q.R(p + t)k = (R(-t)q).R(p)k), from a table
of turns (`Turns`). A chunk holds rows of one shift only.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ._simd import F32, FASTMATH, LN2, LOG2E, NEG_INF, exp2_neg, kv_to_f64, kv_view, readonly
from ._vec import (
    W,
    packed_channels,
    prefetch,
    row_addr,
    touch,
    vadd,
    vexp2_neg,
    vfma,
    vhmax,
    vhsum,
    vload,
    vload2,
    vmax,
    vmul,
    vsplat,
    vsplat4,
    vstore,
    vsub,
    vsum4,
    vzero,
)
from .kvquant import head_dim_of, kv_dim, kv_row_bytes
from .threads import split_threads, use_threads

CH = 128  # rows per chunk (a multiple of 4): the next chunk is prefetched during this one
PAGE = 4096  # bytes: the next chunk's rows are touched one per page


@njit(inline="always", cache=True)
def _prefetch_lines(pf, r0, r1, lo, hi):
    """Prefetch lines lo..hi-1 (64 bytes each) of the rows r0..r1-1 at addresses pf[]."""
    for i in range(r0, r1):
        for line in range(lo, hi):
            prefetch(pf[i] + line * 64)


@njit(inline="always", cache=True)
def _next_rows(pf, t, p1):
    """Addresses of the next chunk's rows t..t+3 (zeros unless all 4 exist: p1 == t + 4)."""
    if p1 == t + 4:
        return pf[t], pf[t + 1], pf[t + 2], pf[t + 3]
    return 0, 0, 0, 0


@njit(inline="always", cache=True)
def _prefetch_group(pf, t, p1, f, lo, hi):
    """Prefetch lines lo..hi-1 of the next chunk's rows t..p1-1: for a whole tile (addresses f)
    in straight-line code, since a loop over the rows costs about as many instructions as the
    tile's loads and FMAs (ad hoc, warm: 4-11% more rows a second; cold 0.96-0.98x the time);
    else row by row."""
    if p1 == t + 4:
        for line in range(lo, hi):
            o = line * 64
            prefetch(f[0] + o)
            prefetch(f[1] + o)
            prefetch(f[2] + o)
            prefetch(f[3] + o)
    else:
        _prefetch_lines(pf, t, p1, lo, hi)


@njit(inline="always", cache=True)
def _tile_rows(ra, pf, t, nt, npf, ng, nl, lpg):
    """Start a tile of rows t..t+3 of a chunk of nt rows at addresses ra[] (past nt: the last
    row again): prefetch the next chunk's (pf[:npf]) lines that the ng channel groups leave over
    (lpg each of nl) and, in the chunk's last tile, its rows past this one's. Returns the 4
    addresses, p1 (this tile's rows of the next chunk: t..p1-1) and their addresses."""
    if t + 8 > CH:  # the chunk's last tile also takes the rows past it
        _prefetch_lines(pf, t + 4, npf, 0, nl)
    p1 = min(t + 4, npf)
    if lpg * ng < nl:  # lines the groups leave over, taken at the tile's start (AVX2: all)
        _prefetch_lines(pf, t, p1, lpg * ng, nl)
    return ra[t], ra[t + 1], ra[t + 2], ra[t + 3], p1, _next_rows(pf, t, p1)


@njit(inline="always", cache=True)
def _pad_rows(ra, nt):
    """ra[nt:ceil4(nt)] = ra[nt - 1]: a chunk's last tile reads its last row again, unclamped."""
    for i in range(nt, -(-nt // 4) * 4):
        ra[i] = ra[nt - 1]


@njit(inline="always", cache=True)
def _qk_head(qp, h, c, e0, o0, e1, o1, e2, o2, e3, o3, a0, a1, a2, a3):
    """a_i += qp[h] . K row i over the channel group at packed channel c (row i as (e_i, o_i))."""
    qe, qo = vload(qp, h, c), vload(qp, h, c + W)
    return (vfma(qe, e0, vfma(qo, o0, a0)), vfma(qe, e1, vfma(qo, o1, a1)),
            vfma(qe, e2, vfma(qo, o2, a2)), vfma(qe, e3, vfma(qo, o3, a3)))


@njit(inline="always", cache=True)
def _qk_rest(qp, h, n, tag, ra, nt, d, s, pf, npf):
    """`qk_tiles` for the n (1-3, a constant at each call site: the other heads' loads and FMAs
    compile away) heads from h, in register tiles of n heads x 4 rows."""
    ng = qp.shape[1] // (2 * W)
    nl = -(-kv_row_bytes(tag, d) // 64)
    lpg = nl // ng
    for t in range(0, nt, 4):
        k0, k1, k2, k3, p1, f = _tile_rows(ra, pf, t, nt, npf, ng, nl, lpg)
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = vzero()
        for gi in range(ng):
            _prefetch_group(pf, t, p1, f, gi * lpg, gi * lpg + lpg)
            c = gi * 2 * W
            e0, o0 = vload2(tag, k0, d, gi)
            e1, o1 = vload2(tag, k1, d, gi)
            e2, o2 = vload2(tag, k2, d, gi)
            e3, o3 = vload2(tag, k3, d, gi)
            a00, a01, a02, a03 = _qk_head(qp, h, c, e0, o0, e1, o1, e2, o2, e3, o3, a00, a01,
                                          a02, a03)
            if n > 1:
                a10, a11, a12, a13 = _qk_head(qp, h + 1, c, e0, o0, e1, o1, e2, o2, e3, o3, a10,
                                              a11, a12, a13)
            if n > 2:
                a20, a21, a22, a23 = _qk_head(qp, h + 2, c, e0, o0, e1, o1, e2, o2, e3, o3, a20,
                                              a21, a22, a23)
        vsum4(s, h, t, a00, a01, a02, a03)
        if n > 1:
            vsum4(s, h + 1, t, a10, a11, a12, a13)
        if n > 2:
            vsum4(s, h + 2, t, a20, a21, a22, a23)


@njit(inline="always", cache=True)
def _qk_two(qp, h, n, tag, k0, k1, d, ng):
    """Lane partials of qp[h + i] . K rows k0, k1 for the n (1-4, a constant at each call site)
    heads from h, over every channel group: (a00, a01, a10, a11, ...), zeros past n."""
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = vzero()
    for gi in range(ng):
        c = gi * 2 * W
        e0, o0 = vload2(tag, k0, d, gi)
        e1, o1 = vload2(tag, k1, d, gi)
        qe, qo = vload(qp, h, c), vload(qp, h, c + W)
        a00, a01 = vfma(qe, e0, vfma(qo, o0, a00)), vfma(qe, e1, vfma(qo, o1, a01))
        if n > 1:
            qe, qo = vload(qp, h + 1, c), vload(qp, h + 1, c + W)
            a10, a11 = vfma(qe, e0, vfma(qo, o0, a10)), vfma(qe, e1, vfma(qo, o1, a11))
        if n > 2:
            qe, qo = vload(qp, h + 2, c), vload(qp, h + 2, c + W)
            a20, a21 = vfma(qe, e0, vfma(qo, o0, a20)), vfma(qe, e1, vfma(qo, o1, a21))
        if n > 3:
            qe, qo = vload(qp, h + 3, c), vload(qp, h + 3, c + W)
            a30, a31 = vfma(qe, e0, vfma(qo, o0, a30)), vfma(qe, e1, vfma(qo, o1, a31))
    return a00, a01, a10, a11, a20, a21, a30, a31


@njit(inline="always", cache=True)
def _qk_pairs(qp, h, n, tag, k0, k1, k2, k3, t, d, ng, s):
    """s[h + i, t:t + 4] for the n heads from h against rows k0..k3, two rows a pass."""
    x = _qk_two(qp, h, n, tag, k0, k1, d, ng)
    y = _qk_two(qp, h, n, tag, k2, k3, d, ng)
    vsum4(s, h, t, x[0], x[1], y[0], y[1])
    if n > 1:
        vsum4(s, h + 1, t, x[2], x[3], y[2], y[3])
    if n > 2:
        vsum4(s, h + 2, t, x[4], x[5], y[4], y[5])
    if n > 3:
        vsum4(s, h + 3, t, x[6], x[7], y[6], y[7])


@njit(fastmath=FASTMATH, cache=True)
def qk_tiles(qp, tag, ra, nt, d, s, pf, npf):
    """s[r, i] = qp[r] . K row i for rows i < nt (row i at address ra[i], d channels, tag's dtype).

    qp [R, P] packed queries (any R: heads in register tiles of 4 heads x 4 rows, the last
    R % 4 heads in tiles of that many, in a second pass over the rows; with AVX2 tiles of up to 4
    heads x 2 rows, `_qk_pairs`); s [R, CH]; columns nt..ceil4(nt) repeat the last row, whose
    address is written to ra[nt:ceil4(nt)] (ra holds CH).
    Rows pf[:npf] (the next chunk) are prefetched a tile at a time, a few lines per channel
    group, so the prefetches interleave evenly with the loads and FMAs. (A read loop of the same
    shape streams DRAM at 82-86% of the bulk rate this way, 66-76% with a tile's prefetches at
    once; in this kernel 0.90-1.03x the time, mostly within the noise; docs/benchmarks.md.)
    """
    ng = qp.shape[1] // (2 * W)
    nl = -(-kv_row_bytes(tag, d) // 64)  # cache lines per row
    lpg = nl // ng  # lines prefetched with each channel group
    r4 = qp.shape[0] - qp.shape[0] % 4  # heads in groups of 4
    if nt > 0:
        _pad_rows(ra, nt)
    if W == 8:  # 16 registers: tiles of up to 4 heads x 2 rows, all prefetches at a tile's start
        n = qp.shape[0] - r4
        for t in range(0, nt, 4):
            k0, k1, k2, k3, p1, f = _tile_rows(ra, pf, t, nt, npf, ng, nl, 0)
            for h in range(0, r4, 4):
                _qk_pairs(qp, h, 4, tag, k0, k1, k2, k3, t, d, ng, s)
            if n == 3:
                _qk_pairs(qp, r4, 3, tag, k0, k1, k2, k3, t, d, ng, s)
            elif n == 2:
                _qk_pairs(qp, r4, 2, tag, k0, k1, k2, k3, t, d, ng, s)
            elif n == 1:
                _qk_pairs(qp, r4, 1, tag, k0, k1, k2, k3, t, d, ng, s)
        return
    for t in range(0, nt if r4 else 0, 4):
        k0, k1, k2, k3, p1, f = _tile_rows(ra, pf, t, nt, npf, ng, nl, lpg)
        for h in range(0, r4, 4):
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero()
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = vzero()
            p1h = p1 if h == 0 else t  # once per tile, not per group of 4 heads
            for gi in range(ng):
                _prefetch_group(pf, t, p1h, f, gi * lpg, gi * lpg + lpg)
                c = gi * 2 * W
                e0, o0 = vload2(tag, k0, d, gi)
                e1, o1 = vload2(tag, k1, d, gi)
                e2, o2 = vload2(tag, k2, d, gi)
                e3, o3 = vload2(tag, k3, d, gi)
                qe, qo = vload(qp, h, c), vload(qp, h, c + W)
                a00 = vfma(qe, e0, vfma(qo, o0, a00))
                a01 = vfma(qe, e1, vfma(qo, o1, a01))
                a02 = vfma(qe, e2, vfma(qo, o2, a02))
                a03 = vfma(qe, e3, vfma(qo, o3, a03))
                qe, qo = vload(qp, h + 1, c), vload(qp, h + 1, c + W)
                a10 = vfma(qe, e0, vfma(qo, o0, a10))
                a11 = vfma(qe, e1, vfma(qo, o1, a11))
                a12 = vfma(qe, e2, vfma(qo, o2, a12))
                a13 = vfma(qe, e3, vfma(qo, o3, a13))
                qe, qo = vload(qp, h + 2, c), vload(qp, h + 2, c + W)
                a20 = vfma(qe, e0, vfma(qo, o0, a20))
                a21 = vfma(qe, e1, vfma(qo, o1, a21))
                a22 = vfma(qe, e2, vfma(qo, o2, a22))
                a23 = vfma(qe, e3, vfma(qo, o3, a23))
                qe, qo = vload(qp, h + 3, c), vload(qp, h + 3, c + W)
                a30 = vfma(qe, e0, vfma(qo, o0, a30))
                a31 = vfma(qe, e1, vfma(qo, o1, a31))
                a32 = vfma(qe, e2, vfma(qo, o2, a32))
                a33 = vfma(qe, e3, vfma(qo, o3, a33))
            vsum4(s, h, t, a00, a01, a02, a03)
            vsum4(s, h + 1, t, a10, a11, a12, a13)
            vsum4(s, h + 2, t, a20, a21, a22, a23)
            vsum4(s, h + 3, t, a30, a31, a32, a33)
    n, npf = qp.shape[0] - r4, 0 if r4 else npf  # the rest; the first pass prefetched
    if n == 3:
        _qk_rest(qp, r4, 3, tag, ra, nt, d, s, pf, npf)
    elif n == 2:
        _qk_rest(qp, r4, 2, tag, ra, nt, d, s, pf, npf)
    elif n == 1:
        _qk_rest(qp, r4, 1, tag, ra, nt, d, s, pf, npf)


@njit(inline="always", cache=True)
def _pv_head(s, h, t, x0, x1, x2, x3, ae, ao, y0, y1, y2, y3):
    """(ae, ao) + s[h, t:t + 4] @ 4 rows of a channel group, row i as (x_i, y_i)."""
    p0, p1, p2, p3 = vsplat4(s, h, t)
    ae = vfma(p0, x0, vfma(p1, x1, vfma(p2, x2, vfma(p3, x3, ae))))
    ao = vfma(p0, y0, vfma(p1, y1, vfma(p2, y2, vfma(p3, y3, ao))))
    return ae, ao


@njit(inline="always", cache=True)
def _pv_group(s, h, n, tag, rv, nt, d, acc, gi, pf, npf, lo, hi):
    """acc[h + i, channel group gi] += s[h + i, :nt] @ V rows rv[:nt] for the n (1-4, a constant
    at each call site: the other heads' code compiles away) heads from h, 4 rows at a time, the
    accumulators in registers; prefetches lines lo..hi-1 of the next chunk's rows pf[:npf]."""
    c = gi * 2 * W
    a0e, a0o = vload(acc, h, c), vload(acc, h, c + W)
    a1e = a1o = a2e = a2o = a3e = a3o = vzero()
    if n > 3:
        a3e, a3o = vload(acc, h + 3, c), vload(acc, h + 3, c + W)
    if n > 1:
        a1e, a1o = vload(acc, h + 1, c), vload(acc, h + 1, c + W)
    if n > 2:
        a2e, a2o = vload(acc, h + 2, c), vload(acc, h + 2, c + W)
    for t in range(0, nt, 4):
        p1 = min(t + 4, npf)
        _prefetch_group(pf, t, p1, _next_rows(pf, t, p1), lo, hi)
        e0, o0 = vload2(tag, rv[t], d, gi)
        e1, o1 = vload2(tag, rv[t + 1], d, gi)
        e2, o2 = vload2(tag, rv[t + 2], d, gi)
        e3, o3 = vload2(tag, rv[t + 3], d, gi)
        a0e, a0o = _pv_head(s, h, t, e0, e1, e2, e3, a0e, a0o, o0, o1, o2, o3)
        if n > 1:
            a1e, a1o = _pv_head(s, h + 1, t, e0, e1, e2, e3, a1e, a1o, o0, o1, o2, o3)
        if n > 2:
            a2e, a2o = _pv_head(s, h + 2, t, e0, e1, e2, e3, a2e, a2o, o0, o1, o2, o3)
        if n > 3:
            a3e, a3o = _pv_head(s, h + 3, t, e0, e1, e2, e3, a3e, a3o, o0, o1, o2, o3)
    vstore(acc, h, c, a0e)
    vstore(acc, h, c + W, a0o)
    if n > 1:
        vstore(acc, h + 1, c, a1e)
        vstore(acc, h + 1, c + W, a1o)
    if n > 2:
        vstore(acc, h + 2, c, a2e)
        vstore(acc, h + 2, c + W, a2o)
    if n > 3:
        vstore(acc, h + 3, c, a3e)
        vstore(acc, h + 3, c + W, a3o)


@njit(inline="always", cache=True)
def _pv_rest(s, tag, rv, nt, d, acc, h, pf, npf):
    """`_pv_tiles` for the heads h.. (1-4 of them): a pass over the rows per channel group, the
    group's accumulators in registers. (A 4 x 4 tile adds to acc in memory and the next tile
    reloads it: that round trip, not the FMAs, bounds it, and a 3 x 4 tile took as long as the
    4 x 4; these passes 0.6-0.75x the time, ad hoc, warm, SmolLM2's shape.) Prefetches the lines
    of the rows pf[:npf] a group's share per pass."""
    ng = acc.shape[1] // (2 * W)
    nl = -(-kv_row_bytes(tag, d) // 64)
    lpg = nl // ng
    n = min(4, acc.shape[0] - h)
    for gi in range(ng):
        lo, hi = gi * lpg, nl if gi == ng - 1 else gi * lpg + lpg  # the last takes the rest
        if n == 4:
            _pv_group(s, h, 4, tag, rv, nt, d, acc, gi, pf, npf, lo, hi)
        elif n == 3:
            _pv_group(s, h, 3, tag, rv, nt, d, acc, gi, pf, npf, lo, hi)
        elif n == 2:
            _pv_group(s, h, 2, tag, rv, nt, d, acc, gi, pf, npf, lo, hi)
        else:
            _pv_group(s, h, 1, tag, rv, nt, d, acc, gi, pf, npf, lo, hi)
    _prefetch_lines(pf, -(-nt // 4) * 4, npf, 0, nl)  # the next chunk's rows past this one's


@njit(fastmath=FASTMATH, cache=True)
def _pv_tiles(s, tag, rv, nt, d, acc, pf, npf):
    """acc[r] += sum_i s[r, i] * V row i over rows i < nt (row i at address rv[i]).

    s [R, CH] probabilities with columns nt..ceil4(nt) zero; acc [R, P] packed (any R: heads in
    register tiles of 4 heads x 4 rows, the last R % 4 heads by `_pv_rest`; with AVX2 all heads
    by `_pv_rest`, 4 at a time). Rows pf[:npf] are prefetched as in qk_tiles; rv[nt:ceil4(nt)]
    is overwritten with the last row.
    """
    ng = acc.shape[1] // (2 * W)
    nl = -(-kv_row_bytes(tag, d) // 64)
    lpg = nl // ng
    r4 = acc.shape[0] - acc.shape[0] % 4  # heads in groups of 4
    if nt > 0:
        _pad_rows(rv, nt)
    if W == 8:  # 16 registers: up to 4 heads a pass per channel group, accumulators in registers
        for h in range(0, acc.shape[0], 4):
            _pv_rest(s, tag, rv, nt, d, acc, h, pf, npf if h == 0 else 0)
        return
    for t in range(0, nt if r4 else 0, 4):
        v0, v1, v2, v3, p1, f = _tile_rows(rv, pf, t, nt, npf, ng, nl, lpg)
        for h in range(0, r4, 4):
            p00, p01, p02, p03 = vsplat4(s, h, t)
            p10, p11, p12, p13 = vsplat4(s, h + 1, t)
            p20, p21, p22, p23 = vsplat4(s, h + 2, t)
            p30, p31, p32, p33 = vsplat4(s, h + 3, t)
            p1h = p1 if h == 0 else t  # once per tile, not per group of 4 heads
            for gi in range(ng):
                _prefetch_group(pf, t, p1h, f, gi * lpg, gi * lpg + lpg)
                c = gi * 2 * W
                e0, o0 = vload2(tag, v0, d, gi)
                e1, o1 = vload2(tag, v1, d, gi)
                e2, o2 = vload2(tag, v2, d, gi)
                e3, o3 = vload2(tag, v3, d, gi)
                x = vfma(p02, e2, vfma(p03, e3, vload(acc, h, c)))
                vstore(acc, h, c, vfma(p00, e0, vfma(p01, e1, x)))
                x = vfma(p02, o2, vfma(p03, o3, vload(acc, h, c + W)))
                vstore(acc, h, c + W, vfma(p00, o0, vfma(p01, o1, x)))
                x = vfma(p12, e2, vfma(p13, e3, vload(acc, h + 1, c)))
                vstore(acc, h + 1, c, vfma(p10, e0, vfma(p11, e1, x)))
                x = vfma(p12, o2, vfma(p13, o3, vload(acc, h + 1, c + W)))
                vstore(acc, h + 1, c + W, vfma(p10, o0, vfma(p11, o1, x)))
                x = vfma(p22, e2, vfma(p23, e3, vload(acc, h + 2, c)))
                vstore(acc, h + 2, c, vfma(p20, e0, vfma(p21, e1, x)))
                x = vfma(p22, o2, vfma(p23, o3, vload(acc, h + 2, c + W)))
                vstore(acc, h + 2, c + W, vfma(p20, o0, vfma(p21, o1, x)))
                x = vfma(p32, e2, vfma(p33, e3, vload(acc, h + 3, c)))
                vstore(acc, h + 3, c, vfma(p30, e0, vfma(p31, e1, x)))
                x = vfma(p32, o2, vfma(p33, o3, vload(acc, h + 3, c + W)))
                vstore(acc, h + 3, c + W, vfma(p30, o0, vfma(p31, o1, x)))
    if r4 < acc.shape[0]:
        _pv_rest(s, tag, rv, nt, d, acc, r4, pf, 0 if r4 else npf)


@njit(fastmath=FASTMATH, cache=True)
def _chunk(qp, tag, ra, rv, nt, d, s, acc, m, den, ra_next, rv_next, n_next):
    """Online-softmax update of an item's state acc [R, P], m, den [R] (log2 units) by nt rows;
    prefetches the next chunk's n_next rows (K during scores, V during p @ V)."""
    qk_tiles(qp, tag, ra, nt, d, s, ra_next, n_next)
    for h in range(qp.shape[0]):
        for t in range(nt, CH):
            s[h, t] = NEG_INF
        mv = vload(s, h, 0)
        for c in range(W, CH, W):
            mv = vmax(mv, vload(s, h, c))
        mn = max(m[h], vhmax(mv))
        alpha = exp2_neg(m[h] - mn)
        mv = vsplat(mn)
        tot = vzero()
        for c in range(0, CH, W):
            p = vexp2_neg(vsub(vload(s, h, c), mv))
            vstore(s, h, c, p)
            tot = vadd(tot, p)
        den[h] = den[h] * alpha + vhsum(tot)
        m[h] = mn
        if alpha != F32(1.0):
            av = vsplat(alpha)
            for c in range(0, acc.shape[1], W):
                vstore(acc, h, c, vmul(vload(acc, h, c), av))
    _pv_tiles(s, tag, rv, nt, d, acc, rv_next, n_next)


@njit(nogil=True, cache=True)
def _fill(kb, vb, kt, vt, rb, bs, nb_base, ids, sh, n_tokens, i, t, ra, rv):
    """Addresses of the next (up to CH) K/V rows from token t of block ids[i]; with shifts sh
    (one per id; empty: none) the chunk ends where the shift changes. kb, vb / kt, vt: the
    addresses of the KV head's first row in the base / tail K and V; rb bytes a row, bs rows a
    block.

    Returns (rows filled, next i, next t).
    """
    nt = 0
    while nt < CH and i < ids.shape[0]:
        if sh.shape[0] > 0 and nt > 0 and sh[i] != sh[i - 1]:
            break
        b = ids[i]
        end = min(bs, n_tokens - b * bs)
        take = min(CH - nt, end - t)
        k0, v0, blk = (kb, vb, b) if b < nb_base else (kt, vt, b - nb_base)
        o = (blk * bs + t) * rb
        for r in range(take):
            ra[nt + r], rv[nt + r] = k0 + o + r * rb, v0 + o + r * rb
        nt += take
        t += take
        if t == end:
            i, t = i + 1, 0
    return nt, i, t


@njit(nogil=True, cache=True)
def _lines(r, c):
    """An uninitialised float32 array [r, c] (c % 16 == 0) whose rows start on 64-byte cache
    lines: no vector load or store of the tiles spans two lines. (Numba's arrays are 32-byte
    aligned: without this, A/Bs of the same two kernels came out 0.93x in one process and 1.05x
    in another, ad hoc, SmolLM2's shape with g = 4.)"""
    buf = np.empty(r * c + 16, F32)
    o = -(buf.ctypes.data // 4) % 16
    return buf[o:o + r * c].reshape((r, c))


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def turn_rows(qp, tab, pair, out):
    """out [R, P] = packed queries qp [R, P] turned by one row of a `Turns` table, tab [2, P]
    (cos, signed sin per packed channel); pair [P]: each channel's rotate-half partner, or [1]
    holding h when that is p + h for p < h and p - h for h <= p < 2h (no gather)."""
    c, s = tab[0], tab[1]
    if pair.shape[0] == 1:
        h = pair[0]
        for r in range(qp.shape[0]):
            for p in range(h):
                out[r, p] = qp[r, p] * c[p] + qp[r, p + h] * s[p]
            for p in range(h, 2 * h):
                out[r, p] = qp[r, p] * c[p] + qp[r, p - h] * s[p]
            for p in range(2 * h, qp.shape[1]):
                out[r, p] = qp[r, p]
        return
    for r in range(qp.shape[0]):
        for p in range(qp.shape[1]):
            out[r, p] = qp[r, p] * c[p] + qp[r, pair[p]] * s[p]


@njit(nogil=True, cache=True)
def attend_item(qp, k_base, v_base, k_tail, v_tail, nb_base, ids, sh, n_tokens, j, acc_out, m_out,
                den_out, tab, rot):
    """Attend packed queries qp [R, P] of KV head j over blocks `ids` (with shifts sh [n], or
    none), chunk by chunk; the rows of the next chunk are touched (a load per page) and
    prefetched while the current one is computed, the first chunk's before it (ad hoc A/B,
    SmolLM2's shape at 4K, 1 thread: 0.94x the time). The softmax state is the item's own until
    the end: the items' slots of the shared arrays share cache lines, which two threads writing
    every chunk would pass back and forth between their cores. So are the arrays each chunk's
    calls take, since a call adds to and takes from its array arguments' reference counts
    (atomics on the count of the array viewed, which every item shares): copies of qp, ids, sh,
    and for the KV dtype `tag`, an empty array (as above: 0.96x the time). The float arrays
    start on cache lines (`_lines`)."""
    r, p = qp.shape
    q0 = _lines(r, p)  # [R, P]
    q0[:, :] = qp
    qp, ids, sh = q0, ids.copy(), sh.copy()
    tag = np.empty((0, k_tail.shape[3]), k_tail.dtype)  # [0, row]
    rb, bs = k_tail.shape[3] * k_tail.itemsize, k_tail.shape[2]  # bytes a row, rows a block
    kb, vb = row_addr(k_base, j, 0, 0), row_addr(v_base, j, 0, 0)
    kt, vt = row_addr(k_tail, j, 0, 0), row_addr(v_tail, j, 0, 0)
    acc = _lines(r, p)  # [R, P]
    acc[:, :] = 0
    m, den = np.full(r, NEG_INF), np.zeros(r, F32)  # [R], [R]
    ra = np.empty((2, CH), np.intp)  # K row addresses, two chunks
    rv = np.empty((2, CH), np.intp)  # V row addresses
    s = _lines(r, CH)  # [R, CH]
    qt = _lines(r, p)  # [R, P] the query turned by `turned` blocks
    turned, mid = 0, tab.shape[0] // 2
    step = max(1, PAGE // rb)  # rows per page
    d = kv_dim(tag)
    nl = -(-kv_row_bytes(tag, d) // 64)  # cache lines a row
    first = 0  # the current chunk's first id
    nt, i, t = _fill(kb, vb, kt, vt, rb, bs, nb_base, ids, sh, n_tokens, 0, 0, ra[0], rv[0])
    _prefetch_lines(ra[0], 0, nt, 0, nl)
    _prefetch_lines(rv[0], 0, nt, 0, nl)
    cur = 0
    while nt > 0:
        nfirst = i
        nxt, i, t = _fill(kb, vb, kt, vt, rb, bs, nb_base, ids, sh, n_tokens, i, t, ra[1 - cur],
                          rv[1 - cur])
        # start the next chunk's page walks now, ahead of its prefetches (ad hoc A/Bs: 4-14%
        # faster over blocks picked from a 1M context)
        for r in range(0, nxt, step):
            touch(ra[1 - cur, r])
            touch(rv[1 - cur, r])
        q = qp
        if sh.shape[0] > 0 and sh[first] != 0:
            if sh[first] != turned:
                turn_rows(qp, tab[mid + sh[first]], rot, qt)
                turned = sh[first]
            q = qt
        _chunk(q, tag, ra[cur], rv[cur], nt, d, s, acc, m, den, ra[1 - cur], rv[1 - cur], nxt)
        nt, cur, first = nxt, 1 - cur, nfirst
    acc_out[:, :] = acc
    m_out[:] = m
    den_out[:] = den


@njit(parallel=True, nogil=True, cache=True)
def _attend(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, shifts, n_blocks, n_tokens,
            n_split, scale, perm, tab, rot):
    # q [Hq, d] f32; K/V [Hkv, nb, bs, row] (kv_view); blocks [S, n] int32; shifts [S, n] or
    # [S, 0] int32; perm [P] (packing); tab, rot: a `Turns`
    if not ids_in_range(blocks, n_blocks):
        raise ValueError("block id out of range")
    hkv = k_tail.shape[0]
    qp = pack_rows(q, hkv, perm, scale)  # [Hkv, R, P]
    r, p = qp.shape[1], qp.shape[2]
    n = blocks.shape[1]
    n_items = hkv * n_split
    acc, mx, den = softmax_state(n_items, r, p)  # [items, R, P], [items, R], [items, R]
    for item in prange(n_items):
        j, part = item // n_split, item % n_split
        row = 0 if blocks.shape[0] == 1 else j
        a, b = part * n // n_split, (part + 1) * n // n_split
        sh = shifts[row, a:b] if shifts.shape[1] else shifts[row]
        attend_item(qp[j], k_base, v_base, k_tail, v_tail, nb_base, blocks[row, a:b], sh,
                    n_tokens, j, acc[item], mx[item], den[item], tab, rot)
    return merge_items(acc, mx, den, n_split, q.shape[0] // hkv, q.shape[1], perm)


@njit(nogil=True, cache=True)
def ids_in_range(ids, n):
    """Whether every entry of the 2-D id array lies in 0..n-1 (block ids, checked in compiled
    code: a NumPy min and max cost tens of microseconds after a cache flush)."""
    for r in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if ids[r, i] < 0 or ids[r, i] >= n:
                return False
    return True


@njit(nogil=True, cache=True)
def softmax_state(n, r, p):
    """Empty online-softmax states: acc [n, r, p] = 0, max [n, r] = -inf, denominator [n, r] = 0.

    A serial function: in a parallel one, np.zeros would become a parfor of its own."""
    return np.zeros((n, r, p), F32), np.full((n, r), NEG_INF), np.zeros((n, r), F32)


@njit(nogil=True, cache=True)
def pack_rows(x, hkv, perm, scale):
    """x [Hkv*g, d] -> [Hkv, g, P] f32 times scale: each KV head's g rows, channels in packed
    order (perm[p] = channel at packed position p, -1 = zero padding)."""
    g = x.shape[0] // hkv
    out = np.zeros((hkv, g, perm.shape[0]), F32)
    for h in range(x.shape[0]):
        row, src = out[h // g, h % g], x[h]  # the divisions once per row, not per channel
        for p in range(perm.shape[0]):
            c = perm[p]
            if c >= 0:
                row[p] = src[c] * scale
    return out


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def merge_items(acc, mx, den, n_split, g, d, perm):
    """Merge item states acc [Hkv*n_split, R, P], mx/den [Hkv*n_split, R] (log2 units) into
    out [Hkv*g, d] (channel order) and lse [Hkv*g] (natural log)."""
    n_items, _, p = acc.shape
    hkv = n_items // n_split
    out = np.zeros((hkv * g, perm.shape[0]), F32)  # packed order, unpacked below
    lse = np.full(hkv * g, NEG_INF)
    for j in range(hkv):
        for h in range(g):
            big = NEG_INF
            for i in range(j * n_split, (j + 1) * n_split):
                big = max(big, mx[i, h])
            if big == NEG_INF:
                continue
            tot = F32(0.0)
            for i in range(j * n_split, (j + 1) * n_split):
                w = exp2_neg(mx[i, h] - big)
                tot += w * den[i, h]
                for c in range(p):
                    out[j * g + h, c] += w * acc[i, h, c]
            inv = F32(1.0) / tot
            for c in range(p):
                out[j * g + h, c] *= inv
            lse[j * g + h] = (big + np.log2(tot)) * LN2
    res = np.empty((hkv * g, d), F32)
    for h in range(hkv * g):
        for c in range(p):
            if perm[c] >= 0:
                res[h, perm[c]] = out[h, c]
    return res, lse


@lru_cache(maxsize=16)
def channel_perm(d: int, kv_kind: int) -> np.ndarray:
    """Packed channel order for head_dim d and a KV dtype (see _vec.packed_channels)."""
    return packed_channels(d, kv_kind)


class LayerKV(NamedTuple):
    """One layer's K/V store as the kernels read it, checked and viewed once (`layer_kv`): after
    a cache flush each NumPy check or view costs microseconds, and a step would make a dozen.
    Valid while the four arrays are the ones it was made from (a KV store allocates its arrays
    once)."""

    k_base: np.ndarray  # read-only [Hkv, nb_base, bs, row] in the format's type (kv_view)
    v_base: np.ndarray
    k_tail: np.ndarray  # read-only [Hkv, nb_tail_cap, bs, row] in the format's type
    v_tail: np.ndarray
    nb_base: int
    kv_kind: int
    hkv: int
    bs: int
    d: int
    perm: np.ndarray  # packed channel order [P]

    def n_blocks(self, n_tokens: int) -> int:
        """Blocks holding tokens at a context of n_tokens."""
        return min(self.nb_base + self.k_tail.shape[1], -(-n_tokens // self.bs))

    def query(self, q: np.ndarray) -> np.ndarray:
        """q [Hq, d] checked against the layer, as read-only float32."""
        if q.ndim != 2 or q.shape[1] != self.d or q.shape[0] % self.hkv:
            raise ValueError(f"q must be [Hq, {self.d}] with Hq a multiple of {self.hkv}, "
                             f"got {q.shape}")
        return readonly(q, F32)


def layer_kv(k_base, v_base, k_tail, v_tail, nb_base, kv_kind) -> LayerKV:
    """The checked, read-only views of a layer's K/V arrays in their format's element type
    (see `attend_blocks`)."""
    kv = [kv_view(name, a, kv_kind) for name, a in
          (("k_base", k_base), ("v_base", v_base), ("k_tail", k_tail), ("v_tail", v_tail))]
    hkv, _, bs, row = k_tail.shape
    d = head_dim_of(kv_kind, row)
    return LayerKV(*kv, nb_base, kv_kind, hkv, bs, d, channel_perm(d, kv_kind))


def attend_blocks(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, n_tokens, scale, kv_kind):
    """Exact attention of one query token over the listed blocks.

    q [Hq, d] f32; k/v_base [Hkv, nb_base, bs, row], k/v_tail [Hkv, nb_tail_cap, bs, row]
    (float32, uint16 bits or uint8 rows per kv_kind 0 FP32, 1 BF16, 2 FP16, 3 Q8_0, 4 Q4_0);
    blocks int32 [S, n] with S 1 (SHARED) or Hkv, ascending, no repeats. Returns out [Hq, d] f32
    and lse [Hq] f32 (natural log of the summed
    exp(scale * q.k); -inf and out 0 for a head with no tokens).
    """
    return attend_layer(layer_kv(k_base, v_base, k_tail, v_tail, nb_base, kv_kind), q, blocks,
                        n_tokens, scale)


def attend_layer(kv: LayerKV, q, blocks, n_tokens, scale, shifts=None, turns: Turns | None = None):
    """`attend_blocks` over a layer's prepared views; with `shifts` [S, n] int32 (blocks, one per
    entry of `blocks`) and their `turns`, each block read as if it sat that many blocks later."""
    q = kv.query(q)
    blocks = readonly(blocks, np.int32)
    if blocks.ndim != 2 or blocks.shape[0] not in (1, kv.hkv):
        raise ValueError(f"blocks must be [1 or {kv.hkv}, n], got {blocks.shape}")
    n_split = max(1, min(items_per_head(kv.hkv), blocks.shape[1]))
    sh, turns = checked_shifts(shifts, turns, blocks.shape, kv)
    return _attend(q, kv.k_base, kv.v_base, kv.k_tail, kv.v_tail, kv.nb_base, blocks, sh,
                   kv.n_blocks(n_tokens), n_tokens, n_split, F32(scale * LOG2E), kv.perm,
                   turns.tab, turns.rot)


def rows_kv(k: np.ndarray, v: np.ndarray, kv_kind: int = 0) -> LayerKV:
    """Row buffers k, v [Hkv, cap, d] or [Hkv, cap, 1, d] (a sliding window's: float32, or
    bf16 / fp16 bits as uint16 for kv_kind 1 / 2) as a layer of one-row blocks for
    `attend_rows`. The views share the buffers' memory: rows written later are read."""
    hkv, cap, d = k.shape[:2] + k.shape[-1:]
    k, v = k.reshape(hkv, cap, 1, d), v.reshape(hkv, cap, 1, d)
    empty = np.zeros((hkv, 0, 1, d), k.dtype)
    return layer_kv(empty, empty, k, v, 0, kv_kind)


ROWS_PER_ITEM = 256  # fewest rows an item of `attend_rows` takes: below that an item's fixed
# cost outweighs what another thread saves (ad hoc, Gemma 3 270M's 512-row window, 2 threads:
# 2 items 37 us, 4 items 41, 8 items 49)


def attend_rows(kv: LayerKV, q, r0: int, r1: int, scale: float) -> np.ndarray:
    """Exact attention of one token q [Hq, d] over rows [r0, r1) of a `rows_kv` layer ->
    out [Hq, d] float32. The rows are split over the session's threads."""
    if not 0 <= r0 < r1 <= kv.k_tail.shape[1]:
        raise ValueError(f"rows [{r0}, {r1}) are outside the buffer's {kv.k_tail.shape[1]}")
    ids = readonly(np.arange(r0, r1, dtype=np.int32)[None])  # [1, n] one-row blocks
    use_threads()
    n_split = max(1, min(-(-split_threads() // kv.hkv), (r1 - r0) // ROWS_PER_ITEM))
    return _attend(kv.query(q), kv.k_base, kv.v_base, kv.k_tail, kv.v_tail, 0, ids,
                   _NO_SHIFTS, r1, r1, n_split, F32(scale * LOG2E), kv.perm, _NO_TURNS.tab,
                   _NO_TURNS.rot)[0]


def attend_rows_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """float64 reference of `attend_rows`: q [Hq, d], k, v [Hkv, n, d] (the rows read) -> [Hq, d];
    query head j reads KV head j // (Hq / Hkv)."""
    g = q.shape[0] // k.shape[0]
    kk = np.repeat(np.asarray(k, np.float64), g, 0)  # [Hq, n, d]
    vv = np.repeat(np.asarray(v, np.float64), g, 0)
    s = np.einsum("hd,hnd->hn", np.asarray(q, np.float64), kk) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, vv)


class Turns(NamedTuple):
    """RoPE turns of a query, for reading blocks at other positions than their own.

    tab [2T + 1, 2, P] f32, per packed channel: row T + t holds the cos and the signed sin of the
    query's turn back by t blocks (t * bs positions: a key read t blocks later); rot [P] int32:
    each packed channel's rotate-half partner (itself where RoPE leaves the channel), or [1]
    holding h when every partner sits h packed channels on (see `turn_rows`)."""

    tab: np.ndarray
    rot: np.ndarray

    @property
    def reach(self) -> int:
        """The largest |shift| (blocks) the table holds."""
        return self.tab.shape[0] // 2


def rope_turns(inv_freq: np.ndarray, block_size: int, reach: int, d: int, kv_kind: int) -> Turns:
    """The turns of shifts -reach..reach blocks for RoPE frequencies inv_freq [h] (HF's
    rotate-half layout: channel c < h pairs with c + h) over head_dim d, in the packed channel
    order of kv_kind."""
    inv = np.asarray(inv_freq, np.float64)
    h = inv.size
    perm = channel_perm(d, kv_kind)
    P = perm.size
    freq = np.where((perm >= 0) & (perm < 2 * h), perm % h, -1)  # [P]
    sign = np.where(perm < h, -1.0, 1.0)
    t = np.arange(-reach, reach + 1, dtype=np.float64)[:, None]
    ang = -t * block_size * inv[np.maximum(freq, 0)]  # [2T+1, P]
    tab = np.empty((2 * reach + 1, 2, P), F32)
    tab[:, 0] = np.where(freq >= 0, np.cos(ang), 1.0)
    tab[:, 1] = np.where(freq >= 0, sign * np.sin(ang), 0.0)
    where = np.full(d, -1, np.int64)
    where[perm[perm >= 0]] = np.flatnonzero(perm >= 0)
    pair = np.arange(P, dtype=np.int32)
    turned = freq >= 0
    pair[turned] = where[np.where(perm < h, perm + h, perm - h)[turned]]
    half = np.where(np.arange(P) < h, np.arange(P) + h, np.arange(P) - h)
    if np.array_equal(pair[:2 * h], half[:2 * h]):
        pair = np.array([h], np.int32)
    return Turns(tab, pair)


_NO_TURNS = Turns(np.zeros((1, 2, 1), F32), np.zeros(1, np.int32))
_NO_SHIFTS = readonly(np.zeros((1, 0), np.int32))  # [S, 0]: blocks read where they are


def checked_shifts(shifts, turns: Turns | None, shape: tuple, kv: LayerKV):
    """shifts as the kernels take them (read-only int32 `shape`, or [S, 0] for none) and the
    turns to use; ValueError for a shape or a shift the turns do not hold."""
    if shifts is None:
        return readonly(np.zeros((shape[0], 0), np.int32), np.int32), _NO_TURNS
    shifts = readonly(shifts, np.int32)
    if shifts.shape != tuple(shape):
        raise ValueError(f"shifts must be shaped as blocks {tuple(shape)}, got {shifts.shape}")
    if turns is None or turns.tab.shape[2] != kv.perm.size:
        raise ValueError("shifts need the turns of this layer's channel layout")
    if shifts.size and int(np.abs(shifts).max()) > turns.reach:
        raise ValueError(f"a shift beyond the turns' reach of {turns.reach} blocks")
    return shifts, turns


def items_per_head(hkv: int) -> int:
    """Parts each KV head's blocks are split into: at least 4 items a thread (of the machine's:
    `split_threads`). Applies the session's thread count to the calling thread."""
    use_threads()
    return max(1, -(-4 * split_threads() // hkv))


def attend_blocks_ref(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, n_tokens, scale, kv_kind,
                      shifts=None, inv_freq=None):
    """float64 NumPy reference of `attend_blocks` (returns float64); with shifts [S, n] and RoPE
    frequencies inv_freq [h], of `attend_layer`'s turned reads."""
    hkv, _, bs, _ = k_tail.shape
    d = q.shape[1]
    g = q.shape[0] // hkv
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    v = np.concatenate([kv_to_f64(v_base, kv_kind), kv_to_f64(v_tail, kv_kind)], axis=1)
    k, v = k.reshape(hkv, -1, d)[:, :n_tokens], v.reshape(hkv, -1, d)[:, :n_tokens]  # [Hkv, T, d]
    out, lse = np.zeros((q.shape[0], d)), np.full(q.shape[0], -np.inf)
    for h in range(q.shape[0]):
        j = h // g
        row = 0 if blocks.shape[0] == 1 else j
        s = []
        for i, b in enumerate(np.asarray(blocks[row], np.int64)):
            tok = np.arange(b * bs, min((b + 1) * bs, n_tokens))
            x = q[h].astype(np.float64)
            if shifts is not None:
                x = turned_ref(x, inv_freq, -int(shifts[row, i]) * bs)
            s.append((tok, scale * (k[j, tok] @ x)))
        tok = np.concatenate([t for t, _ in s]) if s else np.zeros(0, np.int64)
        if tok.size == 0:
            continue
        sc = np.concatenate([x for _, x in s])
        lse[h] = np.logaddexp.reduce(sc)
        out[h] = np.exp(sc - lse[h]) @ v[j, tok]
    return out, lse


def turned_ref(x, inv_freq, delta):
    """A query x [d] (HF rotate-half RoPE over the first 2 * inv_freq.size channels) as if it sat
    delta positions later: float64."""
    h = inv_freq.size
    ang = delta * np.asarray(inv_freq, np.float64)
    c, s = np.cos(ang), np.sin(ang)
    x = np.asarray(x, np.float64)
    out = x.copy()
    out[:h], out[h:2 * h] = x[:h] * c - x[h:2 * h] * s, x[h:2 * h] * c + x[:h] * s
    return out


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Exact log-sum-exp merge of two attention results over disjoint token sets.

    out_* [Hq, d], lse_* [Hq]; an empty part has lse -inf. Returns (out, lse) float32.
    """
    la, lb = np.asarray(lse_a, F32), np.asarray(lse_b, F32)
    big = np.maximum(la, lb)
    safe = np.where(np.isfinite(big), big, F32(0.0))
    wa, wb = np.exp(la - safe), np.exp(lb - safe)  # exp(-inf) = 0 for an empty part
    tot = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (wa / tot)[:, None] * out_a + (wb / tot)[:, None] * out_b
        lse = safe + np.log(tot)
    empty = tot == 0
    out[empty], lse[empty] = 0.0, -np.inf
    return out.astype(F32), lse.astype(F32)


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def attend_merge(q, k, v, scale, out, lse):
    """Exact attention of q [Hq, d] over a few more keys k, v [Hkv, n, d] (float32; query head
    h reads KV head h // (Hq / Hkv)), merged into the attention out [Hq, d], lse [Hq] (natural
    log, -inf: no keys) over other keys, in place: one call where NumPy would make a dozen."""
    hq, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    if n == 0:
        return
    g = hq // hkv
    s = np.empty(n, F32)
    o = np.empty(d, F32)
    sc = F32(scale)
    for h in range(hq):
        j = h // g
        m = NEG_INF
        for t in range(n):
            acc = F32(0.0)
            for c in range(d):
                acc += q[h, c] * k[j, t, c]
            s[t] = acc * sc
            m = max(m, s[t])
        tot = F32(0.0)
        o[:] = 0.0
        for t in range(n):
            e = np.exp(s[t] - m)
            tot += e
            for c in range(d):
                o[c] += e * v[j, t, c]
        l2 = m + np.log(tot)
        big = max(lse[h], l2)
        w1 = np.exp(lse[h] - big) if lse[h] > NEG_INF else F32(0.0)
        w2 = np.exp(l2 - big)
        inv = F32(1.0) / (w1 + w2)
        w2t = w2 / tot
        for c in range(d):
            out[h, c] = (w1 * out[h, c] + w2t * o[c]) * inv
        lse[h] = big + np.log(w1 + w2)


def merge_partials_ref(out_a, lse_a, out_b, lse_b):
    """float64 NumPy reference of `merge_partials`."""
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(np.isfinite(lse), lse, 0.0)
    wa = np.where(np.isfinite(lse_a), np.exp(lse_a - safe), 0.0)[:, None]
    wb = np.where(np.isfinite(lse_b), np.exp(lse_b - safe), 0.0)[:, None]
    return wa * out_a + wb * out_b, lse
