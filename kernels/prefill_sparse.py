"""Sparse prefill attention (MInference's A-shape, Vertical-Slash and Block-Sparse heads).

A prefill chunk's queries `q [Hq, L, d]` sit at positions `q_start .. q_start + L - 1`; the
layer's K/V (store layout, chunk included) hold `n_tokens = q_start + L` tokens. Queries are cut
into blocks of QB rows (block b: rows b*QB ..). Every pattern becomes one index, per (query head,
query block): key ranges `[s, e)` (ascending, disjoint) and single key columns (ascending, outside
every range). `sparse_attend` computes, for each query row, exact softmax attention over the
keys of its block's ranges and columns that are not after it (causal).

Index builders: `ashape_index` (first `init` keys + the `local` before the block), `vs_index`
(slash offsets o give the ranges `[q0 - o, q1 - o)` of block [q0, q1), merged; vertical columns
not inside them) and `block_index` (the key blocks of QB tokens picked per query block).
Estimators: `vs_estimate` (softmax of the last W queries against every key, summed per column and
per diagonal) and `pool_keys` (mean of each QB-token key block). Each has a NumPy `*_ref`.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ._simd import F32, FASTMATH, LOG2E, NEG_INF, kv_to_f64
from ._vec import (
    W,
    vadd,
    vexp2_neg,
    vfma,
    vhmax,
    vhsum,
    vload,
    vmax,
    vmul,
    vsplat,
    vstore,
    vsub,
    vzero,
)
from .attention import LayerKV
from .kvquant import kv_dim, row_to_f32
from .threads import use_threads

QB = 64  # query rows per index block (and the pooling block of Block-Sparse)
KC = 64  # keys per inner chunk (a multiple of 2W)


class PrefillIndex(NamedTuple):
    """Per (query head h, query block b): ranges[r_off[h, b] : + r_cnt[h, b]] ([s, e) int32
    pairs, ascending, disjoint) and cols[c_off[h, b] : + c_cnt[h, b]] (ascending, outside the
    ranges). Offsets int64 [Hq, nqb], counts int32 [Hq, nqb]."""

    r_off: np.ndarray
    r_cnt: np.ndarray
    ranges: np.ndarray  # [N, 2] int32
    c_off: np.ndarray
    c_cnt: np.ndarray
    cols: np.ndarray  # [M] int32

    def keys(self, h: int, b: int) -> np.ndarray:
        """Sorted key positions of block b of head h (tests, references)."""
        r = self.ranges[self.r_off[h, b]: self.r_off[h, b] + self.r_cnt[h, b]]
        c = self.cols[self.c_off[h, b]: self.c_off[h, b] + self.c_cnt[h, b]]
        parts = [np.arange(s, e) for s, e in r] + [c.astype(np.int64)]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def n_qblocks(length: int) -> int:
    return -(-length // QB)


def pack_index(heads: list[np.ndarray], parts: list[tuple], n_heads: int, nqb: int
               ) -> PrefillIndex:
    """Assemble a PrefillIndex from groups of heads, each with padded ranges
    `[Hs, nqb, R, 2]` + counts `[Hs, nqb]` and padded cols `[Hs, nqb, C]` + counts."""
    r_off = np.zeros((n_heads, nqb), np.int64)
    r_cnt = np.zeros((n_heads, nqb), np.int32)
    c_off = np.zeros((n_heads, nqb), np.int64)
    c_cnt = np.zeros((n_heads, nqb), np.int32)
    rs, cs, nr, nc = [], [], 0, 0
    for hs, (rg, rn, cl, cn) in zip(heads, parts, strict=True):
        keep = np.arange(rg.shape[2]) < rn[..., None]  # [Hs, nqb, R]
        r_cnt[hs], r_off[hs] = rn, nr + (np.cumsum(rn.ravel()) - rn.ravel()).reshape(rn.shape)
        rs.append(rg[keep])
        nr += int(rn.sum())
        keep = np.arange(cl.shape[2]) < cn[..., None]
        c_cnt[hs], c_off[hs] = cn, nc + (np.cumsum(cn.ravel()) - cn.ravel()).reshape(cn.shape)
        cs.append(cl[keep])
        nc += int(cn.sum())
    ranges = np.concatenate(rs).astype(np.int32) if rs else np.zeros((0, 2), np.int32)
    cols = np.concatenate(cs).astype(np.int32) if cs else np.zeros(0, np.int32)
    return PrefillIndex(r_off, r_cnt, ranges.reshape(-1, 2), c_off, c_cnt, cols)


# --- index builders -----------------------------------------------------------------------------
def ashape_index(n_heads: int, q_start: int, length: int, init: int, local: int) -> tuple:
    """A-shape for `n_heads` heads: keys [0, init) and the `local` keys before each query block
    (plus the block itself). Returns the padded parts of `pack_index`."""
    nqb = n_qblocks(length)
    rg = np.zeros((n_heads, nqb, 2, 2), np.int32)
    rn = np.zeros((n_heads, nqb), np.int32)
    for b in range(nqb):
        q0 = q_start + b * QB
        q1 = min(q_start + length, q0 + QB)
        lo = max(0, q0 - local)
        if init >= lo:  # one range
            rg[:, b, 0] = (0, q1)
            rn[:, b] = 1
        else:
            rg[:, b, 0], rg[:, b, 1] = (0, init), (lo, q1)
            rn[:, b] = 2 if init > 0 else 1
            if init <= 0:
                rg[:, b, 0] = (lo, q1)
    return rg, rn, np.zeros((n_heads, nqb, 1), np.int32), np.zeros((n_heads, nqb), np.int32)


@njit(cache=True)
def vs_index(vertical, slash, q_start, length):
    """Vertical-Slash index. vertical [H, kv] int32 ascending key columns; slash [H, ks] int32
    ascending diagonal offsets (query pos - key pos >= 0). Returns padded parts for pack_index:
    ranges [H, nqb, ks, 2], counts [H, nqb], cols [H, nqb, kv], counts [H, nqb]."""
    h_n, kv_n, ks_n = vertical.shape[0], vertical.shape[1], slash.shape[1]
    nqb = (length + QB - 1) // QB
    rg = np.zeros((h_n, nqb, max(ks_n, 1), 2), np.int32)
    rn = np.zeros((h_n, nqb), np.int32)
    cl = np.zeros((h_n, nqb, max(kv_n, 1)), np.int32)
    cn = np.zeros((h_n, nqb), np.int32)
    tmp = np.zeros((max(ks_n, 1), 2), np.int32)
    for h in range(h_n):
        for b in range(nqb):
            q0 = q_start + b * QB
            q1 = min(q_start + length, q0 + QB)
            # offsets ascending -> ranges with descending starts; merge touching ones
            n = 0
            for i in range(ks_n):
                o = slash[h, i]
                e = q1 - o
                if e <= 0:
                    break
                s = max(0, q0 - o)
                if n > 0 and e >= tmp[n - 1, 0]:
                    tmp[n - 1, 0] = min(tmp[n - 1, 0], s)
                else:
                    tmp[n, 0], tmp[n, 1] = s, e
                    n += 1
            for i in range(n):  # ascending
                rg[h, b, i, 0], rg[h, b, i, 1] = tmp[n - 1 - i, 0], tmp[n - 1 - i, 1]
            rn[h, b] = n
            # columns before q1 that no range covers (both lists ascending: one merge pass)
            r, m = 0, 0
            for i in range(kv_n):
                c = vertical[h, i]
                if c >= q1:
                    break
                while r < n and rg[h, b, r, 1] <= c:
                    r += 1
                if r < n and rg[h, b, r, 0] <= c:
                    continue
                if m == 0 or cl[h, b, m - 1] != c:
                    cl[h, b, m] = c
                    m += 1
            cn[h, b] = m
    return rg, rn, cl, cn


@njit(cache=True)
def block_index(scores, q_start, length, k_b):
    """Block-Sparse index from block scores [H, nqb, nkb] (query block x key block of QB
    tokens, absolute key blocks): per query block the k_b best causal key blocks, always with
    key block 0 and the blocks the query block overlaps. Padded parts for pack_index."""
    h_n, nqb = scores.shape[0], scores.shape[1]
    rg = np.zeros((h_n, nqb, k_b + 3, 2), np.int32)
    rn = np.zeros((h_n, nqb), np.int32)
    for h in range(h_n):
        for b in range(nqb):
            q0 = q_start + b * QB
            q1 = min(q_start + length, q0 + QB)
            first_diag = q0 // QB
            last = (q1 - 1) // QB  # last causal key block
            pick = np.zeros(last + 1, np.bool_)
            pick[0] = True
            pick[first_diag:last + 1] = True
            n_cand = first_diag - 1  # blocks 1 .. first_diag - 1 compete
            if n_cand > 0:
                sc = scores[h, b, 1:first_diag]
                order = np.argsort(-sc)
                for i in range(min(k_b, n_cand)):
                    pick[1 + order[i]] = True
            n = 0
            j = 0
            while j <= last:
                if pick[j]:
                    s = j
                    while j <= last and pick[j]:
                        j += 1
                    rg[h, b, n, 0], rg[h, b, n, 1] = s * QB, min(j * QB, q1)
                    n += 1
                else:
                    j += 1
            rn[h, b] = n
    return rg, rn, np.zeros((h_n, nqb, 1), np.int32), np.zeros((h_n, nqb), np.int32)


def topk_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row of x [H, n], ascending, int32."""
    k = min(k, x.shape[1])
    if k == 0:
        return np.zeros((x.shape[0], 0), np.int32)
    idx = np.argpartition(-x, k - 1, axis=1)[:, :k] if k < x.shape[1] else \
        np.broadcast_to(np.arange(x.shape[1]), x.shape)
    # C order whatever x's strides (a reversed or sliced view sorts to F order): one signature
    # for the index kernels
    return np.ascontiguousarray(np.sort(idx, axis=1), dtype=np.int32)


@njit(cache=True)
def _positions(r_off, r_cnt, ranges, c_off, c_cnt, cols, h, out, cnt):
    """Count (out None-like: 0 columns) or fill head h's key positions per query block."""
    for b in range(r_cnt.shape[1]):
        n = 0
        for ri in range(r_off[h, b], r_off[h, b] + r_cnt[h, b]):
            for t in range(ranges[ri, 0], ranges[ri, 1]):
                if out.shape[1]:
                    out[b, n] = t
                n += 1
        for ci in range(c_off[h, b], c_off[h, b] + c_cnt[h, b]):
            if out.shape[1]:
                out[b, n] = cols[ci]
            n += 1
        cnt[b] = n


def index_positions(index: PrefillIndex, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Head h's key positions per query block: (pos [nqb, P] int64, zero-padded to the
    longest block; counts [nqb]). Ranges first, then columns (not sorted across the two)."""
    nqb = index.r_cnt.shape[1]
    args = (index.r_off, index.r_cnt, np.ascontiguousarray(index.ranges, np.int32), index.c_off,
            index.c_cnt, np.ascontiguousarray(index.cols, np.int32), h)
    cnt = np.zeros(nqb, np.int64)
    _positions(*args, np.zeros((nqb, 0), np.int64), cnt)
    out = np.zeros((nqb, max(1, int(cnt.max(initial=0)))), np.int64)
    _positions(*args, out, cnt)
    return out, cnt


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
def _softmax_step(s, nq, n, pos, qpos0, m, den, acc):
    """Mask (key after query, or padding), then the online-softmax update of rows i < nq:
    s becomes probabilities (log2 units), acc/den rescaled."""
    need_mask = n < KC or pos[n - 1] > qpos0
    for i in range(nq):
        if need_mask:
            qp = qpos0 + i
            for t in range(KC):
                if t >= n or pos[t] > qp:
                    s[i, t] = NEG_INF
        mv = vload(s, i, 0)
        for t in range(W, KC, W):
            mv = vmax(mv, vload(s, i, t))
        mn = max(m[i], vhmax(mv))
        if mn == NEG_INF:  # nothing visible yet for this row
            for t in range(KC):
                s[i, t] = F32(0.0)
            continue
        alpha = np.exp2(m[i] - mn) if m[i] != NEG_INF else F32(0.0)
        mvec = vsplat(mn)
        tot = vzero()
        for t in range(0, KC, W):
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
    _softmax_step(s, nq, n, pos, qpos0, m, den, acc)
    _load_v(v_base, v_tail, nb_base, j, pos, n, vv)
    _pv(s, nq, n, vv, acc)


@njit(cache=True, fastmath=FASTMATH)
def _task(q, h, b, q_start, k_base, v_base, k_tail, v_tail, nb_base, g, ix, scale2, out):
    """Query block b of head h over its index entry; writes out[h, rows of b]."""
    r_off, r_cnt, ranges, c_off, c_cnt, cols = ix
    length, d = q.shape[1], q.shape[2]
    dp = -(-d // (2 * W)) * 2 * W
    i0 = b * QB
    nq = min(QB, length - i0)
    rows = -(-nq // 4) * 4
    qt = np.zeros((rows, d), F32)
    for i in range(nq):
        for c in range(d):
            qt[i, c] = q[h, i0 + i, c] * scale2
    kt = np.zeros((d, KC), F32)
    vv = np.zeros((KC, dp), F32)
    s = np.zeros((rows, KC), F32)
    acc = np.zeros((rows, dp), F32)
    m = np.full(rows, NEG_INF)
    den = np.zeros(rows, F32)
    pos = np.zeros(KC, np.int64)
    j = h // g
    qpos0 = q_start + i0
    qlast = qpos0 + nq - 1
    for ri in range(r_off[h, b], r_off[h, b] + r_cnt[h, b]):
        st, en = ranges[ri, 0], min(ranges[ri, 1], qlast + 1)
        for c0 in range(st, en, KC):
            n = min(KC, en - c0)
            for t in range(n):
                pos[t] = c0 + t
            _chunk(qt, nq, qpos0, k_base, v_base, k_tail, v_tail, nb_base, j, pos, n, kt, vv,
                   s, m, den, acc)
    c1 = c_off[h, b] + c_cnt[h, b]
    for c0 in range(c_off[h, b], c1, KC):
        n = 0
        for t in range(c0, min(c1, c0 + KC)):
            if cols[t] <= qlast:
                pos[n] = cols[t]
                n += 1
        if n > 0:
            _chunk(qt, nq, qpos0, k_base, v_base, k_tail, v_tail, nb_base, j, pos, n, kt, vv,
                   s, m, den, acc)
    for i in range(nq):
        inv = F32(1.0) / den[i] if den[i] > 0 else F32(0.0)
        for c in range(d):
            out[h, i0 + i, c] = acc[i, c] * inv


@njit(cache=True)
def _task_kind(q, h, b, q_start, k_base, v_base, k_tail, v_tail, kind, nb_base, g, ix, scale2,
               out):
    """`_task` over K/V bytes viewed back as the storage dtype of `kind`."""
    if kind == 1:
        _task(q, h, b, q_start, k_base.view(np.uint16), v_base.view(np.uint16),
              k_tail.view(np.uint16), v_tail.view(np.uint16), nb_base, g, ix, scale2, out)
    elif kind == 2:
        _task(q, h, b, q_start, k_base.view(np.int16), v_base.view(np.int16),
              k_tail.view(np.int16), v_tail.view(np.int16), nb_base, g, ix, scale2, out)
    elif kind == 3:
        _task(q, h, b, q_start, k_base.view(np.int32), v_base.view(np.int32),
              k_tail.view(np.int32), v_tail.view(np.int32), nb_base, g, ix, scale2, out)
    elif kind == 4:
        _task(q, h, b, q_start, k_base.view(np.uint32), v_base.view(np.uint32),
              k_tail.view(np.uint32), v_tail.view(np.uint32), nb_base, g, ix, scale2, out)
    else:
        _task(q, h, b, q_start, k_base.view(F32), v_base.view(F32), k_tail.view(F32),
              v_tail.view(F32), nb_base, g, ix, scale2, out)


@njit(cache=True)
def _empty_out(shape0, shape1, shape2):
    return np.empty((shape0, shape1, shape2), F32)


@njit(parallel=True, cache=True)
def _sparse_attend(q, k_base, v_base, k_tail, v_tail, kind, nb_base, q_start, ix, scale2):
    hq, length = q.shape[0], q.shape[1]
    g = hq // k_tail.shape[0]
    nqb = (length + QB - 1) // QB
    out = _empty_out(hq, length, q.shape[2])
    for t in prange(hq * nqb):
        h, b = t // nqb, nqb - 1 - t % nqb  # the later (longer) blocks first
        _task_kind(q, h, b, q_start, k_base, v_base, k_tail, v_tail, kind, nb_base, g, ix,
                   scale2, out)
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
    for a in (index.ranges.ravel(), index.cols):
        if a.size and (a.min() < 0 or a.max() > n_tokens):
            raise ValueError("index position out of range")
    use_threads()
    ix = (index.r_off, index.r_cnt, np.ascontiguousarray(index.ranges, np.int32), index.c_off,
          index.c_cnt, np.ascontiguousarray(index.cols, np.int32))
    return _sparse_attend(q, kv.k_base, kv.v_base, kv.k_tail, kv.v_tail, kv.kv_kind, kv.nb_base,
                          q_start, ix, F32(scale * LOG2E))


# --- estimators ---------------------------------------------------------------------------------
@njit(cache=True, fastmath=FASTMATH)
def _vs_head(qw, hi, j, k_base, k_tail, nb_base, n_tokens, scale2, vert, slash):
    """Softmax of the last queries qw[hi] [Wq, d] (positions n_tokens - Wq + w) over every key,
    summed into vert[hi, key] and slash[hi, query - key]."""
    wq, d = qw.shape[1], qw.shape[2]
    rows = -(-wq // 4) * 4
    qt = np.zeros((rows, d), F32)
    for w in range(wq):
        for c in range(d):
            qt[w, c] = qw[hi, w, c] * scale2
    ncol = -(-n_tokens // KC) * KC
    s = np.zeros((rows, ncol), F32)  # [rows, n_tokens padded] scores, then probabilities
    kt = np.zeros((d, KC), F32)
    pos = np.zeros(KC, np.int64)
    for c0 in range(0, n_tokens, KC):
        n = min(KC, n_tokens - c0)
        for t in range(n):
            pos[t] = c0 + t
        _load_kt(k_base, k_tail, nb_base, j, pos, n, kt)
        _qk(qt, wq, kt, s, c0)
    for w in range(wq):  # vert/slash padded: [H, ncol], [H, ncol + wq]; slash reversed
        qp = n_tokens - wq + w
        for t in range(qp + 1, ncol):
            s[w, t] = NEG_INF
        mv = vload(s, w, 0)
        for t in range(W, ncol, W):
            mv = vmax(mv, vload(s, w, t))
        mx = vsplat(vhmax(mv))
        tot = vzero()
        for t in range(0, ncol, W):
            p = vexp2_neg(vsub(vload(s, w, t), mx))
            vstore(s, w, t, p)
            tot = vadd(tot, p)
        inv = vsplat(F32(1.0) / vhsum(tot))
        shift = wq - 1 - w  # key t has offset qp - t, stored at (n_tokens - 1) - offset
        for t in range(0, ncol, W):
            p = vmul(vload(s, w, t), inv)
            vstore(vert, hi, t, vadd(vload(vert, hi, t), p))
            vstore(slash, hi, t + shift, vadd(vload(slash, hi, t + shift), p))


@njit(cache=True)
def _vs_head_kind(qw, hi, j, k_base, k_tail, kind, nb_base, n_tokens, scale2, vert, slash):
    if kind == 1:
        _vs_head(qw, hi, j, k_base.view(np.uint16), k_tail.view(np.uint16), nb_base, n_tokens,
                 scale2, vert, slash)
    elif kind == 2:
        _vs_head(qw, hi, j, k_base.view(np.int16), k_tail.view(np.int16), nb_base, n_tokens,
                 scale2, vert, slash)
    elif kind == 3:
        _vs_head(qw, hi, j, k_base.view(np.int32), k_tail.view(np.int32), nb_base, n_tokens,
                 scale2, vert, slash)
    elif kind == 4:
        _vs_head(qw, hi, j, k_base.view(np.uint32), k_tail.view(np.uint32), nb_base, n_tokens,
                 scale2, vert, slash)
    else:
        _vs_head(qw, hi, j, k_base.view(F32), k_tail.view(F32), nb_base, n_tokens, scale2, vert,
                 slash)


@njit(cache=True)
def _zeros2(a, b):
    return np.zeros((a, b), F32)


@njit(parallel=True, cache=True)
def _vs_estimate(qw, kv_heads, k_base, k_tail, kind, nb_base, n_tokens, scale2):
    ncol = -(-n_tokens // KC) * KC
    vert = _zeros2(qw.shape[0], ncol)
    slash = _zeros2(qw.shape[0], ncol + qw.shape[1])  # reversed: offset o at n_tokens - 1 - o
    for hi in prange(qw.shape[0]):
        _vs_head_kind(qw, hi, kv_heads[hi], k_base, k_tail, kind, nb_base, n_tokens, scale2,
                      vert, slash)
    return vert, slash


def vs_estimate(kv: LayerKV, qw: np.ndarray, kv_heads: np.ndarray, n_tokens: int,
                scale: float) -> tuple[np.ndarray, np.ndarray]:
    """qw [H, Wq, d]: the last Wq queries (positions n_tokens - Wq ..) of H query heads reading
    KV heads kv_heads [H]. Softmax of each against every key up to it, summed over the Wq rows:
    -> (vert [H, n_tokens]: mass per key, slash [H, n_tokens]: mass per offset query - key)."""
    qw = np.ascontiguousarray(qw, F32)
    use_threads()
    vert, rev = _vs_estimate(qw, np.ascontiguousarray(kv_heads, np.int64), kv.k_base, kv.k_tail,
                             kv.kv_kind, kv.nb_base, n_tokens, F32(scale * LOG2E))
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
        dt = {0: F32, 1: np.uint16, 2: np.int16, 3: np.int32, 4: np.uint32}[kv.kv_kind]
        _pool_keys(kv.k_base.view(dt), kv.k_tail.view(dt), kv.nb_base, b0, b1, n_tokens, out)
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
            keys = index.keys(h, b)
            for i in range(b * QB, min(length, (b + 1) * QB)):
                vis = keys[keys <= q_start + i]
                if vis.size == 0:
                    continue
                sc = scale * (k[h // g, vis] @ q[h, i].astype(np.float64))
                p = np.exp(sc - sc.max())
                out[h, i] = (p / p.sum()) @ v[h // g, vis]
    return out


def dense_index(n_heads: int, q_start: int, length: int) -> PrefillIndex:
    """Every key up to each block's last query (exact attention)."""
    rg, rn, cl, cn = ashape_index(n_heads, q_start, length, 0, q_start + length)
    return pack_index([np.arange(n_heads)], [(rg, rn, cl, cn)], n_heads, n_qblocks(length))


def vs_index_ref(vertical, slash, q_start, length, h, b):
    """Key set of block b of head h under `vs_index`: each offset's range, the columns."""
    q0 = q_start + b * QB
    q1 = min(q_start + length, q0 + QB)
    keys = set()
    for o in slash[h]:
        keys.update(range(max(0, q0 - o), max(0, q1 - o)))
    keys.update(int(c) for c in vertical[h] if c < q1)
    return np.array(sorted(keys), np.int64)


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
