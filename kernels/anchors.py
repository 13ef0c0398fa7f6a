"""Block anchors (representative keys), block scores against a query, and top-k block choice.

Anchor types (anchor_num = A per block):
- MAX / MEAN: the block is cut into A equal runs of tokens; anchor a is the per-channel max / mean
  of run a (A = 1: of the whole block).
- QUEST: A = 2; anchor 0 the per-channel min, anchor 1 the per-channel max of the block.
- FIX: anchor a is token a * (bs // A).
- DYNAMIC: the A tokens of the block with the highest `token_scores` (ties: earliest first).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import FASTMATH, F32, kv_to_f64, kv_view, to_f32
from .threads import use_threads

ANCHOR_TYPES = {"MAX": 0, "MEAN": 1, "QUEST": 2, "FIX": 3, "DYNAMIC": 4}


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def _anchors(k_base, k_tail, nb_base, first, last, kind, anchors, token_scores):
    # K [Hkv, nb, bs, d]; anchors [Hkv, nb_cap, A, d] f32; token_scores [Hkv, n_tokens] (DYNAMIC)
    hkv, bs, d = k_tail.shape[0], k_tail.shape[2], k_tail.shape[3]
    na = anchors.shape[2]
    nblk = last - first
    for it in prange(hkv * nblk):
        j = it // nblk
        b = first + it % nblk
        kb = k_base[j, b] if b < nb_base else k_tail[j, b - nb_base]  # [bs, d]
        out = anchors[j, b]  # [A, d]
        if kind == 2:  # QUEST: min, max
            lo, hi = out[0], out[1]
            for c in range(d):
                lo[c] = hi[c] = to_f32(kb[0, c])
            for t in range(bs):
                kt = kb[t]
                for c in range(d):
                    x = to_f32(kt[c])
                    lo[c] = min(lo[c], x)
                    hi[c] = max(hi[c], x)
        elif kind <= 1:  # MAX / MEAN over run a
            for a in range(na):
                t0, t1 = a * bs // na, (a + 1) * bs // na
                o = out[a]
                for c in range(d):
                    o[c] = to_f32(kb[t0, c])
                for t in range(t0 + 1, t1):
                    kt = kb[t]
                    for c in range(d):
                        o[c] = max(o[c], to_f32(kt[c])) if kind == 0 else o[c] + to_f32(kt[c])
                if kind == 1:
                    inv = F32(1.0) / F32(t1 - t0)
                    for c in range(d):
                        o[c] *= inv
        else:  # FIX / DYNAMIC: copy chosen tokens
            sc = token_scores[j, b * bs:(b + 1) * bs]
            taken = np.zeros(bs, np.bool_)
            for a in range(na):
                best = a * (bs // na)
                if kind == 4:
                    best = -1
                    for t in range(bs):
                        if not taken[t] and (best < 0 or sc[t] > sc[best]):
                            best = t
                    taken[best] = True
                o, kt = out[a], kb[best]
                for c in range(d):
                    o[c] = to_f32(kt[c])


def compute_anchors(k_base, k_tail, nb_base, first, last, anchor_type, anchor_num, anchors,
                    token_scores=None, *, kv_kind):
    """Fill `anchors[:, first:last]` for the full blocks `first..last-1` (in place).

    k_base [Hkv, nb_base, bs, d], k_tail [Hkv, nb_tail_cap, bs, d] storage per kv_kind;
    anchors [Hkv, nb_cap, anchor_num, d] f32; token_scores [Hkv, n_tokens] f32 for DYNAMIC.
    """
    kind = ANCHOR_TYPES[anchor_type]
    bs = k_tail.shape[2]
    if anchors.dtype != np.float32 or anchors.shape[2] != anchor_num or not anchors.flags.c_contiguous:
        raise ValueError(f"anchors must be C-contiguous float32 [Hkv, nb_cap, {anchor_num}, d]")
    if not 1 <= anchor_num <= bs or (kind == 2 and anchor_num != 2):
        raise ValueError(f"{anchor_type} anchors cannot number {anchor_num} with block_size {bs}")
    if not 0 <= first <= last <= min(nb_base + k_tail.shape[1], anchors.shape[1]):
        raise ValueError(f"block range {first}..{last} out of the store")
    if kind == 4:
        if token_scores is None or token_scores.shape[1] < last * bs:
            raise ValueError("DYNAMIC anchors need token_scores covering the blocks")
        token_scores = np.ascontiguousarray(token_scores, dtype=np.float32)
    else:
        token_scores = np.zeros((1, 1), np.float32)
    if last > first:
        use_threads()
        _anchors(kv_view(k_base, kv_kind), kv_view(k_tail, kv_kind), nb_base, first, last, kind,
                 anchors, token_scores)


def compute_anchors_ref(k_base, k_tail, nb_base, first, last, anchor_type, anchor_num, anchors,
                        token_scores=None, *, kv_kind):
    """float64 NumPy reference of `compute_anchors` (writes float32 into `anchors`)."""
    hkv, _, bs, d = k_tail.shape
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    for b in range(first, last):
        kb = k[:, b]  # [Hkv, bs, d]
        if anchor_type == "QUEST":
            res = np.stack([kb.min(1), kb.max(1)], axis=1)
        elif anchor_type in ("MAX", "MEAN"):
            runs = [kb[:, a * bs // anchor_num:(a + 1) * bs // anchor_num] for a in range(anchor_num)]
            res = np.stack([r.max(1) if anchor_type == "MAX" else r.mean(1) for r in runs], axis=1)
        elif anchor_type == "FIX":
            res = kb[:, np.arange(anchor_num) * (bs // anchor_num)]
        else:
            sc = token_scores[:, b * bs:(b + 1) * bs]
            order = np.stack([np.lexsort((np.arange(bs), -sc[j]))[:anchor_num] for j in range(hkv)])
            res = np.take_along_axis(kb, order[:, :, None], axis=1)
        anchors[:, b] = res


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def _score(q, anchors, candidates, quest, shared):
    # q [Hq, d] f32; anchors [Hkv, nb_cap, A, d]; candidates [n] -> [S, n]
    hq, d = q.shape
    hkv, na = anchors.shape[0], anchors.shape[2]
    g = hq // hkv
    n = candidates.shape[0]
    qsum = np.zeros((hkv, d), F32)  # group sums / A: linear scores read each anchor once
    for h in range(hq):
        for c in range(d):
            qsum[h // g, c] += q[h, c] / F32(na)
    out = np.empty((1 if shared else hkv, n), F32)
    for i in prange(n):
        b = candidates[i]
        tot = F32(0.0)
        for j in range(hkv):
            acc = F32(0.0)
            if quest:
                lo, hi = anchors[j, b, 0], anchors[j, b, 1]
                for hh in range(g):
                    qh = q[j * g + hh]
                    for c in range(d):
                        acc += max(qh[c] * lo[c], qh[c] * hi[c])
            else:
                qj = qsum[j]
                for a in range(na):
                    an = anchors[j, b, a]
                    for c in range(d):
                        acc += qj[c] * an[c]
            if shared:
                tot += acc
            else:
                out[j, i] = acc
        if shared:
            out[0, i] = tot
    return out


def score_blocks(q, anchors, candidates, quest, shared):
    """Scores of candidate blocks for query q [Hq, d]: [1 (shared) or Hkv, n_cand] f32.

    Per head: mean over anchors of q_h . anchor, or QUEST's bound sum_c max(q_c min_c, q_c max_c);
    summed over all heads (shared) or over each KV head's group.
    """
    candidates = np.ascontiguousarray(candidates, dtype=np.int32)
    if candidates.size and (candidates.min() < 0 or candidates.max() >= anchors.shape[1]):
        raise ValueError("candidate block id out of range")
    if quest and anchors.shape[2] != 2:
        raise ValueError("QUEST scores need anchors [..., 2, d] (min, max)")
    use_threads()
    return _score(np.ascontiguousarray(q, dtype=np.float32), anchors, candidates, bool(quest),
                  bool(shared))


def score_blocks_ref(q, anchors, candidates, quest, shared):
    """float64 NumPy reference of `score_blocks`."""
    hkv = anchors.shape[0]
    g = q.shape[0] // hkv
    qg = q.astype(np.float64).reshape(hkv, g, -1)  # [Hkv, g, d]
    an = anchors[:, candidates].astype(np.float64)  # [Hkv, n, A, d]
    if quest:
        lo, hi = an[:, None, :, 0], an[:, None, :, 1]  # [Hkv, 1, n, d]
        per_group = np.maximum(qg[:, :, None] * lo, qg[:, :, None] * hi).sum((1, 3))
    else:
        per_group = np.einsum("jgd,jnad->jn", qg, an) / an.shape[2]
    return per_group.sum(0, keepdims=True) if shared else per_group


@njit(parallel=True, nogil=True, cache=True)
def _topk(scores, candidates, k):
    s, n = scores.shape
    out = np.empty((s, k), np.int32)
    for r in prange(s):
        row = scores[r]
        thr = np.partition(row, n - k)[n - k]  # k-th largest
        picked = np.empty(k, np.int32)
        m = 0
        for i in range(n):
            if row[i] > thr:
                picked[m] = candidates[i]
                m += 1
        for i in range(n):  # ties at the threshold: earliest first
            if m < k and row[i] == thr:
                picked[m] = candidates[i]
                m += 1
        out[r] = np.sort(picked)
    return out


def topk_blocks(scores, candidates, k):
    """The k best candidates per row of scores [S, n]: [S, min(k, n)] int32, ascending ids."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    candidates = np.ascontiguousarray(candidates, dtype=np.int32)
    k = min(k, candidates.shape[0])
    if k == 0:
        return np.empty((scores.shape[0], 0), np.int32)
    use_threads()
    return _topk(scores, candidates, k)


def topk_blocks_ref(scores, candidates, k):
    """NumPy reference of `topk_blocks` (stable: ties go to the earlier candidate)."""
    k = min(k, len(candidates))
    idx = [np.lexsort((np.arange(len(candidates)), -row))[:k] for row in scores]
    return np.stack([np.sort(candidates[i]) for i in idx]).astype(np.int32).reshape(len(scores), k)
