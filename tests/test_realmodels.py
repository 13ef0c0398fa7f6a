"""The two real pretrained models the dev install brings (SmolLM2-135M-Instruct, Q4_1 GGUF;
Gemma 3 270M, Q4_K_M GGUF with Q5_0 tensors and sliding-window layers), on real prose that the
project did not write (the license texts Debian ships)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ktlong.config import resolve_settings
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.registry import resolve_model

GPL3 = Path("/usr/share/common-licenses/GPL-3")
pytestmark = pytest.mark.skipif(not GPL3.exists(), reason="needs Debian's license texts")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def models(home):
    import os

    old = os.environ.get("KTLONG_HOME")
    os.environ["KTLONG_HOME"] = str(home)
    try:
        yield {name: str(resolve_model(name)) for name in ("smollm2", "gemma3-270m")}
    finally:
        if old is None:
            os.environ.pop("KTLONG_HOME", None)
        else:
            os.environ["KTLONG_HOME"] = old


def _ids(tokenizer, n: int) -> list[int]:
    return tokenizer(GPL3.read_text())["input_ids"][:n]


def _dense(**kw):
    return resolve_settings("dense", {"threads_num": 2, "kv_type": "FP32", "max_seq_len": 4096,
                                      "kv_tier": "RAM", **kw}).settings


def _stock(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)


# Gemma: 700 tokens put every sliding-window layer past its 512-token window
@pytest.mark.parametrize("name,n", [("smollm2", 600), ("gemma3-270m", 700)])
def test_dense_decode_follows_transformers_on_the_same_gguf(models, name, n):
    """transformers' greedy tokens fed to ktlong one at a time (the decode path: the int8 GEMV):
    at every step ktlong's log-probabilities of transformers' ten likeliest tokens stay within
    0.5 of transformers' (rounding x to int8 per 32 channels, as llama.cpp does, moves them a
    little), and its choice is transformers' wherever transformers' top two are no near-tie."""
    lm = load_model(models[name], device="CPU")
    assert not lm.warnings  # every tensor read in its file's type, none widened
    ids = _ids(lm.tokenizer, n)
    stock = _stock(models[name])
    with torch.no_grad():
        seq = stock.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0]
        ref = stock(seq[None, :-1]).logits[0, len(ids) - 1:]  # [12, vocab]
    s = Session(lm, _dense())
    got = [s.prefill(ids)[-1]]
    got += [s.prefill([int(t)])[-1] for t in seq[len(ids):-1]]
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        likely = torch.topk(r, 10).indices
        lg, lr = torch.log_softmax(g, -1)[likely], torch.log_softmax(r, -1)[likely]
        assert (lg - lr).abs().max() < 0.5, (step, lg, lr)
        top = torch.topk(r, 2).values
        if top[0] - top[1] > 0.25:
            assert int(g.argmax()) == int(r.argmax()), step


def test_gemma_keeps_only_the_window_for_its_sliding_layers(models):
    lm = load_model(models["gemma3-270m"], device="CPU")
    spec = lm.spec
    assert (spec.arch, spec.sliding_window, spec.kv_layers) == ("gemma3", 512, (5, 11, 17))
    s = Session(lm, _dense())
    s.prefill(_ids(lm.tokenizer, 1500))
    assert s.store.shape.n_layers == 3 and s.store.length == 1500
    # pinned at the document's end: the rows a cut back to it needs, no more
    assert {s.window.first[layer] for layer in spec.sliding_layers} == {1500 - 512}
    assert {s.window.rows(layer)[0].shape[1] for layer in spec.sliding_layers} == {512}
    # decode appends in place: the buffers (k and v, 15 layers, 1 KV head of 256 floats) stay
    # within twice the rows kept
    list(s.generate(Sampling(max_new_tokens=40)))
    assert {s.window.rows(layer)[0].shape[1] for layer in spec.sliding_layers} == {512 + 39}
    assert s.window.nbytes() <= 2 * (2 * 15 * (512 + 39) * 256 * 4)


def test_gemma_prompt_cache_restores_the_sliding_window(models, home, tmp_path):
    """A question after a cached document reads as after a fresh prefill: the entry carries
    the sliding-window layers' last rows (without them, those layers would see nothing)."""
    from ktlong.promptcache import open_document

    lm = load_model(models["gemma3-270m"], device="CPU")
    ids = _ids(lm.tokenizer, 900)
    question = lm.tokenizer(" Who may modify it?")["input_ids"][1:]  # no second BOS
    st = _dense()
    fresh = Session(lm, st)
    want = fresh.prefill(ids + question)[-1]
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    assert first.source == "prefill" and first.entry is not None
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache" and again.session.window is not None
    got = again.session.prefill(question)[-1]
    assert int(got.argmax()) == int(want.argmax())
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    again.session.truncate(len(ids))  # back to the document (/reset), then the same again
    got2 = again.session.prefill(question)[-1]
    torch.testing.assert_close(got2, got, rtol=1e-4, atol=1e-4)


def test_memcheck_counts_gemma_sliding_layers_at_their_window(models, home):
    from typer.testing import CliRunner

    from ktlong.cli import app

    r = CliRunner().invoke(app, ["memcheck", "-m", "gemma3-270m", "--json"],
                           env={"KTLONG_HOME": str(home)})
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kv_bytes_per_token"]["BF16"] == 2 * 3 * 1 * 256 * 2  # the 3 global layers
    assert (data["sliding_layers"], data["sliding_window"]) == (15, 512)
    smol = CliRunner().invoke(app, ["memcheck", "-m", "smollm2", "--json"],
                              env={"KTLONG_HOME": str(home)})
    assert json.loads(smol.stdout)["kv_bytes_per_token"]["BF16"] == 2 * 30 * 3 * 64 * 2


def test_chat_answers_about_a_real_document(models, home, tmp_path):
    from typer.testing import CliRunner

    from ktlong.cli import app

    doc = tmp_path / "license.txt"
    doc.write_text(GPL3.read_text()[:6000])
    r = CliRunner().invoke(app, ["chat", "-m", "smollm2", "-f", str(doc), "-q",
                                 "Which license is this text?", "--max-new-tokens", "24",
                                 "--json", "--no-cache", "-t", "2"],
                           env={"KTLONG_HOME": str(home)})
    assert r.exit_code == 0, r.output
    answers = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    text = " ".join(str(a.get("answer", a.get("text", ""))) for a in answers)
    assert "GNU" in text or "General Public" in text, text


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_the_saved_tokenizer_is_the_converted_one(models, name):
    """Later loads read the tokenizer saved in KTLONG_HOME: the same ids on real prose with the
    chat markers in it, the same special tokens and chat prompt as transformers' conversion."""
    from transformers import AutoTokenizer

    from ktlong.model import load_tokenizer

    load_tokenizer(models[name])  # the module's first load converted and saved it
    saved = load_tokenizer(models[name])
    p = Path(models[name])
    fresh = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    text = GPL3.read_text()[:40000] + "<start_of_turn>user\n<|im_start|>assistant\n<eos>"
    assert saved(text)["input_ids"] == fresh(text)["input_ids"]
    assert saved.all_special_ids == fresh.all_special_ids
    assert (saved.bos_token, saved.eos_token) == (fresh.bos_token, fresh.eos_token)
    if saved.chat_template:
        chat = [{"role": "user", "content": "What is section 15?"}]
        assert saved.apply_chat_template(chat, add_generation_prompt=True) == \
            fresh.apply_chat_template(chat, add_generation_prompt=True)


def test_accuracy_peers_answer_as_ktlong_dense_inside_the_trained_length(models):
    """bench accuracy's llama.cpp rows read the same prompt ids: inside the trained length
    llama.cpp (YaRN or not: nothing to stretch) gives ktlong dense's greedy answer (its first
    line: past it, near-ties between float orders may part the two)."""
    pytest.importorskip("llama_cpp")
    from ktlong.demo import accuracy

    recs = accuracy.run(Path(models["smollm2"]), [1500], 1,
                        ["dense", "llamacpp", "llamacpp-yarn"], threads=2,
                        task_names=["passkey", "needle"], haystack="real")
    by = {(r.profile, r.task): r for r in recs}
    assert len(recs) == 6 and all(r.answer.strip() for r in recs)
    for task in ("passkey", "needle"):
        want = by[("dense", task)]
        for peer in ("llamacpp", "llamacpp-yarn"):
            got = by[(peer, task)]
            assert got.answer.strip().splitlines()[0] == want.answer.strip().splitlines()[0]
            assert got.correct == want.correct


def _step_reads(session, steps: int) -> list[int]:
    """Tokens each layer's decode step reads (the policy's blocks, the local window's partial
    block at its size, the first block's second read), over `steps` greedy tokens."""
    policy, bs = session.policy, session.settings.block_size
    reads: list[int] = []
    commit = policy.commit

    def counting(step, chosen=None):
        out = commit(step, chosen)
        blocks = out.blocks()[0]
        tokens = sum(min(bs, out.n_tokens - b * bs) for b in blocks.tolist())
        reads.append(tokens + (bs if policy._head and out.n_init else 0))
        return out

    policy.commit = counting
    list(session.generate(Sampling(max_new_tokens=steps)))
    policy.commit = commit
    return reads


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def test_a_real_chat_step_reads_its_budget_and_nothing_from_disk(models, home, tmp_path):
    """SmolLM2 over 3,500 tokens of real prose (GPL-3), a budget of 1,792 tokens a step: every
    decode step of every layer reads at most its budget (plus the block the window moves into
    while a selection is reused), from a fresh prefill and from the prompt cache alike; the
    cache entry stays in memory, so decoding from it reads nothing from the disk."""
    from ktlong.conversation import Conversation
    from ktlong.fit import fit_to_model
    from ktlong.promptcache import open_document

    lm = load_model(models["smollm2"])
    st = fit_to_model(resolve_settings(None, {
        "threads_num": 2, "second_select_num": 8, "local_windows_len": 512, "init_len": 128,
        "token_step": 2}, config_file=False), lm.spec).settings
    conv = Conversation(lm.tokenizer, lm.tokenizer.decode(_ids(lm.tokenizer, 3500)))
    ids = conv.document_ids()
    question = conv.prompt_ids(conv.question_text("What does the license say about patents?"))
    budget = st.init_len + st.second_select_num * st.block_size + st.local_windows_len \
        + st.block_size  # the window's partial block
    for source in ("prefill", "cache"):
        opened = open_document(lm, st, ids, cache_dir=tmp_path)
        assert opened.source == source
        s = opened.session
        assert s.policy.sparse_for(len(question))
        s.extend_to(question)
        io0 = _read_bytes()
        reads = _step_reads(s, 24)
        assert len(reads) == 23 * s.store.shape.n_layers
        assert max(reads) <= budget + st.block_size + (st.block_size if s.policy._head else 0)
        assert min(reads) >= budget - 2 * st.block_size  # sparse, not a sliver of it
        if source == "cache":
            assert s.store.mapped
            assert _read_bytes() - io0 < 1 << 20  # the entry's blocks came from memory


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_the_cache_and_the_thread_count_leave_the_answer_as_it_was(models, tmp_path, name):
    """3,000 tokens of real prose read sparsely (a budget of ~1,900 tokens a step): the question
    after the document from the prompt cache gets the logits, bit for bit, and the greedy answer
    that it gets after the document's own prefill; decoding on 1 thread instead of 2 too (the
    attention's work split is the machine's, not the session's); and a read whose KV goes to
    the disk tier (kv_tier DISK: the block choice is made before the kernel reads)."""
    import dataclasses

    from ktlong.conversation import Conversation
    from ktlong.fit import fit_to_model
    from ktlong.promptcache import open_document

    lm = load_model(models[name])
    st = fit_to_model(resolve_settings(None, {
        "threads_num": 2, "second_select_num": 12, "local_windows_len": 256, "init_len": 128},
        config_file=False), lm.spec).settings  # 12 blocks: 8 the question's, 4 chosen a step
    conv = Conversation(lm.tokenizer, lm.tokenizer.decode(_ids(lm.tokenizer, 3000)))
    ids = conv.document_ids()
    question = conv.prompt_ids(conv.question_text("What does the license say about patents?"))
    runs, states = [], []
    for threads, tier in ((2, "RAM"), (2, "RAM"), (1, "RAM"), (2, "DISK")):
        # the first reads the document and writes its entry; the one on the disk tier reads it
        # again (into a cache folder of its own) and maps its entry as the first did
        where = tmp_path / tier
        opened = open_document(lm, dataclasses.replace(st, kv_tier=tier), ids, cache_dir=where)
        s = opened.session
        assert (s.store.tier is not None) == (tier == "DISK")
        s.settings = dataclasses.replace(st, threads_num=threads)
        states.append((s.policy.doc_start, s.policy.pinned().copy()))
        # the document leaves the same state however it came: the template's length, no pins
        assert states[-1][0] == states[0][0] and np.array_equal(states[-1][1], states[0][1])
        s.extend_to(question)
        logits = s.logits.clone()
        answer = [step.token_id for step in s.generate(Sampling(max_new_tokens=24))]
        runs.append((opened.source, logits, answer))
    assert [r[0] for r in runs] == ["prefill", "cache", "cache", "prefill"]
    assert s.policy.sparse_for(len(question))
    for source, logits, answer in runs[1:]:
        assert torch.equal(logits, runs[0][1]), source
        assert answer == runs[0][2], source
