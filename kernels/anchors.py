"""Block anchors (representative keys), block scores against a query, and top-k block choice.

Scoring reads every anchor of the context each step: anchor bytes are what grows with the context.
Three formats, told apart by dtype (the KV store keeps Q8):
- float32 [..., d];
- BF16 bits, uint16 [..., d];
- Q8, uint8 [..., d + 4]: d signed 8-bit codes, then the anchor's float32 scale (the largest
  |channel| / 127; value = code * scale). Half BF16's bytes.

Anchor types (anchor_num = A per block):
- MAX / MEAN: the block is cut into A equal runs of tokens; anchor a is the per-channel max / mean
  of run a (A = 1: of the whole block).
- QUEST: A = 2; anchor 0 the per-channel min, anchor 1 the per-channel max of the block. Q8 rounds
  the min down and the max up, so the pair still bounds every key of the block.
- FIX: anchor a is token a * (bs // A).
- DYNAMIC: the A tokens of the block with the highest `token_scores` (ties: earliest first).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._simd import (
    F32,
    FASTMATH,
    f32_to_kv,
    kv_to_f64,
    kv_view,
    readonly,
    readonly_bytes,
    to_bf16,
    to_f32,
)
from ._vec import (
    W,
    load_f32,
    prefetch,
    row_addr,
    store_f32,
    vfma,
    vhsum,
    vload,
    vload2,
    vsplat,
    vsum4,
    vzero,
)
from .attention import channel_perm, ids_in_range, pack_rows
from .kvquant import head_dim_of, row_to_f32
from .threads import use_threads

ANCHOR_TYPES = {"MAX": 0, "MEAN": 1, "QUEST": 2, "FIX": 3, "DYNAMIC": 4}
FMT_F32, FMT_BF16, FMT_Q8 = 0, 1, 2
Q8_EXTRA = 4  # bytes after a Q8 anchor's codes: its float32 scale


@njit(nogil=True, cache=True)
def _q8(x, codes, scale_addr, mode):
    """Q8 code of anchor x [d] f32 into codes [d] int8 and its scale at scale_addr. mode 0
    rounds to nearest; -1 down and 1 up, exactly (code * scale <= or >= x). In float64, not
    fastmath: `q8_encode` rounds the same way."""
    d = x.shape[0]
    m = F32(0.0)
    for c in range(d):
        m = max(m, abs(x[c]))
    inv = 127.0 / np.float64(m) if m > F32(0.0) else 0.0
    scale = m / F32(127.0)
    if np.float64(scale) * 127.0 < np.float64(m):  # 127 steps reach the largest channel
        scale = np.nextafter(scale, F32(np.inf))
    s64 = np.float64(scale)
    for c in range(d):
        y = np.float64(x[c]) * inv
        if mode < 0:
            r = np.floor(y)
            if r * s64 > x[c]:
                r -= 1.0
        elif mode > 0:
            r = np.ceil(y)
            if r * s64 < x[c]:
                r += 1.0
        else:
            r = np.floor(y + 0.5)
        codes[c] = np.int8(min(max(r, -128.0), 127.0))
    store_f32(scale_addr, scale)


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _block(kb, kind, out, sc):
    """Anchors out [A, d] f32 of one block kb [bs, d] (storage dtype); sc [bs] scores (DYNAMIC).

    Indexes elements directly: a row view per token would cost atomic reference counts."""
    bs, d = kb.shape
    na = out.shape[0]
    if kind == 2:  # QUEST: min, max
        for c in range(d):
            out[0, c] = out[1, c] = to_f32(kb[0, c])
        for t in range(1, bs):
            for c in range(d):
                x = to_f32(kb[t, c])
                out[0, c] = min(out[0, c], x)
                out[1, c] = max(out[1, c], x)
    elif kind <= 1:  # MAX / MEAN over run a
        for a in range(na):
            t0, t1 = a * bs // na, (a + 1) * bs // na
            for c in range(d):
                out[a, c] = to_f32(kb[t0, c])
            for t in range(t0 + 1, t1):
                if kind == 0:
                    for c in range(d):
                        out[a, c] = max(out[a, c], to_f32(kb[t, c]))
                else:
                    for c in range(d):
                        out[a, c] += to_f32(kb[t, c])
            if kind == 1:
                inv = F32(1.0) / F32(t1 - t0)
                for c in range(d):
                    out[a, c] *= inv
    else:  # FIX / DYNAMIC: copy chosen tokens
        taken = np.zeros(bs, np.bool_)
        for a in range(na):
            best = a * (bs // na)
            if kind == 4:
                best = -1
                for t in range(bs):
                    if not taken[t] and (best < 0 or sc[t] > sc[best]):
                        best = t
                taken[best] = True
            for c in range(d):
                out[a, c] = to_f32(kb[best, c])


@njit(nogil=True, cache=True)
def _decode(kb, x):
    """Rows kb [bs, d] of a 16/32-bit storage dtype into x [bs, d] f32."""
    for t in range(kb.shape[0]):
        for c in range(kb.shape[1]):
            x[t, c] = to_f32(kb[t, c])


@njit(nogil=True, cache=True)
def _turn_back(x, pos0, freq, tc, ts):
    """Rows x [bs, d] f32 of tokens pos0.. turned back to position 0 (RoPE, rotate-half layout:
    channel c pairs with c + h, h = freq.size), in place. tc, ts [bs, h]: cos and sin of
    -t * freq; the block's own angle is added by the angle-sum formulas (float64)."""
    h = freq.shape[0]
    bc, bsn = np.empty(h), np.empty(h)  # [h] the block's own angle
    for c in range(h):
        a = -np.float64(pos0) * freq[c]
        bc[c], bsn[c] = np.cos(a), np.sin(a)
    for t in range(x.shape[0]):  # row by row: contiguous channels
        for c in range(h):
            co = bc[c] * tc[t, c] - bsn[c] * ts[t, c]
            si = bsn[c] * tc[t, c] + bc[c] * ts[t, c]
            x1, x2 = np.float64(x[t, c]), np.float64(x[t, c + h])
            x[t, c] = F32(x1 * co - x2 * si)
            x[t, c + h] = F32(x2 * co + x1 * si)


def _block_anchors(kb, b, kind, out, sc, freq, tc, ts):
    """Anchors out [A, d] of block b's keys kb [bs, row] (kv_view), turned back to position 0
    first when freq [h] is not empty."""
    raise NotImplementedError  # compiled only (see the overload)


@overload(_block_anchors)
def _block_anchors_impl(kb, b, kind, out, sc, freq, tc, ts):
    if kb.dtype in (types.int32, types.uint32):  # quantised rows: decoded first
        def decoded(kb, b, kind, out, sc, freq, tc, ts):
            bs = kb.shape[0]
            x = np.empty((bs, out.shape[1]), F32)
            for t in range(bs):
                row_to_f32(kb[t], x[t])
            if freq.shape[0] > 0:
                _turn_back(x, b * bs, freq, tc, ts)
            _block(x, kind, out, sc)
        return decoded

    def plain(kb, b, kind, out, sc, freq, tc, ts):
        if freq.shape[0] > 0:  # decoded to be turned
            x = np.empty(kb.shape, F32)
            _decode(kb, x)
            _turn_back(x, b * kb.shape[0], freq, tc, ts)
            _block(x, kind, out, sc)
        else:
            _block(kb, kind, out, sc)
    return plain


@njit(parallel=True, nogil=True, cache=True)
def _anchors(k_base, k_tail, nb_base, first, last, kind, anchors, fmt, token_scores, freq, tc,
             ts):
    # K [Hkv, nb, bs, row] (kv_view); anchors bytes [Hkv, nb_cap, A, row] in format fmt;
    # token_scores [Hkv, n | 0]; freq [h | 0] f64 (none: keys as stored), tc/ts [bs, h]
    hkv, bs = k_tail.shape[0], k_tail.shape[2]
    na, row = anchors.shape[2], anchors.shape[3]
    d = row - Q8_EXTRA if fmt == FMT_Q8 else row // (2 if fmt == FMT_BF16 else 4)
    nblk = last - first
    for it in prange(hkv * nblk):
        j, b = it // nblk, first + it % nblk
        kb = k_base[j, b] if b < nb_base else k_tail[j, b - nb_base]  # [bs, row]
        sc = token_scores[j, b * bs:(b + 1) * bs]
        out = np.empty((na, d), F32)  # [A, d]
        _block_anchors(kb, b, kind, out, sc, freq, tc, ts)
        if fmt == FMT_Q8:
            codes = anchors[j, b].view(np.int8)  # [A, d + 4]
            for a in range(na):
                mode = (-1 if a == 0 else 1) if kind == 2 else 0  # QUEST: min down, max up
                _q8(out[a], codes[a, :d], row_addr(anchors, j, b, a) + d, mode)
        elif fmt == FMT_BF16:
            dst16 = anchors[j, b].view(np.uint16)
            for a in range(na):
                for c in range(d):
                    dst16[a, c] = to_bf16(out[a, c])
        else:
            dst32 = anchors[j, b].view(F32)
            for a in range(na):
                for c in range(d):
                    dst32[a, c] = out[a, c]


def _turn_tables(inv_freq: np.ndarray | None, bs: int, d: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """freq [h] f64 and the cos, sin [bs, h] of -t * freq (t < bs) for `_anchors`; empty
    without inv_freq."""
    if inv_freq is None:
        z = np.zeros((bs, 0))
        return np.zeros(0), z, z
    freq = np.ascontiguousarray(inv_freq, np.float64)
    if freq.ndim != 1 or not 0 < 2 * freq.size <= d:
        raise ValueError(f"inv_freq must be [h] with 0 < 2h <= head_dim {d}, got {freq.shape}")
    ang = -np.arange(bs, dtype=np.float64)[:, None] * freq[None]  # [bs, h]
    return freq, np.cos(ang), np.sin(ang)


def turned_back_ref(k: np.ndarray, inv_freq: np.ndarray, pos0: int = 0) -> np.ndarray:
    """Keys k [..., n, d] of positions pos0.. turned back to position 0 (float64 NumPy)."""
    h = inv_freq.size
    ang = -(pos0 + np.arange(k.shape[-2], dtype=np.float64))[:, None] * inv_freq[None]  # [n, h]
    co, si = np.cos(ang), np.sin(ang)
    out = np.array(k, np.float64)
    x1, x2 = out[..., :h].copy(), out[..., h:2 * h].copy()
    out[..., :h] = x1 * co - x2 * si
    out[..., h:2 * h] = x2 * co + x1 * si
    return out


def compute_anchors(k_base, k_tail, nb_base, first, last, anchor_type, anchor_num, anchors,
                    token_scores=None, *, kv_kind, inv_freq=None):
    """Fill `anchors[:, first:last]` for the full blocks `first..last-1` (in place).

    k_base [Hkv, nb_base, bs, d], k_tail [Hkv, nb_tail_cap, bs, d] storage per kv_kind;
    anchors [Hkv, nb_cap, anchor_num, d (+ 4 for Q8)] in any anchor format (BF16 rounds to
    nearest even); token_scores [Hkv, n_tokens] f32 for DYNAMIC. With inv_freq [h] (RoPE
    frequencies), every key is first turned back to position 0: anchors that carry no position,
    scored by a query turned to one distance for every block.
    """
    if anchor_type not in ANCHOR_TYPES:
        raise ValueError(f"unknown anchor_type {anchor_type!r}")
    kind = ANCHOR_TYPES[anchor_type]
    hkv, _, bs, row = k_tail.shape
    d = head_dim_of(kv_kind, row)
    raw, fmt = anchor_bytes(anchors, write=True)
    want = (hkv, anchors.shape[1], anchor_num, d + (Q8_EXTRA if fmt == FMT_Q8 else 0))
    if anchors.shape != want:
        raise ValueError(f"anchors must be {list(want)}, got {list(anchors.shape)}")
    if (kind == 2 and anchor_num != 2) or (kind != 2 and not 1 <= anchor_num <= bs):
        raise ValueError(f"{anchor_type} anchors cannot number {anchor_num} with block_size {bs}")
    if not 0 <= first <= last <= min(nb_base + k_tail.shape[1], anchors.shape[1]):
        raise ValueError(f"block range {first}..{last} out of the store")
    if kind == 4:
        if token_scores is None or token_scores.shape[1] < last * bs:
            raise ValueError("DYNAMIC anchors need token_scores covering the blocks")
        token_scores = readonly(token_scores, F32)
    else:
        token_scores = readonly(np.zeros((k_tail.shape[0], 0), F32))
    if last > first:
        use_threads()
        _anchors(kv_view("k_base", k_base, kv_kind), kv_view("k_tail", k_tail, kv_kind), nb_base,
                 first, last, kind, raw, fmt, token_scores, *_turn_tables(inv_freq, bs, d))


def compute_anchors_ref(k_base, k_tail, nb_base, first, last, anchor_type, anchor_num, anchors,
                        token_scores=None, *, kv_kind, inv_freq=None):
    """float64 NumPy reference of `compute_anchors` (writes into `anchors`, any format)."""
    hkv, _, bs, _ = k_tail.shape
    k = np.concatenate([kv_to_f64(k_base, kv_kind), kv_to_f64(k_tail, kv_kind)], axis=1)
    if inv_freq is not None:  # [Hkv, nb, bs, d]: every key turned back to position 0
        nb = k.shape[1]
        k = turned_back_ref(k.reshape(hkv, nb * bs, -1), np.asarray(inv_freq, np.float64))
        k = k.reshape(hkv, nb, bs, -1)
    fmt = anchor_format(anchors)
    for b in range(first, last):
        kb = k[:, b]  # [Hkv, bs, d]
        if anchor_type == "QUEST":
            res = np.stack([kb.min(1), kb.max(1)], axis=1)
        elif anchor_type in ("MAX", "MEAN"):
            cuts = [a * bs // anchor_num for a in range(anchor_num + 1)]
            runs = [kb[:, cuts[a]:cuts[a + 1]] for a in range(anchor_num)]
            res = np.stack([r.max(1) if anchor_type == "MAX" else r.mean(1) for r in runs], axis=1)
        elif anchor_type == "FIX":
            res = kb[:, np.arange(anchor_num) * (bs // anchor_num)]
        else:
            sc = token_scores[:, b * bs:(b + 1) * bs]
            order = np.stack([np.lexsort((np.arange(bs), -sc[j]))[:anchor_num] for j in range(hkv)])
            res = np.take_along_axis(kb, order[:, :, None], axis=1)
        if fmt == FMT_Q8:
            anchors[:, b] = q8_encode(res.astype(F32), quest=anchor_type == "QUEST")
        else:
            anchors[:, b] = res if fmt == FMT_F32 else f32_to_kv(res.astype(F32), 1)


def q8_encode(x: np.ndarray, quest: bool = False) -> np.ndarray:
    """NumPy Q8 of anchors x [..., A, d] float32: uint8 [..., A, d + 4] (codes, float32 scale),
    rounded to nearest; `quest` rounds anchor 0 (the min) down and anchor 1 (the max) up."""
    m = np.abs(x).max(-1, keepdims=True)  # [..., A, 1] float32
    with np.errstate(divide="ignore"):
        inv = np.where(m > 0, 127.0 / m.astype(np.float64), 0.0)
    scale = (m / F32(127.0)).astype(F32)
    scale = np.where(scale.astype(np.float64) * 127 < m, np.nextafter(scale, F32(np.inf)), scale)
    s64, x64 = scale.astype(np.float64), x.astype(np.float64)
    y = x64 * inv
    r = np.floor(y + 0.5)
    if quest:  # outward, exactly: code * scale <= min, >= max
        lo, hi = np.floor(y[..., 0, :]), np.ceil(y[..., 1, :])
        lo -= lo * s64[..., 0, :] > x64[..., 0, :]
        hi += hi * s64[..., 1, :] < x64[..., 1, :]
        r[..., 0, :], r[..., 1, :] = lo, hi
    codes = np.clip(r, -128, 127).astype(np.int8)
    return np.concatenate([codes.view(np.uint8), scale.astype(F32).view(np.uint8)], axis=-1)


def anchors_to_f64(anchors: np.ndarray) -> np.ndarray:
    """Anchor values [..., d] float64 from any anchor format."""
    fmt = anchor_format(anchors)
    if fmt != FMT_Q8:
        return kv_to_f64(anchors, fmt)
    d = anchors.shape[-1] - Q8_EXTRA
    codes = np.ascontiguousarray(anchors[..., :d]).view(np.int8).astype(np.float64)
    return codes * np.ascontiguousarray(anchors[..., d:]).view(F32).astype(np.float64)


PF = 32  # blocks ahead whose anchors are prefetched while scoring
# Fewer anchor bytes than this are scored on one thread. Ad hoc, after a cache flush, 2 threads:
# 64K and 128K contexts' selections took 0.35 and 0.46 ms serially against 0.52 and 0.53 ms in
# parallel; at 1M, 1.96 against 1.31 ms.
SERIAL_BYTES = 2 << 20


@njit(nogil=True, cache=True, fastmath=FASTMATH, inline="always")
def dot4(sj, a, an, r0, r1, r2, r3, d, a0, a1, a2, a3):
    """a0..a3 plus the lanes of sj[a] . (row at r0..r3), over the d channels (packed order)."""
    for gi in range(sj.shape[1] // (2 * W)):
        qe, qo = vload(sj, a, 2 * W * gi), vload(sj, a, 2 * W * gi + W)
        e, o = vload2(an, r0, d, gi)
        a0 = vfma(qe, e, vfma(qo, o, a0))
        e, o = vload2(an, r1, d, gi)
        a1 = vfma(qe, e, vfma(qo, o, a1))
        e, o = vload2(an, r2, d, gi)
        a2 = vfma(qe, e, vfma(qo, o, a2))
        e, o = vload2(an, r3, d, gi)
        a3 = vfma(qe, e, vfma(qo, o, a3))
    return a0, a1, a2, a3


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _score_range(qs, an, q8, candidates, i0, i1, j, out):
    """Scores of candidates[i0:i1] for KV head j into out [Hkv, n]; an [Hkv, nb_cap, A, row] (f32,
    BF16 bits, or Q8 as int8 with q8 set); qs [Hkv, A, P] the packed query sum that multiplies
    each anchor. Four blocks at a time (four independent FMA chains, one query load and one
    lane-sum tree for the four), prefetching PF blocks ahead."""
    na, row = an.shape[2], an.shape[3]
    d = row - Q8_EXTRA if q8 else row
    sj = qs[j]  # [A, P]
    for i in range(i0, i1, 4):
        if i + PF < i1:  # anchors PF blocks ahead (4 blocks' rows a step)
            for r in range(4):
                pa = row_addr(an, j, candidates[min(i + PF + r, i1 - 1)], 0)
                for off in range(0, na * row * an.itemsize, 64):
                    prefetch(pa + off)
        b0 = candidates[i]
        b1, b2, b3 = (candidates[min(i + 1, i1 - 1)], candidates[min(i + 2, i1 - 1)],
                      candidates[min(i + 3, i1 - 1)])
        a0 = a1 = a2 = a3 = vzero()
        for a in range(na):
            r0, r1 = row_addr(an, j, b0, a), row_addr(an, j, b1, a)
            r2, r3 = row_addr(an, j, b2, a), row_addr(an, j, b3, a)
            if q8:  # each anchor's dot times its own scale
                z = vzero()
                t0, t1, t2, t3 = dot4(sj, a, an, r0, r1, r2, r3, d, z, z, z, z)
                a0 = vfma(vsplat(load_f32(r0 + d)), t0, a0)
                a1 = vfma(vsplat(load_f32(r1 + d)), t1, a1)
                a2 = vfma(vsplat(load_f32(r2 + d)), t2, a2)
                a3 = vfma(vsplat(load_f32(r3 + d)), t3, a3)
            else:
                a0, a1, a2, a3 = dot4(sj, a, an, r0, r1, r2, r3, d, a0, a1, a2, a3)
        if i + 4 <= i1:
            vsum4(out, j, i, a0, a1, a2, a3)
        else:  # the last 1-3 candidates (the rest repeat the last one)
            out[j, i] = vhsum(a0)
            if i + 1 < i1:
                out[j, i + 1] = vhsum(a1)
            if i + 2 < i1:
                out[j, i + 2] = vhsum(a2)


@njit(nogil=True, cache=True)
def score_prep(q, hkv, na, quest, perm, n):
    """Per KV head, the packed query sum each anchor is multiplied by [Hkv, A, P], and the
    per-head score array [Hkv, n]; serial, so that no allocation becomes a parfor.

    Linear scores: every anchor gets sum_h q_h / A. QUEST: with lo <= hi per channel,
    max(q lo, q hi) = min(q, 0) lo + max(q, 0) hi, so the group's bound is
    (sum_h min(q_h, 0)) . lo + (sum_h max(q_h, 0)) . hi: one pass over the two anchors.
    """
    g = q.shape[0] // hkv
    qp = pack_rows(q, hkv, perm, F32(1.0))[:, :g]  # [Hkv, g, P]
    qs = np.zeros((hkv, na, qp.shape[2]), F32)
    for j in range(hkv):
        for h in range(g):
            for c in range(qp.shape[2]):
                x = qp[j, h, c]
                if quest:
                    qs[j, 0, c] += min(x, F32(0.0))
                    qs[j, 1, c] += max(x, F32(0.0))
                else:
                    for a in range(na):
                        qs[j, a, c] += x / F32(na)
    return qs, np.empty((hkv, n), F32)


@njit(nogil=True, cache=True)
def score_part(qs, anchors, fmt, candidates, i0, i1, j, per_head):
    """Scores of candidates[i0:i1] for KV head j (see _score_range), anchors as raw bytes."""
    if fmt == FMT_Q8:
        _score_range(qs, anchors.view(np.int8), True, candidates, i0, i1, j, per_head)
    elif fmt == FMT_BF16:
        _score_range(qs, anchors.view(np.uint16), False, candidates, i0, i1, j, per_head)
    else:
        _score_range(qs, anchors.view(F32), False, candidates, i0, i1, j, per_head)


@njit(parallel=True, nogil=True, cache=True)
def _score(q, anchors, fmt, candidates, quest, n_parts, perm):
    # q [Hq, d] f32; anchors bytes [Hkv, nb_cap, A, row] in format fmt; candidates [n] -> [Hkv, n]
    n, hkv = candidates.shape[0], anchors.shape[0]
    qs, per_head = score_prep(q, hkv, anchors.shape[2], quest, perm, n)
    per = max(1, n_parts // hkv)  # parts per head: each head's anchors stay one long stream
    for part in prange(hkv * per):
        j, c = part // per, part % per
        score_part(qs, anchors, fmt, candidates, c * n // per, (c + 1) * n // per, j, per_head)
    return per_head


@njit(nogil=True, cache=True)
def _score_serial(q, anchors, fmt, candidates, quest, perm):
    """`_score` on the calling thread: for few anchors, waking a thread costs more than it
    saves (tens of microseconds a parallel region on a VM)."""
    n, hkv = candidates.shape[0], anchors.shape[0]
    qs, per_head = score_prep(q, hkv, anchors.shape[2], quest, perm, n)
    for j in range(hkv):
        score_part(qs, anchors, fmt, candidates, 0, n, j, per_head)
    return per_head


@njit(nogil=True, cache=True)
def _scores(q, anchors, fmt, candidates, quest, n_parts, perm):
    """Per-head scores [Hkv, n]: in parallel, or serially when n_parts is 1."""
    if not ids_in_range(candidates.reshape(1, -1), anchors.shape[1]):
        raise ValueError("candidate block id out of range")
    if n_parts == 1:
        return _score_serial(q, anchors, fmt, candidates, quest, perm)
    return _score(q, anchors, fmt, candidates, quest, n_parts, perm)


_FORMATS = {np.dtype(np.float32): FMT_F32, np.dtype(np.uint16): FMT_BF16,
            np.dtype(np.uint8): FMT_Q8}


def anchor_format(anchors: np.ndarray) -> int:
    """FMT_F32, FMT_BF16 or FMT_Q8 of anchors [Hkv, nb_cap, A, row] (by dtype)."""
    fmt = _FORMATS.get(anchors.dtype)
    if fmt is None or anchors.ndim != 4 or (fmt == FMT_Q8 and anchors.shape[3] <= Q8_EXTRA):
        raise ValueError("anchors must be a float32, uint16 (BF16) or uint8 (Q8, d + 4 bytes a "
                         f"row) [Hkv, nb_cap, A, row] array, got {anchors.dtype} {anchors.shape}")
    return fmt


def anchor_bytes(anchors: np.ndarray, write: bool = False) -> tuple[np.ndarray, int]:
    """Anchors [Hkv, nb_cap, A, row] (any format) as a uint8 view, read-only unless written (see
    _simd.readonly_bytes), and their format."""
    fmt = anchor_format(anchors)
    if not anchors.flags.c_contiguous:
        raise ValueError("anchors must be C-contiguous")
    return (anchors.view(np.uint8) if write else readonly_bytes(anchors)), fmt


class AnchorView(NamedTuple):
    """A layer's anchors as the scoring kernels read them, made once per anchor array
    (`anchor_view`; see `LayerKV` for why)."""

    raw: np.ndarray  # read-only bytes [Hkv, nb_cap, A, row]
    fmt: int
    perm: np.ndarray  # packed channel order
    shape: tuple[int, ...]  # of the anchor array


def anchor_view(anchors: np.ndarray) -> AnchorView:
    raw, fmt = anchor_bytes(anchors)
    return AnchorView(raw, fmt, score_perm(anchors, fmt), anchors.shape)


def candidate_ids(candidates, anchors, quest) -> np.ndarray:
    """The candidates as read-only int32 (their range is checked in the kernels); `anchors` (an
    array or its AnchorView) for its shape."""
    candidates = readonly(candidates, np.int32)
    if candidates.ndim != 1:
        raise ValueError(f"candidates must be 1-D, got {candidates.shape}")
    if quest and anchors.shape[2] != 2:
        raise ValueError("QUEST scores need anchors [..., 2, d] (min, max)")
    return candidates


def _n_parts(candidates: np.ndarray, anchors: np.ndarray) -> int:
    """Parts the scoring is split into; 1 (scored serially) below SERIAL_BYTES of anchors."""
    per_block = anchors.shape[0] * anchors.shape[2] * anchors.shape[3] * anchors.itemsize
    if candidates.size * per_block < SERIAL_BYTES:
        return 1
    return max(1, min(4 * use_threads(), candidates.size))


def score_perm(anchors: np.ndarray, fmt: int) -> np.ndarray:
    """The packed channel order the scoring kernel reads anchors of this format in."""
    d = anchors.shape[3] - (Q8_EXTRA if fmt == FMT_Q8 else 0)
    return channel_perm(d, 1 if fmt == FMT_BF16 else 0)


def score_blocks(q, anchors, candidates, quest, shared):
    """Scores of candidate blocks for query q [Hq, d]: [1 (shared) or Hkv, n_cand] f32.

    Per head: mean over anchors of q_h . anchor, or QUEST's bound sum_c max(q_c min_c, q_c max_c)
    (anchors [..., 0] <= [..., 1], as compute_anchors makes them);
    summed over all heads (shared) or over each KV head's group. anchors [Hkv, nb_cap, A, row] in
    any anchor format.
    """
    av = anchor_view(anchors)
    candidates = candidate_ids(candidates, anchors, quest)
    per_head = _scores(readonly(q, F32), av.raw, av.fmt, candidates, bool(quest),
                       _n_parts(candidates, anchors), av.perm)
    return per_head.sum(0, keepdims=True) if shared else per_head  # [S, n]


def score_blocks_ref(q, anchors, candidates, quest, shared):
    """float64 NumPy reference of `score_blocks`."""
    hkv = anchors.shape[0]
    g = q.shape[0] // hkv
    qg = q.astype(np.float64).reshape(hkv, g, -1)  # [Hkv, g, d]
    an = anchors_to_f64(anchors[:, candidates])  # [Hkv, n, A, d]
    if quest:
        lo, hi = an[:, None, :, 0], an[:, None, :, 1]  # [Hkv, 1, n, d]
        per_group = np.maximum(qg[:, :, None] * lo, qg[:, :, None] * hi).sum((1, 3))
    else:
        per_group = np.einsum("jgd,jnad->jn", qg, an) / an.shape[2]
    return per_group.sum(0, keepdims=True) if shared else per_group


@njit(nogil=True, cache=True)
def _topk_rows(scores, candidates, k):
    """[S, k] int32: per row of scores [S, n], the candidates with the k highest scores (ties: the
    earlier candidate), ascending; 0 < k < n. A heap of the best k so far whose root is the worst
    of them (lowest score; of equal scores, the later candidate): O(n log k), and most candidates
    cost one comparison with the root."""
    n = scores.shape[1]
    out = np.empty((scores.shape[0], k), np.int32)
    hs = np.empty(k, F32)  # heap scores [k]
    hi = np.empty(k, np.int64)  # heap positions in candidates [k]
    for r in range(scores.shape[0]):
        for i in range(k):  # sift up each of the first k
            x, c = scores[r, i], i
            while c > 0:
                p = (c - 1) >> 1
                if hs[p] < x or (hs[p] == x and hi[p] > i):  # the parent ranks below: stop
                    break
                hs[c], hi[c] = hs[p], hi[p]
                c = p
            hs[c], hi[c] = x, i
        for i in range(k, n):
            x = scores[r, i]
            if x <= hs[0]:  # a tie goes to the earlier candidate, already held
                continue
            c = 0
            while True:  # sift the root's replacement down; x ranks below equal scores held
                a = 2 * c + 1
                if a >= k:
                    break
                if a + 1 < k and (hs[a + 1] < hs[a] or (hs[a + 1] == hs[a] and hi[a + 1] > hi[a])):
                    a += 1
                if not hs[a] < x:
                    break
                hs[c], hi[c] = hs[a], hi[a]
                c = a
            hs[c], hi[c] = x, i
        for i in range(k):
            out[r, i] = candidates[hi[i]]
        out[r].sort()
    return out


def topk_blocks(scores, candidates, k):
    """The k best candidates per row of scores [S, n]: [S, min(k, n)] int32, ascending ids.

    Ties at the k-th score go to the earlier candidate.
    """
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    candidates = np.ascontiguousarray(candidates, dtype=np.int32)
    if scores.ndim != 2 or scores.shape[1] != candidates.shape[0]:
        raise ValueError(f"scores must be [S, {candidates.shape[0]}], got {scores.shape}")
    k = min(k, candidates.shape[0])
    if k == candidates.shape[0] or k == 0:
        return _all_or_none(candidates, scores.shape[0], k)
    return _topk_rows(scores, candidates, k)


def _all_or_none(candidates: np.ndarray, rows: int, k: int) -> np.ndarray:
    """The answer when k is 0 or every candidate: [rows, k] int32, ascending."""
    return np.broadcast_to(np.sort(candidates)[:k], (rows, k)).copy()


@njit(nogil=True, cache=True)
def _select(q, anchors, fmt, candidates, quest, n_parts, perm, k, shared):
    """Top-k candidates [S, k] by score: one call (scores, their sum over heads, top-k)."""
    return top_blocks(_scores(q, anchors, fmt, candidates, quest, n_parts, perm), candidates, k,
                      shared)


@njit(nogil=True, cache=True)
def top_blocks(per_head, candidates, k, shared):
    """[S, k] top-k candidates of per-head scores [Hkv, n]: of their sum (shared, S = 1) or of
    each head's row (S = Hkv); 0 < k < n."""
    if not shared:
        return _topk_rows(per_head, candidates, k)
    total = np.zeros((1, per_head.shape[1]), F32)
    for j in range(per_head.shape[0]):
        for i in range(per_head.shape[1]):
            total[0, i] += per_head[j, i]
    return _topk_rows(total, candidates, k)


def select_blocks(q, anchors, candidates, k, quest, shared):
    """`topk_blocks(score_blocks(q, anchors, candidates, quest, shared), candidates, k)` in one
    kernel call: the selection a decode step makes, with no NumPy calls between its parts
    (after a cache flush, each costs tens of microseconds)."""
    av = anchor_view(anchors)
    candidates = candidate_ids(candidates, anchors, quest)
    k = min(k, candidates.size)
    if k == candidates.size or k == 0:
        return unscored_choice(candidates, av, k, shared)
    return _select(readonly(q, F32), av.raw, av.fmt, candidates, bool(quest),
                   _n_parts(candidates, anchors), av.perm, k, bool(shared))


def unscored_choice(candidates, av: AnchorView, k: int, shared: bool) -> np.ndarray:
    """The choice when k is 0 or covers every candidate: [S, k] int32, no scoring (so the
    candidates' range is checked here)."""
    if not ids_in_range(candidates[None], av.shape[1]):
        raise ValueError("candidate block id out of range")
    return _all_or_none(candidates, 1 if shared else av.shape[0], k)


def topk_blocks_ref(scores, candidates, k):
    """NumPy reference of `topk_blocks` (stable: ties go to the earlier candidate)."""
    k = min(k, len(candidates))
    idx = [np.lexsort((np.arange(len(candidates)), -row))[:k] for row in scores]
    return np.stack([np.sort(candidates[i]) for i in idx]).astype(np.int32).reshape(len(scores), k)
