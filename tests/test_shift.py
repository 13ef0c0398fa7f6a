"""Context shift (overflow: SHIFT): a chat past max_seq_len drops its oldest turns and moves the
later turns' K,V down, keys re-rotated (llama.cpp's K-shift; ktlong/shift.py).

Tolerances, and why:
- Keys: a re-rotated key differs from a key rotated afresh at its new position only by the
  rounding of the two float32 RoPE angles (transformers computes `pos * inv_freq` in float32;
  inv_freq <= 1, so at positions below 2048 each angle is off by at most half an ulp of 2048,
  1.2e-4 rad): at most ~2.4e-4 of the key's size. Asserted: 3e-4 of the largest |key|.
- Logits of a 1-layer model (its layer-0 K,V depend on the token and its position only, so the
  shifted store must equal a fresh prefill of the kept tokens at their new positions): float32
  KV within 1e-4 of the largest |logit| (measured ~2e-7: the key errors are a few 1e-5 and
  attention averages them); BF16 KV adds one BF16 rounding of each moved key (2^-8 relative,
  where a fresh prefill rounds the fresh key once), so 4e-3 (measured ~6e-5).
- A model of 2+ layers is not compared: the moved tokens' layer>=1 K,V were computed while the
  dropped turns were in their past (as in llama.cpp); a fresh prefill never saw them.
"""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from rich.console import Console

from ktlong import shift
from ktlong.chat import ChatLoop
from ktlong.chatui import TerminalUI
from ktlong.conversation import Conversation, Turn
from ktlong.documents import Document
from ktlong.engine import Sampling, Session
from ktlong.errors import KtlongError
from ktlong.model import load_model
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

DOC = filler_text(250, seed=5)  # ~300 tokens
QUESTIONS = [f"Question {i}: {filler_text(8, seed=100 + i)}?" for i in range(80)]


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


@pytest.fixture(scope="module")
def lm1():
    """One layer, head_dim 32 (quantised KV types need a multiple of 32), peaked attention."""
    return load_model(hf_model("llama", qk_scale=4.0, layers=1, head_dim=32), device="CPU",
                      dtype="float32")


class UI(TerminalUI):
    def __init__(self) -> None:
        super().__init__(out=Console(file=io.StringIO(), width=200),
                         err=Console(file=io.StringIO(), width=200))

    def text(self) -> tuple[str, str]:
        return self.out.file.getvalue(), self.err.file.getvalue()  # type: ignore[attr-defined]


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the plan and the rotation ----------------------------------------------------------------
def test_plan_keeps_the_prefix_and_moves_the_longest_kept_run() -> None:
    doc, a, b, q = rand_ids(50, 1), rand_ids(30, 2), rand_ids(40, 3), rand_ids(5, 4)
    p = shift.plan(doc + a + b, doc + [7, 8] + b + q)
    assert p == shift.ShiftPlan(keep=50, drop=30, gap=(7, 8), moved=40)
    assert p.delta == -28
    assert shift.plan(doc + a + b, doc + b + q) == shift.ShiftPlan(50, 30, (), 40)
    assert shift.plan(doc + a, doc + a + q) is None  # a continuation: nothing to move
    assert shift.plan(doc + a + b, doc + q) is None  # nothing of the old turns is kept
    assert shift.plan(doc + a + b[-10:], doc + b[-10:] + q) is None  # below MIN_REUSE
    # the kept run must end with the store's last token, and may not move up
    assert shift.plan(doc + a + b, doc + b[:-1] + q) is None
    assert shift.plan(doc + b, doc + rand_ids(10, 5) + b) is None


def test_rerotation_equals_rope_at_the_new_position(lm1) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = lm1.model.model.rotary_emb
    d = lm1.spec.head_dim
    k = torch.randn(2, 300, d, generator=torch.Generator().manual_seed(0))
    old = torch.arange(1700, 2000)[None]
    inv = shift.rope_inv_freq(lm1.model)
    for delta in (-1, -37, -1500, 25):
        cos0, sin0 = rotary(k, old)
        cos1, sin1 = rotary(k, old + delta)
        at_old = apply_rotary_pos_emb(k, k, cos0, sin0, unsqueeze_dim=0)[1]
        fresh = apply_rotary_pos_emb(k, k, cos1, sin1, unsqueeze_dim=0)[1]
        moved = shift.rerotate(at_old.clone(), *shift.rotation(inv, delta))
        assert (moved - fresh).abs().max() <= 3e-4 * fresh.abs().max(), delta


# --- logits after a shift = a fresh prefill of the kept tokens --------------------------------
def conversation(lm, n_turns: int, answer_len: int = 60) -> Conversation:  # type: ignore[no-untyped-def]
    conv = Conversation(lm.tokenizer, DOC)
    for i in range(n_turns):
        conv.turns.append(Turn(QUESTIONS[i], rand_ids(answer_len, 10 + i)))
    return conv


@pytest.mark.parametrize("kv_type,tol", [("FP32", 1e-4), ("BF16", 4e-3)])
def test_dense_logits_after_a_shift_match_a_fresh_prefill(lm1, kv_type: str, tol: float) -> None:
    st = settings(attention="DENSE", prefill="DENSE", kv_type=kv_type, max_seq_len=1024)
    conv = conversation(lm1, 8)
    question = QUESTIONS[20]
    old = conv.prompt_ids(question)
    s = Session(lm1, st)
    s.prefill(old[:-40])  # the store: document + turns (the question not yet read)
    ids, dropped = conv.fit(question, 700)
    assert len(dropped) >= 3 and conv.turns and len(ids) <= 700
    doc_ids = conv.document_ids()
    assert ids[: len(doc_ids)] == old[: len(doc_ids)] == doc_ids
    plan = s.shift_to(ids)
    assert plan is not None and plan.keep >= len(doc_ids) and plan.moved > 100
    assert s.tokens == ids[: len(s.tokens)] and set(s.store.lengths) == {len(s.tokens)}
    got = s.extend_to(ids)[-1]
    assert s.tokens == ids
    ref = Session(lm1, st).prefill(ids)[-1]
    assert (got - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("kv_type", ["FP32", "BF16", "FP16", "Q8_0", "Q4_0"])
def test_every_kv_type_moves_keys_and_values(lm1, kv_type: str, tmp_path) -> None:
    """Each format (and the disk tier): the moved rows' V is bit-equal to the rows before the
    shift; K equals the old K re-rotated, within the format's own rounding."""
    st = settings(attention="DENSE", prefill="DENSE", kv_type=kv_type, max_seq_len=2048,
                  kv_tier="DISK", cache_dir=str(tmp_path))
    doc, a, b, q = rand_ids(100, 1), rand_ids(300, 2), rand_ids(500, 3), rand_ids(5, 4)
    s = Session(lm1, st)
    assert s.store.tier is not None
    s.prefill(doc + a + b)
    k_old, v_old = s.store.token_range(0, 400, 900)
    _, v_rows = s.store.row_range(0, 400, 900)
    v_rows = np.array(v_rows)
    plan = s.shift_to(doc + b + q)
    assert plan == shift.ShiftPlan(100, 300, (), 500)
    k_new, v_new = s.store.token_range(0, 100, 600)
    assert np.array_equal(s.store.row_range(0, 100, 600)[1], v_rows)
    expect = shift.rerotate(k_old.clone(), *shift.rotation(shift.rope_inv_freq(lm1.model), -300))
    step = {"FP32": 1e-6, "BF16": 2**-8, "FP16": 2**-10, "Q8_0": 1 / 127, "Q4_0": 1 / 8}[kv_type]
    big = expect.abs().amax(-1, keepdim=True)  # per row: the quantised types' scale
    assert ((k_new - expect).abs() <= 2 * step * big + 1e-6).all()
    assert s.store.n_anchored[0] <= 100 // st.block_size  # the moved blocks' anchors go


def test_anchors_of_moved_blocks_are_recomputed(lm1) -> None:
    """Sparse: after a shift the anchors equal those computed from scratch over the new store,
    and the policy's cached choices are gone."""
    st = settings(kv_type="FP32", max_seq_len=2048)
    doc, a, b, q = rand_ids(100, 1), rand_ids(300, 2), rand_ids(500, 3), rand_ids(5, 4)
    s = Session(lm1, st)
    s.prefill(doc + a + b)
    s.policy.complete_anchors()
    list(s.generate(Sampling(max_new_tokens=3)))
    assert s.policy._groups  # a decode step chose blocks
    ids = doc + [9] + s.tokens[400:] + q  # b and what was generated move down
    moved = len(s.tokens) - 400
    assert s.shift_to(ids) == shift.ShiftPlan(100, 300, (9,), moved)
    assert not s.policy._groups
    s.extend_to(ids)
    s.policy.complete_anchors()
    got = [a.copy() for a in s.store.anchors]
    s.store.n_anchored = [0] * len(got)
    s.policy.complete_anchors()
    nb = len(s.tokens) // st.block_size
    for g, r in zip(got, s.store.anchors, strict=True):
        assert np.array_equal(g[:, :nb], r[:, :nb])


# --- the chat ---------------------------------------------------------------------------------
def make_loop(lm, cap: int, new: int, ui: UI | None = None, **kw) -> ChatLoop:  # type: ignore[no-untyped-def]
    st = settings(max_new_tokens=new, max_seq_len=cap, **kw)
    loop = ChatLoop(lm, st, Document("doc.txt", DOC, len(DOC)), ui or UI())
    loop.open()
    return loop


def total_tokens(loop: ChatLoop) -> int:
    """Tokens the conversation would hold without shifting."""
    return len(loop.session.tokens) + loop.dropped[1]


@pytest.mark.parametrize("kw", [dict(attention="DENSE"), dict(kv_type="BF16"),
                                dict(attention="DENSE", kv_tier="DISK")],
                         ids=["dense", "sparse-bf16", "disk-tier"])
def test_a_chat_three_times_past_max_seq_len_keeps_answering(lm, kw, tmp_path) -> None:
    cap = 768
    if kw.get("kv_tier") == "DISK":
        kw = dict(kw, cache_dir=str(tmp_path))
    loop = make_loop(lm, cap, 40, **kw)
    doc_ids = loop.conv.document_ids()
    mid = []
    real = loop._make_room
    loop._make_room = lambda left: (mid.append(left), real(left))[1]  # type: ignore[method-assign]
    answers = []
    for q in QUESTIONS:
        a = loop.answer(q)
        assert a is not None and a.stop in ("eos", "max_new_tokens"), a and a.stop
        answers.append(a)
        s = loop.session
        assert s.tokens[: len(doc_ids)] == doc_ids  # the document never moves
        assert set(s.store.lengths) == {len(s.tokens)} <= set(range(cap + 1))
        assert loop.conv.prompt_ids("")[: len(s.tokens)] == s.tokens  # store = conversation
        if total_tokens(loop) > 3 * cap:
            break
    assert total_tokens(loop) > 3 * cap
    assert loop.dropped[0] >= 3 and len(loop.conv.turns) >= 1
    assert mid  # some answers made room mid-answer too
    out, err = loop.ui.text()
    assert "context full: dropped the oldest" in err and "kept the document" in err
    loop.handle("/context")
    out = loop.ui.text()[0]
    assert f"document  doc.txt: {len(doc_ids):,} tokens" in out
    assert f"dropped   {loop.dropped[0]} turns, {loop.dropped[1]:,} tokens" in out
    assert f"of {cap:,} tokens" in out
    loop.handle("/reset")
    assert loop.dropped == [0, 0] and len(loop.session.tokens) == len(doc_ids)


def test_answers_after_a_shift_are_those_of_the_kept_conversation(lm1) -> None:
    """One layer, dense, float32 KV: after each shift (before an answer or in the middle of one)
    the answer goes on as a fresh prefill of the kept conversation would."""
    loop = make_loop(lm1, 640, 16, attention="DENSE", prefill="DENSE")
    snaps: list[tuple[list[int], int]] = []
    real = loop._make_room

    def make_room(left: int) -> None:
        real(left)
        snaps.append((list(loop.session.tokens), len(loop.conv.turns[-1].answer_ids)))

    loop._make_room = make_room  # type: ignore[method-assign]
    compared = 0
    for q in QUESTIONS[:16]:
        before, n_snaps = loop.dropped[0], len(snaps)
        a = loop.answer(q)
        assert a is not None and a.stop in ("eos", "max_new_tokens")
        if loop.dropped[0] == before:
            continue
        if len(snaps) == n_snaps:  # shifted before the answer began: prompt_ids are the kept ones
            ctx, done = a.prompt_ids, 0
        else:  # shifted after `done` tokens; the next one was sampled before the shift
            ctx, done = snaps[-1]
            ctx, done = ctx + [a.ids[done]], done + 1
        fresh = Session(lm1, loop.settings)
        fresh.prefill(ctx)
        sp = dataclasses.replace(loop.sampling, max_new_tokens=loop.sampling.max_new_tokens - done)
        ids = [st.token_id for st in fresh.generate(sp) if st.token_id not in lm1.eos_ids]
        assert ids == a.ids[done:]
        compared += 1
    assert compared >= 2


def test_overflow_stop_keeps_the_context_full_error(lm) -> None:
    loop = make_loop(lm, 640, 24, attention="DENSE", overflow="STOP")
    stops = []
    for q in QUESTIONS:
        try:
            a = loop.answer(q)
        except KtlongError as e:
            assert "the prompt needs" in e.message and "max_seq_len is 640" in e.message
            break
        assert a is not None
        stops.append(a.stop)
    else:
        pytest.fail("the chat never filled the context")
    assert loop.dropped == [0, 0] and len(loop.conv.turns) == len(stops)
    assert "context full: dropped" not in loop.ui.text()[1]


def test_a_loaded_conversation_shifts_out_of_its_mapped_base(lm, tmp_path) -> None:
    """After /load the turns sit in the read-only mapped base: a shift copies them out first."""
    loop = make_loop(lm, 1024, 24, attention="DENSE", cache_dir=str(tmp_path))
    for q in QUESTIONS[:4]:
        loop.answer(q)
    loop.handle("/save talk")
    loop.handle("/load talk")
    s = loop.session
    mapped = s.store.nb_base
    assert mapped * s.store.shape.block_size > loop.doc_len  # turns in the base
    for q in QUESTIONS[4:]:
        a = loop.answer(q)
        assert a is not None and a.stop in ("eos", "max_new_tokens")
        if loop.dropped[0]:
            break
    assert loop.session is s and s.store.nb_base < mapped
    assert set(s.store.lengths) == {len(s.tokens)}
    assert s.tokens[: loop.doc_len] == loop.conv.document_ids()


# --- the demo model: the document's pass key after shifts -------------------------------------
def test_the_pass_key_is_still_found_after_shifts() -> None:
    from ktlong.config import resolve_settings
    from ktlong.demo import MODEL_DIR, tasks

    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip("the demo model is not trained yet")
    sample = tasks.demo_sample(0, 256)
    key = next(f.value for f in sample.facts if f.kind == "passkey")
    others = [f.question for f in sample.asked if f.kind != "passkey"]
    lm = load_model(MODEL_DIR, "CPU")
    st = resolve_settings(None, {"max_seq_len": 512, "device": "CPU", "threads_num": 2,
                                 "max_new_tokens": 24}).settings
    loop = ChatLoop(lm, st, Document("demo.txt", sample.document, len(sample.document)), UI())
    loop.open()
    assert loop.doc_len < 0.6 * st.max_seq_len
    asked = 0
    while len(loop.session.tokens) + loop.dropped[1] <= 3 * st.max_seq_len:
        a = loop.answer(others[asked % len(others)])
        assert a is not None and a.stop in ("eos", "max_new_tokens")
        asked += 1
        assert asked < 300
    assert loop.dropped[0] >= 10
    a = loop.answer("What is the pass key?")
    assert a is not None and key in a.text, a.text
