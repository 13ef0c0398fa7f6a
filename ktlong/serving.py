"""The engine behind `ktlong serve`: prompts rendered to ids, prefix reuse, one job at a time.

`Renderer` turns a request's messages (or a completion prompt) into token ids with the model's
chat template, and says how many leading ids are worth a prompt-cache entry on disk: the leading
system messages (where a client puts a long document), or, with `--prompt-file`, the document
that opens the first user message (the layout of `ktlong chat`, so `ktlong prefill` entries are
shared). That prefix is tokenized apart from the rest, so its ids never depend on the question.

`Engine` owns the one live `Session` and runs jobs one at a time on a worker thread (Numba's and
torch's threads stay with one Python thread). A prompt is read as its prefix, then the rest:
a fresh session reads the prefix (or maps it from the prompt cache, `open_document`), then the
rest; the live store is reused only when it holds the whole prefix, and is then cut back to the
prefix's end (or extended, when the prompt goes on from everything it holds: the next turn). So
the same request gets the same KV, and with greedy settings the same answer, whatever ran before
it. A job
reports through `emit(event)`: ("progress", done, total), ("start", prompt_tokens,
cached_tokens), ("text", str), ("passages", [dict]) when it asks for them (`ktlong.passages`:
what the answer attended most, before "end"), ("end", finish_reason, usage, stats: the numbers of
`Engine.last`), ("error", exception). Setting its `cancel` event stops it at the next token or
prefill chunk and frees the engine.

Context shift (`overflow: SHIFT`, chat requests only): `Renderer.fit` leaves out the oldest
non-system messages, whole turns at a time (a user message and what follows it up to the next
one; never a system message, the `-f` document or the last user message), until the prompt leaves
room for the answer. The engine reuses the K,V of the kept turns when the live store holds them
(`Session.shift_to`: moved down, keys re-rotated, as `ktlong chat` does), and an answer that fills
the store asks `Job.fit` for a prompt without more turns (generate's `make_room`). A job reports
a mid-answer shift as ("shift", dropped_messages, dropped_tokens).
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
    head: list[int] | None = None  # ids before the served document (template, system
    # messages); None: not known (Session finds the template's own)
    after: int = 0  # the last ids begin the answer: a final assistant message, continued


@dataclass(frozen=True)
class Fitted:
    """A chat prompt without its `dropped` oldest non-system messages (`Renderer.fit`)."""

    prompt: Prompt
    dropped: int = 0  # messages left out
    dropped_tokens: int = 0  # the full prompt's tokens minus the kept one's


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

    def render(self, messages: list[dict[str, str]], generation: bool = True,
               go_on: bool = False) -> str:
        """The prompt text; `go_on`: the last message (the assistant's) is left open, for the
        answer to continue it."""
        if self.plain:
            names = {"system": "System", "user": "User", "assistant": "Assistant"}
            text = (self.tokenizer.bos_token or "") + "".join(
                f"{names[m['role']]}: {m['content']}{SEP}" for m in messages)
            if go_on:
                return text[: -len(SEP)]
            return text + ("Assistant:" if generation else "")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation and not go_on,
                continue_final_message=go_on)
        except Exception as e:  # jinja2 TemplateError, or raise_exception() in the template
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise KtlongError(f"the model's chat template refused these messages: {first}") \
                from None

    def chat(self, messages: list[dict[str, str]]) -> Prompt:
        """Ids for `messages` ({role: system|user|assistant, content: str}) + the answer cue."""
        with self._lock:
            return self._chat([dict(m) for m in messages])

    def _chat(self, msgs: list[dict[str, str]]) -> Prompt:
        if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"].strip():
            msgs = msgs[:-1]  # an empty answer begun: answered as if it were not there
        go_on = bool(msgs) and msgs[-1]["role"] == "assistant"  # the answer begun, continued
        try:
            text = self.render(self._with_document(msgs), go_on=go_on)
        except KtlongError:
            if not any(m["role"] == "system" for m in msgs):
                raise
            msgs = _system_into_user(msgs)  # "System role not supported"
            text = self.render(self._with_document(msgs), go_on=go_on)
        head, rest, before = "", text, None
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
        prefix = len(ids)
        ids += self.encode(rest)
        after = min(len(self.encode(msgs[-1]["content"].strip())), len(ids)) if go_on else 0
        return Prompt(ids, prefix, None if before is None else self.encode(before), after)

    def fit(self, messages: list[dict[str, str]], limit: int,
            rows: Callable[[Prompt], int] = lambda p: len(p.ids)) -> Fitted:
        """`chat(messages)` without as few of the oldest turns as leave it at most `limit`
        KV rows (`rows`: its tokens, unless the session keeps fewer; all of the turns when even
        that is too long: the caller checks the length). A turn
        is a user message and the messages after it up to the next user message (an assistant
        message before the first user message is one too); system messages, the `-f` document
        and the last user message with what follows it are never left out."""
        with self._lock:
            msgs = [dict(m) for m in messages]
            full = self._chat(msgs)
            if rows(full) <= limit:
                return Fitted(full)
            rest = [i for i, m in enumerate(msgs) if m["role"] != "system"]
            cuts = [k for k, i in enumerate(rest) if k > 0 and msgs[i]["role"] == "user"]
            if not cuts:
                return Fitted(full)

            def without(k: int) -> Prompt:
                gone = set(rest[:k])
                return self._chat([m for i, m in enumerate(msgs) if i not in gone])

            lo, hi, best = 0, len(cuts) - 1, None  # the fewest turns: a binary search
            while lo <= hi:
                mid = (lo + hi) // 2
                p = without(cuts[mid])
                if rows(p) <= limit:
                    best, hi = (cuts[mid], p), mid - 1
                else:
                    lo = mid + 1
            k, p = best if best is not None else (cuts[-1], without(cuts[-1]))
            return Fitted(p, k, len(full.ids) - len(p.ids))

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


def prompt_rows(settings: Any, prompt: Prompt) -> int:
    """KV rows a new session needs for `prompt`: its document prefix (or the whole prompt, when
    it has none) is read first, which attention LOCRET keeps to its budget."""
    from ktlong.engine import kv_rows

    return kv_rows(settings, len(prompt.ids), prompt.prefix or len(prompt.ids))


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
    # a chat's messages fitted to a token limit (Renderer.fit): set with overflow SHIFT
    fit: Callable[[int], Fitted] | None = None
    dropped: list[int] | None = None  # a chat's [messages, tokens] left out so far
    moved: int = 0  # tokens whose K,V a context shift moved (reused) for this job
    passages: int = 0  # report this many passages the answer attended most (0: none)


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
        self.prompt_len = 0  # the live store's first tokens that were a rendered prompt
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
        self.prompt_len = len(ids)
        prefill_s = time.perf_counter() - t0
        cached = len(ids) - prefilled
        job.emit(("start", len(ids), cached))
        finish, n_new = "length", 0
        if job.sampling is not None:
            finish, n_new = self._generate(s, job)
        decode_s = time.perf_counter() - t0 - prefill_s
        usage: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": n_new,
                                 "total_tokens": len(ids) + n_new,
                                 "prompt_tokens_details": {"cached_tokens": cached}}
        dropped = job.dropped or [0, 0]
        if job.dropped is not None:  # a chat: what overflow SHIFT left out (0: nothing)
            usage.update(dropped_messages=dropped[0], dropped_tokens=dropped[1])
        self.last = {"prompt_tokens": len(ids), "cached_tokens": cached,
                     "prefilled_tokens": prefilled, "prefill_s": round(prefill_s, 3),
                     "completion_tokens": n_new, "finish_reason": finish,
                     "decode_tok_s": round(n_new / decode_s, 2) if decode_s > 0 else 0.0,
                     "dropped_messages": dropped[0], "dropped_tokens": dropped[1],
                     "moved_tokens": job.moved}
        job.emit(("end", finish, usage, dict(self.last)))

    def _generate(self, s: Session, job: Job) -> tuple[str, int]:
        """Decode until EOS, a stop string, max_tokens, a full store or a cancel."""
        text, finish, n, flush = StopText(job.stop), "length", 0, True
        make_room = self._make_room(s, job) if job.fit is not None else None
        ids = job.prompt.ids
        steps = s.generate(job.sampling, make_room,  # type: ignore[arg-type]
                           ids[len(ids) - job.prompt.after:])
        recorder = None
        if job.passages:
            from ktlong.attnmap import SelectionRecorder

            recorder = SelectionRecorder(s.policy).__enter__()
        try:
            for step in steps:
                if step.token_id in self.lm.eos_ids:
                    finish = "stop"
                    break
                n += 1
                out, hit = text.feed(step.text)
                if out:
                    job.emit(("text", out))
                if hit or job.cancel.is_set():  # what StopText holds back is not sent
                    finish, flush = "stop" if hit else "cancelled", False
                    break
        except KtlongError:  # the store is full (max_seq_len) mid-answer, no turn left to drop
            s.truncate(len(s.tokens))
            finish = "length"
        finally:
            steps.close()
            if recorder is not None:
                recorder.__exit__()
        tail = text.flush() if flush else ""
        if tail:
            job.emit(("text", tail))
        if recorder is not None and finish != "cancelled":
            try:
                found = self._passages(s, job, recorder.records)
            except Exception as e:  # what it read is a view on the answer: never costs it
                self.notes.append(f"passages: {type(e).__name__}: {e}")
                found = []
            job.emit(("passages", found))
        return finish, n

    def _passages(self, s: Session, job: Job, records: list[Any]) -> list[dict[str, Any]]:
        """The document passages the answer's selection attended most (`ktlong.passages`)."""
        from ktlong.passages import top_passages

        p = job.prompt
        doc = (len(p.head), p.prefix) if p.head is not None and p.prefix else \
            (0, p.prefix or len(p.ids))
        attn = self.lm.model.model.layers[0].self_attn
        scale = float(getattr(attn, "scaling", self.lm.spec.head_dim ** -0.5))

        def decode(ids: list[int]) -> str:
            return self.lm.tokenizer.decode(ids, skip_special_tokens=True)

        return [x.to_dict() for x in top_passages(s, records, scale, doc, decode, job.passages)]

    def _make_room(self, s: Session, job: Job) -> Callable[[int], None]:
        """generate's hook when the store is full mid-answer: the prompt without more of its
        oldest turns (`job.fit`), leaving room for the `left` tokens the answer may still take,
        and the store shifted to it (the kept turns' and the answer's K,V moved when they can
        be, else prefilled). Nothing more to drop: it returns and the store refuses the token."""
        prompt = [job.prompt.ids]  # the prompt the store holds now

        def make_room(left: int) -> None:
            assert job.fit is not None and job.dropped is not None
            answer = s.tokens[len(prompt[0]):]
            fitted = job.fit(s.store.capacity - left - 1 - len(answer))
            if fitted.dropped <= job.dropped[0]:
                return
            ids = fitted.prompt.ids + answer
            s.template_head = fitted.prompt.head
            if s.common_prefix(ids) < s.store.nb_base * s.store.shape.block_size:
                return  # the mapped base (a cached document) cannot be rewritten
            job.moved += self._shift(s, ids, fitted.prompt.prefix)[0]
            if len(s.tokens) < len(ids):  # the rest (or all: nothing was reusable) prefilled
                s.extend_to(ids, self._progress(job))
            prompt[0] = fitted.prompt.ids
            self.prompt_len = len(fitted.prompt.ids)
            job.dropped[:] = [fitted.dropped, fitted.dropped_tokens]
            job.emit(("shift", fitted.dropped, fitted.dropped_tokens))

        return make_room

    def _shift(self, s: Session, ids: list[int], prefix: int,
               cut: int = 0) -> tuple[int, int]:
        """`s.shift_to(ids)` when it keeps the prompt's cacheable prefix (and the mapped base)
        in place and reuses a run of the store's tokens; returns (tokens moved, gap tokens
        prefilled), (0, 0) when nothing was done (the caller prefills as usual). The run must
        end with the store's last token; when the store's tail is not in `ids` (the last answer,
        sent back as text, tokenizes otherwise), the store cut back to its first `cut` tokens
        (the prompt it answered) is tried too."""
        from ktlong import shift

        base = s.store.nb_base * s.store.shape.block_size
        for n in (len(s.tokens), cut) if base < cut < len(s.tokens) else (len(s.tokens),):
            plan = shift.plan(s.tokens[:n], ids)
            if plan is not None and plan.keep >= max(base, prefix):
                if n < len(s.tokens):
                    s.truncate(n)
                s.shift_to(ids)
                return plan.moved, len(plan.gap)
        return 0, 0

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
        check_fits(self.lm.spec, self.settings, prompt_rows(self.settings, job.prompt),
                   self.settings.max_seq_len)
        progress = self._progress(job)
        disk = self.use_cache and p >= CACHE_MIN_TOKENS
        s, shifted = self.session, 0
        if s is not None and job.fit is not None and job.dropped and job.dropped[0]:
            # the request left out its oldest turns: the store may hold the kept ones after them
            moved, shifted = self._shift(s, ids, p, self.prompt_len)
            job.moved += moved
            if moved:  # its logits are the last token's before the move: fed again
                s.logits = None
        if s is not None:
            keep = s.common_prefix(ids)
            if p and len(s.tokens) > keep >= p:  # another question on the same document
                keep = p  # cut back where a fresh start splits the prompt (same KV, same answer)
            if not (keep == len(ids) == len(s.tokens) and s.logits is not None):
                keep = min(keep, len(ids) - 1)  # the last id is fed again for its logits
            base = s.store.nb_base * s.store.shape.block_size  # read-only: cannot be cut
            if keep >= base and keep >= p:  # never from inside the prefix: read from its start
                s.template_head = job.prompt.head
                return s, shifted + _extend(s, ids, progress)
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
        s.template_head = job.prompt.head
        if 0 < p < len(ids) and len(s.tokens) < p:  # the prefix, then the rest: the split a
            prefilled += _extend(s, ids[:p], progress)  # reuse cuts back to
        if len(ids) > len(s.tokens) or s.logits is None:
            prefilled += _extend(s, ids, progress)
        return s, prefilled



def _extend(s: Session, ids: list[int], progress: Callable[[int, int], None]) -> int:
    """Make `s` hold exactly `ids` with their logits; returns the ids prefilled."""
    if s.tokens == ids and s.logits is not None:
        return 0
    s.extend_to(ids, progress)
    return s.stats.prompt_tokens
