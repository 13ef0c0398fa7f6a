"""select_attend (one decode step's scoring, top-k and attention in one kernel call) against
select_blocks for the choice and the float64 attention reference for the output. Shapes, GQA
ratios, block sizes, partial last blocks, base / tail splits, anchor formats, QUEST, SHARED /
SEPARATE, KV dtypes and thread counts are drawn from seeded generators."""
from __future__ import annotations

import numpy as np
import pytest

from ktlong import kernels as K
from tests.test_kernels import KINDS, check_concurrent, head_dims, rope_freqs, store

FORMATS = ("F32", "BF16", "Q8")


def anchors_of(f, fmt, quest):
    """float32 anchors [Hkv, nb, A, d] in one of the three stored formats."""
    if fmt == "Q8":
        return K.q8_encode(f, quest)
    return K.f32_to_kv(f, 1) if fmt == "BF16" else f


def draw(rng, g, bs, kind, fmt, quest, shared, k=None):
    """One random step: (args for select_attend)."""
    hkv = int(rng.integers(1, 4))
    d = int(rng.choice(head_dims(kind)))
    nb = int(rng.integers(3, max(4, 600 // bs) + 1))
    n_tokens = int(rng.integers((nb - 1) * bs + 1, nb * bs + 1))  # last block often partial
    nb_base = int(rng.integers(0, nb))
    kb, vb, kt, vt = store(rng, hkv, nb_base, nb - nb_base + int(rng.integers(0, 3)), bs, d, kind)
    ids = rng.permutation(nb).astype(np.int32)
    n_fixed = int(rng.integers(0, nb - 1))  # 0: no init blocks or window (a device takes it)
    fixed, cand = np.sort(ids[:n_fixed]), ids[n_fixed:]
    if rng.random() < 0.5:
        cand = np.sort(cand)  # as the policy hands them; unsorted works too
    f = rng.standard_normal((hkv, nb + int(rng.integers(0, 3)), 2 if quest else 1, d))
    f = f.astype(np.float32)
    if quest:
        f.sort(axis=2)
    k = int(rng.integers(1, cand.size)) if k is None and cand.size > 1 else (k or 1)
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    return (q, anchors_of(f, fmt, quest), cand, k, quest, shared, fixed, kb, vb, kt, vt, nb_base,
            n_tokens, d ** -0.5, kind)


def check(args):
    out, lse, chosen = K.select_attend(*args)
    q, anchors, cand, k, quest, shared = args[:6]
    want_chosen = K.select_blocks(q, anchors, cand, k, quest, shared)
    np.testing.assert_array_equal(chosen, want_chosen)
    ref_out, ref_lse, _ = K.select_attend_ref(*args)
    assert out.dtype == np.float32 and lse.dtype == np.float32 and chosen.dtype == np.int32
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("g", [1, 4, 7])
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_select_attend_matches_select_then_attend(kind, fmt, g, bs):
    rng = np.random.default_rng(1000 * kind + 100 * FORMATS.index(fmt) + 10 * g + bs)
    for trial in range(4):
        check(draw(rng, g, bs, kind, fmt, quest=trial == 3, shared=trial % 2 == 0))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared", [True, False])
def test_select_attend_on_one_or_two_threads(threads, shared):
    """One thread runs every task in order (the top-k before any item that needs it); two
    threads share them. Both equal the two-call result."""
    rng = np.random.default_rng(7 + threads + 10 * shared)
    K.configure_threads(threads)
    try:
        for _ in range(6):
            check(draw(rng, 4, 16, 1, "Q8", quest=False, shared=shared))
    finally:
        K.configure_threads(0)


@pytest.mark.parametrize("k", [0, "all", "more"])
def test_select_attend_with_nothing_to_choose(k):
    """k = 0 attends the fixed blocks alone; k >= the candidate count attends every candidate."""
    rng = np.random.default_rng(3)
    args = list(draw(rng, 4, 16, 1, "Q8", quest=False, shared=True))
    n = args[2].size
    args[3] = {0: 0, "all": n, "more": n + 5}[k]
    out, lse, chosen = K.select_attend(*args)
    assert chosen.shape == (1, min(args[3], n))
    np.testing.assert_array_equal(chosen[0], np.sort(args[2])[:chosen.shape[1]])
    ref_out, ref_lse, _ = K.select_attend_ref(*args)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_select_attend_with_turned_reads(kind, bs):
    """Fixed blocks read with their own shifts and the i-th chosen block of a row as block
    base + i: the same choice, and attention equal to the float64 reference over those reads
    (k below the candidates: one kernel call; k = all of them: attend_layer)."""
    rng = np.random.default_rng(31 * kind + bs)
    for trial in range(4):
        args = draw(rng, 4, bs, kind, "Q8", quest=False, shared=trial != 1)
        q, anchors, cand, k, quest, shared, fixed, kb, vb, kt, vt, nb_base, n_tokens, scale = \
            args[:14]
        if trial == 3:
            k = cand.size
        d, nb = q.shape[1], -(-n_tokens // bs)
        inv = rope_freqs(rng, d)
        fixed_sh = rng.integers(-5, 30, fixed.size).astype(np.int32)
        base = int(rng.integers(0, 20))
        turns = K.rope_turns(inv, bs, nb + 40, d, kind)
        out, lse, chosen = K.select_attend_layer(
            K.layer_kv(kb, vb, kt, vt, nb_base, kind), K.anchor_view(anchors), q, cand, k, quest,
            shared, fixed, n_tokens, scale, fixed_sh, base, turns)
        np.testing.assert_array_equal(chosen, K.select_blocks(q, anchors, cand, k, quest, shared))
        S, k = chosen.shape
        blocks = np.concatenate([np.broadcast_to(fixed, (S, fixed.size)), chosen], axis=1)
        shifts = np.concatenate([np.broadcast_to(fixed_sh, (S, fixed.size)),
                                 base + np.arange(k) - chosen], axis=1)
        ref_out, ref_lse = K.attend_blocks_ref(q, kb, vb, kt, vt, nb_base, blocks, n_tokens,
                                               scale, kind, shifts, inv)
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=3e-5)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("turned", [False, True])
def test_select_attend_scores_with_its_own_query(turned):
    """qscore chooses the blocks (as select_blocks with it would), q is attended with (the
    output equals the reference's for q over that choice), with and without turned reads."""
    rng = np.random.default_rng(5 + turned)
    differ = 0
    for trial in range(4):
        args = draw(rng, 3, 16, 1, "Q8", quest=trial == 3, shared=trial % 2 == 0)
        q, anchors, cand, k, quest, shared, fixed, kb, vb, kt, vt, nb_base, n_tokens, scale = \
            args[:14]
        qscore = rng.standard_normal(q.shape).astype(np.float32)
        kv = K.layer_kv(kb, vb, kt, vt, nb_base, 1)
        extra = ()
        if turned:
            turns = K.rope_turns(rope_freqs(rng, q.shape[1]), 16, 80, q.shape[1], 1)
            extra = (np.zeros(fixed.size, np.int32), -1, turns)
        out, lse, chosen = K.select_attend_layer(kv, K.anchor_view(anchors), q, cand, k, quest,
                                                 shared, fixed, n_tokens, scale, *extra,
                                                 qscore=qscore)
        want = K.select_blocks(qscore, anchors, cand, k, quest, shared)
        np.testing.assert_array_equal(chosen, want)
        differ += not np.array_equal(want, K.select_blocks(q, anchors, cand, k, quest, shared))
        blocks = np.sort(np.concatenate([np.broadcast_to(fixed, (want.shape[0], fixed.size)),
                                         want], axis=1), axis=1)
        ref_out, ref_lse = K.attend_blocks_ref(q, kb, vb, kt, vt, nb_base, blocks, n_tokens,
                                               scale, 1)
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert differ  # some draw where q alone would have chosen other blocks


@pytest.mark.parametrize("turned", [False, True])
def test_a_choice_made_first_reads_to_the_same_bit(turned):
    """`chosen=` (a disk tier asks for the blocks before the kernel reads them): no scoring,
    the same blocks and the same output and lse, bit for bit, as the kernel's own choice."""
    rng = np.random.default_rng(11 + turned)
    for trial in range(4):
        args = draw(rng, 4, 16, 1, "Q8", quest=False, shared=trial % 2 == 0)
        q, anchors, cand, k, quest, shared, fixed, kb, vb, kt, vt, nb_base, n_tokens, scale = \
            args[:14]
        kv, av = K.layer_kv(kb, vb, kt, vt, nb_base, 1), K.anchor_view(anchors)
        extra = ()
        if turned:
            turns = K.rope_turns(rope_freqs(rng, q.shape[1]), 16, 80, q.shape[1], 1)
            extra = (rng.integers(-3, 9, fixed.size).astype(np.int32), 2, turns)
        own = K.select_attend_layer(kv, av, q, cand, k, quest, shared, fixed, n_tokens, scale,
                                    *extra)
        first = K.select_blocks(q, anchors, cand, k, quest, shared)
        given = K.select_attend_layer(kv, av, q, cand, k, quest, shared, fixed, n_tokens, scale,
                                      *extra, chosen=first)
        for a, b in zip(own, given, strict=True):
            np.testing.assert_array_equal(a, b)
        other = np.sort(cand[rng.choice(cand.size, first.shape[1], replace=False)])
        moved = K.select_attend_layer(kv, av, q, cand, k, quest, shared, fixed, n_tokens, scale,
                                      *extra, chosen=np.broadcast_to(other, first.shape))
        np.testing.assert_array_equal(moved[2], np.broadcast_to(other, first.shape))
    with pytest.raises(ValueError, match="chosen must be"):
        K.select_attend_layer(kv, av, q, cand, k, quest, shared, fixed, n_tokens, scale,
                              chosen=first[:, :-1])


def test_concurrent_steps_from_two_threads():
    """The task counter is per call: two Python threads stepping at once get exact results."""
    rng = np.random.default_rng(4)
    check_concurrent(K.select_attend,
                     [draw(rng, 4, 16, 1, "Q8", quest=False, shared=True) for _ in range(2)])


def test_select_attend_rejects_bad_input():
    rng = np.random.default_rng(5)
    args = list(draw(rng, 4, 16, 1, "Q8", quest=False, shared=True))
    n_blocks = -(-args[12] // 16)
    bad = list(args)
    bad[2] = np.append(args[2], n_blocks).astype(np.int32)  # past the last block
    with pytest.raises(ValueError, match="out of range"):
        K.select_attend(*bad)
    bad = list(args)
    bad[6] = np.append(args[6], n_blocks + 3).astype(np.int32)
    with pytest.raises(ValueError, match="out of range"):
        K.select_attend(*bad)
    bad = list(args)
    bad[6] = args[6][None]
    with pytest.raises(ValueError, match="1-D"):
        K.select_attend(*bad)


def test_prepared_views_follow_writes_to_their_arrays():
    """`layer_kv` / `anchor_view` are made once per layer (the KV store keeps them): they view
    the arrays, so tokens and anchors written in place later are read by the next step."""
    rng = np.random.default_rng(8)
    args = list(draw(rng, 4, 16, 1, "Q8", quest=False, shared=True))
    q, anchors, cand, k, quest, shared, fixed, kb, vb, kt, vt, nb_base, n_tokens, scale, kind = args
    kv = K.layer_kv(kb, vb, kt, vt, nb_base, kind)
    av = K.anchor_view(anchors)
    for _ in range(2):
        got = K.select_attend_layer(kv, av, q, cand, k, quest, shared, fixed, n_tokens, scale)
        want = K.select_attend(*args)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        kt[...] = K.f32_to_kv(rng.standard_normal(kt.shape).astype(np.float32), kind)
        vt[...] = K.f32_to_kv(rng.standard_normal(vt.shape).astype(np.float32), kind)
        f = rng.standard_normal((anchors.shape[0], anchors.shape[1], 1, kt.shape[3]))
        anchors[...] = K.q8_encode(f.astype(np.float32), False)
