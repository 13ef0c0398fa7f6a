"""Locret: the labels, the heads file, eviction against NumPy references, LOCRET sessions, and
`ktlong train-heads` on a tiny model."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ktlong.kernels import turned_back_ref

from ktlong import locret, trainheads
from ktlong.engine import Sampling, Session
from ktlong.errors import KtlongError
from ktlong.model import load_model
from tests.models import hf_model, settings


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama", qk_scale=2.0), device="CPU", dtype="float32")


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(s: Session, ids: list[int], n: int = 10) -> list[int]:
    s.prefill(ids)
    return [st.token_id for st in s.generate(Sampling(max_new_tokens=n))]


# --- labels and features ------------------------------------------------------------------------
def test_labels_equal_numpy_max_attention_rule():
    """Each prompt token's label is the largest scaled logit any answer query of its KV head's
    group gives it (a plain loop over queries, heads and keys)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, n, n_prompt, d, scale = 6, 2, 23, 17, 8, 0.35
    q, k = torch.randn(hq, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    got = locret.cis_labels(q, k, n_prompt, scale).numpy()
    qn, kn, grp = q.double().numpy(), k.double().numpy(), hq // hkv
    want = np.full((hkv, n_prompt), -np.inf)
    for h in range(hq):
        for p in range(n_prompt, n):
            for t in range(n_prompt):
                dot = scale * float(qn[h, p] @ kn[h // grp, t])
                want[h // grp, t] = max(want[h // grp, t], dot)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_features_carry_no_position():
    """The same q, k, v at two positions give the same features (keys turned back to 0)."""
    g = torch.Generator().manual_seed(1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    q0, k0, v = (torch.randn(h, 5, 8, generator=g) for h in (4, 2, 2))
    at = [locret.features(locret.rotate(q0, inv, torch.arange(p, p + 5.0)),
                          locret.rotate(k0, inv, torch.arange(p, p + 5.0)), v, p, inv)
          for p in (0, 3000)]
    assert at[0].shape == (5, (4 + 2 + 2) * 8)
    torch.testing.assert_close(at[0], at[1], atol=2e-5, rtol=1e-5)
    back = locret.rotate(k0, inv, -torch.arange(0, 5.0))
    np.testing.assert_allclose(back.numpy(), turned_back_ref(k0.numpy(), inv.numpy()), atol=1e-5)


def _rope_np(x: np.ndarray, inv: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows x [n, d] rotated to positions pos [n] (float64; halves layout)."""
    h = inv.size
    ang = pos[:, None] * inv[None]
    out = np.array(x, np.float64)
    x1, x2 = out[:, :h].copy(), out[:, h : 2 * h].copy()
    out[:, :h] = x1 * np.cos(ang) - x2 * np.sin(ang)
    out[:, h : 2 * h] = x2 * np.cos(ang) + x1 * np.sin(ang)
    return out


# --- eviction -----------------------------------------------------------------------------------
class _Store:
    """Just enough of a KVStore for the evictor: one layer of float32 rows."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def row_range(self, layer: int, a: int, b: int):
        return self.k[:, a:b].numpy(), self.v[:, a:b].numpy()

    def token_range(self, layer: int, a: int, b: int):
        return self.k[:, a:b], self.v[:, a:b]

    def rewrite(self, layer: int, k: torch.Tensor, v_rows: np.ndarray) -> None:
        self.k, self.v = k.clone(), torch.from_numpy(np.array(v_rows))


@pytest.mark.parametrize("scorer", ["RECENT", "ATTENTION"])
def test_eviction_keeps_budget_like_numpy(scorer):
    """After a chunk pushes a layer past the budget, each KV head keeps the budget's best rows
    (the last `stabilisers` whatever their score) in document order, keys at positions
    0..budget-1 (turned back from where they were, then rotated there), values unchanged."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, b, stab, m, c = 4, 2, 8, 12, 3, 10, 8
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    st = SimpleNamespace(locret_budget=b, locret_stabilisers=stab, locret_scores=scorer,
                         init_len=2)
    ev = locret.Evictor(st, inv, None, 1)
    k0_all = torch.randn(hkv, m + c, d, generator=g)  # keys at position 0
    v_all = torch.randn(hkv, m + c, d, generator=g)
    k_pos = locret.rotate(k0_all, inv, torch.arange(0.0, m + c))  # as written at 0..m+c-1
    store = _Store(k_pos.clone(), v_all.clone())
    q = torch.randn(hq, m + c, d, generator=g)
    ev.after_chunk(0, q[:, :m], k_pos[:, :m], v_all[:, :m], 0, 0.5, store)  # fits: kept
    assert ev.k0[0].shape == (hkv, m, d) and store.k.shape[1] == m + c
    scores_before = ev.scores[0].clone()
    ev.after_chunk(0, q[:, m:], k_pos[:, m:], v_all[:, m:], m, 0.5, store)
    # the reference choice
    if scorer == "RECENT":
        s = np.tile(np.arange(m + c, dtype=np.float64), (hkv, 1))
        s[:, :2] = np.inf
    else:
        qn, kn = q.double().numpy(), k_pos.double().numpy()
        s = np.full((hkv, m + c), -np.inf)
        for h in range(hq):
            for p in range(m + c - min(locret.OBSERVE, c), m + c):
                for t in range(p + 1):
                    s[h // 2, t] = max(s[h // 2, t], 0.5 * qn[h, p] @ kn[h // 2, t])
        # kept rows keep the larger of their earlier and the new score
        s[:, :m] = np.maximum(s[:, :m], scores_before.double().numpy())
    for h in range(hkv):
        pick = s[h].copy()
        pick[m + c - stab :] = np.inf
        keep = np.sort(np.argsort(-pick, kind="stable")[:b])
        want_k = _rope_np(k0_all[h, keep].numpy(), inv.numpy(), np.arange(b))
        np.testing.assert_allclose(store.k[h].numpy(), want_k, atol=1e-4)
        np.testing.assert_array_equal(store.v[h].numpy(), v_all[h, keep].numpy())
    assert ev.evicted == m + c - b


def _surprise_ref(hidden: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """-log p(ids[t] | hidden[t-1]) under logits hidden @ w; token 0: 0 (float64)."""
    logits = hidden @ w  # [n, vocab]
    lp = logits - logits.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    out = np.zeros(ids.size)
    out[1:] = -lp[np.arange(ids.size - 1), ids[1:]]
    return out


def test_surprise_keeps_the_most_surprising_segments(monkeypatch):
    """SURPRISE, chunk after chunk: a token's score is the mean of the TOP largest surprisals
    in its segment so far (segments end after a break token or at SEGMENT tokens; shorter ones
    divide by TOP too; a NumPy loop); the first
    init_len tokens and the last `stabilisers` are kept; every KV head keeps the same budget of
    best-scored rows, and the store holds exactly their values."""
    monkeypatch.setattr(locret, "SEGMENT", 5)
    monkeypatch.setattr(locret, "LOGIT_ROWS", 3)  # the head's rows in pieces
    g = torch.Generator().manual_seed(7)
    hkv, d, hid, vocab, b, stab, c, n = 2, 4, 6, 9, 12, 3, 8, 40
    st = SimpleNamespace(locret_budget=b, locret_stabilisers=stab, locret_scores="SURPRISE",
                         init_len=2)
    breaks = np.zeros(vocab, bool)
    breaks[:2] = True  # tokens 0 and 1 end a line
    ev = locret.Evictor(st, None, None, 1, breaks)
    top3 = lambda x: sum(sorted(x)[-3:]) / 3  # noqa: E731
    w = torch.randn(hid, vocab, generator=g) * 3
    hidden = torch.randn(n, hid, generator=g)
    ids = torch.randint(0, vocab, (n,), generator=g)
    v_all = torch.randn(hkv, n, d, generator=g)
    k_all = torch.randn(hkv, n, d, generator=g)
    sur = _surprise_ref(hidden.double().numpy(), ids.numpy(), w.double().numpy())
    seg, start, count = np.empty(n, int), 0, 0  # each token's segment (its first token)
    for t in range(n):
        seg[t], count = start, count + 1
        if breaks[ids[t]] or count == 5:
            start, count = t + 1, 0
    store = _Store(k_all[:, :0].clone(), v_all[:, :0].clone())
    for c0 in range(0, n, c):
        c1 = min(n, c0 + c)
        before = set() if ev.index[0] is None else set(ev.index[0][0].tolist())
        store.k = torch.cat([store.k, k_all[:, c0:c1]], 1)
        store.v = torch.cat([store.v, v_all[:, c0:c1]], 1)
        q = torch.randn(4, c1 - c0, d, generator=g)
        ev.after_chunk(0, q, k_all[:, c0:c1], v_all[:, c0:c1], 0, 1.0, store)
        ev.after_layers(hidden[c0:c1], ids[c0:c1].tolist(), lambda x: x @ w, store)
        cand = sorted(before | set(range(c0, c1)))
        score = {t: (np.inf if t < 2 else top3([sur[u] for u in range(seg[t], c1)
                                                  if seg[u] == seg[t]])) for t in cand}
        for t in cand[-stab:]:
            score[t] = np.inf
        kept = ev.index[0][0].tolist()
        assert ev.index[0][1].tolist() == kept  # one ranking for every KV head
        assert kept == sorted(kept) and set(kept) <= set(cand) and len(kept) == min(b, len(cand))
        dropped = set(cand) - set(kept)
        if dropped:
            assert min(score[t] for t in kept) >= max(score[t] for t in dropped)
        finite = [t for t in kept if np.isfinite(score[t]) and t not in cand[-stab:]]
        np.testing.assert_allclose(ev.scores[0][0, [kept.index(t) for t in finite]].numpy(),
                                   [score[t] for t in finite], rtol=1e-4)
        torch.testing.assert_close(store.v, v_all[:, kept])
    assert 0 in kept and 1 in kept and n - 1 in kept


def test_line_breaks_are_the_tokens_holding_a_newline():
    class Tok:
        vocab = ["a", "\n", " end.", "?", " x", ".\n\n", "3.5"]

        def __len__(self):
            return len(self.vocab)

        def batch_decode(self, rows):
            return [self.vocab[r[0]] for r in rows]

    got = locret.line_breaks(Tok(), 9)  # the model's vocabulary can be larger
    assert got.tolist() == [False, True, False, False, False, True, False, False, False]
    assert locret.line_breaks(None, 9) is None


# --- sessions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scorer", ["RECENT", "SURPRISE"])
def test_locret_with_room_for_everything_equals_dense(lm, scorer):
    """A budget that holds the whole document keeps every token: the answer is the exact one."""
    ids = _ids(700)
    want = _greedy(Session(lm, settings(attention="DENSE", prefill="DENSE")), ids)
    s = Session(lm, settings(attention="LOCRET", prefill="DENSE", locret_scores=scorer,
                             locret_budget=1024, chunk_size=128))
    assert _greedy(s, ids) == want
    assert s.dropped == 0 and s.evictor.evicted == 0


def test_surprise_reads_the_models_own_next_token_odds(lm):
    """In a session, SURPRISE's scores come from the model's logits: with nothing evicted, each
    kept row's score is the mean of its line's 3 largest -log p in the dense forward's logits."""
    ids = _ids(300, seed=4)
    dense = Session(lm, settings(attention="DENSE", prefill="DENSE"))
    lp = torch.log_softmax(dense.prefill(ids, all_logits=True).double(), -1).numpy()
    sur = np.zeros(len(ids))
    sur[1:] = -lp[np.arange(len(ids) - 1), ids[1:]]
    s = Session(lm, settings(attention="LOCRET", prefill="DENSE", locret_scores="SURPRISE",
                             locret_budget=512, chunk_size=64, init_len=16))
    s.prefill(ids)
    ends = locret.line_breaks(lm.tokenizer, lm.spec.vocab_size)[ids]
    want, a = np.empty(len(ids)), 0
    for t in range(len(ids)):
        if ends[t] or t - a + 1 == locret.SEGMENT or t == len(ids) - 1:
            want[a : t + 1], a = np.sort(sur[a : t + 1])[-3:].sum() / 3, t + 1
    want[:16] = np.inf
    for layer in range(lm.spec.n_layers):
        np.testing.assert_allclose(s.evictor.scores[layer][0].numpy(), want, rtol=2e-4)


def test_locret_session_holds_the_budget(lm):
    """A document 6x the budget: the store ends with the budget (plus the answer), the next
    token's position is that, and a turn and a reset to the document work from there."""
    ids = _ids(1500, seed=1)
    s = Session(lm, settings(attention="LOCRET", prefill="DENSE", locret_scores="ATTENTION",
                             locret_budget=256, locret_stabilisers=32, chunk_size=128))
    toks = _greedy(s, ids, 6)
    assert len(toks) == 6
    assert s.store.length == 256 + 5 and s.pos == s.store.length
    assert s.dropped == 1500 - 256 and len(s.tokens) == 1505
    s.truncate(1500)  # back to the document: the kept rows stay
    assert s.store.length == 256 and s.pos == 256
    s.prefill(_ids(20, seed=2))  # a question after the document is appended, not evicted
    assert s.store.length == 276
    s.truncate(100)  # into the part that was read with eviction: the document goes
    assert len(s.tokens) == 0 and s.store.length == 0 and s.dropped == 0


def test_recent_keeps_the_first_tokens_and_the_last(lm):
    """RECENT (StreamingLLM at the same budget): init_len first rows and the newest ones; keys
    re-placed at 0..budget-1 equal the exact keys of those tokens at those positions."""
    ids = _ids(600, seed=3)
    st = settings(attention="LOCRET", prefill="DENSE", locret_scores="RECENT",
                  locret_budget=160, locret_stabilisers=16, chunk_size=64, init_len=16)
    s = Session(lm, st)
    s.prefill(ids)
    dense = Session(lm, settings(attention="DENSE", prefill="DENSE"))
    dense.prefill(ids[:16])
    k_first, v_first = dense.store.token_range(0, 0, 16)
    k, v = s.store.token_range(0, 0, 160)
    torch.testing.assert_close(k[:, :16], k_first, atol=1e-4, rtol=1e-4)  # same positions
    torch.testing.assert_close(v[:, :16], v_first, atol=1e-5, rtol=1e-5)


def test_locret_refuses_sliding_window_models(tmp_path):
    from ktlong.tinymodel import make_model

    path = make_model(tmp_path / "g", "gemma3_text", layers=6, hidden=64, heads=4, kv_heads=2,
                      sliding_window=64)
    g = load_model(path, device="CPU", dtype="float32")
    with pytest.raises(KtlongError, match="sliding-window"):
        Session(g, settings(attention="LOCRET", locret_scores="RECENT"))


# --- heads files and training -------------------------------------------------------------------
class _Stop(Exception):
    pass


def _stop_after(n: int):
    def progress(done: int, total: int, loss: float) -> None:
        if done == n:
            raise _Stop
    return progress


def test_train_heads_learns_and_resumes(lm, tmp_path):
    """A tiny model's heads train in seconds and the loss falls; a run stopped after its
    checkpoint resumes to the very heads of an unbroken run (on one thread count: the default
    follows the idle cores, and torch's sums split by threads)."""
    train = functools.partial(trainheads.train, threads=1)
    cfg = trainheads.TrainConfig(docs=4, doc_tokens=300, questions=2, answer_tokens=6,
                                 save_every=2)
    full = tmp_path / "full.safetensors"
    r = train(lm, full, cfg, fresh=True)
    assert r["examples"] == 8 and r["loss_last"] < r["loss_first"]
    assert 0.0 <= r["heads_keeping_fact"] <= 1.0 and 0.0 < r["fact_kept"] <= 1.0
    part = tmp_path / "part.safetensors"
    with pytest.raises(_Stop):
        train(lm, part, cfg, fresh=True, progress=_stop_after(2))
    assert part.with_name(part.name + ".partial").is_file() and not part.exists()
    assert train(lm, part, cfg)["examples"] == 8
    assert not part.with_name(part.name + ".partial").exists()
    (a, meta), (b, _) = locret.load_heads(full, lm.spec), locret.load_heads(part, lm.spec)
    assert meta.n_layers == lm.spec.n_layers and meta.examples == 8
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # cut short: a run stopped after 2 documents, finished with --docs 2, is a --docs 2 run
    short, two = tmp_path / "short.safetensors", tmp_path / "two.safetensors"
    with pytest.raises(_Stop):
        train(lm, short, cfg, fresh=True, progress=_stop_after(2))
    assert train(lm, short, dataclasses.replace(cfg, docs=2))["documents"] == 2
    train(lm, two, dataclasses.replace(cfg, docs=2), fresh=True)
    (a, _), (b, _) = locret.load_heads(short, lm.spec), locret.load_heads(two, lm.spec)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_the_held_out_check_finds_the_fact_line_by_diffing_the_ids(lm):
    text, line = trainheads._document(lm.tokenizer, 300, 7, True)
    assert line in text.split("\n") and line.startswith("The reference code")
    ids = lm.tokenizer.encode(text)
    a, b = trainheads.fact_span(ids, lm.tokenizer.encode(text.replace(f"{line}\n", "", 1)))
    code = line.split()[-1].rstrip(".")
    assert code in lm.tokenizer.decode(ids[a:b]) and code not in lm.tokenizer.decode(ids[:a])
    assert trainheads._document(lm.tokenizer, 300, 7, False)[1] is None


def test_the_held_out_check_counts_the_line_the_scores_rank_high(lm):
    """Scores that put the fact line above everything else keep all of it; below, none."""
    from ktlong.conversation import Conversation

    text, line = trainheads._document(lm.tokenizer, 300, trainheads.HELD_OUT0, True)
    ids = Conversation(lm.tokenizer, text).document_ids()
    a, b = trainheads.fact_span(
        ids, Conversation(lm.tokenizer, text.replace(f"{line}\n", "", 1)).document_ids())
    s = Session(lm, settings(attention="DENSE", prefill="DENSE"))
    rec = trainheads.Recorder(s.store.shape.n_layers)
    s.router.evictor = rec
    for sign, want in ((1.0, 1.0), (-1.0, 0.0)):
        def heads(slot, x, sign=sign):
            out = torch.zeros(x.shape[0], lm.spec.n_kv_heads)
            out[a:b] = sign
            return out
        got = trainheads.fact_kept(s, rec, heads, lm, None, 300, docs=1)
        assert got == {"fact_kept": want, "heads_keeping_fact": want}


def test_heads_file_checks(lm, tmp_path):
    """Heads load only for their model and only undamaged; a LOCRET session without heads for
    its model says how to get them."""
    spec = lm.spec
    heads = locret.RetainingHeads(spec.n_layers, 4 * 16 * 2, spec.n_kv_heads)
    path = tmp_path / "h.safetensors"
    locret.save_heads(path, heads, locret.HeadsMeta(spec.fingerprint, "tiny", spec.n_layers,
                                                    128, spec.n_kv_heads, locret.HIDDEN))
    got, _ = locret.load_heads(path, spec)
    torch.testing.assert_close(got.w1, heads.w1.detach().half().float())
    other = dataclasses.replace(spec, fingerprint="0" * 16)
    with pytest.raises(KtlongError, match="trained for tiny"):
        locret.load_heads(path, other)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(KtlongError, match="damaged"):
        locret.load_heads(path, spec)
    with pytest.raises(KtlongError, match="train-heads"):
        Session(lm, settings(attention="LOCRET", locret_scores="HEADS",
                             locret_heads=str(tmp_path / "none.safetensors")))


def test_locret_scored_by_heads(lm, tmp_path):
    """attention LOCRET with trained heads: the session loads them from locret_heads and keeps
    the budget; the answer comes."""
    cfg = trainheads.TrainConfig(docs=2, doc_tokens=300, questions=1, answer_tokens=4)
    out = tmp_path / "h.safetensors"
    trainheads.train(lm, out, cfg, fresh=True)
    s = Session(lm, settings(attention="LOCRET", prefill="DENSE", locret_heads=str(out),
                             locret_budget=200, locret_stabilisers=32, chunk_size=100))
    assert len(_greedy(s, _ids(900, seed=4), 4)) == 4
    assert s.store.length == 203 and s.dropped == 700


def test_prompt_cache_keeps_what_locret_kept(lm, tmp_path):
    """A LOCRET document's entry holds the kept rows (not the document's): opened again, the
    session answers as the one that read it, and another budget is another entry."""
    from ktlong.promptcache import open_document

    ids = _ids(1200, seed=6)
    st = settings(attention="LOCRET", prefill="DENSE", locret_scores="ATTENTION",
                  locret_budget=256, locret_stabilisers=32, chunk_size=128, max_seq_len=1024)
    question = ids + _ids(12, seed=7)  # a cached session has no logits: a question brings them
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    assert first.source == "prefill" and first.session.store.length == 256
    first.session.extend_to(question)
    want = [x.token_id for x in first.session.generate(Sampling(max_new_tokens=8))]
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache" and again.session.store.length == 256
    assert again.session.dropped == 1200 - 256 and again.session.pos == 256
    again.session.extend_to(question)
    assert [x.token_id for x in again.session.generate(Sampling(max_new_tokens=8))] == want
    other = open_document(lm, dataclasses.replace(st, locret_budget=320), ids, cache_dir=tmp_path)
    assert other.source == "prefill" and other.session.store.length == 320


def test_memcheck_locret_kv_is_flat():
    """memcheck under attention LOCRET: the KV column is the budget and one chunk at every
    length past it; the LOCRET line gives the same bytes."""
    from ktlong import memory
    from ktlong.config import Settings

    st = dataclasses.replace(Settings(), attention="LOCRET")
    r = memory.report(memory.REFERENCE, "bf16", 100 * 10**9, None, settings=st)
    held = st.locret_budget + 1024
    per_tok = memory.kv_bytes_per_token(memory.REFERENCE, "BF16")
    long = [row for row in r["rows"] if row["tokens"] >= held]
    assert len(long) >= 4 and {row["kv_bytes"] for row in long} == {held * per_tok}
    assert r["locret"]["kv_bytes"]["BF16"] == held * per_tok
    dense = memory.report(memory.REFERENCE, "bf16", 100 * 10**9, None)
    assert max(row["kv_bytes"] for row in dense["rows"]) > 100 * held * per_tok


@pytest.mark.parametrize("args, message", [
    (["train-heads"], "train-heads needs --model"),
    (["chat", "-p", "locret", "-q", "hi", "--no-cache"], "retaining heads"),
])
def test_cli_lines(args, message, capsys, tmp_path, monkeypatch):
    """No model to train, or no heads for LOCRET: one line and exit 2, no traceback."""
    from ktlong.cli import main

    monkeypatch.setenv("KTLONG_HOME", str(tmp_path))
    if args[0] == "chat":
        doc = tmp_path / "d.txt"
        doc.write_text("some text " * 50)
        args = [*args, "-m", str(hf_model("llama")), "-f", str(doc)]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_shipped_heads_load_for_their_models():
    """The heads that ship (the demo model's, SmolLM2-135M-Instruct's) are found for their
    model and load: `--profile locret` works on them at once."""
    from ktlong.config import Settings
    from ktlong.demo import MODEL_DIR
    from ktlong.registry import resolve_model
    from ktlong.spec import read_spec

    for model in (MODEL_DIR, resolve_model("smollm2")):
        spec = read_spec(model)
        path = locret.find_heads(spec, Settings())
        assert path == locret.shipped_path(spec) and path.stat().st_size < 8 << 20
        heads, meta = locret.load_heads(path, spec)
        assert meta.n_layers == len(spec.kv_layers) and meta.n_kv_heads == spec.n_kv_heads
        x = torch.randn(5, meta.n_in)
        assert heads(0, x).shape == (5, spec.n_kv_heads)
