"""MInference prefill through the engine: what a sparse prefill changes in the KV store (layer 0's
K, V cannot change: they come before any attention; later layers' do), that budgets covering
everything make it exact, the torch path against the kernel, pattern files and cache keys."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ktlong.kernels import prefill_index as pi
from ktlong.kernels import prefill_sparse as ps

from ktlong import minference as mi
from ktlong.engine import Session
from ktlong.errors import KtlongError
from ktlong.model import load_model
from ktlong.promptcache import content_key
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

N = 700  # 3 chunks of 256: the second and third are sparse


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), "CPU")


def _ids(lm, n=N):
    return lm.tokenizer(filler_text(n, seed=3))["input_ids"][:n]


def _session(lm, **kw):
    sess = Session(lm, settings(**kw))
    if sess.router.chunk_attention is not None:
        sess.router.chunk_attention.dense_below = 256  # sparse from the second chunk on
    return sess


def _kv(sess, layer):
    return [t.numpy() for t in sess.store.token_range(layer, 0, N)]


def test_sparse_prefill_keeps_layer0_kv_and_changes_later_layers(lm):
    ids = _ids(lm)
    dense = _session(lm, prefill="DENSE")
    dense.prefill(ids)
    sparse = _session(lm, prefill="MINFERENCE", prefill_vertical=8, prefill_slash=40)
    sparse.prefill(ids)
    for a, b in zip(_kv(dense, 0), _kv(sparse, 0), strict=True):
        np.testing.assert_array_equal(a, b)  # K, V of layer 0 come before any attention
    k1d, k1s = _kv(dense, 1)[0], _kv(sparse, 1)[0]
    np.testing.assert_allclose(k1d[:, :256], k1s[:, :256], atol=1e-5)  # the dense first chunk
    assert np.abs(k1d[:, 256:] - k1s[:, 256:]).max() > 1e-3  # layer 0's attention was sparse
    assert dense.router.attn_s > 0 and sparse.router.attn_s > 0


def test_budgets_covering_everything_prefill_exactly(lm):
    ids = _ids(lm)
    dense = _session(lm, prefill="DENSE")
    ld = dense.prefill(ids)
    full = _session(lm, prefill="MINFERENCE", prefill_vertical=N, prefill_slash=N)
    lf = full.prefill(ids)
    for layer in range(2):
        for a, b in zip(_kv(dense, layer), _kv(full, layer), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5)
    torch.testing.assert_close(lf, ld, atol=1e-4, rtol=1e-4)


def test_auto_reads_through_the_patterns_within_the_windows_reach_and_the_window_past_it(lm):
    """prefill AUTO: a prompt within its reach (the model's trained context) goes through the
    patterns, bit for bit as MINFERENCE; a longer one through the window, as WINDOW. The cache
    key names both."""
    ids = _ids(lm)
    pat = dict(prefill_vertical=8, prefill_slash=40, init_len=16, prefill_window=300)
    kv = {}
    for reach, twin in ((N, "MINFERENCE"), (N - 1, "WINDOW")):
        auto = _session(lm, prefill="AUTO", **pat)
        auto.router.auto_reach = reach  # as if the model were trained on `reach` tokens
        ref = _session(lm, prefill=twin, **pat)
        la, lr = auto.prefill(ids), ref.prefill(ids)
        assert auto.router.patterns == (twin == "MINFERENCE")
        for layer in range(2):
            for a, b in zip(_kv(auto, layer), _kv(ref, layer), strict=True):
                np.testing.assert_array_equal(a, b)
        torch.testing.assert_close(la, lr, atol=0, rtol=0)
        kv[twin] = _kv(auto, 1)[0]
    assert np.abs(kv["MINFERENCE"][:, 512:] - kv["WINDOW"][:, 512:]).max() > 1e-3  # they differ
    keys = [content_key(lm.spec, settings(**{**pat, **kw})) for kw in (
        dict(prefill="AUTO"), dict(prefill="AUTO", prefill_window=400),
        dict(prefill="AUTO", prefill_slash=41), dict(prefill="WINDOW"), dict(prefill="MINFERENCE"))]
    assert len({str(sorted(k.items())) for k in keys}) == len(keys)


def test_auto_reach_is_the_trained_context_and_a_sixteenth():
    st = settings(prefill="AUTO", init_len=128, prefill_window=6016)
    spec = SimpleNamespace(max_positions=8192, rope_scaling=None)
    assert mi.auto_reach(spec, st) == 8192 + 512  # past the window's 6,144
    assert mi.auto_reach(SimpleNamespace(max_positions=0), st) == 6144  # unknown: the window's
    wide = settings(prefill="AUTO", init_len=128, prefill_window=16384)
    assert mi.auto_reach(SimpleNamespace(max_positions=4096, rope_scaling=None), wide) == 16512
    assert mi.auto_reach(SimpleNamespace(max_positions=0), settings(prefill_window=0)) == 0


def test_mixed_plan_file_runs_and_is_keyed(lm, tmp_path):
    spec = lm.spec
    rows = [("ashape 16 64", "vs 8 40", "block 2", "vs 4 16")] * spec.n_layers
    plan = mi.Plan(tuple(tuple(mi.parse_head(t, "test") for t in r) for r in rows), "test")
    path = tmp_path / "p.yaml"
    mi.write_plan(path, spec, plan, "test plan")
    assert mi.read_plan(path, spec) == mi.Plan(plan.layers, str(path))
    sess = _session(lm, prefill="MINFERENCE", prefill_patterns=str(path))
    assert sess.router.chunk_attention.plan.layers == plan.layers
    sess.prefill(_ids(lm))
    assert sess.router.chunk_attention.attend_s > 0
    s_plan = settings(prefill="MINFERENCE", prefill_patterns=str(path))
    s_vs = settings(prefill="MINFERENCE")
    keys = {
        "dense": content_key(spec, settings(prefill="DENSE")),
        "window0": content_key(spec, settings(prefill="WINDOW", prefill_window=0)),
        "window": content_key(spec, settings(prefill="WINDOW", prefill_window=256)),
        "plan": content_key(spec, s_plan),
        "vs": content_key(spec, s_vs),
        "vs2": content_key(spec, settings(prefill="MINFERENCE", prefill_slash=99)),
    }
    assert keys["dense"] == keys["window0"]  # exact either way: older entries stay valid
    assert len({str(sorted(k.items())) for k in keys.values()}) == 5
    assert keys["plan"]["prefill"] == "MINFERENCE"


def test_plan_file_errors(lm, tmp_path):
    spec = lm.spec
    plan = mi.default_plan(spec, settings())
    path = tmp_path / "p.yaml"
    mi.write_plan(path, spec, plan, "x")
    other = tmp_path / "o.yaml"
    other.write_text(path.read_text().replace(spec.fingerprint, "0" * 16))
    with pytest.raises(KtlongError, match="another model"):
        mi.read_plan(other, spec)
    other.write_text(path.read_text().replace("vs 1024 2048", "vs 12", 1))
    with pytest.raises(KtlongError, match="bad head pattern"):
        mi.read_plan(other, spec)
    with pytest.raises(KtlongError, match="does not exist"):
        mi.resolve_plan(spec, settings(prefill="MINFERENCE", prefill_patterns=str(tmp_path / "x")))
    assert mi.resolve_plan(spec, settings()).source.startswith("default")


def test_torch_path_equals_kernel():
    """attend_chunk_torch (the CUDA path) over the same index as the Numba kernel, on the CPU."""
    rng = np.random.default_rng(4)
    hkv, g, d, bs, start, length = 2, 2, 32, 16, 300, 200
    n = start + length
    nb = -(-n // bs)
    k = rng.standard_normal((hkv, nb, bs, d)).astype(np.float32)
    v = rng.standard_normal((hkv, nb, bs, d)).astype(np.float32)
    empty = np.zeros((hkv, 0, bs, d), np.float32)
    from ktlong import kernels

    kv = kernels.layer_kv(empty, empty, k, v, 0, 0)
    q = rng.standard_normal((hkv * g, length, d)).astype(np.float32)
    row = tuple(mi.parse_head(t, "t") for t in ("ashape 16 64", "vs 8 40", "block 2", "vs 4 9"))
    pooled = ps.pool_keys(kv, 0, -(-n // pi.QB), n)
    index = mi.build_index(row, kv, q, start, 0.2, pooled)
    want = ps.sparse_attend(kv, q, start, index, 0.2)
    got = mi.attend_chunk_torch(torch.from_numpy(q), torch.from_numpy(k.reshape(hkv, -1, d)[:, :n]),
                                torch.from_numpy(v.reshape(hkv, -1, d)[:, :n]), start, index, 0.2,
                                max_elems=5000)  # several batches of query blocks
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=3e-5)
    # lone diagonals (scattered offsets), columns on their keys, and a block-sparse head
    hq = hkv * g
    vert = np.stack([np.sort(rng.choice(n, 40, False)) for _ in range(hq)]).astype(np.int32)
    slash = np.stack([np.r_[np.arange(30), np.sort(rng.choice(np.arange(40, n, 7), 20, False))]
                      for _ in range(hq)]).astype(np.int32)
    vs = pi.vs_index(vert, slash, start, length, 4)
    assert vs[5].min() > 0
    bs = pi.block_index(rng.standard_normal((1, pi.n_qblocks(length), n // 64 + 1)).astype(
        np.float32), start, length, 2)
    heads = [np.arange(hq - 1), np.array([hq - 1])]
    index = pi.pack_index(heads, [tuple(a[:hq - 1] for a in vs), bs], hq, pi.n_qblocks(length))
    want = ps.sparse_attend(kv, q, start, index, 0.2)
    for max_elems in (1 << 26, 5000):
        got = mi.attend_chunk_torch(torch.from_numpy(q),
                                    torch.from_numpy(k.reshape(hkv, -1, d)[:, :n]),
                                    torch.from_numpy(v.reshape(hkv, -1, d)[:, :n]), start, index,
                                    0.2, max_elems=max_elems)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=3e-5)
