"""Attention votes of the prompt's last W queries over every key (DYNAMIC anchors, preselection).

Two passes over the keys, block by block, so nothing of size W x n_tokens x Hq is ever held:
pass 1 finds each query row's log-sum-exp (online max + sum), pass 2 recomputes the scores and adds
each key's softmax probability, summed over the rows of its KV head's group.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import FASTMATH, F32, LOG2E, NEG_INF, exp2_neg, kv_to_f64, kv_view, qk_rows, to_f32
from .threads import use_threads


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _scores(qr, kb, p0, nt, n_tokens, w, kf, s):
    """s[r, :nt] = qr[r] . key (log2 units) for keys p0..p0+nt-1 of block kb; causal mask.

    qr [g*W, d] rows ordered (head, w); query w sits at position n_tokens - W + w.
    """
    d = qr.shape[1]
    for t in range(nt):
        kr, kd = kb[t], kf[t]
        for c in range(d):
            kd[c] = to_f32(kr[c])
    qk_rows(qr, kf, nt, s)
    first_q = n_tokens - w
    for t in range(nt):
        late = p0 + t - first_q  # queries w < late cannot see this key
        if late > 0:
            for r in range(qr.shape[0]):
                if r % w < late:
                    s[r, t] = NEG_INF


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def _votes(qr, k_base, k_tail, nb_base, n_tokens, w, n_split):
    # qr [Hkv, g*W, d] scaled rows; K [Hkv, nb, bs, d] -> votes [Hkv, n_tokens] f32
    hkv, rows, d = qr.shape
    bs = k_tail.shape[2]
    nblk = -(-n_tokens // bs)
    n_items = hkv * n_split
    mx = np.full((n_items, rows), NEG_INF)
    den = np.zeros((n_items, rows), F32)
    votes = np.zeros((hkv, n_tokens), F32)
    lse = np.empty((hkv, rows), F32)
    for pas in range(2):
        for item in prange(n_items):
            j, part = item // n_split, item % n_split
            kf = np.empty((bs, d), F32)  # [bs, d]
            s = np.empty((rows, bs), F32)  # [rows, bs]
            m, l = mx[item], den[item]
            for b in range(part * nblk // n_split, (part + 1) * nblk // n_split):
                kb = k_base[j, b] if b < nb_base else k_tail[j, b - nb_base]
                nt = min(bs, n_tokens - b * bs)
                _scores(qr[j], kb, b * bs, nt, n_tokens, w, kf, s)
                if pas == 0:
                    for r in range(rows):
                        sr = s[r, :nt]
                        mb = NEG_INF
                        for t in range(nt):
                            mb = max(mb, sr[t])
                        mn = max(m[r], mb)
                        if mn == NEG_INF:
                            continue
                        tot = F32(0.0)
                        for t in range(nt):
                            tot += exp2_neg(sr[t] - mn)
                        l[r] = l[r] * exp2_neg(m[r] - mn) + tot
                        m[r] = mn
                else:
                    vb = votes[j, b * bs:b * bs + nt]
                    for r in range(rows):
                        sr, lr = s[r, :nt], lse[j, r]
                        for t in range(nt):
                            vb[t] += exp2_neg(sr[t] - lr)
        if pas == 0:
            for j in range(hkv):  # merge parts into each row's log2-sum-exp
                for r in range(rows):
                    big = NEG_INF
                    for p in range(n_split):
                        big = max(big, mx[j * n_split + p, r])
                    tot = F32(0.0)
                    for p in range(n_split):
                        tot += den[j * n_split + p, r] * exp2_neg(mx[j * n_split + p, r] - big)
                    lse[j, r] = big + np.log2(tot)
    return votes


def query_votes(qw, k_base, k_tail, nb_base, n_tokens, scale, kv_kind):
    """Summed attention probabilities of the last W prompt queries: [Hkv, n_tokens] f32.

    qw [Hq, W, d] f32, query w at position n_tokens - W + w (causal); K storage per kv_kind.
    Entry [j, t] sums, over KV head j's query heads and the W queries, the softmax weight of key t.
    """
    hkv, _, bs, d = k_tail.shape
    hq, w, _ = qw.shape
    if hq % hkv or qw.shape[2] != d or not 1 <= w <= n_tokens:
        raise ValueError(f"qw must be [Hq, W <= n_tokens, {d}], got {qw.shape}")
    if -(-n_tokens // bs) > nb_base + k_tail.shape[1]:
        raise ValueError("n_tokens exceeds the store")
    qr = np.ascontiguousarray(qw, dtype=np.float32).reshape(hkv, (hq // hkv) * w, d)
    qr = qr * F32(scale * LOG2E)  # [Hkv, g*W, d], rows (head, w)
    n_split = max(1, min(-(-2 * use_threads() // hkv), -(-n_tokens // bs)))
    return _votes(qr, kv_view(k_base, kv_kind), kv_view(k_tail, kv_kind), nb_base, n_tokens, w,
                  n_split)


def query_votes_ref(qw, k_base, k_tail, nb_base, n_tokens, scale, kv_kind):
    """float64 NumPy reference of `query_votes`."""
    hkv, _, _, d = k_tail.shape
    hq, w, _ = qw.shape
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    k = k.reshape(hkv, -1, d)[:, :n_tokens]  # [Hkv, T, d]
    votes = np.zeros((hkv, n_tokens))
    for h in range(hq):
        j = h // (hq // hkv)
        for i in range(w):
            pos = n_tokens - w + i
            s = scale * (k[j, :pos + 1] @ qw[h, i].astype(np.float64))
            votes[j, :pos + 1] += np.exp(s - np.logaddexp.reduce(s))
    return votes
