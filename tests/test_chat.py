"""`ktlong chat`: the chat loop driven by scripted input on a tiny model, and the command itself.

Dense attention + FP32 KV (tests/models.settings) makes every answer exact, so an answer given
mid-conversation must equal a fresh prefill of the whole conversation, token for token.
"""
from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ktlong.chat import COMMANDS, ChatLoop
from ktlong.chatui import TerminalUI, printable, prompt_reader
from ktlong.cli import app
from ktlong.conversation import Conversation
from ktlong.documents import Document
from ktlong.engine import Session, Stats
from ktlong.model import load_model
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

DOC = filler_text(250, seed=5)  # ~300 tokens
NEW = 6  # tokens per answer
QUESTIONS = ("What is the hidden key?", "Which city?", "Why?")


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


class UI(TerminalUI):
    """The real terminal UI writing into strings; `stop_at` raises Ctrl-C on that token."""

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__(out=Console(file=io.StringIO(), width=200),
                         err=Console(file=io.StringIO(), width=200))
        self.stop_at, self.seen = stop_at, 0

    def token(self, step):  # type: ignore[no-untyped-def]
        self.seen += 1
        if self.seen == self.stop_at:
            raise KeyboardInterrupt
        super().token(step)

    def text(self) -> tuple[str, str]:
        return self.out.file.getvalue(), self.err.file.getvalue()  # type: ignore[attr-defined]


def make_loop(lm, ui: UI | None = None, doc: str = DOC, **kw) -> ChatLoop:  # type: ignore[no-untyped-def]
    loop = ChatLoop(lm, settings(attention="DENSE", max_new_tokens=NEW), Document("doc.txt", doc,
                    len(doc)), ui or UI(), **kw)
    loop.open()
    return loop


def fresh_answer(lm, loop: ChatLoop, prompt_ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    s = Session(lm, loop.settings)
    s.prefill(prompt_ids)
    return [st.token_id for st in s.generate(loop.sampling) if st.token_id not in lm.eos_ids]


def consistent(loop: ChatLoop) -> bool:
    """Every layer of the store holds exactly the session's tokens."""
    return set(loop.session.store.lengths) == {len(loop.session.tokens)}


# --- the loop ------------------------------------------------------------------------------------

def test_the_session_knows_where_the_document_starts(lm) -> None:
    """The system prompt is the conversation's, not the document's (question_first_block
    copies only the document's first tokens)."""
    loop = make_loop(lm, system="Zulu yankee xray.")
    head = loop.conv.head_ids()
    assert loop.session.template_head == head
    assert "Zulu" in lm.tokenizer.decode(head)
    assert loop.conv.document_ids()[: len(head) - 1] == head[:-1]


def test_a_lead_starts_every_answer_and_stays_in_the_conversation(lm) -> None:
    """--lead / /lead: the answer cue is followed by the lead's ids; the model writes on from
    there (its answer as a fresh session gives it), the lead is shown and kept in the turn."""
    ui = UI()
    loop = make_loop(lm, ui, lead="The city is")
    lead = lm.tokenizer("The city is", add_special_tokens=False)["input_ids"]
    a = loop.answer(QUESTIONS[1])
    assert a.prompt_ids == Conversation(lm.tokenizer, DOC).prompt_ids(QUESTIONS[1]) + lead
    assert a.ids == lead + fresh_answer(lm, loop, a.prompt_ids)
    assert a.text == lm.tokenizer.decode(a.ids, skip_special_tokens=True)
    assert a.text.startswith("The city is") and len(a.ids) > len(lead)
    assert ui.text()[0].startswith(printable(a.text))
    b = loop.answer(QUESTIONS[2])  # the first answer, lead and all, is in the second prompt
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.ids) - len(lead)] == a.prompt_ids + a.ids[
        len(lead):] and consistent(loop)
    assert loop.handle("/lead -") and loop.lead == ""
    c = loop.answer(QUESTIONS[0])
    assert c.ids == fresh_answer(lm, loop, c.prompt_ids)
    assert loop.handle("/lead The key is") and loop.lead == "The key is"


def test_multi_turn_equals_fresh_prefill_and_appends_only_the_turn(lm) -> None:
    loop = make_loop(lm)
    doc_ids = loop.conv.document_ids()
    assert loop.doc_len == len(doc_ids) and loop.session.tokens == doc_ids
    answers = [loop.answer(q) for q in QUESTIONS]
    first, second = answers[0], answers[1]
    # the first prompt is the model's own chat template around document + question
    rendered = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": DOC + "\n\n" + QUESTIONS[0]}], tokenize=False,
        add_generation_prompt=True)
    assert lm.tokenizer.decode(first.prompt_ids) == rendered
    assert first.prefilled_tokens == len(first.prompt_ids)  # document + question
    for a in answers:
        assert a.ids == fresh_answer(lm, loop, a.prompt_ids)
        assert a.stop in ("eos", "max_new_tokens") and len(a.ids) <= NEW
    # later turns: the earlier prompt and answer ids are a prefix; only the new turn is prefilled
    n = len(first.prompt_ids)
    assert second.prompt_ids[:n] == first.prompt_ids
    assert second.prompt_ids[n:n + len(first.ids)] == first.ids
    assert second.prefilled_tokens == len(second.prompt_ids) - n - len(first.ids) + 1
    assert second.prefilled_tokens < 20
    assert consistent(loop)
    out, err = loop.ui.text()
    assert printable(first.text) in out and "tok/s" in err and "blocks read" in err


def test_reset_returns_to_the_document_without_reprefill(lm) -> None:
    loop = make_loop(lm)
    a1 = loop.answer(QUESTIONS[0])
    loop.answer(QUESTIONS[1])
    assert loop.handle("/reset")
    assert len(loop.session.tokens) == loop.doc_len and consistent(loop)
    assert loop.conv.turns == []
    again = loop.answer(QUESTIONS[0])
    assert again.prompt_ids == a1.prompt_ids and again.ids == a1.ids
    assert again.prefilled_tokens == len(a1.prompt_ids) - loop.doc_len  # the question alone
    assert "nothing re-read" in loop.ui.text()[1]


def test_second_chat_on_a_document_uses_the_prompt_cache(lm, tmp_path: Path) -> None:
    first = make_loop(lm)
    a = first.answer(QUESTIONS[0])
    assert first.source == "prefill"
    assert make_loop(lm, use_cache=False).source == "prefill"
    again = make_loop(lm)
    assert again.source == "cache" and "from the prompt cache" in again.ui.text()[1]
    b = again.answer(QUESTIONS[0])
    assert b.prompt_ids == a.prompt_ids and b.ids == a.ids
    assert b.prefilled_tokens < 20  # the question, not the document
    again.handle("/reset")  # back to the document: the memory-mapped entry stays
    assert len(again.session.tokens) == again.doc_len and consistent(again)
    assert again.answer(QUESTIONS[0]).ids == a.ids
    other = make_loop(lm, cache_dir=tmp_path / "elsewhere")
    assert other.source == "prefill" and any((tmp_path / "elsewhere").iterdir())


def test_ctrl_c_in_the_renderer_keeps_the_partial_answer_and_the_chat(lm) -> None:
    loop = make_loop(lm, UI(stop_at=3))
    a = loop.answer(QUESTIONS[0])
    assert a.stop == "interrupted" and len(a.ids) == 3
    assert consistent(loop) and loop.conv.turns[0].answer_ids == a.ids
    assert "stopped by Ctrl-C" in loop.ui.text()[1]
    loop.ui.stop_at = None
    b = loop.answer(QUESTIONS[1])
    assert b.prompt_ids[len(a.prompt_ids):len(a.prompt_ids) + 3] == a.ids  # partial answer kept
    assert b.ids == fresh_answer(lm, loop, b.prompt_ids)


def numba_interrupt() -> None:
    """What Ctrl-C inside a running Numba kernel looks like to Python: a SystemError whose
    context is the KeyboardInterrupt."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise SystemError("CPUDispatcher(<function _attend>) returned a result with an "  # noqa: B904
                          "exception set")


@pytest.mark.parametrize("how", ["python", "numba"])
def test_ctrl_c_inside_a_forward_pass_leaves_a_consistent_store(lm, monkeypatch, how) -> None:
    loop = make_loop(lm)
    router = loop.session.router
    real, calls = router.attend_one, []  # a CPU decode step's attention (ktlong.decoder)

    def attend(layer, *args, **kw):  # type: ignore[no-untyped-def]
        calls.append(layer)
        if layer == 1 and len(calls) > 6:  # fourth decode token: layer 0 written, layer 1 not
            if how == "numba":
                numba_interrupt()
            raise KeyboardInterrupt
        return real(layer, *args, **kw)

    loop.answer(QUESTIONS[0])  # prefill the question first, unpatched
    monkeypatch.setattr(router, "attend_one", attend)
    a = loop.answer(QUESTIONS[1])
    assert a.stop == "interrupted" and 1 <= len(a.ids) < NEW
    assert consistent(loop)
    monkeypatch.setattr(router, "attend_one", real)
    b = loop.answer(QUESTIONS[2])
    assert b.ids == fresh_answer(lm, loop, b.prompt_ids)


def test_ctrl_c_while_reading_the_question_drops_it(lm, monkeypatch) -> None:
    loop = make_loop(lm)
    real = loop.session.extend_to

    def interrupted(ids, progress=None):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.session, "extend_to", interrupted)
    assert loop.answer(QUESTIONS[0]) is None
    assert loop.conv.turns == [] and "question was dropped" in loop.ui.text()[1]
    monkeypatch.setattr(loop.session, "extend_to", real)
    assert loop.answer(QUESTIONS[0]).ids == fresh_answer(lm, loop, loop.last.prompt_ids)


def test_scripted_repl_commands(lm, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("The key is copper.")
    loop = make_loop(lm)
    lines = iter(["/help", "", "/stats", "/frobnicate", f"/read {notes}", "/read", QUESTIONS[0],
                  "/system Answer briefly.", "/system", "//etc/passwd?", "/exit", "never read"])
    assert loop.repl(lambda: next(lines)) == 0
    assert next(lines) == "never read"
    out, err = loop.ui.text()
    for name in COMMANDS:
        assert name in out
    assert "Esc Enter or a trailing \\" in out
    assert "context   " in out and "of 8,192 tokens" in out
    assert f"unknown command /frobnicate; known: {' '.join(sorted(COMMANDS))}" in err
    assert "/read needs a file" in err and "attached" in err
    # the /read file went before the question; /system started over with the system prompt first
    assert loop.conv.turns[0].question == "/etc/passwd?"
    system_doc = lm.tokenizer.decode(loop.conv.document_ids())
    assert system_doc.startswith("<|bos|><|system|>Answer briefly.<|end|><|user|>")
    assert loop.session.tokens[:loop.doc_len] == loop.conv.document_ids()
    assert "system prompt: Answer briefly." in err
    assert loop.last.ids == fresh_answer(lm, loop, loop.last.prompt_ids)


def test_state_and_resume_continue_a_conversation(lm) -> None:
    """The hook for /save and /load: another loop resumes from the state and the same KV."""
    a = make_loop(lm, system="Be brief.")
    a.answer(QUESTIONS[0])
    a.answer(QUESTIONS[1])
    state = json.loads(json.dumps(a.state()))  # what /save would write beside the KV
    b = make_loop(lm, doc="Another document entirely.")
    b.resume(a.session, state)
    assert b.doc_len == a.doc_len and b.conv.prompt_ids("Why?")[:len(a.session.tokens)] == \
        a.session.tokens
    ans = b.answer(QUESTIONS[2])
    assert ans.prefilled_tokens < 20  # only the new turn (+ the last answer token)
    assert ans.ids == fresh_answer(lm, b, ans.prompt_ids)


def test_read_attaches_the_file_before_the_next_question(lm, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("The key is copper.")
    loop = make_loop(lm)
    loop.handle(f"/read {notes}")
    a = loop.answer(QUESTIONS[0])
    assert lm.tokenizer.decode(a.prompt_ids).endswith(
        "\n\nThe key is copper.\n\nWhat is the hidden key?<|end|><|assistant|>")
    assert loop.conv.attachments == []


def test_an_unexpected_error_is_reported_and_the_chat_goes_on(lm, monkeypatch) -> None:
    loop = make_loop(lm)

    def broken(ids, progress=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("disk on fire\nmore")

    real = loop.session.extend_to
    monkeypatch.setattr(loop.session, "extend_to", broken)
    assert loop.handle(QUESTIONS[0])
    assert "error: RuntimeError: disk on fire (set KTLONG_DEBUG=1" in loop.ui.text()[1]
    monkeypatch.setattr(loop.session, "extend_to", real)
    assert loop.answer(QUESTIONS[0]).ids == fresh_answer(lm, loop, loop.last.prompt_ids)


def test_repl_exit_codes(lm) -> None:
    loop = make_loop(lm)

    def ctrl_c() -> str:
        raise KeyboardInterrupt

    def ctrl_d() -> str:
        raise EOFError

    assert loop.repl(ctrl_c) == 130
    assert loop.repl(ctrl_d) == 0


def test_prompt_keys(ktlong_home: Path) -> None:
    """The real prompt-toolkit session fed through a pipe: Enter, Esc Enter, trailing \\,
    Ctrl-C clearing a line, Ctrl-C twice to leave, Ctrl-D, and the history file."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    ui = UI()
    with create_pipe_input() as pipe:
        read = prompt_reader(ui, input=pipe, output=DummyOutput())
        for keys, expect in [("hello\r", "hello"), ("a\x1b\rb\r", "a\nb"),
                             ("one \\\rtwo\r", "one \ntwo"), ("typo\x03fixed\r", "fixed")]:
            pipe.send_text(keys)
            assert read() == expect
        pipe.send_text("\x03\x03")  # once: a hint; twice: leave
        with pytest.raises(KeyboardInterrupt):
            read()
        assert "press Ctrl-C again" in ui.text()[1]
        ui.interrupted()  # Ctrl-C just stopped an answer: one more at the prompt leaves
        pipe.send_text("\x03")
        with pytest.raises(KeyboardInterrupt):
            read()
        pipe.send_text("\x04")
        with pytest.raises(EOFError):
            read()
    assert "hello" in (ktlong_home / "chat_history").read_text()


def test_template_fallbacks(lm) -> None:
    plain = copy.copy(lm.tokenizer)
    plain.chat_template = None
    conv = Conversation(plain, "The doc.", system="Be brief.")
    assert conv.plain
    ui = UI()
    loop = ChatLoop(types.SimpleNamespace(tokenizer=plain, eos_ids=()), settings(), None, ui)
    loop.conv.document = "The doc."
    for _ in range(2):
        ui.document(loop, types.SimpleNamespace(session=types.SimpleNamespace(stats=Stats()),
                                                source="prefill", note="", verify_s=0.0))
    assert ui.text()[1].count("no chat template: using a plain 'User: … / Assistant:'") == 1
    assert plain.decode(conv.prompt_ids("Q?")) == \
        "<|bos|>System: Be brief.\n\nUser: The doc.\n\nQ?\n\nAssistant:"
    no_system = copy.copy(lm.tokenizer)
    no_system.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>")
    conv = Conversation(no_system, "The doc.", system="Be brief.")
    assert no_system.decode(conv.prompt_ids("Q?")) == \
        "<|user|>Be brief.\n\nThe doc.\n\nQ?<|end|><|assistant|>"


# --- the command ------------------------------------------------------------------------------

TINY = ["--profile", "dense", "--kv-type", "FP32", "--max-seq-len", "4096", "-n", str(NEW)]


def test_questions_as_json_lines_in_a_subprocess(lm, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    out = subprocess.run(
        [sys.executable, "-m", "ktlong", "chat", "--model", str(hf_model("llama")),
         "--prompt-file", str(doc), "--question", QUESTIONS[0], "--question", QUESTIONS[1],
         "--json", "--show-prompt-ids", *TINY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    for key in ("answer", "answer_ids", "prompt_tokens", "prefill_tok_s", "decode_tok_s",
                "context_tokens", "kv_bytes", "attended_share", "stop", "prompt_ids"):
        assert key in rows[0]
    a, b = rows
    assert a["prompt_tokens"] == len(a["prompt_ids"]) and a["stop"] in ("eos", "max_new_tokens")
    assert b["prompt_ids"][:len(a["prompt_ids"])] == a["prompt_ids"]
    loop = make_loop(lm, doc=DOC)
    assert a["answer_ids"] == fresh_answer(lm, loop, a["prompt_ids"])
    assert b["answer_ids"] == fresh_answer(lm, loop, b["prompt_ids"])


runner = CliRunner()


def chat(*args: str, input: bytes | str | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["chat", "--model", str(hf_model("llama")), *args], input=input,
                         env={"COLUMNS": "200"})


@pytest.mark.parametrize("make,expect", [
    (lambda d: d / "missing.txt", "does not exist"),
    (lambda d: d, "holds no document"),  # a folder: read for its documents
    (lambda d: (d / "e.txt", (d / "e.txt").write_bytes(b""))[0], "is empty (0 bytes)"),
    (lambda d: (d / "b.bin", (d / "b.bin").write_bytes(b"\x00\x01"))[0], "looks binary"),
    (lambda d: (d / "l.txt", (d / "l.txt").write_bytes("é".encode("latin-1")))[0],
     "is not UTF-8 text"),
])
def test_bad_prompt_files_exit_2_with_one_line(tmp_path: Path, make, expect) -> None:  # type: ignore[no-untyped-def]
    r = chat("--prompt-file", str(make(tmp_path)), "-q", "hi")
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: prompt file ") and expect in lines[0]
    assert len(lines) <= 2 and r.stdout == ""


def test_bad_model_and_question_exit_2(tmp_path: Path) -> None:
    r = runner.invoke(app, ["chat", "-q", "hi"])
    assert r.exit_code == 2 and r.stderr.startswith("error: no model given\nhint: ")
    r = runner.invoke(app, ["chat", "--model", str(tmp_path / "nope"), "-q", "hi"])
    assert r.exit_code == 2 and "does not exist" in r.stderr.splitlines()[0]
    r = chat("-q", " ")
    assert r.exit_code == 2 and r.stderr.startswith("error: --question is empty")


def test_document_too_long_from_stdin_in_latin1_exits_2(tmp_path: Path) -> None:
    r = chat("--prompt-file", "-", "--encoding", "latin-1", "--max-seq-len", "64", "-q", "hi",
             input=("café " * 100).encode("latin-1"))
    assert r.exit_code == 2, r.output
    first = r.stderr.splitlines()[-2]
    assert first.startswith("error: the prompt needs ") and "max_seq_len is 64" in first
    assert "memcheck" in r.stderr.splitlines()[-1]


def test_piped_questions_one_per_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    r = chat("--prompt-file", str(doc), "--json", *TINY,
             input=f"{QUESTIONS[0]}\n/frobnicate\n{QUESTIONS[1]} \\\nsecond line\n")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["question"] for row in rows] == [QUESTIONS[0], QUESTIONS[1] + " \nsecond line"]
    assert "unknown command /frobnicate" in r.stderr


def test_save_and_load_resume_a_conversation(lm) -> None:
    loop = make_loop(lm)
    loop.answer(QUESTIONS[0])
    assert loop.handle("/save talk1")
    follow = loop.answer(QUESTIONS[1])
    other = make_loop(lm, doc="A different document about rivers and stones. " * 40)
    assert other.handle("/load talk1")
    assert len(other.conv.turns) == 1 and other.doc_len == loop.doc_len
    resumed = other.answer(QUESTIONS[1])
    assert resumed.prompt_ids == follow.prompt_ids and resumed.ids == follow.ids
    assert resumed.prefilled_tokens < 20  # nothing re-read: the saved KV came back
    assert other.handle("/load nosuch")  # one line, the chat goes on
    assert "no saved conversation 'nosuch'" in other.ui.text()[1]


@pytest.mark.parametrize("cold", [True, False])
def test_first_run_of_a_version_says_the_kernels_compile(lm, monkeypatch, cold):
    """With kernels of this run not compiled yet, the chat compiles them before the first
    prefill and says so once (a /reset reopens without repeating it); with them, nothing is
    said."""
    from ktlong import kernels, warmup

    monkeypatch.setattr(kernels, "cache_is_cold", lambda *a, **kw: cold)
    monkeypatch.setattr(warmup, "_done", set())  # as in a new process
    ui = UI()
    loop = make_loop(lm, ui)
    loop.handle("/reset")
    loop.answer(QUESTIONS[0])
    assert ui.text()[1].count("compiling kernels, once") == (1 if cold else 0)


def test_cache_is_cold_for_parts_until_warmed(tmp_path, monkeypatch):
    from ktlong import kernels

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert kernels.cache_is_cold(parts=["decode-x"])
    (kernels.cache_dir() / "warm").mkdir(parents=True)
    (kernels.cache_dir() / "warm" / "decode-x").write_text("1.0\n")
    assert not kernels.cache_is_cold(parts=["decode-x"])
    assert kernels.cache_is_cold(parts=["decode-x", "weights-Q4_K-k11"])


def test_cache_is_cold_until_a_kernel_is_filed(tmp_path, monkeypatch):
    from ktlong import kernels

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert kernels.cache_is_cold()
    index = kernels.cache_dir() / "kernels_0123" / "attention._attend-212.py311.nbi"
    index.parent.mkdir(parents=True)
    index.write_bytes(b"")
    assert not kernels.cache_is_cold()
