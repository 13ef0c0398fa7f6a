"""Sparse prefill kernels against their float64 NumPy references: each pattern's attention equals
dense attention restricted to its index; with budgets covering everything it equals dense
attention; the index builders on hand-made cases; the estimators (vertical/slash sums, pooled
keys)."""
from __future__ import annotations

import numpy as np
import pytest
from ktlong.kernels import prefill_index as pi
from ktlong.kernels import prefill_sparse as ps

from ktlong import kernels as K
from tests.test_kernels import KINDS


def layer(rng, hkv, n_tokens, bs, d, kind, nb_base):
    """A layer's K/V holding n_tokens (+ spare) split into base and tail, and its LayerKV."""
    nb = -(-n_tokens // bs) + 1
    nb_base = min(nb_base, n_tokens // bs)

    def seg(n):
        return K.f32_to_kv(rng.standard_normal((hkv, n, bs, d)).astype(np.float32), kind)
    kb, vb, kt, vt = seg(nb_base), seg(nb_base), seg(nb - nb_base), seg(nb - nb_base)
    return (kb, vb, kt, vt, nb_base), K.layer_kv(kb, vb, kt, vt, nb_base, kind)


def dense_ref(q, arrays, kind, q_start, scale):
    """Plain causal attention of q [Hq, L, d] at q_start.. over every key (float64)."""
    kb, vb, kt, vt, _ = arrays
    k = np.concatenate([K.kv_to_f64(kb, kind), K.kv_to_f64(kt, kind)], 1)
    v = np.concatenate([K.kv_to_f64(vb, kind), K.kv_to_f64(vt, kind)], 1)
    hkv, d = k.shape[0], k.shape[-1]
    k, v = k.reshape(hkv, -1, d), v.reshape(hkv, -1, d)
    hq, length, _ = q.shape
    g = hq // hkv
    out = np.zeros(q.shape)
    for h in range(hq):
        n = q_start + length
        s = scale * (q[h].astype(np.float64) @ k[h // g, :n].T)  # [L, n]
        s[np.arange(n)[None, :] > q_start + np.arange(length)[:, None]] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[h] = (p / p.sum(1, keepdims=True)) @ v[h // g, :n]
    return out


def problem(seed, kind, g=2, d=32, bs=16, q_start=200, length=150, hkv=2):
    rng = np.random.default_rng(seed)
    arrays, kv = layer(rng, hkv, q_start + length, bs, d, kind, nb_base=int(rng.integers(0, 8)))
    q = rng.standard_normal((hkv * g, length, d)).astype(np.float32)
    return rng, arrays, kv, q


def check_index(index, hq, nqb):
    """Ranges ascending and disjoint, columns ascending and outside every range."""
    for h in range(hq):
        for b in range(nqb):
            r = index.ranges[index.r_off[h, b]: index.r_off[h, b] + index.r_cnt[h, b]]
            assert np.all(r[:, 0] < r[:, 1])
            assert np.all(r[1:, 0] > r[:-1, 1])  # touching ranges are merged
            c = index.cols[index.c_off[h, b]: index.c_off[h, b] + index.c_cnt[h, b]]
            assert np.all(np.diff(c) > 0)
            for s, e in r:
                assert not np.any((c >= s) & (c < e))


def vs_parts(rng, hq, n_tokens, q_start, length, kv_n=12, ks_n=6, lone_cost=0):
    vert = np.stack([np.sort(rng.choice(n_tokens, kv_n, replace=False)) for _ in range(hq)])
    slash = np.stack([np.sort(np.r_[0, rng.choice(np.arange(1, n_tokens), ks_n - 1,
                                                  replace=False)]) for _ in range(hq)])
    vert, slash = vert.astype(np.int32), slash.astype(np.int32)
    return vert, slash, pi.vs_index(vert, slash, q_start, length, lone_cost)


def lone_vs(rng, hq, n_tokens, kv_n=40, ks_n=40):
    """Columns (some inside the band, some on the diagonals' keys) and offsets: the band 0..23
    (a range at lone cost 4) and scattered ones (each a lone diagonal)."""
    vert = np.stack([np.sort(rng.choice(n_tokens, kv_n, replace=False)) for _ in range(hq)])
    far = [np.sort(rng.choice(np.arange(28, n_tokens, 8), ks_n - 24, replace=False))
           for _ in range(hq)]
    slash = np.stack([np.r_[np.arange(24), f] for f in far])
    return vert.astype(np.int32), slash.astype(np.int32)


def bs_parts(rng, hq, q_start, length, k_b):
    nqb, nkb = pi.n_qblocks(length), -(-(q_start + length) // pi.QB)
    scores = rng.standard_normal((hq, nqb, nkb)).astype(np.float32)
    return scores, pi.block_index(scores, q_start, length, k_b)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("pattern", ["ashape", "vs", "vs-lone", "bs", "mixed"])
def test_pattern_equals_dense_restricted_to_its_index(kind, pattern):
    rng, arrays, kv, q = problem(10 * kind + len(pattern), kind)
    hq, length = q.shape[0], q.shape[1]
    q_start, nqb = 200, pi.n_qblocks(length)
    parts = {
        "ashape": pi.ashape_index(hq, q_start, length, 16, 70),
        "vs": vs_parts(rng, hq, q_start + length, q_start, length)[2],
        # scattered offsets and the band 0..9: lone diagonals, and a range with columns in it
        "vs-lone": pi.vs_index(*lone_vs(rng, hq, q_start + length), q_start, length, 4),
        "bs": bs_parts(rng, hq, q_start, length, 2)[1],
    }
    assert parts["vs-lone"][5].min() > 0  # every block has lone diagonals
    if pattern == "mixed":  # one head per pattern, as a tuned model has
        heads = [np.array([0]), np.array([1, 2]), np.array([3])]
        chosen = [parts["ashape"], parts["vs-lone"], parts["bs"]]
        chosen = [tuple(a[h] for a in p) for h, p in zip(heads, chosen, strict=True)]
        index = pi.pack_index(heads, chosen, hq, nqb)
    else:
        index = pi.pack_index([np.arange(hq)], [parts[pattern]], hq, nqb)
    check_index(index, hq, nqb)
    out = ps.sparse_attend(kv, q, q_start, index, 32 ** -0.5)
    ref = ps.sparse_attend_ref(q, *arrays[:4], arrays[4], kind, q_start, index, 32 ** -0.5)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=3e-5)
    dense = dense_ref(q, arrays, kind, q_start, 32 ** -0.5)
    assert np.abs(out - dense).max() > 1e-3  # the pattern did leave keys out


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_budgets_covering_everything_equal_dense(kind):
    rng, arrays, kv, q = problem(7 + kind, kind, g=3, d=64 if kind >= 3 else 48, q_start=130,
                                 length=100)
    hq, length = q.shape[0], q.shape[1]
    q_start, n = 130, 230
    nqb = pi.n_qblocks(length)
    dense = dense_ref(q, arrays, kind, q_start, 0.2)
    all_cols = np.broadcast_to(np.arange(n, dtype=np.int32), (hq, n)).copy()
    everything = [
        pi.dense_index(hq, q_start, length),
        pi.pack_index([np.arange(hq)], [pi.ashape_index(hq, q_start, length, 64, n)], hq, nqb),
        pi.pack_index([np.arange(hq)], [pi.vs_index(all_cols[:, :1], all_cols, q_start, length,
                                                    0)], hq, nqb),  # every diagonal, as ranges
        pi.pack_index([np.arange(hq)], [pi.vs_index(all_cols[:, :1], all_cols, q_start, length,
                                                    1)], hq, nqb),  # every diagonal, lone
        pi.pack_index([np.arange(hq)], [pi.vs_index(all_cols, all_cols[:, :1], q_start, length,
                                                    4)], hq, nqb),  # every column
        pi.pack_index([np.arange(hq)], [bs_parts(rng, hq, q_start, length, 99)[1]], hq, nqb),
    ]
    for index in everything:
        out = ps.sparse_attend(kv, q, q_start, index, 0.2)
        np.testing.assert_allclose(out, dense, rtol=1e-4, atol=3e-5)


def test_first_chunk_and_partial_blocks():
    """q_start 0 (the document's first chunk), a length that is not a multiple of QB."""
    rng, arrays, kv, q = problem(3, 1, q_start=0, length=97, g=4, d=64, hkv=1)
    out = ps.sparse_attend(kv, q, 0, pi.dense_index(4, 0, 97), 0.125)
    np.testing.assert_allclose(out, dense_ref(q, arrays, 1, 0, 0.125), rtol=1e-4, atol=3e-5)


def test_vs_index_hand_made():
    """Slash ranges merge where they touch; a vertical line inside a slash range is dropped,
    one outside every range becomes a column; lines after the block are left out."""
    q_start, length = 1000, 128  # blocks [1000, 1064) and [1064, 1128)
    vert = np.array([[3, 900, 950, 1063, 1100]], np.int32)
    slash = np.array([[0, 10, 50, 100, 1000]], np.int32)
    rg, rn, cl, cn, _, dn = pi.vs_index(vert, slash, q_start, length, 0)
    assert dn.max() == 0  # lone cost 0: every offset a range
    # block 0: offsets 0,10,50 -> [1000,1064), [990,1054), [950,1014) merge to [950, 1064);
    # 100 -> [900, 964) touches it: [900, 1064); 1000 -> [0, 64)
    assert rn[0, 0] == 2
    assert rg[0, 0, :2].tolist() == [[0, 64], [900, 1064]]
    assert cl[0, 0, : cn[0, 0]].tolist() == []  # 3 in [0, 64), 900..1063 in the band, 1100 after
    # block 1: [1064,1128) [1054,1118) [1014,1078) [964,1028) merge to [964, 1128); [64, 128)
    assert rg[0, 1, : rn[0, 1]].tolist() == [[64, 128], [964, 1128]]
    assert cl[0, 1, : cn[0, 1]].tolist() == [3, 900, 950]
    for b in range(2):
        index = pi.pack_index([np.array([0])], [(rg, rn, cl, cn)], 1, 2)
        np.testing.assert_array_equal(index.keys(0, b),
                                      pi.vs_index_ref(vert, slash, q_start, length, 0, b))


def test_vs_index_matches_reference_random():
    rng = np.random.default_rng(5)
    for _ in range(20):
        q_start, length = int(rng.integers(0, 600)), int(rng.integers(1, 300))
        n = q_start + length
        vert, slash, parts = vs_parts(rng, 3, n, q_start, length, min(n, 20), min(n, 9))
        index = pi.pack_index([np.arange(3)], [parts], 3, pi.n_qblocks(length))
        assert index.diags.size == 0
        check_index(index, 3, pi.n_qblocks(length))
        for h in range(3):
            for b in range(pi.n_qblocks(length)):
                want = pi.vs_index_ref(vert, slash, q_start, length, h, b)
                got = index.keys(h, b)
                np.testing.assert_array_equal(got, want)


def test_lone_diagonals_hand_made():
    """Runs of offsets at most lone_cost apart; a run stays a range when its width + QB keys a
    row cost no more than its offsets read alone."""
    slash = np.array([np.r_[np.arange(30), 40, 43, 200, 203, 206, 500]], np.int32)
    lone = pi.lone_diagonals(slash, 3)
    # 0..29: 93 <= 90? no: lone; with cost 4: 93 <= 120, a range. 40, 43: 67 > 6: lone
    assert lone[0].all()
    lone = pi.lone_diagonals(slash, 4)
    assert not lone[0, :30].any() and lone[0, 30:].all()
    assert not pi.lone_diagonals(slash, 0).any()
    assert not pi.lone_diagonals(np.arange(100, dtype=np.int32)[None], 2).any()


def test_vs_index_lone_rows():
    """With lone diagonals each row reads every key of its columns and diagonals, and nothing
    outside the widened (all-range) index's block."""
    rng = np.random.default_rng(11)
    for _ in range(10):
        q_start, length = int(rng.integers(0, 700)), int(rng.integers(1, 300))
        n = q_start + length
        vert, slash = lone_vs(rng, 2, n, min(n, 30), min(n, 60)) if n > 500 else \
            vs_parts(rng, 2, n, q_start, length, min(n, 20), min(n, 9))[:2]
        nqb = pi.n_qblocks(length)
        index = pi.pack_index([np.arange(2)], [pi.vs_index(vert, slash, q_start, length, 4)],
                              2, nqb)
        check_index(index, 2, nqb)
        for h in range(2):
            for b in range(nqb):
                wide = pi.vs_index_ref(vert, slash, q_start, length, h, b)
                for i in range(b * pi.QB, min(length, (b + 1) * pi.QB)):
                    pos = q_start + i
                    got = index.row_keys(h, b, pos)
                    assert np.isin(pi.vs_row_ref(vert, slash, h, pos), got).all()
                    assert np.isin(got, wide[wide <= pos]).all()


def test_index_pairs():
    """Tiled pairs: rows x keys up to the block's last query; lone: rows x diagonals."""
    q_start, length = 1000, 100  # blocks of 64 and 36 rows
    index = pi.dense_index(2, q_start, length)
    tiled, lone, dense = pi.index_pairs(index, q_start, length)
    assert (tiled, lone) == (2 * (64 * 1064 + 36 * 1100), 0)
    assert dense == 2 * sum(q_start + i + 1 for i in range(length))
    vert = np.array([[5, 900]], np.int32)
    slash = np.array([np.r_[np.arange(64), 300, 700]], np.int32)
    parts = pi.vs_index(vert, slash, q_start, length, 4)
    index = pi.pack_index([np.array([0])], [parts], 1, 2)
    tiled, lone, _ = pi.index_pairs(index, q_start, length)
    assert lone == 2 * 64 + 2 * 36
    # ranges [q0 - 63, q1): 127 and 99 keys; columns 5 and 900 outside them
    assert tiled == 64 * (127 + 2) + 36 * (99 + 2)


def test_block_index_hand_made():
    """Block 0 and the diagonal blocks always; the k_b best earlier blocks; adjacent merge."""
    q_start, length = 320, 64  # one query block [320, 384) = key block 5
    scores = np.zeros((1, 1, 6), np.float32)
    scores[0, 0, [2, 3]] = 5.0  # blocks 2 and 3 win
    scores[0, 0, 5] = -9.0  # the diagonal block is kept whatever its score
    rg, rn, _, cn = pi.block_index(scores, q_start, length, 2)
    assert rg[0, 0, : rn[0, 0]].tolist() == [[0, 64], [128, 256], [320, 384]]
    assert cn[0, 0] == 0
    rg, rn, _, _ = pi.block_index(scores, q_start, length, 0)
    assert rg[0, 0, : rn[0, 0]].tolist() == [[0, 64], [320, 384]]


def test_ashape_index():
    rg, rn, _, _ = pi.ashape_index(1, 1000, 128, 64, 256)
    assert rg[0, 0, : rn[0, 0]].tolist() == [[0, 64], [744, 1064]]
    assert rg[0, 1, : rn[0, 1]].tolist() == [[0, 64], [808, 1128]]
    rg, rn, _, _ = pi.ashape_index(1, 100, 50, 64, 256)  # window reaches the sinks: one range
    assert rg[0, 0, : rn[0, 0]].tolist() == [[0, 150]]


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_vs_estimate_matches_reference(kind):
    rng, arrays, kv, q = problem(20 + kind, kind, q_start=300, length=90)
    n, qw = 390, q[:, -64:]
    heads = np.array([0, 1, 2, 3]) // 2
    vert, slash = ps.vs_estimate(kv, qw, heads, n, 0.3)
    vr, sr = ps.vs_estimate_ref(qw, heads, *arrays[:1], arrays[2], arrays[4], kind, n, 0.3)
    assert vert.shape == slash.shape == (4, n)
    np.testing.assert_allclose(vert, vr, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(slash, sr, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(vert.sum(1), 64, rtol=1e-4)  # each query's softmax sums to 1


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_pool_keys_matches_reference(kind):
    rng, arrays, kv, q = problem(30 + kind, kind, q_start=300, length=90)
    n = 390
    got = ps.pool_keys(kv, 1, 7, n)  # block 6 is partial (384..389)
    ref = ps.pool_keys_ref(arrays[0], arrays[2], kind, 1, 7, n)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_bad_index_is_refused():
    _, _, kv, q = problem(1, 0)
    index = pi.dense_index(4, 200, 150)
    with pytest.raises(ValueError, match="index is for"):
        ps.sparse_attend(kv, q[:, :64], 200, index, 0.1)
    bad = index._replace(ranges=index.ranges + 10_000)
    with pytest.raises(ValueError, match="out of range"):
        ps.sparse_attend(kv, q, 200, bad, 0.1)


def test_index_positions():
    rng = np.random.default_rng(9)
    _, _, parts = vs_parts(rng, 3, 400, 250, 150)
    index = pi.pack_index([np.arange(3)], [parts], 3, 3)
    for h in range(3):
        pos, cnt = pi.index_positions(index, h)
        for b in range(3):
            np.testing.assert_array_equal(np.sort(pos[b, : cnt[b]]), index.keys(h, b))
