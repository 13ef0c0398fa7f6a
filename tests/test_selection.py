"""The selection policy: what each decode step reads, reuse across tokens and layers, profiles."""

from __future__ import annotations

import numpy as np
import pytest

from ktlong import kernels as K
from ktlong.config import available_profiles, resolve_settings
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.tinymodel import filler_text

from .models import hf_model, settings


def _session(n_tokens=1500, layers=2, **kw):
    lm = load_model(hf_model("llama", qk_scale=4.0, layers=layers), device="CPU", dtype="float32")
    s = Session(lm, settings(**kw))
    ids = lm.tokenizer(filler_text(n_tokens, seed=3))["input_ids"][:n_tokens]
    s.prefill(ids)
    return s


def _q(s, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((s.lm.spec.n_heads, s.lm.spec.head_dim)).astype(np.float32)


def test_step_reads_init_topk_and_local_blocks():
    s = _session(anchor_type="MEAN")
    n = len(s.tokens)
    blocks = s.policy.select(0, _q(s), n)  # [1, n]
    bs, nb = 16, -(-n // 16)
    local0 = (n - 64) // bs
    row = blocks[0]
    assert np.all(np.diff(row) > 0)
    assert row[0] == 0  # init
    assert set(range(local0, nb)) <= set(row.tolist())  # local window incl. the partial block
    middle = [b for b in row if 1 <= b < local0]
    assert len(middle) == 8
    # the chosen blocks are the top 8 by the mean-anchor score, checked in NumPy
    k = s.store.k_tail[0]  # [Hkv, nb, bs, d] float32
    anchors = k[:, 1:local0].mean(axis=2)  # [Hkv, n_cand, d]
    q = _q(s).reshape(s.lm.spec.n_kv_heads, -1, s.lm.spec.head_dim)  # [Hkv, g, d]
    score = np.einsum("hgd,hbd->b", q, anchors)
    assert sorted(middle) == sorted((np.argsort(-score)[:8] + 1).tolist())


def test_near_scoring_turns_keys_back_and_the_query_to_the_window():
    """score_positions NEAR: the chosen blocks are the top 8 by MEAN anchors of the keys turned
    back to position 0, against the query turned from its position to local_windows_len,
    checked in NumPy; the anchors carry no position, so they differ from AS_IS's."""
    s = _session(anchor_type="MEAN", score_positions="NEAR")
    n = len(s.tokens)
    blocks = s.policy.select(0, _q(s), n)
    local0 = (n - 64) // 16
    middle = [b for b in blocks[0] if 1 <= b < local0]
    inv = s.policy.inv_freq  # [h]
    k = s.store.k_tail[0][:, :local0].reshape(s.lm.spec.n_kv_heads, -1, 16, 16)  # [Hkv, n, d]
    k0 = K.turned_back_ref(k.reshape(k.shape[0], -1, k.shape[-1]), inv)  # [Hkv, n, d]
    anchors = k0.reshape(k.shape)[:, 1:local0].mean(axis=2)  # [Hkv, n_cand, d]
    q = np.stack([K.turned_ref(row, inv, 64 - (n - 1)) for row in _q(s)])  # [Hq, d]
    q = q.reshape(s.lm.spec.n_kv_heads, -1, s.lm.spec.head_dim)  # [Hkv, g, d]
    score = np.einsum("hgd,hbd->b", q, anchors)
    assert sorted(middle) == sorted((np.argsort(-score)[:8] + 1).tolist())
    stored = K.anchors_to_f64(s.store.anchors[0])[:, 1:local0, 0]  # [Hkv, n_cand, d]
    step = np.abs(anchors).max(-1, keepdims=True) / 127  # Q8's step
    assert np.all(np.abs(stored - anchors) <= 0.51 * step + 1e-6)
    assert not np.allclose(stored, s.store.k_tail[0][:, 1:local0].mean(axis=2), atol=0.05)


def test_separate_mode_selects_per_kv_head():
    s = _session(anchor_type="MEAN", head_select_mode="SEPARATE")
    blocks = s.policy.select(0, _q(s), len(s.tokens))
    assert blocks.shape[0] == s.lm.spec.n_kv_heads
    assert not np.array_equal(blocks[0], blocks[1])  # different heads, different picks


def test_token_step_and_layer_step_reuse_and_keep_blocks_leaving_the_local_window():
    s = _session(anchor_type="MEAN", token_step=4, layer_step=2)
    n = 1600  # a multiple of token_step: reselect
    first = s.policy.select(0, _q(s, 1), n)
    assert np.array_equal(s.policy.select(1, _q(s, 2), n), first)  # layer 1 reuses layer 0
    later = s.policy.select(0, _q(s, 3), n + 17)  # not a multiple of 4: reuse
    assert set(first[0].tolist()) <= set(later[0].tolist())  # nothing dropped, local grew
    fresh = s.policy.select(0, _q(s, 3), n + 20)  # multiple of 4: a new selection
    assert not np.array_equal(fresh, later)


def test_preselection_restricts_later_selections():
    s = _session(
        anchor_type="MEAN", preselect_block=True, preselect_block_count=12, second_select_num=4
    )
    n = len(s.tokens)
    pre = set(s.policy._preselected[0].tolist())
    assert len(pre) == 12
    for seed in range(5):
        row = s.policy.select(0, _q(s, seed), n)[0].tolist()
        middle = [b for b in row if 1 <= b < (n - 64) // 16]
        assert len(middle) == 4 and set(middle) <= pre


def test_budget_covering_every_block_decodes_like_dense():
    a = _session(second_select_num=10_000)
    b = _session(attention="DENSE")
    sa = [t.token_id for t in a.generate(Sampling(max_new_tokens=12))]
    sb = [t.token_id for t in b.generate(Sampling(max_new_tokens=12))]
    assert sa == sb and a.policy.attended_share() == 1.0


SCALED = {  # each profile's method keys, at sizes a 1.5K-token test prompt exercises
    "default": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    "ktransformers": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    "recall": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    "dense": {},
    "quest": dict(second_select_num=16),
    "snapkv": dict(preselect_block_count=128, second_select_num=128),
    "infllm": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=4),
    "kvretrieval": dict(
        block_size=16,
        init_len=16,
        local_windows_len=64,
        second_select_num=8,
        preselect_block_count=16,
    ),
    "streamingllm": dict(block_size=16, init_len=16, local_windows_len=64),
    "small": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    "minference": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    "squeeze": dict(block_size=16, init_len=16, local_windows_len=64, second_select_num=8),
    # LOCRET keeps a budget and reads all of it; the heads' scoring is tests/test_locret.py's
    "locret": dict(locret_budget=256, locret_stabilisers=32, locret_scores="ATTENTION"),
    "locret-attention": dict(locret_budget=256, locret_stabilisers=32),
    "locret-recent": dict(locret_budget=256, locret_stabilisers=32),
    "locret-surprise": dict(locret_budget=256, locret_stabilisers=32),
}


def test_every_shipped_profile_is_covered():
    assert set(available_profiles()) <= set(SCALED)


@pytest.mark.parametrize("profile", sorted(SCALED))
def test_profile_runs_end_to_end(profile):
    over = dict(kv_type="FP32", max_seq_len=8192, chunk_size=256, threads_num=2, **SCALED[profile])
    st = resolve_settings(profile=profile, overrides=over).settings
    lm = load_model(hf_model("llama", qk_scale=4.0, layers=3), device="CPU", dtype="float32")
    s = Session(lm, st)
    ids = lm.tokenizer(filler_text(1500, seed=4))["input_ids"][:1500]
    s.prefill(ids)
    steps = list(s.generate(Sampling(max_new_tokens=6)))
    assert 1 <= len(steps) <= 6
    share = steps[-1].stats.attended_share
    if st.attention == "LOCRET":  # every kept token, and no more than the budget kept
        assert share == 1.0 and s.dropped == 1500 - 256 and s.store.length <= 256 + 6
    elif profile == "dense":
        assert share == 1.0
    else:
        assert 0 < share < 1.0, f"{profile} read every block"


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_local_window_on_a_device_merges_to_the_single_kernel_result(mode):
    """The GPU local-window path (forced onto the CPU here) equals the one-kernel path.

    300 decode steps on one layer exercise the split of each step's blocks, the device copy of
    the window (rebuilt after prefill, appended to, compacted when full) and the LSE merge.
    """
    import torch

    from ktlong.attention import LocalWindow

    s = _session(anchor_type="MEAN", head_select_mode=mode, kv_type="BF16")
    router = s.router
    window = LocalWindow(s.store, torch.device("cpu"))
    spec, g = s.lm.spec, torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(300):
        q = torch.randn(spec.n_heads, 1, spec.head_dim, generator=g)
        k, v = (torch.randn(spec.n_kv_heads, 1, spec.head_dim, generator=g) for _ in range(2))
        start = s.store.write(0, k, v)
        router.local = None
        one = router._sparse(0, q, k, v, start, 0.25)
        router.local = window
        split = router._sparse(0, q, k, v, start, 0.25)
        worst = max(worst, (one - split).abs().max().item())
    assert worst < 1e-5
    kb, _, first, n = window.buf[0]
    assert first > 0 and n <= kb.shape[1]  # the window moved on and was compacted


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("anchor_type", ["MEAN", "QUEST"])
def test_router_step_reads_what_select_picks(mode, anchor_type):
    """The router's step is one kernel call (`select_attend`: scoring, top-k and attention). It
    reads the blocks `policy.select` picks for the same query, and its output equals
    `attend_blocks` over them."""
    import torch

    from ktlong import kernels
    from ktlong.attnmap import SelectionRecorder

    s = _session(anchor_type=anchor_type, anchor_num=2, head_select_mode=mode)
    n, spec = len(s.tokens), s.lm.spec
    assert s.store.kernel_views(0) is s.store.kernel_views(0)  # made once per layer
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        q = torch.randn(spec.n_heads, 1, spec.head_dim, generator=g)
        with SelectionRecorder(s.policy) as rec:
            out = s.router._sparse(0, q, None, None, n - 1, 0.25)  # the token at n - 1
        (record,) = rec.records
        qn = q[:, 0].numpy()
        blocks = s.policy.select(0, qn, n)
        assert blocks.shape[1] < -(-n // 16)  # a real choice: not every block
        np.testing.assert_array_equal(record.blocks, blocks)
        want, _ = kernels.attend_blocks(qn, *s.store.kernel_args(0), blocks, n, 0.25,
                                        s.store.kv_kind)
        np.testing.assert_allclose(out[:, 0].numpy(), want, rtol=1e-5, atol=1e-6)
