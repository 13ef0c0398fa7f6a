"""`ktlong chat`: the chat loop (questions, slash commands, Ctrl-C) and the command's entry point.

`ChatLoop` is driven by lines of text and draws nothing itself: it calls a UI object
(`chatui.TerminalUI`, or a test's own). `ask(question)` yields the engine's Steps and keeps the
conversation and the KV store in step; `answer(question)` drives `ask` through the UI and turns
Ctrl-C into a stopped answer; `handle(line)` runs a slash command or answers; `repl(read)` reads
lines until /exit, Ctrl-D (exit 0) or Ctrl-C at the prompt (130).

Every turn renders the whole conversation and calls `Session.extend_to`, which prefills only what
the store lacks (the new turn). Ctrl-C during an answer keeps the partial answer in the
conversation: what the screen shows is what the model remembers (/reset drops it all).

Slash commands live in `COMMANDS`; add one with the `@command` decorator on a ChatLoop method
(or a function taking the loop). /save and /load pair the prompt cache's KV with `state()` and
`resume()`.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ktlong.config import Settings
from ktlong.conversation import Conversation, Turn
from ktlong.documents import Document, check_length, read_document
from ktlong.errors import KtlongError

PROGRESS_MIN_TOKENS = 2048  # a turn shorter than this prefills without a progress bar
FIRST_TURN_TOKENS = 128  # room for a first question when the chat warms its kernels


def is_interrupt(e: BaseException | None) -> bool:
    """Ctrl-C, also when it hit a running Numba kernel: Numba then raises SystemError ("returned
    a result with an exception set") with the KeyboardInterrupt as its context."""
    for _ in range(4):
        if e is None or isinstance(e, KeyboardInterrupt):
            return e is not None
        e = e.__cause__ or e.__context__
    return False


@dataclass
class Answer:
    """One answer and the numbers behind it (the --json object)."""

    question: str
    prompt_ids: list[int]  # the exact ids the model was fed before answering
    prefilled_tokens: int  # ids computed for this answer (document + question on the first)
    prefill_s: float
    document_source: str  # "prefill" | "cache" | "none"
    ids: list[int] = field(default_factory=list)  # generated, without the EOS token
    text: str = ""
    stop: str = "interrupted"  # eos | max_new_tokens | interrupted | context_full
    stats: Any = None  # engine.Stats of the last step
    lead: str = ""  # the words the answer was started with (/lead): `text` and `ids` begin so

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_json(self, with_prompt_ids: bool = False) -> dict[str, Any]:
        st = self.stats
        out = {"question": self.question, "answer": self.text, "answer_ids": self.ids,
               "stop": self.stop, "prompt_tokens": len(self.prompt_ids),
               "prefilled_tokens": self.prefilled_tokens,
               "prefill_tok_s": round(self.prefill_tok_s, 1),
               "new_tokens": st.new_tokens if st else 0,
               "decode_tok_s": round(st.decode_tok_s, 2) if st else 0.0,
               "context_tokens": st.context_tokens if st else len(self.prompt_ids),
               "kv_bytes": st.kv_bytes if st else 0,
               "attended_share": round(st.attended_share, 4) if st else 1.0,
               "threads": st.threads if st else 0,
               "document_source": self.document_source}
        if with_prompt_ids:
            out["prompt_ids"] = self.prompt_ids
        return out


@dataclass(frozen=True)
class Command:
    name: str
    usage: str
    help: str
    run: Callable[[ChatLoop, str], bool | None]  # False ends the chat


COMMANDS: dict[str, Command] = {}


def command(name: str, usage: str, help: str) -> Callable[[Callable], Callable]:
    """Register a ChatLoop method as the slash command `name` (e.g. "/save")."""

    def register(fn: Callable) -> Callable:
        COMMANDS[name] = Command(name, usage, help, fn)
        return fn

    return register


class ChatLoop:
    """A chat about one document: a Conversation, the Session holding its KV, and a UI."""

    def __init__(self, lm: Any, settings: Settings, document: Document | None, ui: Any,
                 system: str | None = None, encoding: str | None = None, use_cache: bool = True,
                 cache_dir: Path | None = None, lead: str = "") -> None:
        from ktlong.engine import Sampling

        self.lm, self.settings, self.document, self.ui = lm, settings, document, ui
        self.lead = lead  # the words every answer starts with (/lead); the model writes the rest
        self.encoding, self.use_cache, self.cache_dir = encoding, use_cache, cache_dir
        self.conv = Conversation(lm.tokenizer, document.text if document else "", system)
        self.sampling = Sampling.from_settings(settings)
        self.session: Any = None
        self.source = "none"
        self.doc_len = 0  # tokens of the document prefix (template head + document)
        self.last: Answer | None = None
        self._carry = (0, 0.0)  # document prefill (tokens, seconds) not yet reported
        self._kernels_told = False
        self.dropped = [0, 0]  # turns, tokens dropped by context shifts (overflow SHIFT)
        self._shift_notes: list[str] = []  # shifts made during an answer, told after it

    # --- the document ------------------------------------------------------------------------
    def open(self) -> None:
        """Put the document prefix into a fresh session (prompt cache or prefill)."""
        from ktlong.engine import Session
        from ktlong.promptcache import Opened, open_document

        ids = self.conv.document_ids()
        self._tell_if_kernels_compile(len(ids))
        self.session = None
        gc.collect()  # a previous session's KV store goes before the new one is made
        with self.ui.progress("reading the document", eta=self._eta(len(ids))) as progress:
            if ids:
                opened = open_document(self.lm, self.settings, ids, progress, self.use_cache,
                                       self.cache_dir)
            else:  # no document and a template with no head: nothing to prefill yet
                opened = Opened(Session(self.lm, self.settings), "none")
        self.session, self.source, self.doc_len = opened.session, opened.source, len(ids)
        self.session.template_head = self.conv.head_ids()  # the system prompt is not document
        self.dropped = [0, 0]
        st = opened.session.stats
        self._carry = (st.prompt_tokens, st.prefill_s)
        self.ui.document(self, opened)

    # --- for /save and /load (the prompt cache keeps the KV; this is the rest) --------------------
    def state(self) -> dict[str, Any]:
        """The conversation as JSON-able data: what a saved KV store needs beside it to resume."""
        name = self.document.name if self.document else ""
        return {"document_name": name, "document": self.conv.document,
                "system": self.conv.system, "turns": [dataclasses.asdict(t)
                                                      for t in self.conv.turns],
                "dropped": list(self.dropped)}

    def resume(self, session: Any, state: dict[str, Any], source: str = "cache") -> None:
        """Continue the conversation `state` (from `state()`) whose KV `session` holds."""
        text = state["document"]
        self.document = Document(state["document_name"], text, len(text.encode())) if text \
            else None
        self.conv = Conversation(self.lm.tokenizer, text, state["system"])
        self.conv.turns = [Turn(**t) for t in state["turns"]]
        self.session, self.source, self.last = session, source, None
        session.template_head = self.conv.head_ids()
        self.doc_len = len(self.conv.document_ids())
        self._carry = (0, 0.0)
        self.dropped = list(state.get("dropped", [0, 0]))

    # --- answering ---------------------------------------------------------------------------
    def ask(self, question: str) -> Iterator[Any]:
        """Append `question` to the conversation and yield the answer's Steps.

        Closing the iterator early (Ctrl-C) keeps the partial answer; the store is cut back to
        the last token a forward pass completed, so it always matches `session.tokens`.
        """
        self.last = None
        if self.session is None:
            self.open()
        s = self.session
        text = self._recalled(question) + self.conv.question_text(question)
        lead = self.lead_ids()
        ids = self.conv.prompt_ids(text) + lead
        try:
            if self.shifts and self.conv.turns and len(ids) + 1 > s.store.capacity:
                ids, told = self.shift(text, lead, self.sampling.max_new_tokens)
                if told:
                    self.ui.note(told)
            with self.ui.progress("reading", PROGRESS_MIN_TOKENS, self._eta(len(ids))) as progress:
                s.extend_to(ids, progress)
        except BaseException:  # Ctrl-C or too long: the question is dropped, the store kept whole
            s.truncate(len(s.tokens))
            raise
        done, secs = self._carry
        self._carry = (0, 0.0)
        turn = Turn(text, list(lead), self.lead if lead else "")
        self.conv.turns.append(turn)
        self.conv.attachments.clear()
        ans = self.last = Answer(question, ids, done + s.stats.prompt_tokens,
                                 secs + s.stats.prefill_s, self.source, ids=turn.answer_ids,
                                 stats=dataclasses.replace(s.stats), lead=turn.answer)
        try:
            for step in s.generate(self.sampling, self._make_room if self.shifts else None,
                                   lead):
                ans.stats = step.stats
                if step.token_id in self.lm.eos_ids:
                    ans.stop = "eos"
                else:
                    turn.answer_ids.append(step.token_id)
                    turn.answer += step.text
                yield step
            if ans.stop != "eos":
                ans.stop = "max_new_tokens"
        except KtlongError:  # the store is full (max_seq_len) mid-answer
            ans.stop = "context_full"
        finally:
            ans.text = turn.answer
            ans.stats = dataclasses.replace(ans.stats)
            if ans.stop in ("interrupted", "context_full"):
                s.truncate(len(s.tokens))  # a forward cut short may have written some layers

    def _eta(self, end: int) -> Any:
        """The progress bar's clock for a read that ends at position `end`."""
        from ktlong.eta import Eta, keys_curve

        return Eta(keys_curve(self.settings, self.lm.spec, end), end)

    def _recalled(self, question: str) -> str:
        """LOCRET, a document longer than what was kept: the passages of it that hold the
        question's rarest words, re-read before the question (ktlong/recall.py); else ""."""
        s, budget = self.session, self.settings.locret_recall
        if not (s.dropped and budget and question.strip()):
            return ""
        from ktlong.recall import prefix

        text, n = prefix(self.lm.tokenizer, np.asarray(s.tokens[: self.doc_len]), question,
                         budget, skip=len(s.template_head or ()))
        if n:
            self.ui.note(f"re-reading {n} passage{'s' if n != 1 else ''} of the document that "
                         "hold the question's words (locret_recall)")
        return text

    # --- context shift (overflow: SHIFT) -------------------------------------------------------
    @property
    def shifts(self) -> bool:
        return self.settings.overflow == "SHIFT"

    def shift(self, question: str, answer_ids: list[int], room: int) -> tuple[list[int], str]:
        """Drop the oldest turns until the conversation ending with `question` (and the
        `answer_ids` of its answer so far) leaves `room` tokens of max_seq_len free, and move the
        store to it (`Session.shift_to`: the kept turns' K,V move down, keys re-rotated). The
        document and `question` stay. Returns the conversation's ids and a line saying what was
        dropped ("" when nothing was)."""
        s = self.session
        old = self.conv.prompt_ids(question) + answer_ids
        limit = s.store.capacity - room - len(answer_ids)
        ids, dropped = self.conv.fit(question, limit)
        ids += answer_ids
        if not dropped:
            return ids, ""
        s.shift_to(ids)  # None: nothing to reuse; extend_to prefills what the store lacks
        n = len(old) - len(ids)
        self.dropped[0] += len(dropped)
        self.dropped[1] += n
        kept = len(self.conv.turns)
        return ids, (f"context full: dropped the oldest {len(dropped)} turn"
                     f"{'s' if len(dropped) != 1 else ''} ({n:,} tokens); kept the document and "
                     f"{kept} later turn{'s' if kept != 1 else ''} (/context)")

    def _make_room(self, left: int) -> None:
        """Session.generate's hook when the store is full mid-answer: a context shift that
        leaves room for the `left` tokens the answer may still take (never drops this turn)."""
        s, cur = self.session, self.conv.turns.pop()
        try:
            ids, told = self.shift(cur.question, list(cur.answer_ids), left + 1)
        finally:
            self.conv.turns.append(cur)
        if told:
            if len(s.tokens) < len(ids):  # nothing was reusable: prefill the kept turns
                s.extend_to(ids)
            self._shift_notes.append(told)

    def _tell_if_kernels_compile(self, doc_tokens: int) -> None:
        """Before the first prefill: compile (or load) the kernels this chat runs over a
        document of doc_tokens and a first question, saying so first when some are not compiled
        yet (ktlong.warmup). A chat that outgrows that compiles the rest (once per install) before
        the prefill or the token that needs them, with its time left out of the speeds."""
        if self._kernels_told:
            return
        self._kernels_told = True
        from ktlong.warmup import warm_up

        warm_up(self.lm, self.settings, note=self.ui.note, n_tokens=doc_tokens + FIRST_TURN_TOKENS)

    def lead_ids(self) -> list[int]:
        """The lead's ids, as they follow the answer cue (none without a lead)."""
        if not self.lead:
            return []
        return list(self.lm.tokenizer(self.lead, add_special_tokens=False)["input_ids"])

    def answer(self, question: str) -> Answer | None:
        """Ask and render; Ctrl-C stops the answer (None if it stopped before the first token)."""
        steps = self.ask(question)
        try:
            for i, step in enumerate(steps):
                if i == 0 and self.last is not None and self.last.lead:
                    self.ui.lead(self.last.lead)
                self.ui.token(step)
        except (KeyboardInterrupt, SystemError) as e:
            if not is_interrupt(e):
                raise
            steps.close()
            self.ui.interrupted()
        if self.last is None:
            self.ui.note("stopped before the answer began; the question was dropped")
            return None
        self.ui.answer_end(self, self.last)
        for told in self._shift_notes:
            self.ui.note(told)
        self._shift_notes.clear()
        return self.last

    # --- input -------------------------------------------------------------------------------
    def handle(self, line: str) -> bool:
        """Run one line of input: a slash command or a question. False ends the chat.

        A line starting with "//" is sent as a question that starts with "/".
        """
        text = line.strip()
        if not text:
            return True
        try:
            if text.startswith("/") and not text.startswith("//"):
                name, _, arg = text.partition(" ")
                cmd = COMMANDS.get(name.lower())
                if cmd is None:
                    raise KtlongError(f"unknown command {name}; known: "
                                      + " ".join(sorted(COMMANDS)))
                return cmd.run(self, arg.strip()) is not False
            self.answer(text[1:] if text.startswith("//") else text)
        except KtlongError as e:
            self.ui.error(e)
        except KeyboardInterrupt:
            self.ui.note("stopped")
        except Exception as e:  # a bug should not cost the chat: ask() keeps the store whole
            if is_interrupt(e):
                self.ui.note("stopped")
                return True
            if os.environ.get("KTLONG_DEBUG", "") not in ("", "0"):
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            self.ui.error(KtlongError(f"{type(e).__name__}: {first}",
                                      hint="set KTLONG_DEBUG=1 for the traceback"))
        return True

    def repl(self, read: Callable[[], str]) -> int:
        """Read and handle lines until the end: 0 for /exit or Ctrl-D, 130 for Ctrl-C."""
        while True:
            try:
                line = read()
            except EOFError:
                return 0
            except KeyboardInterrupt:
                return 130
            try:
                if not self.handle(line):
                    return 0
            except KeyboardInterrupt:  # a second Ctrl-C while the first was being handled
                return 130

    # --- slash commands ----------------------------------------------------------------------
    @command("/help", "", "this list")
    def _help(self, arg: str) -> None:
        self.ui.help(COMMANDS)

    @command("/reset", "", "forget the questions and answers; keep the document (no re-read)")
    def _reset(self, arg: str) -> None:
        self.conv.turns.clear()
        self.conv.attachments.clear()
        self.dropped = [0, 0]
        if self.session is not None and len(self.session.tokens) > self.doc_len:
            self.session.truncate(self.doc_len)
        self.ui.note(f"back to the document alone ({self.doc_len:,} tokens), nothing re-read")

    @command("/read", "FILE", "attach a text file; it goes before your next question")
    def _read(self, arg: str) -> None:
        if not arg:
            raise KtlongError("/read needs a file: /read FILE")
        doc = read_document(arg.strip("'\""), self.encoding, what="file")
        n = self.conv.count_tokens(doc.text)
        if self.session is not None:
            self.session.check_fits(n)
        self.conv.attachments.append(doc.text)
        self.ui.note(f"attached {doc.name} ({n:,} tokens); it goes before your next question")

    @command("/context", "", "what the context holds: the document, kept and dropped turns, "
             "free tokens")
    def _context(self, arg: str) -> None:
        self.ui.context(self)

    @command("/stats", "", "context size, KV memory, speed of the last answer")
    def _stats(self, arg: str) -> None:
        self.ui.stats(self)

    @command("/system", "[TEXT|-]", "show, set or (with -) clear the system prompt; setting "
             "it starts over and reads the document again")
    def _system(self, arg: str) -> None:
        if not arg:
            self.ui.note(f"system prompt: {self.conv.system or '(none)'}")
            return
        self.conv.system = None if arg == "-" else arg
        self.conv.turns.clear()
        self.conv.attachments.clear()
        self.session = None  # the system prompt precedes the document in every template
        self.open()

    @command("/lead", "[TEXT|-]", "show, set or (with -) clear the words every answer starts "
             "with; the model writes on from them (e.g. 'The pass key is': a small model is "
             "left only the number to write)")
    def _lead(self, arg: str) -> None:
        if arg:
            self.lead = "" if arg == "-" else arg
        self.ui.note(f"answers start with: {self.lead!r}" if self.lead
                     else "answers start with: (nothing: the model's own words)")

    @command("/save", "NAME", "keep this conversation (its KV cache and text) under NAME")
    def _save(self, arg: str) -> None:
        from ktlong.promptcache import save_conversation

        if not arg:
            raise KtlongError("/save needs a name: /save NAME")
        path = save_conversation(self.session, arg, self.cache_dir, self.state())
        self.ui.note(f"saved as '{arg}' ({path.stat().st_size / 1e9:.2f} GB); /load {arg} "
                     "resumes it, here or in a later chat")

    @command("/load", "NAME", "resume a conversation kept with /save (same model)")
    def _load(self, arg: str) -> None:
        from ktlong.promptcache import load_conversation

        if not arg:
            raise KtlongError("/load needs a name: /load NAME")
        session, state = load_conversation(self.lm, self.settings, arg, self.cache_dir)
        self.resume(session, state)
        self.ui.note(f"resumed '{arg}': {len(self.conv.turns)} turns, "
                     f"{len(session.tokens):,} tokens, nothing re-read")

    @command("/exit", "", "leave (or Ctrl-D)")
    def _exit(self, arg: str) -> bool:
        return False


def run(model: Path | None, prompt_file: str | list[str] | None, settings: Settings, *,
        system: str | None = None, questions: Sequence[str] = (), as_json: bool = False,
        show_prompt_ids: bool = False, encoding: str | None = None, use_cache: bool = True,
        cache_dir: Path | None = None, lead: str = "") -> int:
    """`ktlong chat`: check the inputs, load, read the document, then answer; returns the exit code.

    With `questions`, answers them in order and returns; otherwise chats on the terminal (or
    reads one question per line from a piped stdin).
    """
    from ktlong import chatui
    from ktlong.model import load_model
    from ktlong.spec import read_spec

    if model is None:
        raise KtlongError("no model given", hint="pass --model with a Hugging Face folder or a "
                                                 ".gguf file")
    read_spec(model)  # missing, not a model, unsupported: before anything slow
    if any(not q.strip() for q in questions):
        raise KtlongError("--question is empty", hint="give the question text after --question")
    doc = read_document(prompt_file, encoding) if prompt_file else None
    ui = chatui.TerminalUI(as_json=as_json, show_prompt_ids=show_prompt_ids)
    read = None if questions else chatui.input_reader(ui, stdin_taken=prompt_file == "-")
    try:
        with ui.loading(model):
            lm = load_model(model, settings.device, weight_type=settings.weight_type)
        if doc is not None:
            check_length(doc, lm.tokenizer, settings.max_seq_len)  # before tokenizing it
        loop = ChatLoop(lm, settings, doc, ui, system, encoding, use_cache, cache_dir, lead)
        loop.open()
        if not questions:
            ui.banner(loop)
            return loop.repl(read)
        for q in questions:
            answer = loop.answer(q)
            if answer is None or answer.stop == "interrupted":
                return 130
        return 0
    except (KeyboardInterrupt, SystemError) as e:
        if not is_interrupt(e):
            raise
        ui.note("interrupted")
        return 130
