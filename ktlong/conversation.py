"""A conversation about one document, rendered to token ids with the model's chat template.

Layout: `[system] user(document + "\\n\\n" + question 1) assistant(answer 1) user(question 2) ...`.
The document always opens the first user turn, so every question follows it (as preselection
expects) and the document's tokens are a prefix shared by every turn: the KV store keeps them
while turns are appended or dropped (/reset).

To keep that prefix stable, the template is rendered with placeholders for the document and the
answers, and the pieces are tokenized apart: `ids = encode(head + document + sep)` +
`encode(text between)` + answer ids as generated + ... So the document's ids never depend on the
question, and answers keep the exact ids the model produced (re-tokenizing text can differ).

No template: a plain `User: ... / Assistant: ...` format (`plain` is True; the UI says so once).
A template that refuses a system role gets the system text at the top of the first user turn.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ktlong.errors import KtlongError

DOC = "\u27e6ktlong:document\u27e7"
ANSWER = "\u27e6ktlong:answer:{}\u27e7"
_ANSWER_RE = re.compile("\u27e6ktlong:answer:(\\d+)\u27e7")
SEP = "\n\n"  # between the document (or a /read file) and the question
LONG_TEXT = 1 << 20  # characters past which tokenising returns its scratch memory to the OS


@dataclass
class Turn:
    question: str  # the user's text as sent (attached /read files included)
    answer_ids: list[int] = field(default_factory=list)  # generated ids, without EOS
    answer: str = ""


class Conversation:
    """The document, an optional system prompt and the turns so far; renders token ids."""

    def __init__(self, tokenizer: Any, document: str = "", system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.document = document
        self.system = system or None
        self.turns: list[Turn] = []
        self.attachments: list[str] = []  # /read files waiting for the next question
        self.plain = not getattr(tokenizer, "chat_template", None)
        self._system_in_user = False  # set when the template refused a system role
        self._memo: dict[str, list[int]] = {}

    # --- building messages ---------------------------------------------------------------------
    def question_text(self, question: str) -> str:
        """The user text for the next turn: attached files, then the question."""
        return "".join(a + SEP for a in self.attachments) + question

    def _messages(self, question: str) -> list[dict[str, str]]:
        msgs = []
        if self.system and not self._system_in_user:
            msgs.append({"role": "system", "content": self.system})
        lead = (self.system + SEP if self.system and self._system_in_user else "") + DOC
        for i, t in enumerate(self.turns):
            msgs.append({"role": "user", "content": (lead if i == 0 else "") + t.question})
            msgs.append({"role": "assistant", "content": ANSWER.format(i)})
        msgs.append({"role": "user", "content": (lead if not self.turns else "") + question})
        return msgs

    def _render(self, question: str) -> str:
        if self.plain:
            return self._render_plain(self._messages(question))
        try:
            return self.tokenizer.apply_chat_template(self._messages(question), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # jinja2 TemplateError, or raise_exception() in the template
            if self.system and not self._system_in_user:
                self._system_in_user = True  # e.g. "System role not supported"
                return self._render(question)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise KtlongError(f"the model's chat template failed: {first}",
                              hint="report it with the model name") from e

    def _render_plain(self, msgs: list[dict[str, str]]) -> str:
        names = {"system": "System", "user": "User", "assistant": "Assistant"}
        out = [self.tokenizer.bos_token or ""]
        out += [f"{names[m['role']]}: {m['content']}\n\n" for m in msgs]
        return "".join(out) + "Assistant:"

    # --- token ids -----------------------------------------------------------------------------
    def _split(self, question: str) -> tuple[str, str]:
        """(text up to and including the document, the rest with answer placeholders)."""
        text = self._render(question)
        head, found, rest = text.partition(DOC)
        if not found:
            raise KtlongError("the model's chat template dropped the first user message",
                              hint="report it with the model name")
        return head + (self.document + SEP if self.document else ""), rest

    def _encode(self, text: str, memo: dict[str, list[int]]) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            from ktlong import memory

            long = len(text) > LONG_TEXT  # a document: the tokenizer's scratch goes back after
            if long:
                memory.limit_heap_retention()
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            if long:
                memory.trim_heap()
        memo[text] = ids
        return ids

    def head_ids(self) -> list[int]:
        """The ids before the document: the template's head and the system prompt."""
        return list(self._encode(self._render("").partition(DOC)[0], {}))

    def document_ids(self) -> list[int]:
        """The ids every turn starts with: template head, system prompt, document, separator."""
        memo: dict[str, list[int]] = {}
        ids = list(self._encode(self._split("")[0], memo))
        self._memo.update(memo)
        return ids

    def prompt_ids(self, question: str) -> list[int]:
        """The whole conversation plus `question`, ready for the answer to follow."""
        head, rest = self._split(question)
        memo: dict[str, list[int]] = {}
        ids = list(self._encode(head, memo))
        pieces = _ANSWER_RE.split(rest)  # text, answer index, text, ...
        for i, piece in enumerate(pieces):
            ids += self.turns[int(piece)].answer_ids if i % 2 else self._encode(piece, memo)
        self._memo = memo  # keep only what this conversation still uses
        return ids

    def fit(self, question: str, limit: int) -> tuple[list[int], list[Turn]]:
        """Drop the oldest turns until `prompt_ids(question)` holds at most `limit` tokens
        (context shift); the document and `question` are never dropped, so the ids may still
        be longer. Returns the ids and the dropped turns, oldest first."""
        ids, dropped = self.prompt_ids(question), []
        while len(ids) > limit and self.turns:
            dropped.append(self.turns.pop(0))
            ids = self.prompt_ids(question)
        return ids, dropped

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
