"""The engine behind `ktlong serve`: prompts rendered to ids, prefix reuse, one job at a time.

`Renderer` turns a request's messages (or a completion prompt) into token ids with the model's
chat template, and says how many leading ids are worth a prompt-cache entry on disk: the leading
system messages (where a client puts a long document), or, with `--prompt-file`, the document
that opens the first user message (the layout of `ktlong chat`, so `ktlong prefill` entries are
shared). That prefix is tokenized apart from the rest, so its ids never depend on the question.

`Engine` owns the one live `Session` and runs jobs one at a time on a worker thread (Numba's and
torch's threads stay with one Python thread). A job's prompt reuses the live store's longest
common prefix (the store is cut back to it, then extended), or, when the live store shares less
than the prompt cache on disk has, a session opened from the cache (`open_document`). A job
reports through `emit(event)`: ("progress", done, total), ("start", prompt_tokens,
cached_tokens), ("text", str), ("end", finish_reason, usage), ("error", exception). Setting its
`cancel` event stops it at the next token or prefill chunk and frees the engine.
"""
from __future__ import annotations

import copy
import gc
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ktlong.config import Settings
from ktlong.engine import Sampling, Session
from ktlong.errors import KtlongError

SEP = "\n\n"  # between the --prompt-file document and what follows (as `ktlong chat`)
DOC = "\u27e6ktlong:document\u27e7"
CACHE_MIN_TOKENS = 1024  # a shorter prefix is not worth a prompt-cache file
PROGRESS_EVERY_S = 1.0

Event = tuple  # see the module docstring


class Cancelled(Exception):
    """The client went away: raised inside a prefill to stop it."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    prefix: int = 0  # leading ids worth keeping in the prompt cache on disk (0: none)


class Renderer:
    """Messages or a prompt -> `Prompt`, with the model's chat template (or a plain format)."""

    def __init__(self, tokenizer: Any, document: str = "") -> None:
        # its own copy, used by one thread at a time: a fast tokenizer that encodes while another
        # thread encodes or decodes with it raises "Already borrowed" (the engine decodes)
        self.tokenizer, self.document = copy.deepcopy(tokenizer), document
        self.plain = not getattr(tokenizer, "chat_template", None)
        self._memo: tuple[str, bool, list[int]] = ("", False, [])  # the last prefix and its ids
        self._lock = threading.Lock()

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

    def _prefix_ids(self, text: str, special: bool = False) -> list[int]:
        if self._memo[:2] != (text, special):  # a 128K-token prefix is tokenized once
            self._memo = (text, special, self.encode(text, special))
        return list(self._memo[2])

    def render(self, messages: list[dict[str, str]], generation: bool = True) -> str:
        if self.plain:
            names = {"system": "System", "user": "User", "assistant": "Assistant"}
            text = (self.tokenizer.bos_token or "") + "".join(
                f"{names[m['role']]}: {m['content']}{SEP}" for m in messages)
            return text + ("Assistant:" if generation else "")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation)
        except Exception as e:  # jinja2 TemplateError, or raise_exception() in the template
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise KtlongError(f"the model's chat template refused these messages: {first}") \
                from None

    def chat(self, messages: list[dict[str, str]]) -> Prompt:
        """Ids for `messages` ({role: system|user|assistant, content: str}) + the answer cue."""
        with self._lock:
            return self._chat([dict(m) for m in messages])

    def _chat(self, msgs: list[dict[str, str]]) -> Prompt:
        try:
            text = self.render(self._with_document(msgs))
        except KtlongError:
            if not any(m["role"] == "system" for m in msgs):
                raise
            msgs = _system_into_user(msgs)  # "System role not supported"
            text = self.render(self._with_document(msgs))
        head, rest = "", text
        if self.document:
            before, found, rest = text.partition(DOC)
            if not found:
                raise KtlongError("the model's chat template dropped the first user message")
            head = before + self.document + SEP
        else:
            k = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
            if 0 < k < len(msgs):
                try:
                    lead = self.render(msgs[:k], generation=False)
                except KtlongError:
                    lead = ""
                if lead and text.startswith(lead):
                    head, rest = lead, text[len(lead):]
        ids = self._prefix_ids(head) if head else []
        return Prompt(ids + self.encode(rest), len(ids))

    def _with_document(self, msgs: list[dict[str, str]]) -> list[dict[str, str]]:
        if not self.document:
            return msgs
        first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first is None:
            raise KtlongError("messages need a user message: the served document opens the "
                              "first one")
        out = list(msgs)
        out[first] = {**msgs[first], "content": DOC + msgs[first]["content"]}
        return out

    def completion(self, prompt: str | list[int]) -> Prompt:
        """Ids for a raw prompt (text, or ids as given), after the document if one is served."""
        with self._lock:
            return self._completion(prompt)

    def _completion(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, list):
            head = self._prefix_ids(self.document + SEP, special=True) if self.document else []
            return Prompt(head + prompt, len(head))
        if self.document:
            head = self._prefix_ids(self.document + SEP, special=True)
            return Prompt(head + self.encode(prompt), len(head))
        return Prompt(self.encode(prompt, special=True))


def _system_into_user(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """For templates without a system role: system texts open the first user message."""
    system = SEP.join(m["content"] for m in msgs if m["role"] == "system")
    rest = [m for m in msgs if m["role"] != "system"]
    first = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first is None:
        return [{"role": "user", "content": system}, *rest]
    rest[first] = {**rest[first], "content": system + SEP + rest[first]["content"]}
    return rest


class StopText:
    """Cuts generated text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit)."""
        self.held += delta
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.held = self.held[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:k]):
                    keep = k
                    break
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Job:
    prompt: Prompt
    sampling: Sampling | None  # None: prefill only (the --prompt-file document at start)
    emit: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)


class Engine:
    """One Session, one worker thread, a queue of jobs."""

    def __init__(self, lm: Any, settings: Settings, use_cache: bool = True,
                 cache_dir: Path | None = None) -> None:
        self.lm, self.settings = lm, settings
        self.use_cache, self.cache_dir = use_cache, cache_dir
        self.session: Session | None = None
        self.current: Job | None = None
        self.last: dict[str, Any] = {}  # numbers of the last finished job
        self.notes: list[str] = []  # prompt-cache notes (a damaged entry recomputed, ...)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ktlong-engine", daemon=True)
        self._thread.start()

    # --- outside the worker ------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def run(self, job_prompt: Prompt, progress: Callable[[int, int], None] | None = None) -> None:
        """Prefill `job_prompt` on the worker and wait (the served document, at start)."""
        done, errors = threading.Event(), []

        def emit(ev: Event) -> None:
            if ev[0] == "progress" and progress is not None:
                progress(ev[1], ev[2])
            elif ev[0] == "error":
                errors.append(ev[1])
            if ev[0] in ("end", "error"):
                done.set()

        self.submit(Job(job_prompt, None, emit))
        done.wait()
        if errors:
            raise errors[0]

    def health(self) -> dict[str, Any]:
        s = self.session
        return {"busy": self.current is not None, "queued": self._jobs.qsize(),
                "context_tokens": len(s.tokens) if s else 0,
                "max_seq_len": self.settings.max_seq_len, "last": dict(self.last)}

    def close(self) -> None:
        job = self.current
        if job is not None:
            job.cancel.set()
        self._jobs.put(None)
        self._thread.join(timeout=60)

    # --- on the worker -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancel.is_set():  # its client left while it waited
                continue
            self.current = job
            try:
                self._run(job)
            except BaseException as e:  # reported to the client; the engine keeps serving
                if self.session is not None:  # a forward cut short may have written layers
                    self.session.truncate(len(self.session.tokens))
                job.emit(("error", e))
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        s, prefilled = self._prepare(job)
        ids = job.prompt.ids
        prefill_s = time.perf_counter() - t0
        cached = len(ids) - prefilled
        job.emit(("start", len(ids), cached))
        finish, n_new = "length", 0
        if job.sampling is not None:
            finish, n_new = self._generate(s, job)
        decode_s = time.perf_counter() - t0 - prefill_s
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_new,
                 "total_tokens": len(ids) + n_new,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self.last = {"prompt_tokens": len(ids), "cached_tokens": cached,
                     "prefilled_tokens": prefilled, "prefill_s": round(prefill_s, 3),
                     "completion_tokens": n_new, "finish_reason": finish,
                     "decode_tok_s": round(n_new / decode_s, 2) if decode_s > 0 else 0.0}
        job.emit(("end", finish, usage))

    def _generate(self, s: Session, job: Job) -> tuple[str, int]:
        """Decode until EOS, a stop string, max_tokens, a full store or a cancel."""
        text, finish, n = StopText(job.stop), "length", 0
        steps = s.generate(job.sampling)  # type: ignore[arg-type]
        try:
            for step in steps:
                if step.token_id in self.lm.eos_ids:
                    finish = "stop"
                    break
                n += 1
                out, hit = text.feed(step.text)
                if out:
                    job.emit(("text", out))
                if hit:
                    return "stop", n
                if job.cancel.is_set():
                    return "cancelled", n
        except KtlongError:  # the store is full (max_seq_len) mid-answer
            s.truncate(len(s.tokens))
            finish = "length"
        finally:
            steps.close()
        tail = text.flush()
        if tail:
            job.emit(("text", tail))
        return finish, n

    def _progress(self, job: Job) -> Callable[[int, int], None]:
        last = [time.monotonic()]  # a prefill shorter than PROGRESS_EVERY_S reports nothing

        def progress(done: int, total: int) -> None:
            if job.cancel.is_set():
                raise Cancelled
            now = time.monotonic()
            if job.sampling is None or now - last[0] >= PROGRESS_EVERY_S:  # None: a bar
                last[0] = now
                job.emit(("progress", done, total))

        return progress

    def _prepare(self, job: Job) -> tuple[Session, int]:
        """A session whose store holds the job's ids; returns it and how many ids it prefilled."""
        from ktlong.engine import check_fits

        ids, p = job.prompt.ids, job.prompt.prefix
        check_fits(self.lm.spec, self.settings, len(ids), self.settings.max_seq_len)
        progress = self._progress(job)
        disk = self.use_cache and p >= CACHE_MIN_TOKENS
        s = self.session
        if s is not None:
            keep = s.common_prefix(ids)
            if not (keep == len(ids) == len(s.tokens) and s.logits is not None):
                keep = min(keep, len(ids) - 1)  # the last id is fed again for its logits
            base = s.store.nb_base * s.store.shape.block_size  # read-only: cannot be cut
            if keep >= base and (not disk or keep >= p or keep >= self._on_disk(ids[:p])):
                prefilled = 0
                if disk and keep < p:  # the prefix goes to disk for the next start too
                    prefilled += _extend(s, ids[:p], progress)
                    self._store(s)
                return s, prefilled + _extend(s, ids, progress)
        if s is not None:
            self.session = s = None
            gc.collect()  # the old store goes before the new one is made (~0.4 s: not always)
        if disk:
            from ktlong.promptcache import open_document

            opened = open_document(self.lm, self.settings, ids[:p], progress, True,
                                   self.cache_dir)
            if opened.note:
                self.notes.append(opened.note)
            s = opened.session
            prefilled = s.stats.prompt_tokens if opened.source == "cache" else p
        else:
            s, prefilled = Session(self.lm, self.settings), 0
        self.session = s
        if len(ids) > len(s.tokens) or s.logits is None:
            prefilled += _extend(s, ids, progress)
        return s, prefilled

    def _on_disk(self, ids: list[int]) -> int:
        """Tokens of the longest prompt-cache entry that starts `ids` (0: none)."""
        from ktlong.promptcache import content_key, open_cache

        entry = open_cache(self.settings, self.cache_dir).find_prefix(
            content_key(self.lm.spec, self.settings), ids)
        return entry.header["n_tokens"] if entry else 0

    def _store(self, s: Session) -> None:
        from ktlong.promptcache import content_key, open_cache

        try:
            open_cache(self.settings, self.cache_dir).store(s, content_key(self.lm.spec,
                                                                          self.settings))
        except KtlongError as e:  # a full disk costs the cache, not the answer
            self.notes.append(f"{e.message} ({e.hint})")


def _extend(s: Session, ids: list[int], progress: Callable[[int, int], None]) -> int:
    """Make `s` hold exactly `ids` with their logits; returns the ids prefilled."""
    if s.tokens == ids and s.logits is not None:
        return 0
    s.extend_to(ids, progress)
    return s.stats.prompt_tokens
