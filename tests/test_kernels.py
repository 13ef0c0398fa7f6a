"""Attention kernels against their float64 NumPy references: attend_blocks, merge_partials,
query_votes. Shapes, GQA ratios, block sizes, partial last blocks, SHARED / SEPARATE, base / tail
splits (nb_base 0 included) and every KV format are drawn from seeded generators."""
from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from ktlong import kernels as K

KINDS = {"FP32": 0, "BF16": 1, "FP16": 2, "Q8_0": 3, "Q4_0": 4}
HEAD_DIMS = (16, 48, 64, 128)  # 48: a partial last channel group
QUANT_HEAD_DIMS = (32, 64, 96, 128)  # Q8_0 / Q4_0: whole blocks of 32


def head_dims(kind: int) -> tuple[int, ...]:
    """head_dims a KV format takes."""
    return QUANT_HEAD_DIMS if kind >= 3 else HEAD_DIMS


def store(rng, hkv, nb_base, nb_tail, bs, d, kind, scale=1.0):
    """Random K, V split into base [Hkv, nb_base, bs, d] and tail segments (storage dtype)."""
    def seg(nb):
        return K.f32_to_kv(scale * rng.standard_normal((hkv, nb, bs, d)).astype(np.float32), kind)
    return seg(nb_base), seg(nb_base), seg(nb_tail), seg(nb_tail)


def draw(rng, g, bs, kind, shared):
    """One random attention problem: (args for attend_blocks, n_blocks)."""
    hkv = int(rng.integers(1, 4))
    d = int(rng.choice(head_dims(kind)))
    nb = int(rng.integers(1, max(2, 400 // bs) + 1))
    n_tokens = int(rng.integers((nb - 1) * bs + 1, nb * bs + 1))  # last block often partial
    nb_base = int(rng.integers(0, nb))  # 0: everything in the tail
    kb, vb, kt, vt = store(rng, hkv, nb_base, nb - nb_base + int(rng.integers(0, 3)), bs, d, kind)
    n_sel = int(rng.integers(1, nb + 1))
    rows = 1 if shared else hkv
    blocks = np.stack([np.sort(rng.choice(nb, n_sel, replace=False)) for _ in range(rows)])
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    return (q, kb, vb, kt, vt, nb_base, blocks.astype(np.int32), n_tokens, d ** -0.5, kind)


def check_attend(args):
    out, lse = K.attend_blocks(*args)
    ref_out, ref_lse = K.attend_blocks_ref(*args)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_attend_matches_reference(kind, g, bs):
    rng = np.random.default_rng(100 * kind + 10 * g + bs)
    for trial in range(4):
        check_attend(draw(rng, g, bs, kind, shared=trial % 2 == 0))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_attend_large_scores_and_odd_group(kind):
    """Scores of several hundred (the max must be subtracted) and g = 7 (Qwen2-7B's ratio)."""
    rng = np.random.default_rng(kind)
    hkv, g, bs, d, nb = 2, 7, 16, 128, 9
    kb, vb, kt, vt = store(rng, hkv, 4, 5, bs, d, kind, scale=3.0)
    q = 10 * rng.standard_normal((hkv * g, d)).astype(np.float32)
    blocks = np.array([[0, 2, 5, 8], [1, 3, 4, 8]], np.int32)
    check_attend((q, kb, vb, kt, vt, 4, blocks, nb * bs - 3, d ** -0.5, kind))


def test_attend_empty_selection():
    rng = np.random.default_rng(1)
    kb, vb, kt, vt = store(rng, 2, 0, 3, 16, 64, 1)
    out, lse = K.attend_blocks(rng.standard_normal((8, 64)).astype(np.float32), kb, vb, kt, vt, 0,
                               np.zeros((1, 0), np.int32), 40, 0.125, 1)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_storage_rounding_is_within_dtype_precision():
    """BF16 / FP16 storage versus the same attention on the unrounded float32 values."""
    rng = np.random.default_rng(2)
    hkv, g, bs, d, nb = 2, 4, 16, 64, 6
    k, v = (rng.standard_normal((hkv, nb, bs, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    blocks = np.arange(nb, dtype=np.int32)[None]
    empty = np.zeros((hkv, 0, bs, d), np.float32)
    exact, _ = K.attend_blocks_ref(q, empty, empty, k, v, 0, blocks, nb * bs, d ** -0.5, 0)
    for kind, tol in ((1, 2e-2), (2, 2e-3)):
        e16 = np.zeros((hkv, 0, bs, d), np.uint16)
        kk, vv = K.f32_to_kv(k, kind), K.f32_to_kv(v, kind)
        out, _ = K.attend_blocks(q, e16, e16, kk, vv, 0, blocks, nb * bs, d ** -0.5, kind)
        np.testing.assert_allclose(out, exact, atol=tol)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_union_equals_merge_of_parts(kind):
    """Attending blocks A u B equals merge_partials of A and B (also with an empty part)."""
    rng = np.random.default_rng(3 + kind)
    q, kb, vb, kt, vt, nb_base, _, n_tokens, scale, _ = draw(rng, 4, 16, kind, shared=True)
    nb = -(-n_tokens // 16)
    ids = rng.permutation(nb)
    cut = int(rng.integers(0, nb + 1))
    a, b = np.sort(ids[:cut])[None].astype(np.int32), np.sort(ids[cut:])[None].astype(np.int32)
    whole = K.attend_blocks(q, kb, vb, kt, vt, nb_base, np.sort(ids)[None].astype(np.int32),
                            n_tokens, scale, kind)
    pa = K.attend_blocks(q, kb, vb, kt, vt, nb_base, a, n_tokens, scale, kind)
    pb = K.attend_blocks(q, kb, vb, kt, vt, nb_base, b, n_tokens, scale, kind)
    out, lse = K.merge_partials(*pa, *pb)
    np.testing.assert_allclose(out, whole[0], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-5, atol=1e-4)
    ref_out, ref_lse = K.merge_partials_ref(*pa, *pb)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_merge_with_empty_parts():
    out = np.ones((3, 8), np.float32)
    lse = np.array([0.5, -np.inf, -np.inf], np.float32)
    other = (2 * np.ones((3, 8), np.float32), np.array([-np.inf, 1.0, -np.inf], np.float32))
    m_out, m_lse = K.merge_partials(out, lse, *other)
    np.testing.assert_array_equal(m_out, [[1] * 8, [2] * 8, [0] * 8])
    np.testing.assert_array_equal(m_lse, [0.5, 1.0, -np.inf])


def check_concurrent(fn, args):
    """fn(*a) for each a in args, each from its own Python thread, 20 times at once (the
    GPU-overlap pattern), returns exactly what one call alone returns."""
    want = [fn(*a) for a in args]
    got = [None] * len(args)

    def run(i):
        for _ in range(20):
            got[i] = fn(*args[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            np.testing.assert_array_equal(a, b)


def test_concurrent_launches_from_two_threads():
    rng = np.random.default_rng(4)
    check_concurrent(K.attend_blocks, [draw(rng, 4, 16, 1, shared=True) for _ in range(2)])


def test_memory_mapped_base_uses_the_same_compiled_kernel(tmp_path):
    """A read-only memory-mapped base (a prompt-cache hit) and RAM arrays: same result, and no
    second compilation (every input the kernels only read is passed read-only)."""
    from ktlong.kernels import attention

    rng = np.random.default_rng(6)
    q, kb, vb, kt, vt, nb_base, blocks, n_tokens, scale, kind = draw(rng, 4, 16, 1, True)
    want = K.attend_blocks(q, kb, vb, kt, vt, nb_base, blocks, n_tokens, scale, kind)
    before = set(attention._attend.signatures)
    kb.tofile(tmp_path / "k")
    vb.tofile(tmp_path / "v")
    km, vm = (np.memmap(tmp_path / n, np.uint16, "r", shape=kb.shape) for n in "kv")
    got = K.attend_blocks(q, km, vm, kt, vt, nb_base, blocks, n_tokens, scale, kind)
    np.testing.assert_array_equal(got[0], want[0])
    assert set(attention._attend.signatures) == before


def test_a_kv_type_compiles_its_own_code_only():
    """Each KV format compiles a kernel signature of its own, and only when it is used: a cold
    start with BF16 KV compiles no FP16, Q8_0 or Q4_0 code (every format in one signature cost a
    fresh install minutes of compiling)."""
    code = ("import numpy as np; from ktlong import kernels as K; "
            "from ktlong.kernels import attention; "
            "from ktlong.kernels._simd import kv_view; "
            "rng = np.random.default_rng(0); "
            "k = rng.integers(0, 1 << 14, (1, 2, 16, 64), dtype=np.uint16); "
            "q = rng.standard_normal((2, 64), dtype=np.float32); "
            "K.attend_blocks(q, k[:, :0], k[:, :0], k, k, 0, np.array([[0, 1]], np.int32), 32, "
            "0.125, 1); "
            "print(sorted({str(s[1].dtype) for s in attention._attend.signatures}), "
            "kv_view('k', np.zeros((1, 1, 1, 68), np.uint8), 3).dtype)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['uint16']", "int32"]


def test_attend_rejects_bad_input():
    rng = np.random.default_rng(5)
    q, kb, vb, kt, vt, nb_base, blocks, n_tokens, scale, kind = draw(rng, 4, 16, 1, True)
    with pytest.raises(ValueError, match="out of range"):
        K.attend_blocks(q, kb, vb, kt, vt, nb_base, blocks + 1000, n_tokens, scale, kind)
    with pytest.raises(ValueError, match="2-byte"):
        K.attend_blocks(q, kb, vb, kt.astype(np.float32), vt, nb_base, blocks, n_tokens, scale,
                        kind)


def rope_freqs(rng, d):
    """RoPE frequencies [h] over all d channels or a part of them (partial rotary)."""
    h = int(rng.choice([d // 2, d // 4])) if d % 8 == 0 else d // 2
    return 1.0 / 10000.0 ** (np.arange(h) / h)


def check_turned(rng, g, bs, kind, shared):
    """One drawn read with the query turned back by each block's shift (runs of equal shifts,
    negative ones, zero) against the float64 reference; all shifts 0 equal the plain read."""
    q, kb, vb, kt, vt, nb_base, blocks, n_tokens, scale, _ = draw(rng, g, bs, kind, shared)
    inv = rope_freqs(rng, q.shape[1])
    shifts = rng.integers(-6, 50, blocks.shape).astype(np.int32)
    shifts[:, 1::3] = shifts[:, ::3][:, :shifts[:, 1::3].shape[1]]  # runs of one shift
    shifts[:, -1] = 0
    turns = K.rope_turns(inv, bs, 50, q.shape[1], kind)
    kv = K.layer_kv(kb, vb, kt, vt, nb_base, kind)
    out, lse = K.attend_layer(kv, q, blocks, n_tokens, scale, shifts, turns)
    ref_out, ref_lse = K.attend_blocks_ref(q, kb, vb, kt, vt, nb_base, blocks, n_tokens,
                                           scale, kind, shifts, inv)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=3e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=2e-4)
    plain = K.attend_layer(kv, q, blocks, n_tokens, scale)
    zero = K.attend_layer(kv, q, blocks, n_tokens, scale, np.zeros_like(shifts), turns)
    np.testing.assert_array_equal(zero[0], plain[0])  # shift 0: the query as it is


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_turned_reads_match_reference(kind, bs):
    """Each block read with the query turned back by its shift equals the float64 reference,
    over partial rotary and every KV format."""
    rng = np.random.default_rng(7 * kind + bs)
    for trial in range(3):
        check_turned(rng, 4, bs, kind, trial != 1)


def test_a_turned_read_equals_the_keys_at_their_new_positions():
    """RoPE: keys rotated at position p and read with shift t score as the same keys rotated at
    p + t * bs (the reads move blocks, not the query's own position)."""
    rng = np.random.default_rng(11)
    hkv, g, bs, d, nb = 2, 3, 8, 32, 10
    inv = 1.0 / 10000.0 ** (np.arange(d // 2) / (d // 2))
    raw_k = rng.standard_normal((hkv, nb * bs, d))
    v = rng.standard_normal((hkv, nb * bs, d)).astype(np.float32)

    def rotated(pos):  # [Hkv, n, d] keys rotated at positions pos [n]
        return np.stack([np.stack([K.turned_ref(raw_k[j, i], inv, int(p))
                                   for i, p in enumerate(pos)]) for j in range(hkv)])

    def layer(k):
        kt = k.astype(np.float32).reshape(hkv, nb, bs, d)
        return K.layer_kv(kt[:, :0], v.reshape(kt.shape)[:, :0], kt, v.reshape(kt.shape), 0, 0)

    q = rng.standard_normal((hkv * g, d)).astype(np.float32)
    here = np.arange(nb * bs)
    blocks, shifts = np.array([[1, 2, 5, 9]], np.int32), np.array([[4, 4, 2, 0]], np.int32)
    moved = here.copy()
    for b, t in zip(blocks[0], shifts[0], strict=True):
        moved[b * bs:(b + 1) * bs] += t * bs
    got = K.attend_layer(layer(rotated(here)), q, blocks, nb * bs, d ** -0.5, shifts,
                         K.rope_turns(inv, bs, 8, d, 0))
    want = K.attend_layer(layer(rotated(moved)), q, blocks, nb * bs, d ** -0.5)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)


def test_turned_reads_reject_bad_shifts():
    rng = np.random.default_rng(12)
    q, kb, vb, kt, vt, nb_base, blocks, n_tokens, scale, kind = draw(rng, 4, 16, 1, True)
    kv = K.layer_kv(kb, vb, kt, vt, nb_base, kind)
    turns = K.rope_turns(rope_freqs(rng, q.shape[1]), 16, 3, q.shape[1], kind)
    with pytest.raises(ValueError, match="shaped as blocks"):
        K.attend_layer(kv, q, blocks, n_tokens, scale, np.zeros((1, 99), np.int32), turns)
    with pytest.raises(ValueError, match="reach of 3"):
        K.attend_layer(kv, q, blocks, n_tokens, scale, np.full(blocks.shape, 4, np.int32), turns)
    with pytest.raises(ValueError, match="turns"):
        K.attend_layer(kv, q, blocks, n_tokens, scale, np.zeros(blocks.shape, np.int32))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("bs", [1, 16, 128])
def test_query_votes_match_reference(kind, bs):
    rng = np.random.default_rng(10 * kind + bs)
    for g, w in ((1, 1), (4, 5), (8, 3)):
        hkv, d = int(rng.integers(1, 3)), int(rng.choice(head_dims(kind)))
        nb = int(rng.integers(1, max(2, 300 // bs) + 1))
        n_tokens = int(rng.integers(max(w, (nb - 1) * bs + 1), nb * bs + 1))
        nb_base = int(rng.integers(0, nb))
        kb, _, kt, _ = store(rng, hkv, nb_base, nb - nb_base, bs, d, kind)
        qw = rng.standard_normal((hkv * g, w, d)).astype(np.float32)
        votes = K.query_votes(qw, kb, kt, nb_base, n_tokens, d ** -0.5, kind)
        ref = K.query_votes_ref(qw, kb, kt, nb_base, n_tokens, d ** -0.5, kind)
        assert votes.shape == (hkv, n_tokens) and votes.dtype == np.float32
        np.testing.assert_allclose(votes, ref, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(votes.sum(1), g * w, rtol=1e-4)  # each query's weights sum to 1


def test_turn_blocks_turns_each_block_by_its_own_angle():
    rng = np.random.default_rng(7)
    k = rng.standard_normal((2, 5, 4, 12)).astype(np.float32)  # [Hkv, c, bs, d], rot 8 of 12
    ang = rng.uniform(-3, 3, (5, 4))  # [c, h]
    got = k.copy()
    K.turn_blocks(got, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32))
    want = k.astype(np.float64).copy()
    for i in range(5):  # rotate_half: channel f pairs with f + 4
        c, s = np.cos(ang[i]), np.sin(ang[i])
        x1, x2 = k[:, i, :, :4].astype(np.float64), k[:, i, :, 4:8].astype(np.float64)
        want[:, i, :, :4], want[:, i, :, 4:8] = x1 * c - x2 * s, x2 * c + x1 * s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[..., 8:], k[..., 8:])  # past the rotary channels


def test_block_lse_is_each_blocks_log_sum_exp():
    rng = np.random.default_rng(8)
    sc = (rng.standard_normal((3, 6, 40)) * 20).astype(np.float32)  # [Hkv, R, n], 5 blocks of 8
    got = K.block_lse(sc, 8)  # [5, Hkv, R]
    want = np.logaddexp.reduce(sc.astype(np.float64).reshape(3, 6, 5, 8), axis=-1)
    np.testing.assert_allclose(got, want.transpose(2, 0, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hq,hkv,n,d",
                         [(9, 3, 127, 64), (4, 1, 5, 16), (8, 8, 1, 32), (4, 2, 0, 8)])
def test_attend_merge_matches_reference(hq, hkv, n, d):
    """Attention over a few more keys merged into a partial result, against float64 NumPy."""
    rng = np.random.default_rng(n + d)
    q = rng.standard_normal((hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((hkv, n, d)).astype(np.float32) for _ in range(2))
    out = rng.standard_normal((hq, d)).astype(np.float32)
    lse = rng.standard_normal(hq).astype(np.float32)
    lse[0] = -np.inf  # a head whose other part read nothing
    got_o, got_l = out.copy(), lse.copy()
    K.attend_merge(q, k, v, 0.3, got_o, got_l)
    if n == 0:  # no keys: unchanged
        np.testing.assert_array_equal(got_o, out)
        np.testing.assert_array_equal(got_l, lse)
        return
    g = hq // hkv
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), np.repeat(k, g, 0).astype(np.float64)) * 0.3
    l2 = np.logaddexp.reduce(s, axis=1)
    o2 = np.einsum("hn,hnd->hd", np.exp(s - l2[:, None]), np.repeat(v, g, 0).astype(np.float64))
    want_o, want_l = K.merge_partials_ref(out.astype(np.float64), lse.astype(np.float64), o2, l2)
    np.testing.assert_allclose(got_o, want_o, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(got_l, want_l, atol=2e-6, rtol=1e-6)
