"""One decode step's block choice and attention in a single kernel call and parallel region.

`select_attend` scores the candidate blocks by their anchors, takes the top k, and attends to the
fixed blocks (init and local window) and the chosen ones. It returns what `select_blocks` and then
`attend_blocks` over the union return (the same blocks; the output to float rounding), but the
threads wake once instead of twice, no Python runs between the parts, and the fixed blocks are
read while the candidates are scored and the top-k is taken.

The work is a list of tasks, each thread claiming the next one from a shared atomic counter:
scoring parts (KV head x part of the candidates), then attention items over the fixed blocks, then
items over the chosen blocks. The thread that finishes the last scoring part sums the heads and
takes the top-k; a thread that reaches an item over the chosen blocks before that waits for it.
A thread only ever waits for tasks another thread has claimed and runs without waiting, so the
loop cannot deadlock, whether Numba runs it on many threads or on one.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd import F32, LOG2E, readonly
from ._vec import cpu_relax, fetch_add, load_acquire
from .anchors import (
    AnchorView,
    anchor_view,
    candidate_ids,
    score_part,
    score_prep,
    select_blocks,
    top_blocks,
    unscored_choice,
)
from .attention import (
    LayerKV,
    Turns,
    attend_blocks_ref,
    attend_item,
    attend_layer,
    checked_shifts,
    ids_in_range,
    items_per_head,
    layer_kv,
    merge_items,
    pack_rows,
    softmax_state,
)
from .threads import use_threads

NEXT, SCORED, CHOSEN = 0, 8, 16  # counter slots, a cache line apart: next task, parts scored,
# top-k taken


@njit(nogil=True, cache=True)
def _prologue(q, qsel, anchors, quest, perm_a, n, hkv, perm, scale, n_items, rows, k):
    """The kernel's allocations, serial (in the parallel function each would be a parfor)."""
    # [Hkv, A, P], [Hkv, n]
    qs, per_head = score_prep(qsel, hkv, anchors.shape[2], quest, perm_a, n)
    qp = pack_rows(q, hkv, perm, scale)  # [Hkv, R, P]
    acc, mx, den = softmax_state(n_items, qp.shape[1], qp.shape[2])
    return (qs, per_head, qp, acc, mx, den, np.empty((rows, k), np.int32),
            np.empty((rows, k), np.int32), np.zeros(24, np.int64))


@njit(nogil=True, cache=True)
def _choose(per_head, candidates, k, shared, chosen, base, shifts):
    """The top-k of the per-head scores [Hkv, n] into chosen [S, k]; with base >= 0, the chosen
    blocks' shifts [S, k] when the i-th of a row is read as if it were block base + i."""
    chosen[:, :] = top_blocks(per_head, candidates, k, shared)
    if base >= 0:
        for r in range(chosen.shape[0]):
            for i in range(chosen.shape[1]):
                shifts[r, i] = base + i - chosen[r, i]


@njit(nogil=True, cache=True)
def _take(given, chosen, base, shifts, ctr):
    """A choice made before the call (`given` [S, k]) as if the scoring had made it."""
    chosen[:, :] = given
    if base >= 0:
        for r in range(chosen.shape[0]):
            for i in range(chosen.shape[1]):
                shifts[r, i] = base + i - chosen[r, i]
    ctr[CHOSEN] = 1


@njit(parallel=True, nogil=True, cache=True)
def _step(q, qsel, anchors, fmt, candidates, quest, k, shared, perm_a, fixed, fixed_sh, base,
          k_base, v_base, k_tail, v_tail, nb_base, n_blocks, n_tokens, scale, perm, tab, rot, lanes,
          per, sf, ss, given):
    # q [Hq, d], qsel [Hq, d] the query that scores; anchors bytes [Hkv, nb_cap, A, row];
    # candidates [n], fixed [nf] int32;
    # fixed_sh [nf] or [0] and base (< 0: none): shifts (see select_attend); tab, rot: a Turns;
    # K/V [Hkv, nb, bs, row] (kv_view); per / sf / ss: parts per head of the scoring, the fixed
    # blocks and the chosen ones; given [S, k] int32: the choice, already made (no scoring), or
    # [0, 0] -> out [Hq, d], lse [Hq], chosen [S, k]
    if not (ids_in_range(candidates.reshape(1, -1), min(n_blocks, anchors.shape[1]))
            and ids_in_range(fixed.reshape(1, -1), n_blocks)):
        raise ValueError("block id out of range")
    hkv, n, nf, ni = k_tail.shape[0], candidates.shape[0], fixed.shape[0], sf + ss
    qs, per_head, qp, acc, mx, den, chosen, csh, ctr = _prologue(
        q, qsel, anchors, quest, perm_a, n, hkv, perm, scale, hkv * ni, 1 if shared else hkv, k)
    if given.shape[0]:
        _take(given, chosen, base, csh, ctr)
        per = 0
    n_score, n_fixed = hkv * per, hkv * sf
    n_tasks = n_score + n_fixed + hkv * ss
    for _lane in prange(lanes):
        while True:
            t = fetch_add(ctr, NEXT, 1)
            if t >= n_tasks:
                break
            if t < n_score:
                j, c = t // per, t % per
                score_part(qs, anchors, fmt, candidates, c * n // per, (c + 1) * n // per, j,
                           per_head)
                if fetch_add(ctr, SCORED, 1) == n_score - 1:  # the last part: choose
                    _choose(per_head, candidates, k, shared, chosen, base, csh)
                    fetch_add(ctr, CHOSEN, 1)
                continue
            t -= n_score
            if t < n_fixed:
                j, part = t // sf, t % sf
                a, b = part * nf // sf, (part + 1) * nf // sf
                ids = fixed[a:b]
                sh = fixed_sh[a:b] if fixed_sh.shape[0] else fixed_sh
                item = j * ni + part
            else:
                t -= n_fixed
                j, part = t // ss, t % ss
                while load_acquire(ctr, CHOSEN) == 0:
                    cpu_relax()
                row, a, b = 0 if shared else j, part * k // ss, (part + 1) * k // ss
                ids = chosen[row, a:b]
                sh = csh[row, a:b] if base >= 0 else fixed_sh[:0]
                item = j * ni + sf + part
            attend_item(qp[j], k_base, v_base, k_tail, v_tail, nb_base, ids, sh, n_tokens, j,
                        acc[item], mx[item], den[item], tab, rot)
    out, lse = merge_items(acc, mx, den, ni, q.shape[0] // hkv, q.shape[1], perm)
    return out, lse, chosen


def _union(fixed: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Per row of chosen [S, k]: the fixed blocks and the chosen ones, ascending: [S, nf + k]."""
    return np.sort(np.concatenate(
        [np.broadcast_to(fixed, (chosen.shape[0], fixed.size)), chosen], axis=1), axis=1)


def select_attend(q, anchors, candidates, k, quest, shared, fixed, k_base, v_base, k_tail, v_tail,
                  nb_base, n_tokens, scale, kv_kind):
    """One decode step: choose the k best candidates by anchor score and attend to them and to
    the fixed blocks.

    Returns out [Hq, d] f32, lse [Hq] f32 and chosen [S, min(k, n)] int32 (rows ascending), as
    `chosen = select_blocks(q, anchors, candidates, k, quest, shared)` and `attend_blocks` over
    each row's union with `fixed` would. fixed: int32 [nf] ascending, attended by every head,
    disjoint from the candidates; the other arguments as for those two functions.
    """
    return select_attend_layer(layer_kv(k_base, v_base, k_tail, v_tail, nb_base, kv_kind),
                               anchor_view(anchors), q, candidates, k, quest, shared, fixed,
                               n_tokens, scale)


def select_attend_layer(kv: LayerKV, av: AnchorView, q, candidates, k, quest, shared, fixed,
                        n_tokens, scale, fixed_shifts=None, chosen_base=-1,
                        turns: Turns | None = None, qscore=None, chosen=None):
    """`select_attend` over a layer's prepared K/V and anchor views. With `fixed_shifts` [nf]
    int32, `chosen_base` and their `turns`, blocks are read at other positions (see
    `attend_layer`): fixed block i as if fixed_shifts[i] blocks later, the i-th chosen block of a
    row as if it were block chosen_base + i (chosen_base < 0: the chosen blocks where they are).
    qscore [Hq, d]: the query that scores the candidates (default q). `chosen` [S, k] int32:
    the choice `select_blocks` made already (e.g. to ask a disk tier for those blocks first):
    not scored again, and read in the same order, so the output is the same to the bit."""
    q = kv.query(q)
    qsel = q if qscore is None else kv.query(qscore)
    fixed = readonly(fixed, np.int32)
    if fixed.ndim != 1:
        raise ValueError(f"fixed must be 1-D, got {fixed.shape}")
    if av.shape[0] != kv.hkv:
        raise ValueError(f"anchors must have {kv.hkv} KV heads, got {av.shape}")
    candidates = candidate_ids(candidates, av, quest)
    k = min(k, candidates.size)
    turned = fixed_shifts is not None
    fsh, turns = checked_shifts(None if not turned else np.asarray(fixed_shifts)[None], turns,
                                (1, fixed.size), kv)
    base = int(chosen_base) if turned else -1
    if base >= 0 and k and max(abs(base - int(candidates.max())),
                            abs(base + k - 1 - int(candidates.min()))) > turns.reach:
        raise ValueError(f"a shift beyond the turns' reach of {turns.reach} blocks")
    if k == candidates.size or k == 0:  # nothing to score: every candidate or none
        chosen = unscored_choice(candidates, av, k, shared)
        if not turned:
            return (*attend_layer(kv, q, _union(fixed, chosen), n_tokens, scale), chosen)
        S = chosen.shape[0]
        blocks = np.concatenate([np.broadcast_to(fixed, (S, fixed.size)), chosen], axis=1)
        shifts = np.concatenate([np.broadcast_to(fsh, (S, fixed.size)),
                                 base + np.arange(k, dtype=np.int32) - chosen], axis=1)
        return (*attend_layer(kv, q, blocks, n_tokens, scale, shifts, turns), chosen)
    # parts per head; the scoring and the chosen blocks' items twice as fine as the fixed ones:
    # the top-k waits for the last scoring part, and the chosen blocks' items end the step
    # (ad hoc A/Bs at 128K-1M on 2 threads: equal parts took 1.00-1.16x the time)
    given = _NOT_GIVEN
    if chosen is not None:
        given = readonly(chosen, np.int32)
        if given.shape != (1 if shared else kv.hkv, k):
            raise ValueError(f"chosen must be [{1 if shared else kv.hkv}, {k}], "
                             f"got {given.shape}")
    split = items_per_head(kv.hkv)
    return _step(q, qsel, av.raw, av.fmt, candidates, bool(quest), k, bool(shared), av.perm, fixed,
                 fsh[0], base, kv.k_base, kv.v_base, kv.k_tail, kv.v_tail, kv.nb_base,
                 kv.n_blocks(n_tokens), n_tokens, F32(scale * LOG2E), kv.perm, turns.tab,
                 turns.rot, use_threads(), min(2 * split, candidates.size),
                 min(split, fixed.size), min(2 * split, k), given)


_NOT_GIVEN = readonly(np.zeros((0, 0), np.int32))


def select_attend_ref(q, anchors, candidates, k, quest, shared, fixed, k_base, v_base, k_tail,
                      v_tail, nb_base, n_tokens, scale, kv_kind):
    """float64 NumPy reference of `select_attend`'s attention, given its choice: the chosen
    blocks come from `select_blocks` (float32 scores; which blocks win a near-tie in float64 is
    the reference's own question, tested apart)."""
    chosen = select_blocks(q, anchors, candidates, k, quest, shared)
    out, lse = attend_blocks_ref(q, k_base, v_base, k_tail, v_tail, nb_base,
                                 _union(np.asarray(fixed, np.int32), chosen), n_tokens, scale,
                                 kv_kind)
    return out, lse, chosen
