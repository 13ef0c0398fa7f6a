"""Anchor, scoring and top-k kernels against their NumPy references; kernel setup (compiled-cache
key, threads)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numba
import numpy as np
import pytest
from ktlong.kernels import anchors as anchors_mod

from ktlong import kernels as K
from tests.test_kernels import KINDS

TYPES = ("MAX", "MEAN", "QUEST", "FIX", "DYNAMIC")


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("anchor_type", TYPES)
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_anchors_match_reference(kind, anchor_type, bs):
    """float32 anchors equal the reference; BF16 anchors (uint16) equal it to bf16 rounding; Q8
    anchors (uint8) equal it to one code step."""
    rng = np.random.default_rng(100 * TYPES.index(anchor_type) + 10 * kind + bs)
    nums = [2] if anchor_type == "QUEST" else [n for n in (1, 3, 4) if n <= bs]
    for num in nums:
        dims = [32, 96, 128] if kind >= 3 else [16, 48, 128]
        hkv, d = int(rng.integers(1, 4)), int(rng.choice(dims))
        nb = int(rng.integers(2, max(3, 300 // bs) + 1))
        nb_base = int(rng.integers(0, nb))
        k = K.f32_to_kv(rng.standard_normal((hkv, nb, bs, d)).astype(np.float32), kind)
        kb, kt = k[:, :nb_base].copy(), k[:, nb_base:].copy()
        # coarse scores make ties: the earliest token must win
        scores = np.round(rng.random((hkv, nb * bs)) * 4).astype(np.float32)
        first, last = int(rng.integers(0, nb)), nb
        for dtype in (np.float32, np.uint16, np.uint8):
            row = d + K.Q8_EXTRA if dtype == np.uint8 else d
            got = np.full((hkv, nb + 2, num, row), 7, dtype)  # spare capacity stays untouched
            want = got.copy()
            K.compute_anchors(kb, kt, nb_base, first, last, anchor_type, num, got, scores,
                              kv_kind=kind)
            K.compute_anchors_ref(kb, kt, nb_base, first, last, anchor_type, num, want, scores,
                                  kv_kind=kind)
            if dtype == np.float32:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            elif dtype == np.uint8:  # a float32 mean may round to the neighbouring code
                np.testing.assert_array_equal(got[:, :first], want[:, :first])
                step = want[..., d:].copy().view(np.float32)  # [..., 1]: the scales
                np.testing.assert_allclose(got[..., d:].copy().view(np.float32), step, rtol=1e-6)
                err = np.abs(K.anchors_to_f64(got) - K.anchors_to_f64(want))
                assert np.all(err <= 1.001 * step + 1e-12)
                if anchor_type != "MEAN":  # copies of keys: bit-equal
                    np.testing.assert_array_equal(got, want)
            else:  # a mean summed in float32 may round to the neighbouring bf16 value
                np.testing.assert_allclose(K.kv_to_f64(got, 1), K.kv_to_f64(want, 1), rtol=8e-3,
                                           atol=1e-6)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("anchor_type", TYPES)
def test_turned_back_anchors_match_reference(kind, anchor_type):
    """With inv_freq, anchors of the keys turned back to position 0 equal the reference's (which
    turns them in float64), for every key dtype and anchor type; partial rotary included."""
    rng = np.random.default_rng(7 * kind + TYPES.index(anchor_type))
    num = 2 if anchor_type == "QUEST" else 3
    for d, rot in ((64, 64), (96, 64)):
        if kind >= 3 and d % 32:
            continue
        hkv, bs, nb = 2, 16, 9
        inv = 10000.0 ** (-np.arange(0, rot, 2) / rot)  # [rot/2]
        k = K.f32_to_kv(rng.standard_normal((hkv, nb, bs, d)).astype(np.float32), kind)
        kb, kt = k[:, :4].copy(), k[:, 4:].copy()
        scores = np.round(rng.random((hkv, nb * bs)) * 4).astype(np.float32)
        got = np.zeros((hkv, nb, num, d), np.float32)
        want = got.copy()
        K.compute_anchors(kb, kt, 4, 2, nb, anchor_type, num, got, scores, kv_kind=kind,
                          inv_freq=inv)
        K.compute_anchors_ref(kb, kt, 4, 2, nb, anchor_type, num, want, scores, kv_kind=kind,
                              inv_freq=inv)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert not got[:, :2].any()  # blocks before `first` untouched


def test_turned_back_anchors_carry_no_position():
    """The same keys written at two different positions give the same turned-back anchors (up
    to float32 rounding of the rotation), and a query turned to one distance scores them alike:
    what position-free block scoring rests on."""
    rng = np.random.default_rng(3)
    hkv, bs, d = 1, 8, 32
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    k0 = rng.standard_normal((bs, d))  # [bs, d] keys at position 0 (no rotation)
    nb = 40
    k = np.zeros((hkv, nb, bs, d), np.float32)
    for b in (1, 37):  # the same block of keys at two places, rotated to where it sits
        pos = b * bs + np.arange(bs)
        ang = pos[:, None] * inv[None]
        x1, x2 = k0[:, : d // 2], k0[:, d // 2:]
        k[0, b] = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                                  x2 * np.cos(ang) + x1 * np.sin(ang)], axis=1)
    an = np.zeros((hkv, nb, 1, d), np.float32)
    K.compute_anchors(k[:, :0], k, 0, 0, nb, "MAX", 1, an, kv_kind=0, inv_freq=inv)
    np.testing.assert_allclose(an[0, 1], an[0, 37], atol=1e-4)
    np.testing.assert_allclose(an[0, 1, 0], k0.max(0), atol=1e-4)


def test_anchors_reject_bad_arguments():
    k = np.zeros((2, 3, 16, 32), np.uint16)
    an = np.zeros((2, 3, 1, 32), np.float32)
    with pytest.raises(ValueError, match="QUEST"):
        K.compute_anchors(k, k, 0, 0, 3, "QUEST", 1, an, kv_kind=1)
    with pytest.raises(ValueError, match="token_scores"):
        K.compute_anchors(k, k, 0, 0, 3, "DYNAMIC", 1, an, kv_kind=1)
    with pytest.raises(ValueError, match="anchors must be"):
        K.compute_anchors(k, k, 0, 0, 3, "MAX", 2, an, kv_kind=1)


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8"])
@pytest.mark.parametrize("d", [64, 40])
def test_scores_match_reference(quest, shared, g, fmt, d):
    rng = np.random.default_rng(int(quest) + 2 * int(shared) + 4 * g + 40 * len(fmt) + d)
    hkv, nb = 3, 50
    num = 2 if quest else int(rng.integers(1, 4))
    anchors = rng.standard_normal((hkv, nb, num, d)).astype(np.float32)
    if quest:
        anchors.sort(axis=2)  # [..., 0] min, [..., 1] max
    anchors = {"f32": lambda a: a, "bf16": lambda a: K.f32_to_kv(a, 1),
               "q8": lambda a: K.q8_encode(a, quest)}[fmt](anchors)
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    cand = np.sort(rng.choice(nb, 20, replace=False)).astype(np.int32)
    got = K.score_blocks(q, anchors, cand, quest, shared)
    want = K.score_blocks_ref(q, anchors, cand, quest, shared)
    assert got.shape == (1 if shared else hkv, 20) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_cand", [1, 2, 3, 4, 5, 7, 45, 299])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("serial", [True, False])
def test_scores_any_candidate_count(n_cand, threads, q8, serial, monkeypatch):
    """Blocks are scored four at a time: counts (and per-thread parts) that are not a multiple
    of 4 score their last 1-3 blocks alone; parts longer than the prefetch distance prefetch.
    Both paths: serial (few anchors, as here) and parallel (forced)."""
    if not serial:
        monkeypatch.setattr(anchors_mod, "SERIAL_BYTES", 0)
    rng = np.random.default_rng(n_cand)
    f = rng.standard_normal((2, 300, 1, 128)).astype(np.float32)
    anchors = K.q8_encode(f) if q8 else K.f32_to_kv(f, 1)
    q = rng.standard_normal((8, 128)).astype(np.float32)
    cand = np.sort(rng.choice(300, n_cand, replace=False)).astype(np.int32)
    K.configure_threads(threads)
    try:
        got = K.score_blocks(q, anchors, cand, False, False)
    finally:
        K.configure_threads(0)
    np.testing.assert_allclose(got, K.score_blocks_ref(q, anchors, cand, False, False),
                               rtol=1e-4, atol=1e-4)


def test_q8_encoding_error_and_quest_bound():
    """Q8 rounds each channel to within half a step of its value (the step: the anchor's
    largest |channel| / 127); QUEST's pair rounds outward, so its bound still covers every key
    of the block, and scores from Q8 anchors stay close to scores from exact ones."""
    rng = np.random.default_rng(5)
    hkv, nb, bs, d, g = 2, 40, 32, 64, 4
    x = (rng.standard_normal((hkv, nb, 3, d)) * rng.lognormal(0, 1, (1, 1, 1, d))).astype(
        np.float32)  # channels of very different sizes, as real keys have
    q8 = K.q8_encode(x)
    step = np.abs(x).max(-1, keepdims=True) / 127
    assert np.all(np.abs(K.anchors_to_f64(q8) - x) <= 0.5001 * step)
    x.sort(axis=2)  # the reference's outward rounding: a min and a max
    lo_hi = K.anchors_to_f64(K.q8_encode(x[:, :, 1:], quest=True))
    assert np.all(lo_hi[:, :, 0] <= x[:, :, 1]) and np.all(lo_hi[:, :, 1] >= x[:, :, 2])
    k = K.f32_to_kv(rng.standard_normal((hkv, nb, bs, d)).astype(np.float32), 1)
    an = np.zeros((hkv, nb, 2, d + K.Q8_EXTRA), np.uint8)
    K.compute_anchors(k[:, :0], k, 0, 0, nb, "QUEST", 2, an, kv_kind=1)
    lo_hi = K.anchors_to_f64(an)  # [Hkv, nb, 2, d]
    keys = K.kv_to_f64(k, 1)  # [Hkv, nb, bs, d]
    assert np.all(lo_hi[:, :, :1] <= keys) and np.all(keys <= lo_hi[:, :, 1:])
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    cand = np.arange(nb, dtype=np.int32)
    bound = K.score_blocks(q, an, cand, True, False)  # [Hkv, nb]
    qk = np.einsum("jgc,jbtc->jgbt", q.reshape(hkv, g, d).astype(np.float64), keys)
    assert np.all(bound >= qk.max(-1).sum(1) - 1e-4)
    exact = K.score_blocks_ref(q, x, cand, False, False)
    np.testing.assert_allclose(K.score_blocks(q, q8, cand, False, False), exact,
                               atol=0.02 * np.abs(exact).max())


@pytest.mark.parametrize("k", [0, 1, 5, 19, 20, 30])
def test_topk_matches_reference(k):
    rng = np.random.default_rng(k)
    scores = np.round(rng.random((4, 20)) * 5).astype(np.float32)  # many ties
    cand = np.sort(rng.choice(1000, 20, replace=False)).astype(np.int32)
    got = K.topk_blocks(scores, cand, k)
    assert got.dtype == np.int32 and got.shape == (4, min(k, 20))
    np.testing.assert_array_equal(got, K.topk_blocks_ref(scores, cand, k))
    assert np.all(np.diff(got, axis=1) > 0)


@pytest.mark.parametrize("order", ["random", "ascending", "descending", "ties"])
@pytest.mark.parametrize("k", [1, 2, 96, 499])
def test_topk_heap_any_score_order(order, k):
    """The heap keeps the best k through any order of scores: ascending (every candidate
    replaces the root), descending (none does) and long runs of equal scores; candidates need
    not be sorted."""
    rng = np.random.default_rng(k)
    n = 500
    scores = {"random": rng.standard_normal((2, n)),
              "ascending": np.tile(np.arange(n, dtype=np.float64), (2, 1)),
              "descending": np.tile(np.arange(n, 0, -1, dtype=np.float64), (2, 1)),
              "ties": rng.integers(0, 3, (2, n))}[order].astype(np.float32)
    cand = rng.permutation(10 * n)[:n].astype(np.int32)
    got = K.topk_blocks(scores, cand, k)
    np.testing.assert_array_equal(got, K.topk_blocks_ref(scores, cand, k))


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("k", [0, 1, 7, 60, 61, 100])
@pytest.mark.parametrize("serial", [True, False])
def test_select_is_topk_of_scores(quest, shared, k, serial, monkeypatch):
    """select_blocks (scores, head sum and top-k in one call) picks what top-k of the
    reference scores picks; k >= the candidate count returns every candidate."""
    if not serial:
        monkeypatch.setattr(anchors_mod, "SERIAL_BYTES", 0)
    rng = np.random.default_rng(k + 200 * quest + 400 * shared)
    hkv, nb, d = 4, 80, 64
    f = rng.standard_normal((hkv, nb, 2 if quest else 1, d)).astype(np.float32)
    if quest:
        f.sort(axis=2)
    anchors = K.q8_encode(f, quest)
    q = rng.standard_normal((hkv * 4, d)).astype(np.float32)
    cand = np.sort(rng.choice(np.arange(1, nb), 61, replace=False)).astype(np.int32)
    got = K.select_blocks(q, anchors, cand, k, quest, shared)
    assert got.dtype == np.int32 and got.shape == (1 if shared else hkv, min(k, 61))
    ref_scores = K.score_blocks_ref(q, anchors, cand, quest, shared)
    want = K.topk_blocks_ref(ref_scores, cand, k)
    if 0 < k < 61:  # float32 sums may swap two near-equal scores at the k-th place
        kth = np.sort(ref_scores, axis=1)[:, -k][:, None]
        close = np.abs(ref_scores - kth) < 1e-4 * np.abs(ref_scores).max()
        for r in range(got.shape[0]):
            diff = set(got[r]) ^ set(want[r])
            assert diff <= set(cand[close[r]]), (r, diff)
    else:
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="out of range"):
        K.select_blocks(q, anchors, np.array([nb], np.int32), 1, quest, shared)


def test_cache_key_follows_every_kernel_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = Path(K.__file__).parent
    copy = tmp_path / "kernels"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = K.source_hash(copy)
    assert before == K.source_hash(src)
    helper = copy / "_simd.py"  # a helper module, not the file of any parallel kernel
    helper.write_text(helper.read_text() + "\n# changed\n")
    assert K.source_hash(copy) != before
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("KTLONG_HOME", str(tmp_path / "home"))
    assert K.cache_dir(copy) == tmp_path / "home" / "numba-cache" / K.source_hash(copy)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "nb"))
    assert K.cache_dir(copy).parent == tmp_path / "nb"


def test_threads_and_threading_layer():
    cores = numba.config.NUMBA_NUM_THREADS
    try:
        assert K.configure_threads(1) == 1
        assert numba.get_num_threads() == 1
        assert K.configure_threads(0) == cores
        assert numba.get_num_threads() == cores
    finally:
        K.configure_threads(0)
    q = np.ones((4, 16), np.float32)
    kv = np.zeros((1, 1, 16, 16), np.float32)
    K.attend_blocks(q, kv[:, :0], kv[:, :0], kv, kv, 0, np.zeros((1, 1), np.int32), 16, 1.0, 0)
    assert numba.threading_layer() in ("omp", "tbb", "workqueue")
