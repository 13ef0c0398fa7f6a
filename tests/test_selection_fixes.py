"""Selection fixes for retrieval: the question's pinned blocks and neighbouring blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ktlong import kernels
from ktlong.engine import Sampling
from ktlong.selection import near_votes, spread_choice, with_neighbours

from .test_selection import _q, _session

BS, LOCAL = 16, 64  # the test settings' block_size and local window


def test_with_neighbours_takes_each_best_block_then_the_one_after():
    cand = np.array([1, 2, 3, 5, 6, 9, 10], np.int32)
    scores = np.array([[0.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.0]], np.float32)  # best: 3, 6, 9
    # 3 and 6 (4 and 7 are not candidates), then 9 and its successor 10
    assert with_neighbours(scores, cand, 4).tolist() == [[3, 6, 9, 10]]
    assert with_neighbours(scores, cand, 2).tolist() == [[3, 6]]
    # a successor that is also a top block is not taken twice; k never exceeds the candidates
    assert with_neighbours(np.array([[5, 4, 3, 2, 1, 0, 0]], np.float32), cand, 3).tolist() \
        == [[1, 2, 3]]
    assert with_neighbours(scores, cand, 99).shape == (1, 7)
    other = np.array([0.9, 0, 0, 0, 0, 0, 0.1], np.float32)  # best: 1, then its successor 2
    two = with_neighbours(np.stack([scores[0], other]), cand, 2)  # one row per KV head
    assert two.tolist() == [[3, 6], [1, 2]]


def test_question_blocks_are_the_votes_best_and_read_at_every_step():
    s = _session(anchor_type="MEAN", question_blocks=3, second_select_num=8,
                 question_positions="AS_IS")
    n = len(s.tokens)
    local0 = (n - LOCAL) // BS
    pins = s.policy._pins[0]
    assert pins.size == 3 and np.all(np.diff(pins) > 0) and pins.min() >= 1 and pins.max() < local0
    # the pins: per block, its best attention share from any of the question's last queries
    # (question_window) in any head, summed over the voting layers (here every layer)
    W = s.settings.question_window
    vote = np.zeros(local0)
    for layer in range(2):
        k_base, _, k_tail, _, nb_base = s.store.kernel_args(layer)
        qw = s.router.captured[layer].numpy()[:, -W:]  # [Hq, W, d]
        best = np.zeros(local0)
        for w in range(W):
            v = kernels.query_votes_ref(qw[:, w:w + 1], k_base, k_tail, nb_base, n - W + w + 1,
                                        s.policy.scale, s.store.kv_kind)  # [Hkv, n']
            best = np.maximum(best, v[:, : local0 * BS].reshape(-1, local0, BS).sum(2).max(0))
        vote += best
    want = np.argsort(-vote[1:local0], kind="stable")[:3] + 1
    assert pins.tolist() == sorted(want.tolist())
    assert all(np.array_equal(s.policy._pins[layer], pins) for layer in range(2))
    for seed in range(4):  # whatever the token's query, the pins are read, within the budget
        row = s.policy.select(0, _q(s, seed), n)[0]
        assert np.all(np.diff(row) > 0)
        middle = [b for b in row.tolist() if 1 <= b < local0]
        assert set(pins.tolist()) <= set(middle) and len(middle) == 8


def test_near_votes_score_each_block_as_if_read_just_before_the_local_window():
    """question_votes NEAR: the question's vote equals, in float64 NumPy, the attention its
    last queries give each block with the keys of every block before the window re-rotated
    to the block just before it, the window's keys where they are."""
    s = _session(anchor_type="MEAN", question_blocks=3, second_select_num=8,
                 question_votes="NEAR")
    pol, n = s.policy, len(s.tokens)
    local0 = (n - LOCAL) // BS
    W = s.settings.question_window
    k_all = s.store.token_range(1, 0, n)[0].double().numpy()  # [Hkv, n, d]
    g = s.lm.spec.n_heads // k_all.shape[0]
    keys = k_all.copy()
    for b in range(local0):
        for j in range(k_all.shape[0]):
            keys[j, b * BS:(b + 1) * BS] = _rope_turn(k_all[j, b * BS:(b + 1) * BS],
                                                      pol.inv_freq, (local0 - 1 - b) * BS)
    qw = s.router.captured[1].numpy()[:, -W:].astype(np.float64)  # [Hq, W, d]

    def reference(skip: int) -> np.ndarray:
        want = np.zeros(local0)
        for w in range(W):
            pos = n - W + w
            share = np.zeros((k_all.shape[0], local0))
            for h in range(qw.shape[0]):
                sc = float(pol.scale) * (keys[h // g, :pos + 1] @ qw[h, w])
                p = np.exp(sc - np.logaddexp.reduce(sc))
                p[:skip] = 0.0
                share[h // g] += p[: local0 * BS].reshape(local0, BS).sum(1)
            want = np.maximum(want, share.max(0))
        return want

    got = near_votes(s.store, 1, np.ascontiguousarray(qw[:, :, :].astype(np.float32)), n, local0,
                     pol.inv_freq, float(pol.scale))
    np.testing.assert_allclose(got, reference(0), rtol=2e-3, atol=1e-6)
    # skip: the first tokens keep their weight in every share's total but vote for no block
    skip = 5
    got_skip = near_votes(s.store, 1, np.ascontiguousarray(qw.astype(np.float32)), n, local0,
                          pol.inv_freq, float(pol.scale), skip)
    np.testing.assert_allclose(got_skip, reference(skip), rtol=2e-3, atol=1e-6)
    assert got_skip[0] < got[0] and np.allclose(got_skip[1:], got[1:], rtol=1e-5, atol=1e-7)
    as_is = kernels.query_votes_ref(qw[:, -1:], *_layer_args(s, 1), n, pol.scale,
                                    s.store.kv_kind)[:, : local0 * BS]
    assert not np.allclose(as_is.reshape(-1, local0, BS).sum(2).max(0), got, rtol=0.05)
    # the pins follow these votes, summed over the voting layers (here both)
    vote = sum(near_votes(s.store, layer, s.router.captured[layer].numpy()[:, -W:], n, local0,
                          pol.inv_freq, float(pol.scale)) for layer in range(2))
    best = np.argsort(-vote[1:local0], kind="stable")[:3] + 1
    assert pol._pins[0].tolist() == sorted(best.tolist())


def _layer_args(s, layer):
    k_base, _, k_tail, _, nb_base = s.store.kernel_args(layer)
    return k_base, k_tail, nb_base


def test_question_blocks_step_equals_attention_over_its_blocks():
    """The fused select+attend step with pins reads exactly init + pins + top-k + local."""
    s = _session(anchor_type="MEAN", question_blocks=2, second_select_num=6, kv_type="FP32",
                 question_positions="AS_IS")
    n = len(s.tokens)
    q = _q(s, 5)
    step = s.policy.plan(0, q, n)
    assert step.candidates is not None and step.k == 4 and step.pins.size == 2
    assert not set(step.candidates.tolist()) & set(step.pins.tolist())
    out, lse = s.policy.attend(step, float(s.policy.scale))
    k_base, v_base, k_tail, v_tail, nb_base = s.store.kernel_args(0)
    ref, ref_lse = kernels.attend_blocks_ref(q, k_base, v_base, k_tail, v_tail, nb_base,
                                             step.blocks(), n, float(s.policy.scale),
                                             s.store.kv_kind)
    assert step.blocks().shape[1] == 1 + 2 + 4 + (-(-n // BS) - (n - LOCAL) // BS)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_neighbours_keep_the_budget_and_pair_blocks(mode):
    s = _session(anchor_type="MEAN", select_neighbours=True, second_select_num=8,
                 head_select_mode=mode)
    n = len(s.tokens)
    local0 = (n - LOCAL) // BS
    q = _q(s, 2)
    blocks = s.policy.select(0, q, n)
    cand = np.arange(1, local0, dtype=np.int32)
    scores = kernels.score_blocks(q, s.store.anchors[0], cand, False, mode == "SHARED")
    for r, row in enumerate(blocks):
        picked: list[int] = []  # the reference: best first, each followed by its successor
        for b in cand[np.argsort(-scores[r], kind="stable")].tolist():
            for c in (b, b + 1):
                if c < local0 and c not in picked and len(picked) < 8:
                    picked.append(c)
        middle = [b for b in row.tolist() if 1 <= b < local0]
        assert middle == sorted(picked)
        assert sum(b + 1 in middle for b in middle) >= 4  # pairs
    # the step that attends chooses the same blocks
    step = s.policy.plan(0, q, n)
    s.policy.attend(step, float(s.policy.scale))
    assert np.array_equal(step.blocks(), blocks)


def test_pins_and_neighbours_decode_and_count_their_reads():
    s = _session(anchor_type="MAX", question_blocks=2, select_neighbours=True,
                 second_select_num=8)
    steps = list(s.generate(Sampling(max_new_tokens=4)))
    n = len(s.tokens) - 1
    nb, local0 = -(-n // BS), (n - LOCAL) // BS
    assert steps[-1].stats.attended_share == pytest.approx((1 + 8 + nb - local0) / nb, abs=0.02)


def test_question_blocks_beyond_the_budget_take_the_whole_budget():
    s = _session(anchor_type="MEAN", question_blocks=12, second_select_num=8)
    assert s.settings.question_blocks == 8
    steps = list(s.generate(Sampling(max_new_tokens=2)))
    n = len(s.tokens) - 1
    nb, local0 = -(-n // BS), (n - LOCAL) // BS
    assert steps[-1].stats.attended_share == pytest.approx((1 + 8 + nb - local0) / nb, abs=0.02)


def _rope(x, pos, inv):
    """HF's rotate-half RoPE of x [n, d] at positions pos [n] (float64)."""
    ang = pos[:, None] * inv[None]  # [n, h]
    c, s = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
    h = inv.size
    rot = np.concatenate([-x[:, h:2 * h], x[:, :h]], 1)
    return x * c + rot * s


def test_a_turned_query_moves_as_a_key_moves_the_other_way():
    rng = np.random.default_rng(0)
    inv = 1e4 ** (-np.arange(0, 32, 2) / 32)  # d 32
    q_raw, k_raw = rng.standard_normal((1, 32)), rng.standard_normal((1, 32))
    pq, pk, delta = 70_000, 1_000, 60_000
    q = _rope(q_raw, np.array([pq]), inv).astype(np.float32)
    k = _rope(k_raw, np.array([pk]), inv)
    k_moved = _rope(k_raw, np.array([pk + delta]), inv)
    shifted = kernels.turned_ref(q[0], inv, -delta)[None]
    np.testing.assert_allclose(shifted @ k.T, q.astype(np.float64) @ k_moved.T, rtol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(shifted), np.linalg.norm(q), rtol=1e-6)
    near = _rope(q_raw, np.array([pk + 4096]), inv) @ k.T  # what a query 4,096 later sees
    np.testing.assert_allclose(kernels.turned_ref(q[0], inv, -(pq - pk - 4096))[None] @ k.T,
                               near, rtol=1e-4)


def test_near_positions_read_each_pin_as_if_before_the_local_window():
    """The step's output equals exact attention over init + chosen + local with the pins' keys
    re-rotated to the m blocks before the local window (a NumPy reference)."""
    s = _session(anchor_type="MEAN", question_blocks=3, second_select_num=6,
                 question_positions="NEAR")
    n = len(s.tokens)
    pol = s.policy
    assert pol.inv_freq is not None
    q = _q(s, 7)
    step = pol.plan(1, q, n)
    pins = step.pins.copy()
    assert pins.size == 3
    out, lse = pol.attend(step, float(pol.scale))
    m, local0 = pins.size, step.local0
    moved = {int(b): (local0 - m + i - int(b)) * BS for i, b in enumerate(pins)}
    ref = _moved_reference(s, q, step.blocks()[0].tolist(), moved)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    as_is = _session(anchor_type="MEAN", question_blocks=3, second_select_num=6,
                     question_positions="AS_IS")
    o2, _ = as_is.policy.attend(as_is.policy.plan(1, q, n), float(pol.scale))
    assert not np.allclose(o2, out, atol=1e-4)  # the turn changes what is read


def _rope_turn(k, inv, delta):
    """Rotated keys k [n, d] moved `delta` positions later (rotate-half layout)."""
    return np.stack([kernels.turned_ref(row, inv, delta) for row in k])


def _moved_reference(s, q, blocks, moved, extra=None):
    """float64 attention out `[Hq, d]` of q over layer 1's `blocks`, the keys of each block in
    `moved` re-rotated that many positions later; `extra` (a, b, delta): tokens [a, b) read
    once more, re-rotated delta positions later."""
    n, pol = len(s.tokens), s.policy
    k_all, v_all = (t.double().numpy() for t in s.store.token_range(1, 0, n))  # [Hkv, n, d]
    g = q.shape[0] // k_all.shape[0]
    ref = np.zeros(q.shape, np.float64)
    for h in range(q.shape[0]):
        ks, vs = [], []
        for b in blocks:
            tok = np.arange(b * BS, min(n, (b + 1) * BS))
            kb = k_all[h // g, tok]
            if b in moved:
                kb = _rope_turn(kb, pol.inv_freq, moved[b])
            ks.append(kb)
            vs.append(v_all[h // g, tok])
        if extra is not None:
            a, b, delta = extra
            ks.append(_rope_turn(k_all[h // g, a:b], pol.inv_freq, delta))
            vs.append(v_all[h // g, a:b])
        kk, vv = np.concatenate(ks), np.concatenate(vs)
        sc = float(pol.scale) * (kk @ q[h].astype(np.float64))
        p = np.exp(sc - sc.max())
        ref[h] = p @ vv / p.sum()
    return ref


@pytest.mark.parametrize("pins_last", [True, False], ids=["pins-near", "pins-as-is"])
@pytest.mark.parametrize("reused", [False, True], ids=["fresh", "reused"])
def test_compact_positions_read_the_blocks_before_the_window_as_one_run(pins_last, reused):
    """block_positions COMPACT: the step's output equals exact attention over its blocks with
    the init, chosen and question's blocks re-rotated to the M blocks just before the local
    window (the pins last with question_positions NEAR, else in document order), the window's
    keys where they are. A fresh choice (one kernel call, or choose then attend) and a choice
    reused by the next layer (layer_step 2) read alike."""
    s = _session(anchor_type="MEAN", question_blocks=3, second_select_num=7, layer_step=2,
                 block_positions="COMPACT", question_positions="NEAR" if pins_last else "AS_IS")
    n, pol, q = len(s.tokens), s.policy, _q(s, 7)
    if reused:
        pol.attend(pol.plan(0, q, n), float(pol.scale))
    step = pol.plan(1, q, n)
    assert (step.candidates is None) == reused and step.pins.size == 3
    pins = step.pins.copy()
    out, lse = pol.attend(step, float(pol.scale))
    far = np.concatenate([np.arange(step.n_init), step.chosen[0], pins])
    if not pins_last:
        far = np.sort(far)
    assert far.size == 1 + 7  # init + the budget, pins within it
    moved = {int(b): (step.local0 - far.size + i - int(b)) * BS for i, b in enumerate(far)}
    ref = _moved_reference(s, q, [*far.tolist(), *range(step.local0, step.nb)], moved)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    as_is = _session(anchor_type="MEAN", question_blocks=3, second_select_num=7,
                     question_positions="AS_IS")
    o2, _ = as_is.policy.attend(as_is.policy.plan(1, q, n), float(pol.scale))
    assert not np.allclose(o2, out, atol=1e-4)  # the turns change what is read


def test_first_block_first_in_the_vote_is_read_again_just_before_the_window():
    """question_first_block: the first block is voted on (its chat-template tokens not) and
    never pinned; when it comes first, every step also reads its document tokens as if they
    ended just before the local window: exact attention over the step's blocks plus that copy."""
    s = _session(anchor_type="MEAN", question_blocks=3, second_select_num=7,
                 block_positions="COMPACT", question_positions="NEAR", question_votes="NEAR",
                 question_first_block=True)
    n, pol, q = len(s.tokens), s.policy, _q(s, 7)
    order = pol.vote_orders[-1]
    assert 0 in order.tolist() and 0 not in pol._pins[0].tolist() and pol._pins[0].size == 3
    assert pol._head == (int(order[0]) == 0)
    pol._head = True  # whichever block this random model's vote put first
    step = pol.plan(1, q, n)
    out, _ = pol.attend(step, float(pol.scale))
    far = np.concatenate([np.arange(step.n_init), step.chosen[0], step.pins])
    moved = {int(b): (step.local0 - far.size + i - int(b)) * BS for i, b in enumerate(far)}
    ref = _moved_reference(s, q, [*far.tolist(), *range(step.local0, step.nb)], moved,
                           (pol.doc_start, BS, step.local0 * BS - BS))
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    # the turned copy is kept while the window stays, turned again when it moves on
    m = n - 2 * BS
    moved_on, _ = pol.attend(pol.plan(1, q, m), float(pol.scale))
    pol._head_kv = {}
    fresh, _ = pol.attend(pol.plan(1, q, m), float(pol.scale))
    np.testing.assert_array_equal(moved_on, fresh)
    pol._head = False
    plain, _ = pol.attend(pol.plan(1, q, n), float(pol.scale))
    assert not np.allclose(plain, out, atol=1e-4)


def test_doc_start_is_where_the_chat_template_ends():
    from ktlong.conversation import Conversation

    s = _session(n_tokens=200)
    tok = s.lm.tokenizer
    ids = Conversation(tok, "Alpha beta gamma delta.").document_ids()
    head = Conversation(tok, "").document_ids()
    s.truncate(0)
    s.prefill(ids)
    start = s.policy.doc_start
    assert 1 <= start < len(ids) and ids[:start] == head[:start]
    assert "Alpha" in tok.decode(ids[start:start + 4]) and "Alpha" not in tok.decode(ids[:start])


def test_doc_start_leaves_out_a_system_prompt_the_conversation_names():
    """Under an empty conversation's head the system prompt would count as document; the
    conversation's own head (what chat sets) puts the start at the document's first word."""
    from ktlong.conversation import Conversation

    s = _session(n_tokens=200)
    tok = s.lm.tokenizer
    conv = Conversation(tok, "Alpha beta gamma delta.", "Zulu yankee xray.")
    ids = conv.document_ids()
    s.truncate(0)
    s.prefill(ids)
    assert "Zulu" in tok.decode(ids[s.policy.doc_start:])  # the default head: no system text
    s.template_head = conv.head_ids()
    s.truncate(0)
    s.prefill(ids)
    start = s.policy.doc_start
    assert "Alpha" in tok.decode(ids[start:start + 4]) and "Zulu" in tok.decode(ids[:start])


def test_compact_positions_change_nothing_on_a_context_read_whole():
    """A context within the budget is read whole, every key where it is: COMPACT answers with
    the tokens AS_IS does."""
    def answer(positions):
        s = _session(n_tokens=150, anchor_type="MEAN", question_blocks=2,
                     block_positions=positions)
        return [t.token_id for t in s.generate(Sampling(max_new_tokens=6, temperature=0.0))]
    assert answer("COMPACT") == answer("AS_IS")


def test_spread_choice_takes_each_runs_best_then_the_best_of_the_rest():
    rng = np.random.default_rng(3)
    cand = np.sort(rng.choice(np.arange(1, 200), 40, replace=False)).astype(np.int32)
    scores = rng.standard_normal((2, 40)).astype(np.float32)
    scores[0, :10] -= 10  # the first run scores low: only its own best is taken from it
    got = spread_choice(scores, cand, 9, 4)
    assert got.shape == (2, 9) and np.all(np.diff(got, axis=1) > 0)
    for r in range(2):
        runs = np.split(np.arange(40), 4)  # 40 candidates in 4 runs of 10
        best = [int(run[np.argmax(scores[r, run])]) for run in runs]
        rest = [i for i in np.argsort(-scores[r], kind="stable") if i not in best][:5]
        assert got[r].tolist() == sorted(cand[best + rest].tolist())
    assert np.isin(cand[:10], got[0]).sum() == 1
    # m >= k: one block from each of k runs; k above the candidates: all of them
    assert spread_choice(scores[:1], cand, 4, 9).shape == (1, 4)
    assert spread_choice(scores[:1, :3], cand[:3], 5, 2)[0].tolist() == cand[:3].tolist()


def test_spread_blocks_reach_every_run_of_the_document():
    """With spread_blocks every step reads a block from each of that many equal runs of the
    candidates, whatever the query, and attends over exactly its blocks."""
    s = _session(anchor_type="MEAN", second_select_num=8, spread_blocks=4, kv_type="FP32")
    n, pol = len(s.tokens), s.policy
    local0 = (n - LOCAL) // BS
    runs = np.array_split(np.arange(1, local0), 4)
    for seed in range(3):
        q = _q(s, seed)
        step = pol.plan(0, q, n)
        out, lse = pol.attend(step, float(pol.scale))
        chosen = step.chosen[0]
        assert chosen.size == 8 and all(np.isin(run, chosen).any() for run in runs)
        kv = s.store.kernel_views(0)[0]
        want = kernels.attend_layer(kv, q, step.blocks(), n, float(pol.scale))
        np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-6)


def test_spread_blocks_and_select_neighbours_are_one_or_the_other():
    from ktlong.config import resolve_settings
    from ktlong.errors import KtlongError
    with pytest.raises(KtlongError, match="spread_blocks and select_neighbours"):
        resolve_settings("default", {"spread_blocks": 8, "select_neighbours": True},
                         config_file=False)


def _spy_votes(s):
    """The pins after each prefill's vote, in order."""
    votes, vote = [], s.policy.on_prefill_end

    def spy(captured, n_tokens):
        vote(captured, n_tokens)
        votes.append(s.policy.pinned().copy())

    s.policy.on_prefill_end = spy
    return votes


def test_a_question_is_read_again_with_the_blocks_it_voted_for():
    """The question's blocks are voted at its end; the question is then read again with them,
    so its tokens and the answer's first token (the prefill's logits) read them: the same K, V
    and logits as the question read once with those blocks pinned before it."""
    kw = dict(anchor_type="MEAN", question_blocks=3, second_select_num=8)
    s, t = _session(**kw), _session(**kw)
    n = len(s.tokens)
    question = [int(x) for x in np.random.default_rng(5).integers(10, 200, 24)]
    votes = _spy_votes(s)
    logits = s.prefill(question)
    assert len(votes) == 2 and votes[0].size == 3  # voted, read again, voted again
    assert len(s.tokens) == n + 24 and s.store.length == n + 24  # stored once
    assert s.policy.pinned().tolist() == votes[1].tolist()
    t.policy._pins = {layer: votes[0] for layer in range(2)}
    ref = t._forward(question, None, sparse=True)  # read once, the first vote's blocks pinned
    torch.testing.assert_close(logits[-1], ref[-1])
    for layer in range(2):
        got, want = s.store.token_range(layer, n, n + 24), t.store.token_range(layer, n, n + 24)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    # without the question's blocks, or for a turn longer than the local window, one reading
    for kw2, m in ((dict(question_blocks=0), 24), ({}, LOCAL + 16)):
        u = _session(**{**kw, **kw2})
        votes = _spy_votes(u)
        u.prefill(question * (m // 24) + question[: m % 24])
        assert len(votes) == 1


def test_every_layer_votes_while_the_votes_read_at_most_vote_keys():
    from types import SimpleNamespace

    from ktlong.selection import VOTE_KEYS

    pol = _session(question_blocks=3, second_select_num=8).policy
    pol.store = SimpleNamespace(shape=SimpleNamespace(n_layers=30))
    assert pol.voting_layers(VOTE_KEYS // 30) == list(range(30))
    assert len(pol.voting_layers(VOTE_KEYS // 10)) == 10
    assert pol.voting_layers(1 << 30) == [0, 10, 19, 29]  # at least 4, evenly spaced
    pol.s = dataclasses.replace(pol.s, question_layers=4)
    assert pol.voting_layers(100) == [0, 10, 19, 29]
