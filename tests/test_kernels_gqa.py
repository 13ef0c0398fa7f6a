"""Decode attention at GQA group sizes g (query heads per KV head) that are not a multiple of 4:
the kernels tile heads in 4s and take the last g % 4 heads in a smaller tile (no padded rows).
Against the float64 reference over every KV format, with and without turned reads (shifts), and
through select_attend (one decode step's scoring, top-k and attention in one call); g = 1, 4, 8
are in test_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from ktlong import kernels as K
from tests import test_kernels_step as step
from tests.test_kernels import KINDS, check_attend, check_turned, draw

GROUPS = (2, 3, 5, 6, 7)  # tails of 2, 3, 1, 2, 3 heads after 0 or 1 tiles of 4


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("g", GROUPS)
def test_attend_matches_reference(kind, g):
    rng = np.random.default_rng((kind, g))
    for trial, bs in enumerate((1, 16, 128, 16)):
        check_attend(draw(rng, g, bs, kind, shared=trial % 2 == 0))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("g", (1, 3, 6))
def test_turned_reads_match_reference(kind, g):
    """Blocks read with the query turned back by their shifts (runs of one shift, negative ones,
    zero) equal the float64 reference; all shifts 0 equal the plain read exactly."""
    rng = np.random.default_rng((kind, g, 1))
    for trial, bs in enumerate((16, 1, 128)):
        check_turned(rng, g, bs, kind, trial != 1)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("g", (2, 3, 5))
def test_select_attend_matches_select_then_attend(kind, g):
    rng = np.random.default_rng((kind, g, 2))
    for trial, bs in enumerate((16, 1, 128, 16)):
        step.check(step.draw(rng, g, bs, kind, "BF16", quest=trial == 3, shared=trial % 2 == 0))


@pytest.mark.parametrize("threads", [1, 2])
def test_splits_on_one_or_two_threads(threads):
    """SmolLM2's shape (3 KV heads, g = 3, d 64, BF16): every block, split into items as the
    thread count has it, equals the reference."""
    rng = np.random.default_rng(threads)
    kb, vb, kt, vt = (K.f32_to_kv(rng.standard_normal((3, n, 16, 64)).astype(np.float32), 1)
                      for n in (5, 5, 11, 11))
    q = rng.standard_normal((9, 64)).astype(np.float32)
    blocks = np.arange(16, dtype=np.int32)[None]
    K.configure_threads(threads)
    try:
        check_attend((q, kb, vb, kt, vt, 5, blocks, 16 * 16 - 5, 0.125, 1))
    finally:
        K.configure_threads(0)


def test_queries_are_packed_without_padding():
    """pack_rows: g rows a KV head, channels in packed order, times the scale."""
    from ktlong.kernels import attention

    q = np.arange(6 * 64, dtype=np.float32).reshape(6, 64)
    perm = attention.channel_perm(64, 1)
    qp = attention.pack_rows(q, 2, perm, np.float32(0.5))
    assert qp.shape == (2, 3, perm.size)
    np.testing.assert_array_equal(qp[1, 2, perm >= 0], 0.5 * q[5, perm[perm >= 0]])
