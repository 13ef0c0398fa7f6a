"""What `ktlong chat` draws: rich output (progress, streamed answers, stats) and the prompt.

Answers (or, with --json, one JSON object per answer per line) go to stdout; progress bars, notes,
errors and the dim stats line go to stderr, so `ktlong chat --question ... > answer.txt` keeps
only answers. Consoles honour NO_COLOR and drop colour when not on a terminal.

Input: prompt-toolkit with a history file in the ktlong home. Enter sends; Esc then Enter, or a
trailing backslash, starts a new line; pasted text keeps its newlines. Ctrl-C clears a line being
typed; on an empty prompt, a second Ctrl-C (after one that stopped an answer or was pressed at the
prompt, within 2 s) ends the chat with exit 130; Ctrl-D on an empty prompt ends it (0).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from ktlong.errors import KtlongError
from ktlong.memory import size

AGAIN_S = 2.0  # a second Ctrl-C within this many seconds leaves
STOPS = {"max_new_tokens": "hit max_new_tokens",
         "interrupted": "stopped by Ctrl-C; the partial answer is kept",
         "context_full": "context full: /reset, or raise max_seq_len"}
KEYS = ("Enter sends · Esc Enter or a trailing \\ adds a line · Ctrl-C stops an answer · "
        "Ctrl-D leaves")
# C0/C1 control characters (but tab and newline) from the model are shown as U+FFFD: a stray
# escape sequence in an answer must not move the cursor or recolour the terminal
_CONTROLS = {c: "\ufffd" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (9, 10)}


def printable(text: str) -> str:
    return text.translate(_CONTROLS)


class _TokRate(ProgressColumn):
    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:,.0f} tok/s" if task.speed else "- tok/s", style="cyan")


class _Eta(ProgressColumn):
    """The time left from the read's cost so far (ktlong.eta), not from the last seconds' rate."""

    def render(self, task: Any) -> Text:
        left = task.fields["eta"].remaining()
        if left is None:
            return Text("ETA -:--:--", style="progress.remaining")
        m, s = divmod(int(left + 0.5), 60)
        return Text(f"ETA {m // 60}:{m % 60:02d}:{s:02d}", style="progress.remaining")


class TerminalUI:
    """The chat's output. `as_json` prints JSON lines instead of streamed text and stats."""

    def __init__(self, as_json: bool = False, show_prompt_ids: bool = False,
                 out: Console | None = None, err: Console | None = None) -> None:
        self.json, self.show_prompt_ids = as_json, show_prompt_ids
        self.out = out or Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err = err or Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self._col = 0  # characters written on the current answer line
        self.last_interrupt = -1e9  # time.monotonic() of the last Ctrl-C
        self._said_plain = False

    # --- loading and prefill -----------------------------------------------------------------
    @contextmanager
    def loading(self, path: Path) -> Iterator[None]:
        """A spinner while the model loads, instead of transformers' own progress bars."""
        # GGUF conversion uses tqdm directly; tqdm reads TQDM_* when first imported
        os.environ.setdefault("TQDM_DISABLE", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        with self.err.status(f"loading {escape(str(path))}"):
            yield

    @contextmanager
    def progress(self, label: str, min_tokens: int = 0, eta: Any = None
                 ) -> Iterator[Callable[[int, int], None]]:
        """A progress callback (done, total) that shows a bar once `total >= min_tokens`; `eta`
        (a ktlong.eta.Eta: the keys the read's tokens read, its end) gives its time left."""
        from ktlong.eta import Eta

        bar: list[Any] = []
        eta = eta or Eta()

        def update(done: int, total: int) -> None:
            eta.update(done, total)
            if not bar:
                p = None
                if total >= min_tokens:
                    p = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                                 TextColumn("{task.completed:,}/{task.total:,} tokens"),
                                 _TokRate(), _Eta(), console=self.err)
                    p.start()
                    p.add_task(label, total=total, eta=eta)
                bar.append(p)
            if bar[0] is not None:
                bar[0].update(bar[0].task_ids[0], completed=done)

        try:
            yield update
        finally:
            if bar and bar[0] is not None:
                bar[0].stop()

    def document(self, loop: Any, opened: Any) -> None:
        n, st = loop.doc_len, opened.session.stats
        name = loop.document.name if loop.document else "no document"
        how = (f"from the prompt cache (checked in {opened.verify_s:.1f} s)"
               if opened.source == "cache" else
               f"read in {st.prefill_s:.1f} s ({st.prefill_tok_s:,.0f} tok/s)" if n else "")
        self.err.print(f"[bold]{escape(name)}[/]: {n:,} tokens {how}")
        if opened.note:
            self.err.print(f"[yellow]{escape(opened.note)}[/]")
        if loop.conv.plain and not self._said_plain:
            self._said_plain = True
            self.err.print("[yellow]the model has no chat template: using a plain "
                           "'User: … / Assistant:' format[/]")

    def banner(self, loop: Any) -> None:
        spec = loop.lm.spec
        self.err.print(f"[bold]ktlong chat[/] · {escape(Path(spec.path).name)} ({spec.arch}, "
                       f"{spec.n_layers} layers) · {loop.settings.attention.lower()} attention · "
                       f"max_seq_len {loop.settings.max_seq_len:,}")
        self.err.print(f"[dim]{KEYS} · /help for commands[/]")

    # --- answers -----------------------------------------------------------------------------
    def lead(self, text: str) -> None:
        """The words the answer was started with, before its first token."""
        self._write(text)

    def token(self, step: Any) -> None:
        self._write(step.text)

    def _write(self, text: str) -> None:
        if self.json or not text:
            return
        text = printable(text)
        self.out.file.write(text)
        self.out.file.flush()
        self._col = 0 if text.endswith("\n") else self._col + len(text)

    def answer_end(self, loop: Any, answer: Any) -> None:
        if self.json:
            self.out.file.write(json.dumps(answer.to_json(self.show_prompt_ids)) + "\n")
            self.out.file.flush()
            return
        if self._col:
            self.out.file.write("\n")
            self.out.file.flush()
        self._col = 0
        self.err.print(f"[dim]{escape(stats_line(answer))}[/]")

    # --- messages ----------------------------------------------------------------------------
    def interrupted(self) -> None:
        """Ctrl-C stopped an answer: a second one soon after, at the prompt, leaves."""
        self.last_interrupt = time.monotonic()

    def note(self, text: str) -> None:
        if self._col:
            self.out.file.write("\n")
            self._col = 0
        self.err.print(f"[dim]{escape(text)}[/]")

    def error(self, e: KtlongError) -> None:
        self.err.print(f"[red]error:[/] {escape(e.message)}"
                       + (f" [dim]({escape(e.hint)})[/]" if e.hint else ""))

    def help(self, commands: dict[str, Any]) -> None:
        table = Table.grid(padding=(0, 2))
        for c in commands.values():
            table.add_row(Text(f"{c.name} {c.usage}".rstrip(), style="bold"), c.help)
        self.out.print(table)
        self.out.print(f"[dim]{KEYS} (so does Ctrl-C twice). A line starting with "
                       "// sends a question that starts with /.[/]")

    def stats(self, loop: Any) -> None:
        s, st = loop.session, loop.settings
        used = len(s.tokens) if s else 0
        kv = s.store.nbytes_used() if s else 0
        doc = loop.document.name if loop.document else "no document"
        self.out.print(f"document  {escape(doc)}: {loop.doc_len:,} tokens ({loop.source})")
        self.out.print(f"context   {used:,} of {st.max_seq_len:,} tokens, {len(loop.conv.turns)} "
                       f"turns, KV {size(kv)} ({st.kv_type})")
        self.out.print(f"attention {st.attention}, block_size {st.block_size}, "
                       f"{st.second_select_num} selected blocks; sampling: temperature "
                       f"{st.temperature}, top_p {st.top_p}, top_k {st.top_k}, max_new_tokens "
                       f"{st.max_new_tokens}")
        if loop.last is not None:
            self.out.print("last      " + escape(stats_line(loop.last)))

    def context(self, loop: Any) -> None:
        """/context: the document, the turns kept and dropped (context shift), free tokens."""
        s, cap = loop.session, loop.settings.max_seq_len
        used = len(s.tokens) if s else 0
        cap = s.store.capacity if s else cap
        doc = loop.document.name if loop.document else "no document"
        turns, (gone, gone_tokens) = loop.conv.turns, loop.dropped
        self.out.print(f"document  {escape(doc)}: {loop.doc_len:,} tokens (never dropped)")
        self.out.print(f"kept      {len(turns)} turn{'s' if len(turns) != 1 else ''}, "
                       f"{max(0, used - loop.doc_len):,} tokens")
        for i, t in enumerate(turns, gone + 1):
            q = " ".join(t.question.split())
            q = q if len(q) <= 60 else q[:59] + "…"
            self.out.print(f"  {i:>3}. {escape(q)} [dim]({len(t.answer_ids):,}-token answer)[/]")
        self.out.print(f"dropped   {gone} turn{'s' if gone != 1 else ''}, {gone_tokens:,} tokens "
                       f"(overflow {loop.settings.overflow})")
        self.out.print(f"free      {cap - used:,} of {cap:,} tokens")


def stats_line(a: Any) -> str:
    """The dim line after an answer: speeds, sizes, share of blocks attended, why it stopped."""
    st = a.stats
    parts = [f"{st.new_tokens} tokens at {st.decode_tok_s:.1f} tok/s",
             f"prompt {len(a.prompt_ids):,} (new {a.prefilled_tokens:,} at "
             f"{a.prefill_tok_s:,.0f} tok/s)", f"KV {size(st.kv_bytes)}",
             f"blocks read {st.attended_share:.0%}",
             f"{st.threads} thread{'s' if st.threads != 1 else ''}"]
    if a.stop in STOPS:
        parts.append(STOPS[a.stop])
    return " · ".join(parts)


def input_reader(ui: TerminalUI, stdin_taken: bool = False) -> Callable[[], str]:
    """A function returning the next line of input (EOFError at the end).

    A terminal gets prompt-toolkit (even when stdin carried the document: it reads the tty);
    a piped stdin gives one question per line (a trailing backslash joins lines).
    """
    if sys.stdin.isatty() or (stdin_taken and (sys.stdout.isatty() or sys.stderr.isatty())):
        return prompt_reader(ui)
    if stdin_taken:
        raise KtlongError("the document came from stdin, and there is no terminal to ask on",
                          hint="pass the questions with --question Q (repeatable)")

    def read_lines() -> str:
        lines = []
        while True:
            line = sys.stdin.readline()
            if not line:
                if lines:
                    break
                raise EOFError
            line = line.rstrip("\n")
            if not line.endswith("\\"):
                lines.append(line)
                break
            lines.append(line[:-1])
        return "\n".join(lines)

    return read_lines


def prompt_reader(ui: TerminalUI, input: Any = None, output: Any = None) -> Callable[[], str]:
    """prompt-toolkit input with history and the key bindings in the module docstring.

    Ctrl-C on an empty prompt leaves only if it follows another Ctrl-C (one that stopped an
    answer, or one pressed at the prompt) within `AGAIN_S`; otherwise it says how to leave.
    """
    from prompt_toolkit import PromptSession
    from prompt_toolkit.application import run_in_terminal
    from prompt_toolkit.formatted_text import HTML
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.input.defaults import create_input
    from prompt_toolkit.key_binding import KeyBindings

    from ktlong.config import ktlong_home

    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event: Any) -> None:
        buf = event.current_buffer
        if buf.document.text_before_cursor.endswith("\\") and not buf.document.text_after_cursor:
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _interrupt(event: Any) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()
            return
        now = time.monotonic()
        if now - ui.last_interrupt < AGAIN_S:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")
            return
        ui.last_interrupt = now
        run_in_terminal(lambda: ui.err.print("[dim]press Ctrl-C again (or Ctrl-D) to leave[/]"))

    home = ktlong_home()
    home.mkdir(parents=True, exist_ok=True)
    session: PromptSession[str] = PromptSession(
        history=FileHistory(str(home / "chat_history")), key_bindings=kb, multiline=True,
        input=input or create_input(always_prefer_tty=True), output=output,
        prompt_continuation="... ", enable_open_in_editor=False)
    prompt = HTML("<b><ansicyan>&gt;&gt;&gt;</ansicyan></b> ")
    return lambda: session.prompt(prompt)
