"""Sparse prefill attention over a PrefillIndex (MInference's A-shape, Vertical-Slash and
Block-Sparse heads; the indexes are built in `ktlong.kernels.prefill_index`).

A prefill chunk's queries `q [Hq, L, d]` sit at positions `q_start .. q_start + L - 1`; the
layer's K/V (store layout, chunk included) hold `n_tokens = q_start + L` tokens. `sparse_attend`
computes, for each query row, exact softmax attention over the keys of its block's ranges and
columns that are not after it (causal), and over its lone diagonals' keys that exist and that the
ranges and columns do not already hold.

Ranges and columns are read in chunks of KC keys by every row of the block (register tiles of 4
rows: a key row is loaded once for the block's 64 rows); a lone diagonal gives each row one key of
its own (loaded for that row alone).

Estimators: `vs_estimate` (softmax of the last W queries against every key, summed per column and
per diagonal) and `pool_keys` (mean of each QB-token key block). Each kernel has a NumPy `*_ref`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import F32, FASTMATH, LOG2E, NEG_INF, exp2_neg, kv_to_f64
from ._vec import (
    W,
    row_addr,
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
from .anchors import dot4
from .attention import CH, LayerKV, qk_tiles
from .kvquant import kv_dim, row_to_f32
from .prefill_index import QB, PrefillIndex, n_qblocks
from .threads import use_threads

KC = 64  # keys per inner chunk (a multiple of 2W)
SPAN = 512  # lone diagonals are read an offset span at a time (see _lone_pass)


# --- KV rows ------------------------------------------------------------------------------------
@njit(inline="always", cache=True)
def _row(k_base, k_tail, nb_base, j, t):
    """K (or V) row of token t of KV head j: a 1-D view of the base or the tail."""
    bs = k_tail.shape[2]
    b = t // bs
    if b < nb_base:
        return k_base[j, b, t - b * bs]
    return k_tail[j, b - nb_base, t - b * bs]


@njit(cache=True, fastmath=FASTMATH)
def _load_kt(k_base, k_tail, nb_base, j, pos, n, kt):
    """kt[c, i] = K[j, pos[i], c] as float32 for i < n; columns n.. zero. kt [d, KC]."""
    d = kt.shape[0]
    x = np.empty(d, F32)
    for i in range(n):
        row_to_f32(_row(k_base, k_tail, nb_base, j, pos[i]), x)
        for c in range(d):
            kt[c, i] = x[c]
    for i in range(n, KC):
        for c in range(d):
            kt[c, i] = F32(0.0)


@njit(cache=True, fastmath=FASTMATH)
def _load_v(v_base, v_tail, nb_base, j, pos, n, vv):
    """vv[i, :d] = V[j, pos[i]] as float32 for i < n (vv [KC, dp], dp >= d padded with 0)."""
    d = kv_dim(v_tail)
    for i in range(n):
        row_to_f32(_row(v_base, v_tail, nb_base, j, pos[i]), vv[i, :d])


@njit(cache=True, fastmath=FASTMATH)
def _qk(qt, nq, kt, s, off):
    """s[i, off:off + KC] = qt[i] . kt[:, :KC] for rows i < ceil4(nq). qt [R, d] (R % 4 == 0)."""
    d = kt.shape[0]
    for i in range(0, nq, 4):
        for kc in range(0, KC, 2 * W):
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vzero()
            for c in range(d):
                k0, k1 = vload(kt, c, kc), vload(kt, c, kc + W)
                x = vsplat(qt[i, c])
                a0, b0 = vfma(x, k0, a0), vfma(x, k1, b0)
                x = vsplat(qt[i + 1, c])
                a1, b1 = vfma(x, k0, a1), vfma(x, k1, b1)
                x = vsplat(qt[i + 2, c])
                a2, b2 = vfma(x, k0, a2), vfma(x, k1, b2)
                x = vsplat(qt[i + 3, c])
                a3, b3 = vfma(x, k0, a3), vfma(x, k1, b3)
            vstore(s, i, off + kc, a0)
            vstore(s, i, off + kc + W, b0)
            vstore(s, i + 1, off + kc, a1)
            vstore(s, i + 1, off + kc + W, b1)
            vstore(s, i + 2, off + kc, a2)
            vstore(s, i + 2, off + kc + W, b2)
            vstore(s, i + 3, off + kc, a3)
            vstore(s, i + 3, off + kc + W, b3)


@njit(cache=True, fastmath=FASTMATH)
def _pv(s, nq, n, vv, acc):
    """acc[i, :] += sum_{t < n} s[i, t] * vv[t, :] for rows i < ceil4(nq); acc [R, dp]."""
    dp = acc.shape[1]
    for i in range(0, nq, 4):
        for c in range(0, dp, 2 * W):
            a0, b0 = vload(acc, i, c), vload(acc, i, c + W)
            a1, b1 = vload(acc, i + 1, c), vload(acc, i + 1, c + W)
            a2, b2 = vload(acc, i + 2, c), vload(acc, i + 2, c + W)
            a3, b3 = vload(acc, i + 3, c), vload(acc, i + 3, c + W)
            for t in range(n):
                v0, v1 = vload(vv, t, c), vload(vv, t, c + W)
                x = vsplat(s[i, t])
                a0, b0 = vfma(x, v0, a0), vfma(x, v1, b0)
                x = vsplat(s[i + 1, t])
                a1, b1 = vfma(x, v0, a1), vfma(x, v1, b1)
                x = vsplat(s[i + 2, t])
                a2, b2 = vfma(x, v0, a2), vfma(x, v1, b2)
                x = vsplat(s[i + 3, t])
                a3, b3 = vfma(x, v0, a3), vfma(x, v1, b3)
            vstore(acc, i, c, a0)
            vstore(acc, i, c + W, b0)
            vstore(acc, i + 1, c, a1)
            vstore(acc, i + 1, c + W, b1)
            vstore(acc, i + 2, c, a2)
            vstore(acc, i + 2, c + W, b2)
            vstore(acc, i + 3, c, a3)
            vstore(acc, i + 3, c + W, b3)


@njit(cache=True, fastmath=FASTMATH)
def _mask(s, nq, n, pos, qpos0):
    """s[i, t] = -inf where key t is padding (t >= n) or after query row i."""
    if n == KC and pos[n - 1] <= qpos0:
        return
    for i in range(nq):
        qp = qpos0 + i
        for t in range(KC):
            if t >= n or pos[t] > qp:
                s[i, t] = NEG_INF


@njit(cache=True, fastmath=FASTMATH)
def _softmax_step(s, nq, m, den, acc):
    """The online-softmax update of rows i < nq by the scores s [R, n] (log2 units, -inf =
    masked, n % W == 0; a chunk's KC keys or a head's lone scores): s becomes probabilities, acc
    and den rescaled."""
    n = s.shape[1]
    for i in range(nq):
        mv = vload(s, i, 0)
        for t in range(W, n, W):
            mv = vmax(mv, vload(s, i, t))
        mn = max(m[i], vhmax(mv))
        if mn == NEG_INF:  # nothing visible yet for this row
            for t in range(n):
                s[i, t] = F32(0.0)
            continue
        alpha = np.exp2(m[i] - mn) if m[i] != NEG_INF else F32(0.0)
        mvec = vsplat(mn)
        tot = vzero()
        for t in range(0, n, W):
            p = vexp2_neg(vsub(vload(s, i, t), mvec))
            vstore(s, i, t, p)
            tot = vadd(tot, p)
        den[i] = den[i] * alpha + vhsum(tot)
        m[i] = mn
        if alpha != F32(1.0):
            for c in range(acc.shape[1]):
                acc[i, c] *= alpha


@njit(cache=True, fastmath=FASTMATH)
def _chunk(qt, nq, qpos0, k_base, v_base, k_tail, v_tail, nb_base, j, pos, n, kt, vv, s, m, den,
           acc):
    """One chunk of n keys at positions pos[:n] into the block's softmax state."""
    _load_kt(k_base, k_tail, nb_base, j, pos, n, kt)
    _qk(qt, nq, kt, s, 0)
    _mask(s, nq, n, pos, qpos0)
    _softmax_step(s, nq, m, den, acc)
    _load_v(v_base, v_tail, nb_base, j, pos, n, vv)
    _pv(s, nq, n, vv, acc)


@njit(inline="always", cache=True)
def _lone(qpos, diags, t, t1, seen):
    """(key of lone diagonal t for the query at qpos, 0 where there is none; whether the pair
    counts: not padding (t >= t1), not before the first token, not read through a range or
    column)."""
    if t >= t1:
        return 0, False
    key = qpos - diags[t]
    if key < 0:
        return 0, False
    return key, seen[key] == 0


@njit(inline="always", cache=True)
def _key_addr(key, split, rb, base, tail):
    """Address of the K (or V) row of token `key` of one KV head: its rows lie contiguous in
    the base (the first at `base`, tokens below `split`) and in the tail (token `split` at
    `tail`), rb bytes each."""
    if key < split:
        return base + key * rb
    return tail + (key - split) * rb


@njit(cache=True, fastmath=FASTMATH)
def _lone_qk(qp, nq, qpos0, tag, kb, kt, rb, split, diags, t0, t1, t_end, seen, sl, c0):
    """Scores of lone diagonals t0, t0 + 4, .. (four from each; diagonals from t_end on are
    padding) below t1: sl[i, c0 + t - t0] = row i of qp [R, P] (packed) . its key on diagonal
    t, -inf where the pair is void. K rows at kb / kt (`_key_addr`), tag's storage type; a
    row's four keys lie on four streams of consecutive rows."""
    d = kv_dim(tag)
    for t in range(t0, t1, 4):
        c = c0 + t - t0
        for i in range(nq):
            qpos = qpos0 + i
            y0, ok0 = _lone(qpos, diags, t, t_end, seen)
            y1, ok1 = _lone(qpos, diags, t + 1, t_end, seen)
            y2, ok2 = _lone(qpos, diags, t + 2, t_end, seen)
            y3, ok3 = _lone(qpos, diags, t + 3, t_end, seen)
            k0, k1 = _key_addr(y0, split, rb, kb, kt), _key_addr(y1, split, rb, kb, kt)
            k2, k3 = _key_addr(y2, split, rb, kb, kt), _key_addr(y3, split, rb, kb, kt)
            z = vzero()
            a0, a1, a2, a3 = dot4(qp, i, tag, k0, k1, k2, k3, d, z, z, z, z)
            vsum4(sl, i, c, a0, a1, a2, a3)
            if not ok0:
                sl[i, c] = NEG_INF
            if not ok1:
                sl[i, c + 1] = NEG_INF
            if not ok2:
                sl[i, c + 2] = NEG_INF
            if not ok3:
                sl[i, c + 3] = NEG_INF


@njit(cache=True, fastmath=FASTMATH)
def _lone_pv(sl, nq, qpos0, tag, vb, vt, rb, split, diags, t0, t1, t_end, seen, accp, c0):
    """accp[i] += sl[i, c0 + t - t0] * V row of row i's key on diagonal t, for the diagonals
    of `_lone_qk` (sl now probabilities, 0 where the pair is void)."""
    d = kv_dim(tag)
    ng = accp.shape[1] // (2 * W)
    for t in range(t0, t1, 4):
        c = c0 + t - t0
        for i in range(nq):
            if sl[i, c] == 0 and sl[i, c + 1] == 0 and sl[i, c + 2] == 0 and sl[i, c + 3] == 0:
                continue
            qpos = qpos0 + i
            p0, p1, p2, p3 = vsplat4(sl, i, c)
            v0 = _key_addr(_lone(qpos, diags, t, t_end, seen)[0], split, rb, vb, vt)
            v1 = _key_addr(_lone(qpos, diags, t + 1, t_end, seen)[0], split, rb, vb, vt)
            v2 = _key_addr(_lone(qpos, diags, t + 2, t_end, seen)[0], split, rb, vb, vt)
            v3 = _key_addr(_lone(qpos, diags, t + 3, t_end, seen)[0], split, rb, vb, vt)
            for gi in range(ng):
                cc = gi * 2 * W
                e0, o0 = vload2(tag, v0, d, gi)
                e1, o1 = vload2(tag, v1, d, gi)
                e2, o2 = vload2(tag, v2, d, gi)
                e3, o3 = vload2(tag, v3, d, gi)
                x = vfma(p2, e2, vfma(p3, e3, vload(accp, i, cc)))
                vstore(accp, i, cc, vfma(p0, e0, vfma(p1, e1, x)))
                x = vfma(p2, o2, vfma(p3, o3, vload(accp, i, cc + W)))
                vstore(accp, i, cc + W, vfma(p0, o0, vfma(p1, o1, x)))


@njit(cache=True, fastmath=FASTMATH)
def _lone_pass(pv, qp, sl, accp, nq, qpos0, tag, ka, va, rb, split, diags, starts, ends, seen):
    """Scores (pv False) or p @ V (pv True) of the lone diagonals of a KV head's query heads
    (head hh: diags[starts[hh]:ends[hh]], ascending), an offset span of SPAN at a time, the
    heads in turn within a span: their keys then lie within SPAN + QB rows, which the first
    head brings into the cache for the others."""
    ptr = starts.copy()
    hi = SPAN
    left = True
    while left:
        left = False
        for hh in range(starts.shape[0]):
            t, e = ptr[hh], ends[hh]
            t1 = t
            while t1 < e and diags[t1] < hi:
                t1 += 4
            if t1 > t:
                if pv:
                    _lone_pv(sl[hh], nq, qpos0, tag, va[0], va[1], rb, split, diags, t, t1, e,
                             seen[hh], accp[hh], t - starts[hh])
                else:
                    _lone_qk(qp[hh], nq, qpos0, tag, ka[0], ka[1], rb, split, diags, t, t1, e,
                             seen[hh], sl[hh], t - starts[hh])
                ptr[hh] = min(t1, e)
            left = left or ptr[hh] < e
        hi += SPAN


@njit(cache=True, fastmath=FASTMATH)
def _task(q, j, b, q_start, k_base, v_base, k_tail, v_tail, nb_base, g, ix, perm, scale2, out):
    """Query block b of the g query heads of KV head j over their index entries; writes
    out[h, rows of b]. Each head's ranges and columns, then their lone diagonals together."""
    r_off, r_cnt, ranges, c_off, c_cnt, cols, d_off, d_cnt, diags = ix
    length, d = q.shape[1], q.shape[2]
    dp = -(-d // (2 * W)) * 2 * W
    i0 = b * QB
    nq = min(QB, length - i0)
    rows = -(-nq // 4) * 4
    qt = np.zeros((rows, d), F32)
    kt = np.zeros((d, KC), F32)
    vv = np.zeros((KC, dp), F32)
    s = np.zeros((rows, KC), F32)
    acc = np.zeros((g, rows, dp), F32)
    m = np.full((g, rows), NEG_INF)
    den = np.zeros((g, rows), F32)
    pos = np.zeros(KC, np.int64)
    qpos0 = q_start + i0
    qlast = qpos0 + nq - 1
    for hh in range(g):
        h = j * g + hh
        for i in range(nq):
            for c in range(d):
                qt[i, c] = q[h, i0 + i, c] * scale2
        acc_h, m_h, den_h = acc[hh], m[hh], den[hh]
        for ri in range(r_off[h, b], r_off[h, b] + r_cnt[h, b]):
            st, en = ranges[ri, 0], min(ranges[ri, 1], qlast + 1)
            for c0 in range(st, en, KC):
                n = min(KC, en - c0)
                for t in range(n):
                    pos[t] = c0 + t
                _chunk(qt, nq, qpos0, k_base, v_base, k_tail, v_tail, nb_base, j, pos, n, kt,
                       vv, s, m_h, den_h, acc_h)
        c1 = c_off[h, b] + c_cnt[h, b]
        for c0 in range(c_off[h, b], c1, KC):
            n = 0
            for t in range(c0, min(c1, c0 + KC)):
                if cols[t] <= qlast:
                    pos[n] = cols[t]
                    n += 1
            if n > 0:
                _chunk(qt, nq, qpos0, k_base, v_base, k_tail, v_tail, nb_base, j, pos, n, kt,
                       vv, s, m_h, den_h, acc_h)
    nd_max = 0
    for hh in range(g):
        nd_max = max(nd_max, d_cnt[j * g + hh, b])
    if nd_max > 0:
        _lone_task(q, j, b, q_start, k_base, v_base, k_tail, v_tail, nb_base, g, ix, perm,
                   scale2, nd_max, nq, acc, m, den)
    for hh in range(g):
        for i in range(nq):
            inv = F32(1.0) / den[hh, i] if den[hh, i] > 0 else F32(0.0)
            for c in range(d):
                out[j * g + hh, i0 + i, c] = acc[hh, i, c] * inv


@njit(cache=True, fastmath=FASTMATH)
def _lone_task(q, j, b, q_start, k_base, v_base, k_tail, v_tail, nb_base, g, ix, perm, scale2,
               nd_max, nq, acc, m, den):
    """The lone diagonals of block b of KV head j's query heads into their softmax states
    (acc [g, R, dp], m, den [g, R], over the ranges and columns so far)."""
    r_off, r_cnt, ranges, c_off, c_cnt, cols, d_off, d_cnt, diags = ix
    rows, npk = acc.shape[1], perm.shape[0]
    i0 = b * QB
    qpos0 = q_start + i0
    qlast = qpos0 + nq - 1
    wp = -(-nd_max // W) * W
    sl = np.empty((g, rows, wp), F32)  # [g, R, diagonals] scores, then probabilities
    qp = np.zeros((g, rows, npk), F32)  # packed scaled queries
    accp = np.zeros((g, rows, npk), F32)  # packed p @ V
    seen = np.zeros((g, qlast + 1), np.uint8)  # the keys each head's ranges and columns hold
    starts = np.empty(g, np.int64)
    ends = np.empty(g, np.int64)
    for hh in range(g):
        h = j * g + hh
        starts[hh], ends[hh] = d_off[h, b], d_off[h, b] + d_cnt[h, b]
        for ri in range(r_off[h, b], r_off[h, b] + r_cnt[h, b]):
            for t in range(ranges[ri, 0], min(ranges[ri, 1], qlast + 1)):
                seen[hh, t] = 1
        for t in range(c_off[h, b], c_off[h, b] + c_cnt[h, b]):
            if cols[t] <= qlast:
                seen[hh, cols[t]] = 1
        for i in range(nq):
            for p in range(npk):
                if perm[p] >= 0:
                    qp[hh, i, p] = q[h, i0 + i, perm[p]] * scale2
            for t in range(-(-d_cnt[h, b] // 4) * 4, wp):
                sl[hh, i, t] = NEG_INF
    split, rb = nb_base * k_tail.shape[2], k_tail.shape[3] * k_tail.itemsize
    ka = (row_addr(k_base, j, 0, 0), row_addr(k_tail, j, 0, 0))
    va = (row_addr(v_base, j, 0, 0), row_addr(v_tail, j, 0, 0))
    _lone_pass(False, qp, sl, accp, nq, qpos0, k_tail, ka, va, rb, split, diags, starts, ends,
               seen)
    for hh in range(g):
        if ends[hh] > starts[hh]:
            _softmax_step(sl[hh], nq, m[hh], den[hh], acc[hh])
    _lone_pass(True, qp, sl, accp, nq, qpos0, k_tail, ka, va, rb, split, diags, starts, ends,
               seen)
    for hh in range(g):
        for i in range(nq):
            for p in range(npk):
                if perm[p] >= 0:
                    acc[hh, i, perm[p]] += accp[hh, i, p]


@njit(cache=True)
def _empty_out(shape0, shape1, shape2):
    return np.empty((shape0, shape1, shape2), F32)


@njit(parallel=True, cache=True)
def _sparse_attend(q, k_base, v_base, k_tail, v_tail, nb_base, q_start, ix, perm, scale2):
    hq, length = q.shape[0], q.shape[1]
    g = hq // k_tail.shape[0]
    nqb = (length + QB - 1) // QB
    out = _empty_out(hq, length, q.shape[2])
    for t in prange(k_tail.shape[0] * nqb):
        j, b = t // nqb, nqb - 1 - t % nqb  # the later (longer) blocks first
        _task(q, j, b, q_start, k_base, v_base, k_tail, v_tail, nb_base, g, ix, perm, scale2,
              out)
    return out


def sparse_attend(kv: LayerKV, q: np.ndarray, q_start: int, index: PrefillIndex,
                  scale: float) -> np.ndarray:
    """Attention of a prefill chunk's queries q [Hq, L, d] (positions q_start ..) over the keys
    its index lists, causal; the layer's store must hold q_start + L tokens. -> [Hq, L, d] f32."""
    q = np.ascontiguousarray(q, F32)
    if q.ndim != 3 or q.shape[2] != kv.d or q.shape[0] % kv.hkv:
        raise ValueError(f"q must be [Hq, L, {kv.d}] with Hq a multiple of {kv.hkv}")
    nqb = n_qblocks(q.shape[1])
    if index.r_cnt.shape != (q.shape[0], nqb):
        raise ValueError(f"index is for {index.r_cnt.shape}, queries need {(q.shape[0], nqb)}")
    n_tokens = q_start + q.shape[1]
    if n_tokens > (kv.nb_base + kv.k_tail.shape[1]) * kv.bs:
        raise ValueError("the store does not hold the chunk's tokens")
    for a in (index.ranges.ravel(), index.cols, index.diags):
        if a.size and (a.min() < 0 or a.max() > n_tokens):
            raise ValueError("index position out of range")
    use_threads()
    ix = (index.r_off, index.r_cnt, np.ascontiguousarray(index.ranges, np.int32), index.c_off,
          index.c_cnt, np.ascontiguousarray(index.cols, np.int32), index.d_off, index.d_cnt,
          np.ascontiguousarray(index.diags, np.int32))
    return _sparse_attend(q, kv.k_base, kv.v_base, kv.k_tail, kv.v_tail, kv.nb_base, q_start, ix,
                          kv.perm, F32(scale * LOG2E))


# --- estimators ---------------------------------------------------------------------------------
@njit(cache=True, fastmath=FASTMATH)
def _vs_head(qw, hi, j, k_base, k_tail, nb_base, n_tokens, scale2, perm, vert, slash):
    """Softmax of the last queries qw[hi] [Wq, d] (positions n_tokens - Wq + w) over every key,
    summed into vert[hi, key] and slash[hi, query - key].

    One pass over the keys, CH at a time: scores by the decode kernel's register tiles (4
    queries x 4 keys, packed channels, K rows read in place), then at once their powers of 2
    against the row's running maximum (kept per chunk) and the running sum. A second pass
    scales each chunk by its maximum's distance to the final one and adds it up, chunk by chunk
    (vert's and slash's slices stay in the cache)."""
    wq = qw.shape[1]
    d = kv_dim(k_tail)
    rows = -(-wq // 4) * 4
    qp = np.zeros((rows, perm.shape[0]), F32)  # packed
    for w in range(wq):
        for p in range(perm.shape[0]):
            if perm[p] >= 0:
                qp[w, p] = qw[hi, w, perm[p]] * scale2
    ncol = -(-n_tokens // CH) * CH
    ex = np.empty((wq, ncol), F32)  # 2 ** (score - the row's running max at the chunk)
    mc = np.empty((wq, ncol // CH), F32)  # that max, per row and chunk
    m = np.full(wq, NEG_INF)
    z = np.zeros(wq, F32)
    s = np.zeros((rows, CH), F32)
    split, rb = nb_base * k_tail.shape[2], k_tail.shape[3] * k_tail.itemsize
    kb, kt = row_addr(k_base, j, 0, 0), row_addr(k_tail, j, 0, 0)
    ra = np.empty((2, CH), np.intp)  # K row addresses: this chunk, the next
    for t in range(min(CH, n_tokens)):
        ra[0, t] = _key_addr(t, split, rb, kb, kt)
    cur = 0
    for c0 in range(0, ncol, CH):
        n_next = max(0, min(CH, n_tokens - c0 - CH))
        for t in range(n_next):
            ra[1 - cur, t] = _key_addr(c0 + CH + t, split, rb, kb, kt)
        qk_tiles(qp, k_tail, ra[cur], min(CH, n_tokens - c0), d, s, ra[1 - cur], n_next)
        cur = 1 - cur
        for w in range(wq):
            qpos = n_tokens - wq + w
            for t in range(max(0, qpos + 1 - c0), CH):  # keys after the query, padding
                s[w, t] = NEG_INF
            mv = vload(s, w, 0)
            for t in range(W, CH, W):
                mv = vmax(mv, vload(s, w, t))
            mn = max(m[w], vhmax(mv))
            mc[w, c0 // CH] = mn
            if mn == NEG_INF:
                for t in range(CH):
                    ex[w, c0 + t] = F32(0.0)
                continue
            mvec = vsplat(mn)
            tot = vzero()
            for t in range(0, CH, W):
                p = vexp2_neg(vsub(vload(s, w, t), mvec))
                vstore(ex, w, c0 + t, p)
                tot = vadd(tot, p)
            z[w] = z[w] * exp2_neg(m[w] - mn) + vhsum(tot)
            m[w] = mn
    for c0 in range(0, ncol, CH):  # vert/slash padded: [H, ncol], [H, ncol + wq]; slash reversed
        for w in range(wq):
            f = exp2_neg(mc[w, c0 // CH] - m[w]) / z[w]
            if f == 0:
                continue
            fv = vsplat(f)
            shift = wq - 1 - w  # key t has offset qpos - t, stored at (n_tokens - 1) - offset
            for t in range(c0, c0 + CH, W):
                p = vmul(vload(ex, w, t), fv)
                vstore(vert, hi, t, vadd(vload(vert, hi, t), p))
                vstore(slash, hi, t + shift, vadd(vload(slash, hi, t + shift), p))


@njit(cache=True)
def _zeros2(a, b):
    return np.zeros((a, b), F32)


@njit(parallel=True, cache=True)
def _vs_estimate(qw, kv_heads, k_base, k_tail, nb_base, n_tokens, scale2, perm):
    ncol = -(-n_tokens // CH) * CH
    vert = _zeros2(qw.shape[0], ncol)
    slash = _zeros2(qw.shape[0], ncol + qw.shape[1])  # reversed: offset o at n_tokens - 1 - o
    for hi in prange(qw.shape[0]):
        _vs_head(qw, hi, kv_heads[hi], k_base, k_tail, nb_base, n_tokens, scale2, perm, vert,
                 slash)
    return vert, slash


def vs_estimate(kv: LayerKV, qw: np.ndarray, kv_heads: np.ndarray, n_tokens: int,
                scale: float) -> tuple[np.ndarray, np.ndarray]:
    """qw [H, Wq, d]: the last Wq queries (positions n_tokens - Wq ..) of H query heads reading
    KV heads kv_heads [H]. Softmax of each against every key up to it, summed over the Wq rows:
    -> (vert [H, n_tokens]: mass per key, slash [H, n_tokens]: mass per offset query - key)."""
    qw = np.ascontiguousarray(qw, F32)
    use_threads()
    vert, rev = _vs_estimate(qw, np.ascontiguousarray(kv_heads, np.int64), kv.k_base, kv.k_tail,
                             kv.nb_base, n_tokens, F32(scale * LOG2E), kv.perm)
    return vert[:, :n_tokens], rev[:, n_tokens - 1:: -1] if n_tokens else rev[:, :0]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _pool_keys(k_base, k_tail, nb_base, b0, b1, n_tokens, out):
    hkv, d = k_tail.shape[0], kv_dim(k_tail)
    for t in prange(hkv * (b1 - b0)):
        j, kb = t // (b1 - b0), b0 + t % (b1 - b0)
        e = min(n_tokens, (kb + 1) * QB)
        x = np.empty(d, F32)
        for c in range(d):
            out[j, kb - b0, c] = F32(0.0)
        for p in range(kb * QB, e):
            row_to_f32(_row(k_base, k_tail, nb_base, j, p), x)
            for c in range(d):
                out[j, kb - b0, c] += x[c]
        inv = F32(1.0) / F32(e - kb * QB)
        for c in range(d):
            out[j, kb - b0, c] *= inv


def pool_keys(kv: LayerKV, b0: int, b1: int, n_tokens: int) -> np.ndarray:
    """Mean key of each QB-token block b0..b1-1 (the last may be partial) -> [Hkv, b1-b0, d]."""
    out = np.empty((kv.hkv, b1 - b0, kv.d), F32)
    if b1 > b0:
        use_threads()
        _pool_keys(kv.k_base, kv.k_tail, kv.nb_base, b0, b1, n_tokens, out)
    return out


# --- NumPy references ---------------------------------------------------------------------------
def _layer_f64(k_base, k_tail, kv_kind):
    hkv = k_tail.shape[0]
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    return k.reshape(hkv, -1, k.shape[-1])  # [Hkv, T, d]


def sparse_attend_ref(q, k_base, v_base, k_tail, v_tail, nb_base, kv_kind, q_start, index,
                      scale):
    """float64 reference of `sparse_attend`."""
    k, v = _layer_f64(k_base, k_tail, kv_kind), _layer_f64(v_base, v_tail, kv_kind)
    hq, length, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros((hq, length, d))
    for h in range(hq):
        for b in range(n_qblocks(length)):
            for i in range(b * QB, min(length, (b + 1) * QB)):
                vis = index.row_keys(h, b, q_start + i)
                if vis.size == 0:
                    continue
                sc = scale * (k[h // g, vis] @ q[h, i].astype(np.float64))
                p = np.exp(sc - sc.max())
                out[h, i] = (p / p.sum()) @ v[h // g, vis]
    return out


def vs_estimate_ref(qw, kv_heads, k_base, k_tail, nb_base, kv_kind, n_tokens, scale):
    """float64 reference of `vs_estimate`."""
    k = _layer_f64(k_base, k_tail, kv_kind)
    h_n, wq, _ = qw.shape
    vert, slash = np.zeros((h_n, n_tokens)), np.zeros((h_n, n_tokens))
    for hi in range(h_n):
        for w in range(wq):
            qp = n_tokens - wq + w
            sc = scale * (k[kv_heads[hi], : qp + 1] @ qw[hi, w].astype(np.float64))
            p = np.exp(sc - sc.max())
            p /= p.sum()
            vert[hi, : qp + 1] += p
            slash[hi, : qp + 1] += p[::-1]
    return vert, slash


def pool_keys_ref(k_base, k_tail, kv_kind, b0, b1, n_tokens):
    k = _layer_f64(k_base, k_tail, kv_kind)
    return np.stack([k[:, b * QB: min(n_tokens, (b + 1) * QB)].mean(1) for b in range(b0, b1)],
                    axis=1)
