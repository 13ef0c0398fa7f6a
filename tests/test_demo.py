"""The built-in demo: task generator, shipped model (HF and GGUF), `chat --demo`, accuracy."""
from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from ktlong.cli import app
from ktlong.demo import MODEL_DIR, tasks
from ktlong.demo.train import GGUF_NAME

needs_model = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(),
                                 reason="the demo model is not trained yet")


# --- task generator -----------------------------------------------------------------------------
def test_samples_are_deterministic_from_the_seed() -> None:
    a, b = tasks.make_sample(7, 600), tasks.make_sample(7, 600)
    assert a == b
    assert tasks.make_sample(8, 600).document != a.document
    m1 = tasks.make_mixed(3, 2000, {"passkey": 0.1, "kv": 0.5, "needle": 0.9})
    assert m1 == tasks.make_mixed(3, 2000, {"passkey": 0.1, "kv": 0.5, "needle": 0.9})
    assert [f.kind for f in m1.asked] == ["passkey", "kv", "needle"]
    assert tasks.demo_sample(0, 1000) == tasks.demo_sample(0, 1000)


def test_facts_sit_at_their_depths_and_filler_has_no_digits() -> None:
    s = tasks.make_mixed(5, 4000, {"passkey": 0.25, "kv": 0.5, "needle": 0.75})
    doc = s.document
    for f in s.asked:
        assert doc.count(f.sentence) == 1
        assert abs(doc.index(f.sentence) / len(doc) - f.depth) < 0.05
        assert f.value in f.answer
    filler = doc
    for f in s.facts:
        filler = filler.replace(f.sentence, "")
    assert not any(ch.isdigit() for ch in filler)
    assert len(s.facts) == 1 + 4 + 1  # kv: at least 4 records, 3 of them distractors


def test_length_lands_near_the_target_with_a_counter() -> None:
    def count(text: str) -> int:  # ~ the demo tokenizer: one token per word or punctuation
        return len(text.replace(".", " .").split())

    s = tasks.make_mixed(1, 3000, {"passkey": 0.5}, count=count)
    assert abs(count(s.document) - 3000) < 60


def test_training_positions_jump_between_sentences_only() -> None:
    from ktlong.demo import train

    tok = train.build_tokenizer()
    s = tasks.make_sample(11, 800)
    ids, mask, doc_len = train.encode(tok, s)
    assert len(ids) == len(mask) and 0 < doc_len < len(ids)
    answers = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert all(f.answer in answers for f in s.asked)
    pos = train.position_ids(random.Random(0), tok, s, len(ids), doc_len, jump_p=1.0)
    jumps = [i for i in range(1, len(pos)) if pos[i] - pos[i - 1] != 1]
    assert jumps and all(i < doc_len for i in jumps)  # question and answers stay contiguous
    text = tok.decode(ids[:doc_len])
    for i in jumps:  # never inside a fact: the fact's text is whole on one side
        before, after = tok.decode(ids[:i]), tok.decode(ids[i:doc_len])
        for f in s.facts:
            assert f.sentence in before or f.sentence in after or f.sentence not in text


# --- the shipped model ----------------------------------------------------------------------------
@needs_model
def test_shipped_model_loads_as_hf_folder_and_gguf() -> None:
    import torch

    from ktlong.config import resolve_settings
    from ktlong.engine import Session
    from ktlong.model import load_model

    hf = load_model(MODEL_DIR, "CPU")
    gg = load_model(MODEL_DIR / GGUF_NAME, "CPU")
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size < 25e6
    for lm in (hf, gg):
        assert lm.spec.n_heads > lm.spec.n_kv_heads > 0  # GQA: SHARED and SEPARATE differ
        assert lm.tokenizer.chat_template
        assert lm.tokenizer.convert_tokens_to_ids("<|end|>") in lm.eos_ids
    text = "The pass key is 12345. Remember it. What is the pass key?"
    ids = hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert gg.tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    msgs = [{"role": "user", "content": text}]  # the same rendered prompt, BOS included
    assert gg.tokenizer.bos_token == hf.tokenizer.bos_token == "<|bos|>"
    assert gg.tokenizer.apply_chat_template(msgs) == hf.tokenizer.apply_chat_template(msgs)
    ids = [hf.tokenizer.bos_token_id] + ids
    st = resolve_settings("dense", {"max_seq_len": 256, "device": "CPU"}).settings
    a = Session(hf, st).prefill(ids)[-1]
    b = Session(gg, st).prefill(ids)[-1]
    assert torch.allclose(a, b, atol=1e-3)


@needs_model
def test_chat_demo_runs_end_to_end() -> None:
    n = 1024
    key = next(f.value for f in tasks.demo_sample(0, n).facts if f.kind == "passkey")
    r = CliRunner().invoke(app, ["chat", "--demo", "--demo-tokens", "1K", "--no-cache",
                                 "--question", "What is the pass key?", "--json"])
    assert r.exit_code == 0, r.output
    answer = json.loads(r.stdout.strip().splitlines()[-1])["answer"]
    assert "What is the pass key?" in r.stderr  # what to ask is printed
    assert answer.strip().rstrip(".") == f"The pass key is {key}"  # the hidden key, retrieved


def test_chat_demo_refuses_a_prompt_file(tmp_path) -> None:
    doc = tmp_path / "d.txt"
    doc.write_text("hello")
    r = CliRunner().invoke(app, ["chat", "--demo", "--prompt-file", str(doc), "-q", "hi"])
    assert r.exit_code == 2 and "--demo brings its own document" in r.output


@needs_model
def test_bench_accuracy_runs_every_profile_on_one_prefill() -> None:
    from ktlong.demo import accuracy

    recs = accuracy.run(None, [1024], 2, ["dense", "quest", "streamingllm"])
    assert len(recs) == 2 * 3 * 3
    assert {r.profile for r in recs} == {"dense", "quest", "streamingllm"}
    assert all(r.answer for r in recs)
    md = accuracy.markdown(recs, "ktlong bench accuracy --lengths 1K --samples 2")
    assert "| 1K | passkey |" in md and "streamingllm" in md


@needs_model
def test_bench_accuracy_cli_json() -> None:
    r = CliRunner().invoke(app, ["bench", "accuracy", "--lengths", "512", "--samples", "1",
                                 "--profiles", "dense", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {x["task"] for x in out["records"]} == set(tasks.TASKS)
    assert out["device"] == "cpu" and "--device cpu" in out["command"]
    assert out["haystack"] == "filler" and out["tasks"] == list(tasks.TASKS)
    r = CliRunner().invoke(app, ["bench", "accuracy", "--lengths", "1K", "--samples", "1",
                                 "--profiles", "dense", "--haystack", "prose",
                                 "--tasks", "needle,multineedle", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["haystack"] == "prose" and out["tasks"] == ["needle", "multineedle"]
    assert "--haystack prose" in out["command"] and "--tasks needle,multineedle" in out["command"]
    assert [x["task"] for x in out["records"]] == ["needle", "multineedle"]
    assert [(c["task"], c["n"]) for c in out["summary"]] == [("needle", 1), ("multineedle", 1)]
    assert all(0 <= c["ci95"][0] <= c["pct"] <= c["ci95"][1] <= 100 for c in out["summary"])


@needs_model
def test_bench_accuracy_save_keeps_the_documents_of_a_stopped_run(tmp_path, monkeypatch) -> None:
    """--save FILE holds every finished document's records as the run goes (a run stopped in
    its second document keeps the first, marked incomplete), and at the end what --json
    prints."""
    from ktlong.demo import accuracy

    out = tmp_path / "acc.json"
    make, calls = tasks.make_mixed, []

    def stop_at_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return make(*a, **k)
    monkeypatch.setattr(tasks, "make_mixed", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        accuracy.main(None, [512], 2, ["dense"], save=out, device="CPU")
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and len(kept["records"]) == len(tasks.TASKS)
    monkeypatch.setattr(tasks, "make_mixed", make)
    r = CliRunner().invoke(app, ["bench", "accuracy", "--lengths", "512", "--samples", "2",
                                 "--profiles", "dense", "--device", "cpu", "--json",
                                 "--save", str(out)])
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout.strip().splitlines()[-1])
    assert printed["complete"] is True and len(printed["records"]) == 2 * len(tasks.TASKS)
    assert json.loads(out.read_text()) == printed
    assert printed["records"][: len(tasks.TASKS)] == kept["records"]  # the same first document
    def full_disk(path, text):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("ktlong.configfile.atomic_write", full_disk)
    r = CliRunner().invoke(app, ["bench", "accuracy", "--lengths", "512", "--samples", "1",
                                 "--profiles", "dense", "--device", "cpu", "--json",
                                 "--save", str(out)])
    assert r.exit_code == 0 and "No space left on device; the run goes on" in r.output, r.output
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["records"]) == len(tasks.TASKS)
    r = CliRunner().invoke(app, ["bench", "accuracy", "--save", str(tmp_path / "no" / "a.json")])
    assert r.exit_code == 2 and "no folder" in r.output, r.output


@needs_model
def test_bench_accuracy_reads_again_one_document_and_ranks_the_fact(tmp_path) -> None:
    """--only runs just the chosen documents of a run, the same ones; past the step's budget each
    answer records where the question's vote ranked the fact's block (0: first), once per
    vote (the question is voted on, read again with its blocks, and voted on again)."""
    from ktlong.demo import accuracy

    small = tmp_path / "small.yaml"
    small.write_text("local_windows_len: 256\nsecond_select_num: 4\nquestion_blocks: 2\n")
    r = CliRunner().invoke(app, ["bench", "accuracy", "--lengths", "2K", "--samples", "3",
                                 "--only", "2", "--profiles", f"dense,{small}", "--tasks",
                                 "passkey,needle", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "--only 2" in out["command"]
    depths = accuracy.depths_for(2, 3, ["passkey", "needle"])
    assert [(x["task"], x["depth"]) for x in out["records"]] \
        == [(t, round(d, 3)) for t, d in depths.items()] * 2
    sparse = [x for x in out["records"] if x["profile"] == str(small)]
    assert all(x["ranks"] == [] for x in out["records"] if x["profile"] == "dense")
    assert all(len(x["ranks"]) == 2 and all(-1 <= k < 16 for k in x["ranks"]) for x in sparse)
    assert "the fact's block ranked passkey" in " ".join(r.output.split())  # wrapped at 80
    r = CliRunner().invoke(app, ["bench", "accuracy", "--samples", "3", "--only", "0,3"])
    assert r.exit_code == 2 and "--only '0,3'" in r.output, r.output


def test_bench_accuracy_rejects_an_unknown_profile() -> None:
    r = CliRunner().invoke(app, ["bench", "accuracy", "--profiles", "dense,nosuch"])
    assert r.exit_code == 2 and "nosuch" in r.output
