"""SqueezeAttention layer budgets: k-means, budgets, the prefill's measure, decode, the cache."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from ktlong import squeeze
from ktlong.attnmap import SelectionRecorder
from ktlong.config import resolve_settings
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.promptcache import MAGIC, open_cache, open_document, read_header
from ktlong.squeeze import IMPORTANT, MIDDLE, SQUEEZED, kmeans_1d, layer_budgets
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

LAYERS = 6


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama", qk_scale=4.0, layers=LAYERS), device="CPU",
                      dtype="float32")


def _ids(lm, n, seed=3):
    return lm.tokenizer(filler_text(n, seed=seed))["input_ids"][:n]


# --- k-means -------------------------------------------------------------------------------------

def test_kmeans_finds_three_clear_clusters_numbered_by_value():
    x = np.array([0.91, 0.1, 0.52, 0.12, 0.9, 0.5, 0.11, 0.92, 0.49])
    assert kmeans_1d(x).tolist() == [2, 0, 1, 0, 2, 1, 0, 2, 1]


def test_kmeans_ties_and_equal_values():
    assert kmeans_1d(np.full(5, 0.7)).tolist() == [0] * 5  # all equal: one cluster
    assert kmeans_1d(np.array([0.2, 0.8, 0.2, 0.8])).tolist() == [0, 1, 0, 1]  # two values
    # repeated values stay together, and the result does not depend on the order
    x = np.array([0.3, 0.3, 0.6, 0.6, 0.9, 0.9, 0.3])
    lab = kmeans_1d(x)
    assert lab.tolist() == [0, 0, 1, 1, 2, 2, 0]
    perm = np.random.default_rng(0).permutation(x.size)
    assert kmeans_1d(x[perm]).tolist() == lab[perm].tolist()
    assert kmeans_1d(np.zeros(0)).size == 0 and kmeans_1d(np.array([0.4])).tolist() == [0]


# --- budgets -------------------------------------------------------------------------------------

def test_budgets_keep_the_total_and_respect_the_ratio():
    sims = np.array([0.2, 0.5, 0.9, 0.91, 0.52, 0.89, 0.9, 0.21])  # 2 important, 2 middle, 4 low
    b = layer_budgets(sims, k=96, ratio=0.5)
    assert b.group == [IMPORTANT, MIDDLE, SQUEEZED, SQUEEZED, MIDDLE, SQUEEZED, SQUEEZED,
                       IMPORTANT]
    assert sum(b.k) == 8 * 96
    assert [b.k[i] for i in (2, 3, 5, 6)] == [48] * 4  # kept 50%
    assert b.k[1] == b.k[4] == 96  # the middle group is left alone
    assert b.k[0] == b.k[7] == 96 + 4 * 48 // 2  # the important group gets what was freed
    for k, ratio in ((7, 0.3), (96, 0.33), (5, 0.0), (10, 1.0)):
        b = layer_budgets(sims, k=k, ratio=ratio)
        assert sum(b.k) == 8 * k, (k, ratio)
        assert all(b.k[i] == int(k * ratio + 1e-9) for i in (2, 3, 5, 6))


def test_budget_remainder_goes_to_the_most_important_layer_first():
    sims = np.array([0.3, 0.1, 0.6, 0.9, 0.95, 0.92])  # important: layers 1, 0 (1 lowest)
    b = layer_budgets(sims, k=5, ratio=0.5)  # squeezed keep 2; 3 layers free 9 -> 5 + 4 + 5
    assert b.group[:2] == [IMPORTANT, IMPORTANT] and sum(b.k) == 30
    assert b.k[1] == 10 and b.k[0] == 9


def test_dense_layers_excluded_and_layer_step_groups_share_a_budget():
    sims = np.array([0.0, 0.0, 0.2, 0.25, 0.6, 0.62, 0.9, 0.95])
    b = layer_budgets(sims, k=10, ratio=0.5, dense_layer_num=2)
    assert b.group[:2] == [squeeze.DENSE] * 2 and b.k[:2] == [10, 10]
    assert sum(b.k[2:]) == 6 * 10
    g = layer_budgets(sims, k=10, ratio=0.5, dense_layer_num=2, layer_step=2)
    assert all(g.k[i] == g.k[i + 1] and g.group[i] == g.group[i + 1] for i in range(2, 8, 2))
    assert g.k[6] == 5 and g.k[2] == 15 and sum(g.k[2:]) == 60


def test_uniform_when_nothing_to_tell_apart():
    assert layer_budgets(np.full(6, 0.8), 8, 0.5).k == [8] * 6
    assert layer_budgets(np.array([0.1, 0.9]), 8, 0.5, dense_layer_num=1).k == [8, 8]


def test_cosine_sum_is_the_sum_of_per_token_cosines():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 1, 7, 12)).astype(np.float32)
    b[0, 3] = 0.0  # a zero row counts 0
    ref = sum(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) or 1.0))
              for x, y in zip(a[0], b[0], strict=True))
    assert float(squeeze.cosine_sum(torch.from_numpy(a), torch.from_numpy(b))) == pytest.approx(
        ref, rel=1e-5)


# --- with a model --------------------------------------------------------------------------------

def _squeeze_settings(**kw):
    return settings(layer_budget="SQUEEZE", anchor_type="MEAN", **kw)


def test_prefill_measures_every_layer_and_both_orders_agree(lm):
    ids = _ids(lm, 700)
    a = Session(lm, settings())
    a.prefill(ids)
    sims = a.store.layer_similarity()
    assert sims.shape == (LAYERS,) and np.all(np.abs(sims) <= 1.0)
    assert a.store.layer_cos_tokens == 700
    b = Session(lm, settings())
    b._chunk_major = b._layer_major  # the CUDA order
    b.prefill(ids)
    assert np.allclose(b.store.layer_similarity(), sims, atol=1e-6)
    a.prefill(_ids(lm, 1, seed=4))  # one token (decode-like): not a prefill, not measured
    assert a.store.layer_cos_tokens == 700
    a.truncate(0)  # a new prompt starts its own measure
    assert a.store.layer_similarity() is None


def test_squeeze_session_decodes_with_its_per_layer_budgets(lm):
    s = Session(lm, _squeeze_settings())
    s.prefill(_ids(lm, 1500))
    pol = s.policy
    assert len(set(pol.layer_k)) > 1 and sum(pol.layer_k) == LAYERS * 8
    with SelectionRecorder(pol) as rec:
        steps = list(s.generate(Sampling(max_new_tokens=5)))
    assert len(steps) == 5 and rec.records
    bs, n_init = 16, 1
    for r in rec.records:
        local0 = max(0, r.n_tokens - 64) // bs
        chosen = [b for b in r.blocks[0].tolist() if n_init <= b < local0]
        assert len(chosen) == pol.layer_k[r.layer], r.layer


def test_uniform_is_unchanged_and_ratio_one_decodes_like_uniform(lm):
    ids = _ids(lm, 1500)
    u = Session(lm, settings(anchor_type="MEAN"))
    u.prefill(ids)
    assert u.policy.layer_k == [8] * LAYERS  # measured, but UNIFORM ignores it
    assert u.store.layer_similarity() is not None
    assert u.policy.budget_blocks() == 1 + 8 + 4 + 1
    q = Session(lm, _squeeze_settings(squeeze_ratio=1.0))
    q.prefill(ids)
    assert q.policy.layer_k == [8] * LAYERS
    answer = lambda s: [t.token_id for t in s.generate(Sampling(max_new_tokens=8))]  # noqa: E731
    assert answer(u) == answer(q)


def test_similarities_survive_the_prompt_cache(lm, tmp_path):
    st = _squeeze_settings()
    ids = _ids(lm, 1200)
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    assert first.source == "prefill"
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache"
    s0, s1 = first.session.store, again.session.store
    assert np.array_equal(s1.layer_similarity(), s0.layer_similarity())
    assert again.session.policy.layer_k == first.session.policy.layer_k
    assert len(set(again.session.policy.layer_k)) > 1
    # converted to another kv_type: the similarities come along
    bf16 = open_document(lm, _squeeze_settings(kv_type="BF16"), ids, cache_dir=tmp_path)
    assert "converted" in bf16.note
    assert np.array_equal(bf16.session.store.layer_similarity(), s0.layer_similarity())


def test_an_entry_without_similarities_opens_with_uniform_budgets(lm, tmp_path):
    st = _squeeze_settings()
    ids = _ids(lm, 900)
    entry = open_document(lm, st, ids, cache_dir=tmp_path).entry
    header, _ = read_header(entry)
    del header["layer_cos"], header["version"]  # as an entry written before layer_budget
    raw = json.dumps(header).encode()
    with open(entry, "r+b") as f:
        f.write(MAGIC + struct.pack("<IQ", 2, len(raw)) + raw)
    old = open_document(lm, st, ids, cache_dir=tmp_path)
    assert old.source == "cache" and not old.note
    assert old.session.store.layer_similarity() is None
    assert old.session.policy.layer_k == [8] * LAYERS
    old.session.extend_to(ids + _ids(lm, 9, seed=3))  # a question brings the logits
    assert len(list(s.token_id for s in old.session.generate(Sampling(max_new_tokens=3)))) == 3
    assert len(open_cache(st, tmp_path).entries()) == 1


def test_accuracy_bench_copy_keeps_the_similarities(lm):
    from ktlong.demo.accuracy import _copy_store

    s = Session(lm, settings())
    s.prefill(_ids(lm, 400))
    dst = _copy_store(s.store, s.store.shape, 400, 1024)
    assert np.array_equal(dst.layer_similarity(), s.store.layer_similarity())


def test_squeeze_profile_is_default_plus_layer_budget():
    d = resolve_settings("default").settings.to_dict()
    q = resolve_settings("squeeze").settings.to_dict()
    assert {k for k in d if d[k] != q[k]} == {"layer_budget"} and q["layer_budget"] == "SQUEEZE"
