"""`bench accuracy`'s documents and figures: the prose haystack, the multineedle task, Wilson
intervals, the summary and the options; no model forward (the CLI run is in test_demo)."""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ktlong.cli import app
from ktlong.demo import MODEL_DIR, prose, tasks
from ktlong.demo import accuracy as acc

DEPTHS = {"passkey": 0.25, "kv": 0.5, "needle": 0.75}


def _sentences(doc: str) -> list[str]:
    return [s for s in re.split(r'(?<=[.?!])\s+|(?<=[.?!]")\s+', doc) if s]


def _haystack(s: tasks.Sample) -> str:
    doc = s.document
    for f in s.facts:
        doc = doc.replace(f.sentence, "")
    return doc


# --- the prose haystack -------------------------------------------------------------------------
def test_prose_is_deterministic_from_the_seed() -> None:
    a = tasks.make_mixed(3, 3000, DEPTHS, haystack="prose")
    assert a == tasks.make_mixed(3, 3000, DEPTHS, haystack="prose")
    assert a.document != tasks.make_mixed(4, 3000, DEPTHS, haystack="prose").document
    assert a.document != tasks.make_mixed(3, 3000, DEPTHS).document  # filler stays the default
    assert prose.paragraphs(random.Random(9), 20) == prose.paragraphs(random.Random(9), 20)
    s = tasks.make_sample(5, 2000, task="needle", depth=0.4, haystack="prose")
    assert s == tasks.make_sample(5, 2000, task="needle", depth=0.4, haystack="prose")
    with pytest.raises(ValueError, match="haystack"):
        tasks.make_mixed(3, 1000, DEPTHS, haystack="poetry")


def test_prose_reads_as_a_story_and_does_not_repeat() -> None:
    s = tasks.make_mixed(1, 20000, DEPTHS, haystack="prose")  # ~20K demo tokens
    sentences = _sentences(s.document)
    assert len(sentences) > 500
    assert len(set(sentences)) / len(sentences) > 0.9
    paras = s.document.split("\n")
    assert len(paras) > 100 and any(p.startswith('"') for p in paras)  # dialogue lines
    names = {n for n, _ in prose.NAMES if n in s.document}
    assert len(names) >= 6  # a cast, not one character
    assert any(t in s.document for t in prose.TIMES)
    # over a long story the seasons turn and people come and go
    story = prose.Story(random.Random(2)).sentences()
    long = " ".join(next(story)[0] for _ in range(20000))
    assert all(season in long for season in prose.SEASONS)
    assert len({n for n, _ in prose.NAMES if n in long}) > 12


def test_prose_holds_no_digits_cities_or_fact_wording() -> None:
    s = tasks.make_mixed(2, 12000, {**DEPTHS, "multineedle": 0.1}, haystack="prose")
    rest = _haystack(s)
    assert not any(ch.isdigit() for ch in rest)
    words = set(re.findall(r"[A-Za-z]+", rest))
    assert not words & set(tasks.CITIES)
    assert not words & {"key", "value", "pass"}
    assert "best thing" not in rest
    assert not any(obj in rest for obj in tasks.OBJECTS)


def test_prose_facts_sit_at_their_depths() -> None:
    s = tasks.make_mixed(5, 6000, DEPTHS, haystack="prose")
    for f in s.asked:
        assert s.document.count(f.sentence) == 1
        assert abs(s.document.index(f.sentence) / len(s.document) - f.depth) < 0.05


def test_prose_length_lands_near_the_target_with_a_counter() -> None:
    def count(text: str) -> int:  # ~ a tokenizer that splits long words: 1 token per 4 letters
        return sum(1 + len(w) // 4 for w in text.split())

    for n in (3000, 20000):
        s = tasks.make_mixed(1, n, {"passkey": 0.5}, count=count, haystack="prose")
        assert abs(count(s.document) - n) < max(40, n // 200)


@pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").exists(), reason="no demo tokenizer")
def test_prose_length_with_the_demo_tokenizer() -> None:
    """Prose words cost the demo tokenizer (trained on filler) about two tokens: the estimate
    uses prose.WORDS_PER_TOKEN and the correction lands near the asked length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    text = "\n".join(prose.paragraphs(random.Random(0), 600))
    assert abs(len(text.split()) / count(text) - prose.WORDS_PER_TOKEN) < 0.03
    for n in (4096, 32768):
        s = tasks.make_mixed(n, n, {**DEPTHS, "multineedle": 0.6}, count=count, haystack="prose")
        assert abs(count(s.document) - n) < 48
        assert abs(count(tasks.make_mixed(n, n, DEPTHS, haystack="prose").document) - n) < n * 0.05


# --- multineedle --------------------------------------------------------------------------------
@pytest.mark.parametrize("haystack", tasks.HAYSTACKS)
def test_multineedle_documents_hold_distinct_needles_and_ask_one(haystack: str) -> None:
    k = tasks.MULTI_NEEDLES
    for seed in range(6):
        d = (seed + 0.5) / 6
        s = tasks.make_mixed(seed, 4000, {"needle": 0.1, "multineedle": d}, haystack=haystack)
        multi = [f for f in s.facts if f.kind == "multineedle"]
        needles = [f for f in s.facts if f.kind in ("needle", "multineedle")]
        assert len(multi) == k and len(needles) == k + 1
        cities = {f.question.split(" in ")[-1] for f in needles}
        assert len(cities) == k + 1  # every question has one answer in the document
        assert len({f.value for f in needles}) == k + 1  # another needle's activity is wrong
        asked = s.asked[1]
        assert asked.kind == "multineedle" and asked.depth == pytest.approx(d)
        assert s.document.count(asked.sentence) == 1
        assert abs(s.document.index(asked.sentence) / len(s.document) - d) < 0.05
        gaps = sorted(f.depth for f in multi)
        assert [gaps[j + 1] - gaps[j] for j in range(k - 1)] == pytest.approx([1 / k] * (k - 1))
        assert tasks.is_correct(asked, asked.answer)
        assert not any(tasks.is_correct(asked, f.answer) for f in multi if f is not asked)
    s = tasks.make_sample(3, 2000, task="multineedle", depth=0.3)
    assert [f.kind for f in s.asked] == ["multineedle"] and s.asked[0].depth == 0.3
    assert len(s.facts) == k


def test_default_tasks_keep_their_documents() -> None:
    """Adding tasks and haystacks leaves the filler documents of the three tasks as they were."""
    s = tasks.make_mixed(3, 2000, {"passkey": 0.1, "kv": 0.5, "needle": 0.9})
    assert s == tasks.make_mixed(3, 2000, {"passkey": 0.1, "kv": 0.5, "needle": 0.9},
                                 haystack="filler")
    assert acc.depths_for(1, 4) == acc.depths_for(1, 4, tasks.TASKS)
    assert acc.depths_for(1, 4) == pytest.approx({"passkey": 0.375, "kv": 0.375 + 1 / 3,
                                                  "needle": 0.375 + 2 / 3 - 1})


def test_depths_spread_evenly_for_any_task_list() -> None:
    n = 8
    for names in (("needle", "multineedle"), tasks.ALL_TASKS, ("kv",)):
        per = [acc.depths_for(i, n, names) for i in range(n)]
        for t in names:
            got = sorted(d[t] for d in per)
            assert got == pytest.approx([(i + 0.5) / n for i in range(n)])  # one per band
        assert len({tuple(d.values()) for d in per}) == n


# --- Wilson intervals, summary, markdown, plot -------------------------------------------------
def test_wilson_interval_matches_known_values() -> None:
    lo, hi = acc.wilson(20, 20)
    assert lo == pytest.approx(0.8389, abs=1e-3) and hi == 1.0
    assert acc.wilson(10, 20) == pytest.approx((0.2993, 0.7007), abs=1e-3)
    assert acc.wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-3)
    assert acc.wilson(19, 20) == pytest.approx((0.7639, 0.9911), abs=1e-3)
    assert acc.wilson(0, 0) == (0.0, 1.0)


def _records(right: dict[str, int], n: int = 20) -> list[acc.Record]:
    out = []
    for task, r in right.items():
        for i in range(n):
            out.append(acc.Record(4096, task, "default", (i + 0.5) / n, i < r, "x", 1.0))
    return out


def test_summary_and_markdown_carry_the_interval() -> None:
    recs = _records({"needle": 19, "multineedle": 10})
    md = acc.markdown(recs, "ktlong bench accuracy --tasks needle,multineedle")
    assert "| 4K | needle | 95 (76-99) |" in md
    assert "| 4K | multineedle | 50 (30-70) |" in md
    assert md.index("| needle |") < md.index("| multineedle |")
    cells = {c["task"]: c for c in acc.summary(recs)}
    assert cells["needle"] == {"length": 4096, "task": "needle", "profile": "default",
                               "right": 19, "n": 20, "pct": 95.0, "ci95": [76.4, 99.1]}
    assert cells["multineedle"]["ci95"] == [29.9, 70.1]


def test_plot_draws_new_task_names(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import dataclasses

    recs = _records({"passkey": 20, "multineedle": 5}, n=4)
    data = {"bench": "accuracy", "command": "ktlong bench accuracy", "machine": "Test CPU",
            "threads": 2, "model": "m", "haystack": "prose", "tasks": ["passkey", "multineedle"],
            "records": [dataclasses.asdict(r) for r in recs], "summary": acc.summary(recs)}
    fig = acc.plot(data, tmp_path / "a.png")
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["passkey", "multineedle"]
    assert "prose haystack" in fig._suptitle.get_text()
    assert (tmp_path / "a.png").stat().st_size > 10_000


# --- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, why", [
    (["--tasks", "needle,nosuch"], "unknown nosuch"),
    (["--tasks", ","], "no task given"),
    (["--haystack", "poetry"], "--haystack 'poetry'"),
    (["--device", "gpu"], "device must be AUTO|CPU|CUDA"),
])
def test_bench_accuracy_rejects_unknown_tasks_and_haystacks(args: list[str], why: str) -> None:
    r = CliRunner().invoke(app, ["bench", "accuracy", *args])
    assert r.exit_code == 2 and why in r.output, r.output


# --- the real haystack (text the project did not write) ------------------------------------------
@pytest.mark.skipif(not Path("/usr/share/common-licenses").is_dir(),
                    reason="needs Debian's license texts")
def test_real_haystack_is_text_on_the_machine_with_the_facts_at_their_depths() -> None:
    from ktlong.bench import prose as real

    def count(text: str) -> int:
        return sum(1 + len(w) // 4 for w in text.split())

    s = tasks.make_mixed(7, 9000, {"passkey": 0.2, "needle": 0.7}, count=count, haystack="real")
    assert s == tasks.make_mixed(7, 9000, {"passkey": 0.2, "needle": 0.7}, count=count,
                                 haystack="real")
    assert s.document != tasks.make_mixed(8, 9000, {"passkey": 0.2, "needle": 0.7},
                                          count=count, haystack="real").document
    assert 8000 < count(s.document) <= 9000  # never past the length asked for
    paras = s.document.split("\n\n")
    for f in s.asked:  # each fact a paragraph of its own, near its depth
        assert paras.count(f.sentence) == 1
        assert abs(s.document.index(f.sentence) / len(s.document) - f.depth) < 0.05
    source = "\n\n".join(real.sections())
    rest = [p for p in paras if p not in {f.sentence for f in s.facts}]
    assert all(p in source for p in rest)  # every other paragraph is the machine's own text


@pytest.mark.skipif(not Path("/usr/share/common-licenses").is_dir(),
                    reason="needs Debian's license texts")
def test_licenses_haystack_is_the_license_texts_alone_repeated_past_their_length() -> None:
    from ktlong.bench import prose as real

    licenses = real.sections(licenses_only=True)
    assert licenses and set(licenses) < set(real.sections())  # Python's documentation is out
    whole = "\n\n".join(licenses)
    s = tasks.make_mixed(3, 120_000, {"passkey": 0.4, "needle": 0.8}, haystack="licenses")
    paras = s.document.split("\n\n")
    rest = [p for p in paras if p not in {f.sentence for f in s.facts}]
    assert all(p in whole for p in rest)
    assert len(s.document) > len(whole)  # longer than the texts: they repeat
    assert len(rest) > len(set(rest))
    for f in s.asked:
        assert paras.count(f.sentence) == 1


def test_bench_accuracy_peers_need_a_gguf(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "accuracy", "--profiles", "dense,llamacpp"])
    assert r.exit_code == 2 and "GGUF" in r.output, r.output


def test_a_peer_that_cannot_run_says_so_in_one_line(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp refusing the context (e.g. no memory for its KV) leaves no records, only the
    line saying why; the run goes on."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from ktlong.tinymodel import make_model, write_gguf

    path = write_gguf(make_model(tmp_path / "hf", "llama"), tmp_path / "m.gguf", "Q8_0")

    def refuse(**kw: object) -> None:
        raise ValueError("Failed to create llama_context")
    monkeypatch.setattr(llama_cpp, "Llama", refuse)
    lines: list[str] = []
    recs = acc.run(path, [300], 1, ["llamacpp"], task_names=["passkey"], report=lines.append)
    assert recs == []
    assert len(lines) == 1 and "llamacpp did not run (n_ctx " in lines[0]
    assert "Failed to create llama_context" in lines[0]


def test_a_sliding_window_model_answers_as_a_chat_would(tmp_path: Path) -> None:
    """Gemma 3 (sliding-window layers kept apart from the store): each profile's copy of the
    prefilled document carries the window layers' rows, so the bench's dense answer is the one a
    session that prefilled the document itself gives; with --lead the answer starts with the
    reference answer's words and the model writes on from there."""
    from ktlong.config import resolve_settings
    from ktlong.conversation import Conversation
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model
    from ktlong.tinymodel import make_model

    path = make_model(tmp_path / "gemma", "gemma3_text", layers=6, hidden=64, heads=4,
                      kv_heads=1, head_dim=16, sliding_window=16, seed=3)
    recs = acc.run(path, [300], 1, ["dense"], task_names=["passkey"], threads=1, lead=True)
    assert len(recs) == 1
    fact = tasks.make_mixed(300 * 101, 300, acc.depths_for(0, 1, ["passkey"])).asked[0]
    assert recs[0].answer.startswith(fact.lead)

    lm = load_model(path, "CPU")
    tok = lm.tokenizer
    sample = tasks.make_mixed(300 * 101, 300, acc.depths_for(0, 1, ["passkey"]),
                              count=lambda t: len(tok(t, add_special_tokens=False)["input_ids"]))
    conv = Conversation(tok, sample.document)
    st = resolve_settings("dense", {"max_seq_len": 300 + 1024, "device": "CPU", "threads_num": 1},
                          config_file=False).settings
    s = Session(lm, st)
    s.prefill(conv.document_ids())
    s.extend_to(conv.prompt_ids(fact.question) + tok(fact.lead, add_special_tokens=False)
                ["input_ids"])
    ids = [x.token_id for x in s.generate(Sampling(max_new_tokens=acc.MAX_NEW_TOKENS,
                                                   temperature=0.0))
           if x.token_id not in lm.eos_ids]
    assert recs[0].answer == fact.lead + tok.decode(ids, skip_special_tokens=True)


def test_an_answer_may_break_the_copied_sentence_across_lines() -> None:
    fact = tasks.Fact("needle", "The best thing to do in Lisbon is to follow the northern lights.",
                      "What is the best thing to do in Lisbon?",
                      "The best thing to do in Lisbon is to follow the northern lights.",
                      "follow the northern lights", 0.5)
    assert tasks.is_correct(fact, "In Lisbon it is to follow the northern\nlights.")
    assert tasks.is_correct(fact, "to follow  the northern lights")
    assert not tasks.is_correct(fact, "to follow the northern\n\nsky and its lights")
    assert not tasks.is_correct(fact, "follow the northernlights")


def test_licenses_haystack_without_the_texts_is_one_clear_error(monkeypatch) -> None:
    from ktlong.bench import prose as real
    from ktlong.errors import KtlongError

    monkeypatch.setattr(real, "sections", lambda licenses_only=False: ())
    with pytest.raises(KtlongError, match="no prose found"):
        tasks.make_mixed(1, 2000, {"passkey": 0.5}, haystack="licenses")


@pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").exists(), reason="no demo tokenizer")
def test_the_fact_is_found_in_the_ids_and_ranked_by_its_best_block() -> None:
    """fact_span finds the asked sentence's tokens where the document holds them (whatever joins
    it to its neighbours); fact_rank is the place of its best block in a vote's ranking."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    s = tasks.make_mixed(11, 3000, {"passkey": 0.4, "needle": 0.8})
    ids = tok(s.document, add_special_tokens=False)["input_ids"]
    for f in s.asked:
        a, b = acc.fact_span(ids, tok, f.sentence)
        assert f.value in tok.decode(ids[a:b]) and b - a <= len(tok(f.sentence)["input_ids"]) + 2
        assert a / len(ids) == pytest.approx(f.depth, abs=0.05)
    assert acc.fact_span(ids, tok, "Nowhere in this document at all, zebra quartz.") is None
    order = np.array([7, 3, 12, 5, 4])  # a vote's ranking, best first
    assert acc.fact_rank(order, (5 * 128 + 100, 5 * 128 + 140), 128) == 3  # blocks 5, 6: 5 is 4th
    assert acc.fact_rank(order, (4 * 128 + 100, 5 * 128 + 10), 128) == 3  # blocks 4 (5th), 5
    assert acc.fact_rank(order, (3 * 128 + 10, 3 * 128 + 30), 128) == 1
    assert acc.fact_rank(order, (20 * 128, 20 * 128 + 5), 128) == -1
