"""Anchor, scoring and top-k kernels against their NumPy references; kernel setup (compiled-cache
key, threads)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numba
import numpy as np
import pytest

from ktlong import kernels as K

KINDS = {"FP32": 0, "BF16": 1, "FP16": 2}
TYPES = ("MAX", "MEAN", "QUEST", "FIX", "DYNAMIC")


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("anchor_type", TYPES)
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_anchors_match_reference(kind, anchor_type, bs):
    """float32 anchors equal the reference; BF16 anchors (uint16) equal it to bf16 rounding."""
    rng = np.random.default_rng(100 * TYPES.index(anchor_type) + 10 * kind + bs)
    nums = [2] if anchor_type == "QUEST" else [n for n in (1, 3, 4) if n <= bs]
    for num in nums:
        hkv, d = int(rng.integers(1, 4)), int(rng.choice([16, 48, 128]))
        nb = int(rng.integers(2, max(3, 300 // bs) + 1))
        nb_base = int(rng.integers(0, nb))
        k = K.f32_to_kv(rng.standard_normal((hkv, nb, bs, d)).astype(np.float32), kind)
        kb, kt = k[:, :nb_base].copy(), k[:, nb_base:].copy()
        # coarse scores make ties: the earliest token must win
        scores = np.round(rng.random((hkv, nb * bs)) * 4).astype(np.float32)
        first, last = int(rng.integers(0, nb)), nb
        for dtype in (np.float32, np.uint16):
            got = np.full((hkv, nb + 2, num, d), 7, dtype)  # spare capacity stays untouched
            want = got.copy()
            K.compute_anchors(kb, kt, nb_base, first, last, anchor_type, num, got, scores,
                              kv_kind=kind)
            K.compute_anchors_ref(kb, kt, nb_base, first, last, anchor_type, num, want, scores,
                                  kv_kind=kind)
            if dtype == np.float32:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            else:  # a mean summed in float32 may round to the neighbouring bf16 value
                np.testing.assert_allclose(K.kv_to_f64(got, 1), K.kv_to_f64(want, 1), rtol=8e-3,
                                           atol=1e-6)


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
@pytest.mark.parametrize("bf16", [False, True])
def test_scores_match_reference(quest, shared, g, bf16):
    rng = np.random.default_rng(int(quest) + 2 * int(shared) + 4 * g + 40 * int(bf16))
    hkv, d, nb = 3, 64, 50
    num = 2 if quest else int(rng.integers(1, 4))
    anchors = rng.standard_normal((hkv, nb, num, d)).astype(np.float32)
    if quest:
        anchors.sort(axis=2)  # [..., 0] min, [..., 1] max
    if bf16:
        anchors = K.f32_to_kv(anchors, 1)
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    cand = np.sort(rng.choice(nb, 20, replace=False)).astype(np.int32)
    got = K.score_blocks(q, anchors, cand, quest, shared)
    want = K.score_blocks_ref(q, anchors, cand, quest, shared)
    assert got.shape == (1 if shared else hkv, 20) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_cand", [1, 2, 3, 4, 5, 7, 45, 299])
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_any_candidate_count(n_cand, threads):
    """Blocks are scored four at a time: counts (and per-thread parts) that are not a multiple
    of 4 score their last 1-3 blocks alone; parts longer than the prefetch distance prefetch."""
    rng = np.random.default_rng(n_cand)
    anchors = K.f32_to_kv(rng.standard_normal((2, 300, 1, 128)).astype(np.float32), 1)
    q = rng.standard_normal((8, 128)).astype(np.float32)
    cand = np.sort(rng.choice(300, n_cand, replace=False)).astype(np.int32)
    K.configure_threads(threads)
    try:
        got = K.score_blocks(q, anchors, cand, False, False)
    finally:
        K.configure_threads(0)
    np.testing.assert_allclose(got, K.score_blocks_ref(q, anchors, cand, False, False),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [0, 1, 5, 19, 20, 30])
def test_topk_matches_reference(k):
    rng = np.random.default_rng(k)
    scores = np.round(rng.random((4, 20)) * 5).astype(np.float32)  # many ties
    cand = np.sort(rng.choice(1000, 20, replace=False)).astype(np.int32)
    got = K.topk_blocks(scores, cand, k)
    assert got.dtype == np.int32 and got.shape == (4, min(k, 20))
    np.testing.assert_array_equal(got, K.topk_blocks_ref(scores, cand, k))
    assert np.all(np.diff(got, axis=1) > 0)


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
