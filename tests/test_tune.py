"""`ktlong tune prefill` on a tiny model: every head gets a candidate, the file loads back and a
MINFERENCE prefill uses it; recall is a probability share and full coverage keeps all of it."""
from __future__ import annotations

import numpy as np
from ktlong.kernels import prefill_index as pi

from ktlong import minference as mi
from ktlong import tune
from ktlong.model import load_model
from ktlong.tinymodel import filler_text

from .models import hf_model, settings


def test_search_writes_a_plan_the_prefill_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("KTLONG_HOME", str(tmp_path))
    lm = load_model(hf_model("llama"), "CPU")
    ids = lm.tokenizer(filler_text(1200, seed=2))["input_ids"][:1200]
    plan, table = tune.search(lm, settings(), ids, budget=256, queries=256)
    cands = {c.text() for c in tune.candidates(256)}
    assert len(plan.layers) == 2 and all(len(r) == 4 for r in plan.layers)
    for row, rec in zip(plan.layers, table, strict=True):
        for p, h in zip(row, rec, strict=True):
            assert p.text() in cands or p.kind == "vs"
            assert 0.0 < h[p.text()] <= 1.0 + 1e-6
            assert h[p.text()] == max(h.values())
    path = mi.tuned_path(lm.spec)
    mi.write_plan(path, lm.spec, plan, "test")
    assert mi.resolve_plan(lm.spec, settings(prefill="MINFERENCE")).layers == plan.layers


def test_recall_of_full_index_is_one():
    rng = np.random.default_rng(0)
    n, r, d = 300, 128, 16
    q, k = rng.standard_normal((r, d)), rng.standard_normal((n, d))
    probs = tune.dense_probs(q, k, n - r, 0.5)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    assert tune.head_recall(probs, pi.dense_index(1, n - r, r), 0, n - r) > 1 - 1e-5
    narrow = pi.pack_index([np.arange(1)], [pi.ashape_index(1, n - r, r, 0, 0)], 1, 2)
    assert tune.head_recall(probs, narrow, 0, n - r) < 0.9


def test_recall_counts_lone_diagonals_once():
    """Recall over an index with lone diagonals: each row's mass over its own keys (row_keys)."""
    rng = np.random.default_rng(1)
    n, r, d = 400, 128, 16
    q, k = rng.standard_normal((r, d)), rng.standard_normal((n, d))
    probs = tune.dense_probs(q, k, n - r, 0.5)
    vert = np.array([[3, 17, 150, 290]], np.int32)
    slash = np.array([np.r_[np.arange(30), 60, 61, 140, 287, 300]], np.int32)
    parts = pi.vs_index(vert, slash, n - r, r, 4)
    assert parts[5].min() > 0
    index = pi.pack_index([np.arange(1)], [parts], 1, 2)
    want = np.mean([probs[i, index.row_keys(0, i // pi.QB, n - r + i)].sum() for i in range(r)])
    assert abs(tune.head_recall(probs, index, 0, n - r) - want) < 1e-5
