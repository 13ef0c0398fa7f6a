"""Exact decode attention of one query token over selected KV blocks, with log-sum-exp partials.

Work is split over (KV head x part of the block list): each item reads every K/V row of its blocks
once for the g query heads of its KV head, streaming rows through a small float32 chunk buffer
(decoded once, L1-resident); parts merge by log-sum-exp. Scores run in log2 units (q is scaled by
scale * log2(e)) so the softmax uses the vectorised exp2 polynomial.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import FASTMATH, LN2, LOG2E, NEG_INF, F32, exp2_neg, kv_to_f64, kv_view, qk_rows, to_f32
from .threads import use_threads


@njit(fastmath=FASTMATH, cache=True)
def _chunk(qg, kf, vf, nt, s, acc, m, den):
    """Online-softmax update of one item's state with `nt` decoded rows.

    qg [g, d] scaled queries; kf, vf [CH, d] f32 rows; s [g, CH] scratch;
    acc [g, d], m [g], den [g]: running output sum, max, denominator (log2 units).
    """
    g, d = qg.shape
    qk_rows(qg, kf, nt, s)
    for h in range(g):  # softmax state, then p @ V
        sh = s[h, :nt]
        mb = NEG_INF
        for t in range(nt):
            mb = max(mb, sh[t])
        mn = max(m[h], mb)
        alpha = exp2_neg(m[h] - mn)
        tot = F32(0.0)
        for t in range(nt):
            p = exp2_neg(sh[t] - mn)
            sh[t] = p
            tot += p
        den[h] = den[h] * alpha + tot
        m[h] = mn
        ah = acc[h]
        if alpha != F32(1.0):
            for c in range(d):
                ah[c] *= alpha
        t = 0
        while t + 4 <= nt:
            p0, p1, p2, p3 = sh[t], sh[t + 1], sh[t + 2], sh[t + 3]
            v0, v1, v2, v3 = vf[t], vf[t + 1], vf[t + 2], vf[t + 3]
            for c in range(d):
                ah[c] += p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c]
            t += 4
        while t < nt:
            p0 = sh[t]
            vt = vf[t]
            for c in range(d):
                ah[c] += p0 * vt[c]
            t += 1


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _item(qg, k_base, v_base, k_tail, v_tail, nb_base, ids, n_tokens, j, acc, m, den):
    """Attend KV head j's query group qg [g, d] over blocks `ids`; updates acc [g, d], m, den [g]."""
    bs, d = k_tail.shape[2], k_tail.shape[3]
    ch = max(4, 4096 // d)  # rows per chunk: kf + vf stay in L1
    kf = np.empty((ch, d), F32)  # [CH, d]
    vf = np.empty((ch, d), F32)
    s = np.empty((qg.shape[0], ch), F32)  # [g, CH]
    fill = 0
    for b in ids:
        if b < nb_base:
            kb, vb = k_base[j, b], v_base[j, b]  # [bs, d]
        else:
            kb, vb = k_tail[j, b - nb_base], v_tail[j, b - nb_base]
        nt = min(bs, n_tokens - b * bs)
        t = 0
        while t < nt:
            take = min(nt - t, ch - fill)
            for r in range(take):
                kr, vr = kb[t + r], vb[t + r]
                kd, vd = kf[fill + r], vf[fill + r]
                for c in range(d):
                    kd[c] = to_f32(kr[c])
                    vd[c] = to_f32(vr[c])
            fill += take
            t += take
            if fill == ch or (t == nt and b == ids[-1]):
                _chunk(qg, kf, vf, fill, s, acc, m, den)
                fill = 0


@njit(parallel=True, nogil=True, cache=True, fastmath=FASTMATH)
def _attend(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, n_tokens, n_split):
    # q [Hq, d] f32 scaled; K/V [Hkv, nb, bs, d]; blocks [S, n] int32
    hq, d = q.shape
    hkv = k_tail.shape[0]
    g = hq // hkv
    n = blocks.shape[1]
    n_items = hkv * n_split
    acc = np.zeros((n_items, g, d), F32)  # [items, g, d]
    mx = np.full((n_items, g), NEG_INF)
    den = np.zeros((n_items, g), F32)
    for item in prange(n_items):
        j, part = item // n_split, item % n_split
        ids = blocks[0 if blocks.shape[0] == 1 else j, part * n // n_split:(part + 1) * n // n_split]
        if ids.size:
            _item(q[j * g:(j + 1) * g], k_base, v_base, k_tail, v_tail, nb_base, ids, n_tokens, j,
                  acc[item], mx[item], den[item])
    return _merge_parts(acc, mx, den, hq)


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _merge_parts(acc, mx, den, hq):
    """Merge item states acc [Hkv*n_split, g, d], mx/den [Hkv*n_split, g] into (out, lse)."""
    g, d = acc.shape[1], acc.shape[2]
    n_split = acc.shape[0] * g // hq
    out = np.zeros((hq, d), F32)
    lse = np.empty(hq, F32)
    for h in range(hq):
        j, hh = h // g, h % g
        big = NEG_INF
        for p in range(n_split):
            big = max(big, mx[j * n_split + p, hh])
        if big == NEG_INF:
            lse[h] = NEG_INF
            continue
        tot = F32(0.0)
        oh = out[h]
        for p in range(n_split):
            w = exp2_neg(mx[j * n_split + p, hh] - big)
            tot += w * den[j * n_split + p, hh]
            ap = acc[j * n_split + p, hh]
            for c in range(d):
                oh[c] += w * ap[c]
        inv = F32(1.0) / tot
        for c in range(d):
            oh[c] *= inv
        lse[h] = (big + np.log2(tot)) * LN2
    return out, lse


def _check_kv(name: str, a: np.ndarray) -> None:
    if a.ndim != 4 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous [Hkv, nb, bs, d] array")


def attend_blocks(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, n_tokens, scale, kv_kind):
    """Exact attention of one query token over the listed blocks.

    q [Hq, d] f32; k/v_base [Hkv, nb_base, bs, d], k/v_tail [Hkv, nb_tail_cap, bs, d] (float32 or
    uint16 bits per kv_kind 0 FP32, 1 BF16, 2 FP16); blocks int32 [S, n] with S 1 (SHARED) or Hkv.
    Returns out [Hq, d] f32 and lse [Hq] f32 (natural log of the summed exp(scale * q.k)).
    """
    for name, a in (("k_base", k_base), ("v_base", v_base), ("k_tail", k_tail), ("v_tail", v_tail)):
        _check_kv(name, a)
    hkv, _, bs, d = k_tail.shape
    if q.ndim != 2 or q.shape[1] != d or q.shape[0] % hkv:
        raise ValueError(f"q must be [Hq, {d}] with Hq a multiple of {hkv}, got {q.shape}")
    blocks = np.ascontiguousarray(blocks, dtype=np.int32)
    if blocks.ndim != 2 or blocks.shape[0] not in (1, hkv):
        raise ValueError(f"blocks must be [1 or {hkv}, n], got {blocks.shape}")
    if blocks.size and (blocks.min() < 0 or blocks.max() >= min(nb_base + k_tail.shape[1], -(-n_tokens // bs))):
        raise ValueError("block id out of range")
    qs = np.ascontiguousarray(q, dtype=np.float32) * F32(scale * LOG2E)
    n_split = max(1, min(-(-2 * use_threads() // hkv), blocks.shape[1]))
    kv = [kv_view(a, kv_kind) for a in (k_base, v_base, k_tail, v_tail)]
    return _attend(qs, *kv, nb_base, blocks, n_tokens, n_split)


def attend_blocks_ref(q, k_base, v_base, k_tail, v_tail, nb_base, blocks, n_tokens, scale, kv_kind):
    """float64 NumPy reference of `attend_blocks` (returns float64)."""
    hkv, _, bs, d = k_tail.shape
    g = q.shape[0] // hkv
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    v = np.concatenate([kv_to_f64(v_base, kv_kind), kv_to_f64(v_tail, kv_kind)], axis=1)
    k, v = k.reshape(hkv, -1, d)[:, :n_tokens], v.reshape(hkv, -1, d)[:, :n_tokens]  # [Hkv, T, d]
    out, lse = np.zeros((q.shape[0], d)), np.full(q.shape[0], -np.inf)
    for h in range(q.shape[0]):
        j = h // g
        ids = blocks[0 if blocks.shape[0] == 1 else j]
        tok = (ids[:, None] * bs + np.arange(bs)).ravel()
        tok = tok[tok < n_tokens]
        if tok.size == 0:
            continue
        s = scale * (k[j, tok] @ q[h].astype(np.float64))
        lse[h] = np.logaddexp.reduce(s)
        out[h] = np.exp(s - lse[h]) @ v[j, tok]
    return out, lse


@njit(nogil=True, cache=True)
def _merge(out_a, lse_a, out_b, lse_b):
    out = np.zeros_like(out_a)
    lse = np.empty_like(lse_a)
    for h in range(out_a.shape[0]):
        big = max(lse_a[h], lse_b[h])
        if big == -np.inf:
            lse[h] = lse_a[h]
            continue
        wa, wb = np.exp(lse_a[h] - big), np.exp(lse_b[h] - big)
        tot = wa + wb
        out[h] = (wa / tot) * out_a[h] + (wb / tot) * out_b[h]
        lse[h] = big + np.log(tot)
    return out, lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Exact log-sum-exp merge of two attention results over disjoint token sets.

    out_* [Hq, d], lse_* [Hq] (float32); an empty part has lse -inf. Returns (out, lse) float32.
    """
    f = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    return _merge(f(out_a), f(lse_a), f(out_b), f(lse_b))


def merge_partials_ref(out_a, lse_a, out_b, lse_b):
    """float64 NumPy reference of `merge_partials`."""
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(np.isfinite(lse), lse, 0.0)
    wa = np.where(np.isfinite(lse_a), np.exp(lse_a - safe), 0.0)[:, None]
    wb = np.where(np.isfinite(lse_b), np.exp(lse_b - safe), 0.0)[:, None]
    return wa * out_a + wb * out_b, lse
