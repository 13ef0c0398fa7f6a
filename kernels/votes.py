"""Attention votes of the prompt's last W queries over every key (DYNAMIC anchors, preselection).

Two passes over the keys, chunk by chunk, so nothing of size W x n_tokens x Hq is ever held:
pass 1 finds each query row's log-sum-exp (online max + sum), pass 2 recomputes the scores and adds
each key's softmax probability, summed over the rows of its KV head's group.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import F32, FASTMATH, LOG2E, NEG_INF, exp2_neg, kv_to_f64, kv_view, readonly
from ._vec import (
    W,
    row_addr,
    vadd,
    vexp2_neg,
    vhmax,
    vhsum,
    vload,
    vmax,
    vsplat,
    vstore,
    vsub,
    vzero,
)
from .attention import CH, channel_perm, pack_rows, qk_tiles
from .kvquant import head_dim_of, kv_dim
from .threads import split_threads, use_threads


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _part(qp, k_base, k_tail, nb_base, n_tokens, nw, real, j, b0, b1, m, den, lse, votes):
    """Blocks b0..b1-1 of KV head j for the first `real` rows of qp [R, P].

    Pass 1 (lse empty): update each row's running max m and sum den [R] (log2 units).
    Pass 2: add the probabilities exp2(s - lse) to votes [n_tokens].
    """
    bs = k_tail.shape[2]
    rows = qp.shape[0]
    d = kv_dim(k_tail)
    ra = np.empty(CH, np.intp)  # K row addresses of the chunk
    s = np.empty((rows, CH), F32)  # [R, CH]
    col = np.empty((1, CH), F32)  # pass 2: probabilities summed over rows
    first_q = n_tokens - nw  # position of query 0
    end = min(b1 * bs, n_tokens)
    for p0 in range(b0 * bs, end, CH):  # chunks of CH consecutive keys, across block borders
        nt = min(CH, end - p0)
        for i in range(nt):
            b, t = (p0 + i) // bs, (p0 + i) % bs
            if b < nb_base:
                ra[i] = row_addr(k_base, j, b, t)
            else:
                ra[i] = row_addr(k_tail, j, b - nb_base, t)
        qk_tiles(qp, k_tail, ra, nt, d, s, ra, np.int64(0))  # nothing to prefetch
        for i in range(nt):  # causal: query w sees keys up to first_q + w
            late = p0 + i - first_q
            if late > 0:
                for r in range(real):
                    if r % nw < late:
                        s[r, i] = NEG_INF
        for r in range(real):
            for i in range(nt, CH):
                s[r, i] = NEG_INF
        if lse.size == 0:  # pass 1
            for r in range(real):
                mv = vload(s, r, 0)
                for c in range(W, CH, W):
                    mv = vmax(mv, vload(s, r, c))
                mn = max(m[r], vhmax(mv))
                if mn == NEG_INF:
                    continue
                mv, tot = vsplat(mn), vzero()
                for c in range(0, CH, W):
                    tot = vadd(tot, vexp2_neg(vsub(vload(s, r, c), mv)))
                den[r] = den[r] * exp2_neg(m[r] - mn) + vhsum(tot)
                m[r] = mn
        else:  # pass 2
            for c in range(0, CH, W):
                tot = vzero()
                for r in range(real):
                    tot = vadd(tot, vexp2_neg(vsub(vload(s, r, c), vsplat(lse[r]))))
                vstore(col, 0, c, tot)
            for i in range(nt):
                votes[p0 + i] += col[0, i]


@njit(nogil=True, cache=True)
def _state(n_items, rows, hkv, n_tokens):
    """Row max -inf and sum 0 per item [items, R], votes 0 [Hkv, n_tokens], lse [Hkv, R]; serial,
    so that no allocation becomes a parfor of the parallel kernel."""
    return (np.full((n_items, rows), NEG_INF), np.zeros((n_items, rows), F32),
            np.zeros((hkv, n_tokens), F32), np.full((hkv, rows), NEG_INF))


@njit(parallel=True, nogil=True, cache=True)
def _votes(qp, k_base, k_tail, nb_base, n_tokens, nw, real, n_split):
    # qp [Hkv, R, P] packed scaled rows (head, w); K [Hkv, nb, bs, row] (kv_view) -> [Hkv, n_tokens]
    hkv, rows, _ = qp.shape
    nblk = -(-n_tokens // k_tail.shape[2])
    n_items = hkv * n_split
    mx, den, votes, lse = _state(n_items, rows, hkv, n_tokens)
    none = np.empty(0, F32)
    for pas in range(2):  # 1: row log-sum-exp per part; 2: probabilities (needs the merged lse)
        for item in prange(n_items):
            j, part = item // n_split, item % n_split
            b0, b1 = part * nblk // n_split, (part + 1) * nblk // n_split
            _part(qp[j], k_base, k_tail, nb_base, n_tokens, nw, real, j, b0, b1, mx[item],
                  den[item], none if pas == 0 else lse[j], votes[j])
        if pas == 0:
            for j in range(hkv):  # merge parts: log2-sum-exp per row
                for r in range(real):
                    big = NEG_INF
                    for i in range(j * n_split, (j + 1) * n_split):
                        big = max(big, mx[i, r])
                    tot = F32(0.0)
                    for i in range(j * n_split, (j + 1) * n_split):
                        tot += den[i, r] * exp2_neg(mx[i, r] - big)
                    lse[j, r] = big + np.log2(tot)
    return votes


def query_votes(qw, k_base, k_tail, nb_base, n_tokens, scale, kv_kind):
    """Summed attention probabilities of the last W prompt queries: [Hkv, n_tokens] f32.

    qw [Hq, W, d] f32, query w at position n_tokens - W + w (causal); K storage per kv_kind.
    Entry [j, t] sums, over KV head j's query heads and the W queries, the softmax weight of key t.
    """
    kb, kt = kv_view("k_base", k_base, kv_kind), kv_view("k_tail", k_tail, kv_kind)
    hkv, _, bs, row = k_tail.shape
    d = head_dim_of(kv_kind, row)
    hq, nw, _ = qw.shape
    if hq % hkv or qw.shape[2] != d or not 1 <= nw <= n_tokens:
        raise ValueError(f"qw must be [Hq, W <= n_tokens, {d}], got {qw.shape}")
    if -(-n_tokens // bs) > nb_base + k_tail.shape[1]:
        raise ValueError("n_tokens exceeds the store")
    rows = readonly(qw, F32).reshape(hq * nw, d)  # rows (head, w) per group
    qp = pack_rows(rows, hkv, channel_perm(d, kv_kind), F32(scale * LOG2E))  # [Hkv, ceil4(gW), P]
    use_threads()
    n_split = max(1, min(-(-4 * split_threads() // hkv), -(-n_tokens // bs)))  # 4 a thread
    return _votes(qp, kb, kt, nb_base, n_tokens, nw, (hq // hkv) * nw, n_split)


def query_votes_ref(qw, k_base, k_tail, nb_base, n_tokens, scale, kv_kind):
    """float64 NumPy reference of `query_votes`."""
    hkv = k_tail.shape[0]
    hq, nw, d = qw.shape
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    k = k.reshape(hkv, -1, d)[:, :n_tokens]  # [Hkv, T, d]
    votes = np.zeros((hkv, n_tokens))
    for h in range(hq):
        j = h // (hq // hkv)
        for i in range(nw):
            pos = n_tokens - nw + i
            s = scale * (k[j, :pos + 1] @ qw[h, i].astype(np.float64))
            votes[j, :pos + 1] += np.exp(s - np.logaddexp.reduce(s))
    return votes


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def turn_blocks(k, cos, sin):
    """Keys k [Hkv, c, bs, d] f32 turned in place, block i by (cos, sin) [c, h] (Llama's
    rotate_half layout: channel f pairs with f + h; channels past 2h stay)."""
    hkv, c, bs, _ = k.shape
    h = cos.shape[1]
    for item in prange(hkv * c):
        j, i = item // c, item % c
        for t in range(bs):
            for f in range(h):
                x1, x2 = k[j, i, t, f], k[j, i, t, f + h]
                k[j, i, t, f] = x1 * cos[i, f] - x2 * sin[i, f]
                k[j, i, t, f + h] = x2 * cos[i, f] + x1 * sin[i, f]


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def block_lse(sc, bs):
    """Scores sc [Hkv, R, n] f32 -> [n // bs, Hkv, R] f32: each block's log-sum-exp."""
    hkv, rows, n = sc.shape
    nb = n // bs
    out = np.empty((nb, hkv, rows), F32)
    for item in prange(hkv * rows):
        j, r = item // rows, item % rows
        for b in range(nb):
            m = NEG_INF
            for t in range(b * bs, (b + 1) * bs):
                m = max(m, sc[j, r, t])
            tot = F32(0.0)
            for t in range(b * bs, (b + 1) * bs):
                tot += np.exp(sc[j, r, t] - m)
            out[b, j, r] = m + np.log(tot) if m > NEG_INF else NEG_INF
    return out
