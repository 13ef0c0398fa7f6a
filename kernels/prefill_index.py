"""Indexes of sparse prefill attention: which keys each query block of a chunk reads.

A chunk's queries sit at positions `q_start .. q_start + length - 1`, cut into blocks of QB rows.
Every pattern (MInference's A-shape, Vertical-Slash, Block-Sparse) becomes one PrefillIndex per
(query head, query block): key ranges `[s, e)` (ascending, disjoint), single key columns
(ascending, outside every range) and lone diagonals (offsets o: the query at position p reads key
p - o). `ktlong.kernels.prefill_sparse` attends over them.

Builders: `ashape_index` (the first `init` keys + the `local` before the block), `vs_index`
(slash offsets: ranges `[q0 - o, q1 - o)` of block [q0, q1), merged, or lone diagonals where a
diagonal stands alone (cost model LONE_COST); vertical columns outside the ranges) and
`block_index` (the key blocks of QB tokens picked per query block); `dense_index` for exact
attention. Readers: `index_positions`, `index_diags`, `index_pairs` (the pairs a kernel computes).
NumPy references: `vs_index_ref`, `vs_row_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

QB = 64  # query rows per index block (and the pooling block of Block-Sparse)
# A lone-diagonal pair costs about this many tiled pairs: its key row is read for one query, not
# for a register tile of four (ad hoc, one thread, BF16: 12-20 ns a lone pair against 7 ns a
# tiled one at head_dim 128; at head_dim 32 costs 2, 3 and 4 time alike, 6 and 8 slower)
LONE_COST = 3


class PrefillIndex(NamedTuple):
    """Per (query head h, query block b): ranges[r_off[h, b] : + r_cnt[h, b]] ([s, e) int32
    pairs, ascending, disjoint), cols[c_off[h, b] : + c_cnt[h, b]] (ascending, outside the
    ranges) and diags[d_off[h, b] : + d_cnt[h, b]] (lone diagonal offsets, ascending). Offsets
    int64 [Hq, nqb], counts int32 [Hq, nqb]."""

    r_off: np.ndarray
    r_cnt: np.ndarray
    ranges: np.ndarray  # [N, 2] int32
    c_off: np.ndarray
    c_cnt: np.ndarray
    cols: np.ndarray  # [M] int32
    d_off: np.ndarray
    d_cnt: np.ndarray
    diags: np.ndarray  # [K] int32

    def keys(self, h: int, b: int) -> np.ndarray:
        """Sorted key positions of the ranges and columns of block b of head h (every row of
        the block reads them, up to itself)."""
        r = self.ranges[self.r_off[h, b]: self.r_off[h, b] + self.r_cnt[h, b]]
        c = self.cols[self.c_off[h, b]: self.c_off[h, b] + self.c_cnt[h, b]]
        parts = [np.arange(s, e) for s, e in r] + [c.astype(np.int64)]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def row_keys(self, h: int, b: int, pos: int) -> np.ndarray:
        """Sorted key positions the query at position `pos` (a row of block b) attends."""
        k = self.keys(h, b)
        o = self.diags[self.d_off[h, b]: self.d_off[h, b] + self.d_cnt[h, b]]
        lone = pos - o.astype(np.int64)
        return np.union1d(k[k <= pos], lone[lone >= 0])


def n_qblocks(length: int) -> int:
    return -(-length // QB)


def pack_index(heads: list[np.ndarray], parts: list[tuple], n_heads: int, nqb: int
               ) -> PrefillIndex:
    """Assemble a PrefillIndex from groups of heads, each with padded ranges
    `[Hs, nqb, R, 2]` + counts `[Hs, nqb]`, padded cols `[Hs, nqb, C]` + counts, and optionally
    padded lone diagonals `[Hs, nqb, D]` + counts."""
    offs = [np.zeros((n_heads, nqb), np.int64) for _ in range(3)]
    cnts = [np.zeros((n_heads, nqb), np.int32) for _ in range(3)]
    flat: list[list[np.ndarray]] = [[], [], []]
    tot = [0, 0, 0]
    for hs, part in zip(heads, parts, strict=True):
        for k in range(3):
            if 2 * k >= len(part):
                continue
            arr, cnt = part[2 * k], part[2 * k + 1]
            keep = np.arange(arr.shape[2]) < cnt[..., None]  # [Hs, nqb, R]
            cnts[k][hs] = cnt
            offs[k][hs] = tot[k] + (np.cumsum(cnt.ravel()) - cnt.ravel()).reshape(cnt.shape)
            flat[k].append(arr[keep])
            tot[k] += int(cnt.sum())

    def cat(k: int) -> np.ndarray:
        return np.concatenate(flat[k]).astype(np.int32) if flat[k] else np.zeros(0, np.int32)

    return PrefillIndex(offs[0], cnts[0], cat(0).reshape(-1, 2), offs[1], cnts[1], cat(1),
                        offs[2], cnts[2], cat(2))


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
def lone_diagonals(slash, lone_cost):
    """Which offsets of each head's ascending slash offsets [H, ks] to read as lone diagonals
    -> [H, ks] bool. Offsets whose gaps are at most lone_cost form runs; a run of m offsets
    spanning w stays a range (w + QB keys a row) if that costs no more than m lone keys a row at
    lone_cost each. lone_cost <= 0: none (every offset a range)."""
    h_n, ks_n = slash.shape
    lone = np.zeros((h_n, ks_n), np.bool_)
    if lone_cost <= 0:
        return lone
    for h in range(h_n):
        i = 0
        while i < ks_n:
            j = i
            while j + 1 < ks_n and slash[h, j + 1] - slash[h, j] <= lone_cost:
                j += 1
            if slash[h, j] - slash[h, i] + QB > lone_cost * (j - i + 1):
                lone[h, i:j + 1] = True
            i = j + 1
    return lone


@njit(cache=True)
def vs_index(vertical, slash, q_start, length, lone_cost):
    """Vertical-Slash index. vertical [H, kv] int32 ascending key columns; slash [H, ks] int32
    ascending diagonal offsets (query pos - key pos >= 0), each a range or a lone diagonal (see
    `lone_diagonals`). Returns padded parts for pack_index: ranges [H, nqb, ks, 2], counts
    [H, nqb], cols [H, nqb, kv], counts, diags [H, nqb, ks], counts."""
    h_n, kv_n, ks_n = vertical.shape[0], vertical.shape[1], slash.shape[1]
    nqb = (length + QB - 1) // QB
    lone = lone_diagonals(slash, lone_cost)
    rg = np.zeros((h_n, nqb, max(ks_n, 1), 2), np.int32)
    rn = np.zeros((h_n, nqb), np.int32)
    cl = np.zeros((h_n, nqb, max(kv_n, 1)), np.int32)
    cn = np.zeros((h_n, nqb), np.int32)
    dg = np.zeros((h_n, nqb, max(ks_n, 1)), np.int32)
    dn = np.zeros((h_n, nqb), np.int32)
    tmp = np.zeros((max(ks_n, 1), 2), np.int32)
    for h in range(h_n):
        for b in range(nqb):
            q0 = q_start + b * QB
            q1 = min(q_start + length, q0 + QB)
            # offsets ascending -> ranges with descending starts; merge touching ones
            n = nd = 0
            for i in range(ks_n):
                o = slash[h, i]
                e = q1 - o
                if e <= 0:
                    break
                if lone[h, i]:
                    dg[h, b, nd] = o
                    nd += 1
                    continue
                s = max(0, q0 - o)
                if n > 0 and e >= tmp[n - 1, 0]:
                    tmp[n - 1, 0] = min(tmp[n - 1, 0], s)
                else:
                    tmp[n, 0], tmp[n, 1] = s, e
                    n += 1
            for i in range(n):  # ascending
                rg[h, b, i, 0], rg[h, b, i, 1] = tmp[n - 1 - i, 0], tmp[n - 1 - i, 1]
            rn[h, b], dn[h, b] = n, nd
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
    return rg, rn, cl, cn, dg, dn


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


def index_diags(index: PrefillIndex, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Head h's lone diagonal offsets per query block: (offsets [nqb, D] int64, zero-padded;
    counts [nqb])."""
    cnt = index.d_cnt[h].astype(np.int64)
    out = np.zeros((cnt.size, max(1, int(cnt.max(initial=0)))), np.int64)
    for b in range(cnt.size):
        out[b, : cnt[b]] = index.diags[index.d_off[h, b]: index.d_off[h, b] + cnt[b]]
    return out, cnt


def _entries(off: np.ndarray, cnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat (h, b) and array position of every entry that offsets/counts [Hq, nqb] list."""
    cnt = cnt.ravel().astype(np.int64)
    blk = np.repeat(np.arange(cnt.size), cnt)
    first = np.cumsum(cnt) - cnt
    return blk, off.ravel()[blk] + np.arange(blk.size) - first[blk]


def index_pairs(index: PrefillIndex, q_start: int, length: int) -> tuple[int, int, int]:
    """(query, key) pairs `sparse_attend` computes for this index: (tiled, lone, dense). Tiled:
    each block's rows times its range and column keys up to the block's last query (a key
    masked inside a chunk of keys costs as much as a visible one); lone: the block's rows times
    its lone diagonals; dense: the pairs of causal dense attention, for the same queries."""
    hq, nqb = index.r_cnt.shape
    rows = np.minimum(QB, length - np.arange(nqb) * QB)  # [nqb]
    qlast = np.tile(q_start + np.arange(nqb) * QB + rows - 1, hq)  # [Hq * nqb]
    blk, at = _entries(index.r_off, index.r_cnt)
    rg = index.ranges.reshape(-1, 2)[at].astype(np.int64)
    span = np.clip(np.minimum(rg[:, 1], qlast[blk] + 1) - rg[:, 0], 0, None)
    keys = np.bincount(blk, span, hq * nqb).astype(np.int64)
    blk, at = _entries(index.c_off, index.c_cnt)
    keys += np.bincount(blk[index.cols[at] <= qlast[blk]], minlength=hq * nqb)
    tiled = int((keys.reshape(hq, nqb) * rows).sum())
    lone = int((index.d_cnt.astype(np.int64) * rows).sum())
    dense = hq * (length * q_start + length * (length + 1) // 2)
    return tiled, lone, dense


def dense_index(n_heads: int, q_start: int, length: int) -> PrefillIndex:
    """Every key up to each block's last query (exact attention)."""
    rg, rn, cl, cn = ashape_index(n_heads, q_start, length, 0, q_start + length)
    return pack_index([np.arange(n_heads)], [(rg, rn, cl, cn)], n_heads, n_qblocks(length))


def vs_index_ref(vertical, slash, q_start, length, h, b):
    """Key set of block b of head h under `vs_index` with every offset a range (lone_cost 0):
    each offset's range, the columns."""
    q0 = q_start + b * QB
    q1 = min(q_start + length, q0 + QB)
    keys = set()
    for o in slash[h]:
        keys.update(range(max(0, q0 - o), max(0, q1 - o)))
    keys.update(int(c) for c in vertical[h] if c < q1)
    return np.array(sorted(keys), np.int64)


def vs_row_ref(vertical, slash, h, pos):
    """The keys Vertical-Slash itself gives the query at `pos`: its columns and diagonals that
    exist up to it. An index holds them, and with ranges some more."""
    keys = {int(c) for c in vertical[h] if c <= pos} | {pos - int(o) for o in slash[h] if o <= pos}
    return np.array(sorted(keys), np.int64)
