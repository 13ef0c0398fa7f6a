"""A chat session over one KV store: chunked prefill, then token-by-token decode.

The engine prints nothing: `prefill` reports progress through a callback and `generate` yields a
`Step` per token with running stats (mlx-lm's stream_generate shape).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ktlong import decoder, memory
from ktlong.attention import AttentionRouter
from ktlong.config import Settings, reads_patterns
from ktlong.errors import KtlongError
from ktlong.fit import prefill_chunk
from ktlong.kvstore import KVStore, StoreShape
from ktlong.memory import gb, kv_bytes_per_token, limit_heap_retention, resolve_tier
from ktlong.model import LoadedModel
from ktlong.selection import SelectionPolicy
from ktlong.slidingkv import SlidingKV
from ktlong.squeeze import cosine_sum
from ktlong.tokenids import TokenIds, common_prefix
from ktlong.warmup import compile_seconds, same_parts_until, warm_up
from ktlong.weights import set_prefill_matmul

Progress = Callable[[int, int], None]  # (tokens done, total)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = -1  # -1 = random

    @classmethod
    def from_settings(cls, s: Settings) -> Sampling:
        return cls(s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed)


@dataclass
class Stats:
    prompt_tokens: int = 0  # tokens prefilled by the last prefill call
    prefill_tok_s: float = 0.0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_tok_s: float = 0.0
    context_tokens: int = 0
    kv_bytes: int = 0
    attended_share: float = 1.0  # share of context blocks read per decode step (mean)
    threads: int = 0  # CPU threads of the last prefill or generate


@dataclass
class Step:
    token_id: int
    text: str  # new text this token completes (may be "" mid-character)
    stats: Stats = field(default_factory=Stats)


RETHREAD_TOKENS = 16  # with threads_num 0, the idle cores are counted again this often in an
# answer: a thread whose core another job takes stalls every parallel region (kernels/threads.py)
ROPE_CACHE_BYTES = 64 << 20  # keep a forward's cos/sin across layers when they fit in this


def check_fits(spec: Any, settings: Settings, need: int, capacity: int | None = None) -> None:
    """Raise (one clear line) if `need` tokens do not fit in max_seq_len (or `capacity`).

    Before a store exists (`capacity` None) it also checks the room where kv_tier puts the KV:
    free DRAM for the RAM tier; free disk (the file for max_seq_len) and DRAM for the anchors and
    one decode step for the disk tier (`memory.room_problem`; the weights are loaded by then).
    """
    cap = settings.max_seq_len if capacity is None else capacity
    if need > cap:
        per_tok = kv_bytes_per_token(spec, settings.kv_type)
        raise KtlongError(
            f"the prompt needs {need:,} tokens but max_seq_len is {cap:,}; "
            f"{need:,} tokens need {gb(need * per_tok)} of KV cache",
            hint="run `ktlong memcheck` to see what fits, then raise max_seq_len",
        )
    if capacity is None:
        memory.check_room(spec, settings, need, weights_in_dram=False)


def kv_rows(settings: Settings, n_ids: int, first: int) -> int:
    """KV rows a new session holds for `n_ids` tokens whose first `first` it reads in its first
    prefill: under attention LOCRET that prefill keeps at most its budget and one chunk; every
    other token holds a row."""
    if settings.attention != "LOCRET":
        return n_ids
    first = min(first, n_ids)
    return min(first, memory.locret_rows(settings)) + n_ids - first


def position_embeddings(body: Any, h: torch.Tensor, pos: torch.Tensor) -> list[Any]:
    """Each layer's RoPE (cos, sin) for positions `pos` [1, C]: one table for all layers, or one
    per layer type where the model has several (Gemma 3: other bases for global and local)."""
    rope, types = body.rotary_emb, getattr(body.config, "layer_types", None)
    if types and hasattr(rope, "layer_types"):
        per = {t: rope(h, pos, t) for t in set(types)}
        return [per[t] for t in types]
    return [rope(h, pos)] * len(body.layers)


def sample(logits: torch.Tensor, sp: Sampling, gen: torch.Generator | None) -> int:
    """logits [vocab] -> token id (greedy when temperature is 0)."""
    if sp.temperature <= 0:  # NumPy's argmax on a CPU vector: 262K floats in 0.02 ms, torch 0.24
        if logits.device.type == "cpu":
            return int(logits.detach().float().numpy().argmax())
        return int(torch.argmax(logits))
    logits = logits.float() / sp.temperature
    if sp.top_k > 0:
        kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if sp.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _evictor(lm: LoadedModel, settings: Settings, n_layers: int,
             inv_freq: torch.Tensor | None) -> Any:
    """The Locret evictor of a LOCRET session (its retaining heads loaded when they score)."""
    from ktlong import locret

    if lm.spec.sliding_layers:
        raise KtlongError("attention LOCRET does not read sliding-window models (Gemma 3) yet",
                          hint="use the default profile for this model")
    heads, breaks = None, None
    if settings.locret_scores == "HEADS":
        heads = locret.load_heads(locret.find_heads(lm.spec, settings), lm.spec)[0]
    if settings.locret_scores == "SURPRISE":
        breaks = locret.line_breaks(lm.tokenizer, lm.spec.vocab_size)
    return locret.Evictor(settings, inv_freq, heads, n_layers, breaks)


def tier_dir(spec: Any, settings: Settings) -> Path | None:
    """Folder of the KV disk tier's file when the tier resolves to DISK, else None."""
    if resolve_tier(spec, settings) != "DISK":
        return None
    return memory.tier_folder(settings)


class Session:
    """One conversation: the model, its KV store, the selection policy and the tokens so far."""

    def __init__(
        self,
        lm: LoadedModel,
        settings: Settings,
        store: KVStore | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        self.lm, self.settings = lm, settings
        limit_heap_retention()
        spec = lm.spec
        shape = StoreShape(
            len(spec.kv_layers),
            spec.n_kv_heads,
            spec.head_dim,
            settings.block_size,
            settings.kv_type,
            settings.anchor_num,
        )
        self.store = store or KVStore(shape, settings.max_seq_len,
                                      tier_dir=tier_dir(spec, settings))
        self.tokens = tokens or []  # ids whose K,V are in the store (a TokenIds)
        self.window = None  # the sliding-window layers' rows (Gemma 3), outside the store
        if spec.sliding_layers:
            self.window = SlidingKV(spec.sliding_layers, spec.n_kv_heads, spec.head_dim,
                                    spec.sliding_window, settings.kv_type)
            if self.tokens:
                self.window.load(self.store.window_rows, len(self.tokens))
                self.window.pin(len(self.tokens))
        self.policy = SelectionPolicy(settings, spec, self.store)
        rope = getattr(lm.model.model, "rotary_emb", None)
        inv_freq = getattr(rope, "inv_freq", getattr(rope, "full_attention_inv_freq", None))
        inv_freq = None if inv_freq is None else inv_freq.detach().double().cpu()
        if inv_freq is not None:  # [rot/2]: turned reads (positions) of the store's layers
            self.policy.inv_freq = inv_freq.numpy()
        if self.store.mapped:  # how much of a mapped entry may stay resident
            step = self.policy.budget_blocks() * self.store.block_bytes * shape.n_layers
            self.store.bound_residency(step)
        local = lm.device if settings.gpu_local_window and lm.device.type == "cuda" else None
        chunk_attention = None
        if reads_patterns(settings):
            from ktlong.minference import ChunkAttention, resolve_plan

            chunk_attention = ChunkAttention(resolve_plan(spec, settings))
        self.router = AttentionRouter(self.store, self.policy, lm.device, local, chunk_attention,
                                      self.window, spec.kv_layers)
        if settings.prefill == "AUTO":
            from ktlong.minference import auto_reach

            self.router.auto_reach = auto_reach(spec, settings)
        # LOCRET: tokens of self.tokens whose K,V the prefill did not keep; the document's length;
        # its last tokens that sit, in order, at the end of what was kept (a cut may end there)
        self.dropped = len(self.tokens) - self.store.length
        self.doc_end = len(self.tokens) if self.dropped else 0
        self.kept_tail = min(settings.locret_stabilisers, self.store.length) if self.dropped else 0
        self.evictor = None
        if settings.attention == "LOCRET":
            self.evictor = self.router.evictor = _evictor(lm, settings, shape.n_layers, inv_freq)
        self._kv_slot = {li: i for i, li in enumerate(spec.kv_layers)}  # model -> store layer
        self.stats = Stats()
        self.logits: torch.Tensor | None = None  # [vocab] after the last token in the store
        self.threads = 0  # in effect; set before each prefill and generate
        self.capture_queries = 0  # keep at least this many last prompt queries per layer
        self._cos: torch.Tensor | None = None  # [n_layers] during a prefill: cosine sums
        self.prefill_matmul = set_prefill_matmul(lm.model, settings.prefill_matmul)
        self.decoder = decoder.build(lm)  # one-token forwards without transformers' modules
        # ids the conversation puts before the document (Conversation.head_ids: the template's
        # head, the system prompt); None: an empty conversation's under the default prompt
        self.template_head: list[int] | None = None
        self._default_head: list[int] | None = None
        self._warm_n = 0  # contexts up to this many tokens have their kernels
        self.warm(0)  # the kernels of any context; a longer one's before the token that needs them

    def warm(self, n_tokens: int) -> None:
        """Compile (or load) the kernels a context of n_tokens runs, before anything is timed."""
        if n_tokens <= self._warm_n and n_tokens:
            return
        ca = self.router.chunk_attention
        below = None if ca is None else ca.dense_below
        warm_up(self.lm, self.settings, n_tokens=n_tokens, dense_below=below)
        self._warm_n = max(self._warm_n, same_parts_until(self.settings, n_tokens, below))

    def _set_threads(self) -> None:
        """`threads_num`, or with 0 the cores idle right now (kernels/threads.py: a thread on
        a busy core slows every parallel region down to that core's share)."""
        from ktlong import kernels

        n = self.settings.threads_num or kernels.auto_threads()
        if n != self.threads:
            self.threads = kernels.configure_threads(n)  # Numba and torch
        self.stats.threads = self.threads

    @property
    def tokens(self) -> TokenIds:
        return self._tokens

    @tokens.setter
    def tokens(self, ids: Any) -> None:
        self._tokens = TokenIds(ids)

    @property
    def pos(self) -> int:
        """Position of the next token: the tokens whose K,V the store holds."""
        return len(self.tokens) - self.dropped

    # --- checks ------------------------------------------------------------------------------
    def check_fits(self, n_new: int) -> None:
        """Refuse, before any work, a prompt the store cannot hold (never truncate silently).
        A LOCRET document holds at most its budget and one chunk at a time."""
        if self.evictor is not None and not self.tokens:
            n_new = kv_rows(self.settings, n_new, n_new)
        check_fits(self.lm.spec, self.settings, self.pos + n_new, self.store.capacity)

    def _chunk_len(self) -> int:
        if self.evictor is not None:
            from ktlong.locret import chunk_len

            return chunk_len(self.settings)
        return prefill_chunk(self.settings, self.lm.spec, self.lm.device.type == "cuda")

    # --- forward -----------------------------------------------------------------------------
    def _forward(
        self, ids: list[int], progress: Progress | None, sparse: bool, all_logits: bool = False
    ) -> torch.Tensor:
        """Chunked forward of `ids` appended after the store's tokens: chunk-major on the CPU,
        layer-major on CUDA for a prompt of several chunks."""
        lm = self.lm
        dev = lm.device
        start, n = self.pos, len(ids)
        chunk = n if n == 1 else self._chunk_len()  # a single token needs no chunk size
        if n == 1 and sparse and self.decoder is not None:  # a decode step
            self.router.begin(sparse=True)
            with torch.inference_mode():  # the sliding-window rows were made in it
                logits = self.decoder.step(ids[0], start, self.router, self.store)
            self.tokens.extend(ids)
            return logits
        capture = self.policy.vote_window() if n > 1 else 0
        capture = max(capture, self.capture_queries if n > 1 else 0)
        self.router.begin(sparse=sparse, capture=min(capture, n), total=n)
        bounds = [(c, min(n, c + chunk)) for c in range(0, n, chunk)]
        # a prefill measures each layer's input/output cosine (layer_budget SQUEEZE reads it)
        self._cos = torch.zeros(self.store.shape.n_layers, dtype=torch.float64, device=dev) \
            if n > 1 else None  # [store layers] sums over tokens
        with torch.inference_mode():
            if dev.type == "cuda" and len(bounds) > 1 and self.evictor is None:
                last = self._layer_major(ids, start, bounds, progress, all_logits)
            else:
                last = self._chunk_major(ids, start, bounds, progress, all_logits)
            logits = self._head(last.to(dev)).float()  # [n or 1, vocab]
        self.tokens.extend(ids)
        if self.evictor is not None and self.evictor.active:
            self.dropped, self.doc_end = len(self.tokens) - self.store.length, len(self.tokens)
            self.kept_tail = min(self.settings.locret_stabilisers, self.store.length)
        if self._cos is not None:
            self.store.add_layer_cos(self._cos.cpu().numpy(), n)
        if n > 1:
            self.policy.doc_start = self._doc_start()
            self.policy.on_prefill_end(self.router.captured, self.pos)
        return logits

    def settle(self) -> None:
        """The state a document read leaves, whether it was prefilled or mapped from the prompt
        cache: the template's length known and no block pinned (the document's last queries
        ask nothing). The question after it is then read alike either way."""
        self.policy.doc_start = self._doc_start()
        self.policy.unpin()

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """Last hidden rows `[n, hidden]` -> logits `[n, vocab]`."""
        return self.lm.model.lm_head(self.lm.model.model.norm(rows))

    def _doc_start(self) -> int:
        """Tokens before the document: those these tokens share with `template_head` (at
        least 1, the first token)."""
        if self.template_head is None and self._default_head is None:
            from ktlong.conversation import Conversation

            tok = self.lm.tokenizer
            self._default_head = [] if tok is None else Conversation(tok).head_ids()
        head = np.asarray(self.template_head if self.template_head is not None
                          else self._default_head, np.int64)
        ids = np.asarray(self.tokens[: head.size], np.int64)
        apart = np.flatnonzero(ids != head[: ids.size])
        return max(1, int(apart[0]) if apart.size else ids.size)

    def _chunk_major(self, ids: list[int], start: int, bounds: list[tuple[int, int]],
                     progress: Progress | None, all_logits: bool) -> torch.Tensor:
        """Each chunk through every layer: only one chunk's activations exist at a time (the CPU
        path; no device mirror of a layer's KV to amortise). Returns the last hidden rows."""
        body, dev, n = self.lm.model.model, self.lm.device, len(ids)
        n_layers = len(body.layers)
        outs = []
        for c0, c1 in bounds:
            h = body.embed_tokens(torch.tensor(ids[c0:c1], device=dev)).unsqueeze(0)  # [1, C, hid]
            p0 = self.store.length if self.evictor is not None else start + c0  # after evictions
            pos = torch.arange(p0, p0 + c1 - c0, device=dev).unsqueeze(0)
            embs = position_embeddings(body, h, pos)  # per layer ([1, C, d], [1, C, d])
            for li, layer in enumerate(body.layers):
                h_in, h = h, layer(h, position_embeddings=embs[li], position_ids=pos,
                                   ktlong=self.router)
                self._add_cos(li, h_in, h)
                self.store.check_resident()
                if progress is not None:
                    progress(c0 + (c1 - c0) * (li + 1) // n_layers, n)
            if self.evictor is not None and self.evictor.active:  # SURPRISE ranks here
                self.evictor.after_layers(h[0], ids[c0:c1], self._head, self.store)
            if all_logits or c1 == n:
                outs.append(h[0] if all_logits else h[0, -1:])
        return torch.cat(outs) if all_logits else outs[-1]  # [n or 1, hidden]

    def _layer_major(self, ids: list[int], start: int, bounds: list[tuple[int, int]],
                     progress: Progress | None, all_logits: bool) -> torch.Tensor:
        """Each layer over every chunk (CUDA: the router mirrors one layer's KV on the device, so
        the past is uploaded once per layer); hidden states of the whole prompt wait in DRAM."""
        body, dev, n = self.lm.model.model, self.lm.device, len(ids)
        hidden = body.embed_tokens(  # [n, hidden]
            torch.as_tensor(np.asarray(ids, np.int64), device=dev)).cpu()
        n_layers = len(body.layers)
        # cos/sin depend only on positions: kept per chunk when small, else per layer
        keep_rope = n * self.lm.spec.head_dim * 8 <= ROPE_CACHE_BYTES
        rope: dict[int, Any] = {}
        for li, layer in enumerate(body.layers):
            for c0, c1 in bounds:
                h = hidden[c0:c1].to(dev).unsqueeze(0)  # [1, C, hidden]
                pos = torch.arange(start + c0, start + c1, device=dev).unsqueeze(0)
                embs = rope.get(c0) or position_embeddings(body, h, pos)  # per layer (cos, sin)
                if keep_rope:
                    rope[c0] = embs
                h_in, h = h, layer(h, position_embeddings=embs[li], position_ids=pos,
                                   ktlong=self.router)
                self._add_cos(li, h_in, h)
                hidden[c0:c1] = h[0].to(hidden.device)
                self.store.check_resident()
                if progress is not None:
                    progress((li * n + c1) // n_layers, n)
        return hidden if all_logits else hidden[-1:]

    def _add_cos(self, layer: int, h_in: torch.Tensor, h: torch.Tensor) -> None:
        slot = self._kv_slot.get(layer)
        if self._cos is not None and slot is not None:
            self._cos[slot] += cosine_sum(h_in, h)

    def prefill(
        self, ids: list[int], progress: Progress | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """Append `ids` to the conversation (the document, or a new turn); returns logits.

        The first prefill (and any prefill under dense attention) is exact and chunked. A later
        turn under a sparse profile goes token by token through the block-sparse kernels once the
        context outgrows the selection budget, so appending a question never re-reads the whole
        document densely.
        """
        if not ids:
            raise KtlongError("nothing to prefill: the prompt is empty")
        self.check_fits(len(ids))
        self.warm(self.pos + len(ids))
        self._set_threads()
        t0, c0 = time.perf_counter(), compile_seconds()
        sparse = bool(self.tokens) and self.policy.sparse_for(self.pos + len(ids))
        first = not self.tokens
        if self.evictor is not None:  # the document is read within the budget; turns append
            self.evictor.active = first
        try:
            logits = self._forward(ids, progress, sparse=sparse, all_logits=all_logits)
            if sparse and len(ids) > 1 and self._read_again(len(ids)):
                cos = self.store.layer_cos_sum.copy(), self.store.layer_cos_tokens
                logits = self._forward(ids, None, sparse=True, all_logits=all_logits)
                self.store.layer_cos_sum, self.store.layer_cos_tokens = cos  # measured once
        finally:
            if self.evictor is not None:
                self.evictor.active = False
        if first and self.window is not None:  # the document: a point to cut back to
            self.window.pin(len(self.tokens))
        dt = max(0.0, time.perf_counter() - t0 - (compile_seconds() - c0))  # compiling: no work
        self.logits = logits[-1]
        self.stats = Stats(
            prompt_tokens=len(ids),
            prefill_s=dt,
            prefill_tok_s=len(ids) / dt if dt > 0 else 0.0,
            context_tokens=len(self.tokens),
            kv_bytes=self.store.nbytes_used(),
            threads=self.threads,
        )
        return logits

    def _read_again(self, n_new: int) -> bool:
        """After a sparse prefill of a question (a turn appended to a long context): when its
        last queries picked the question's blocks (question_blocks), cut the turn off so that
        it is read again with them, every token of it, and the answer's first token too. Read
        once, the question's tokens were computed before they were chosen, so a fact they ask
        about is read only by the answer's later tokens. False: nothing to read again."""
        n0 = len(self.tokens) - n_new
        if n_new > self.settings.local_windows_len:  # a document appended, not a question
            return False
        if not self.policy.pinned().size or (self.window is not None
                                              and not self.window.can_truncate(n0)):
            return False
        self.truncate(n0)  # the pins stay: they lie before the turn
        return True

    def common_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the store already holds."""
        return common_prefix(self.tokens, ids)

    def extend_to(self, ids: list[int], progress: Progress | None = None) -> torch.Tensor:
        """Make the store hold exactly `ids`, prefilling only what it lacks.

        The usual case appends a new turn; if the conversation diverged (an edited history), the
        store is cut back to the shared prefix first.
        """
        keep = self.common_prefix(ids)
        if keep == len(ids):  # nothing new: re-feed the last token to get its logits
            keep -= 1
        base = self.store.nb_base * self.store.shape.block_size
        if keep < base:  # the mapped prefix cannot be rewritten: the caller opens a new session
            raise ValueError(f"the new ids leave the read-only cached prefix at token {keep}")
        if keep < len(self.tokens):
            self.truncate(keep)
        return self.prefill(ids[keep:], progress)

    def shift_to(self, ids: list[int], min_reuse: int = 16) -> Any:
        """Context shift (llama.cpp's K-shift): make the store hold a prefix of `ids` that
        reuses the K,V of the longest run of its tokens (ending with its last) that `ids` still
        holds after their common prefix, moved down over what `ids` dropped (e.g. the oldest
        turns), keys re-rotated to their new positions; `extend_to(ids)` then prefills the rest.
        The document (the common prefix) never moves. Returns the `shift.ShiftPlan` done, or None
        when nothing could be reused (the store is left as it was). See ktlong/shift.py."""
        from ktlong import shift

        # a sliding-window layer keeps no rows to move: such a model re-reads what follows
        plan = None if self.window is not None or self.evictor is not None \
            else shift.plan(self.tokens, ids, min_reuse)
        base = self.store.nb_base * self.store.shape.block_size
        if plan is None:
            keep = self.common_prefix(ids)
            if keep < base and keep < len(self.tokens):  # let extend_to cut into the mapped part
                self.store.detach_base(keep // self.store.shape.block_size)
            return None
        shift.apply(self, plan)
        return plan

    def generate(self, sampling: Sampling, make_room: Callable[[int], None] | None = None,
                 after: Sequence[int] = ()) -> Iterator[Step]:
        """Yield sampled tokens until EOS or `max_new_tokens`; each Step carries running stats.
        `after`: ids the answer's text continues (a lead the prompt ends with), decoded with the
        new ones so that the first new word keeps its leading space.

        A token is fed through the model only when the next one is needed, so the store holds
        every token yielded except the last (EOS, or the one that hit the limit): the caller
        appends what should follow (e.g. the chat template's end-of-turn) with `prefill`.
        When the store is full, `make_room(tokens still to come)` may free room (e.g. by
        `shift_to` a conversation without its oldest turns) before the store refuses the token.
        """
        if self.logits is None:
            raise RuntimeError("prefill before generate")
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(sampling.seed if sampling.seed >= 0 else int(time.time_ns() % 2**31))
        tok = self.lm.tokenizer
        self._set_threads()
        out_ids = list(after)
        stats, text = self.stats, tok.decode(out_ids, skip_special_tokens=True) if after else ""
        stats.new_tokens, stats.decode_tok_s = 0, 0.0
        self.policy.reset_counters()
        t0, c0 = time.perf_counter(), compile_seconds()
        for i in range(sampling.max_new_tokens):
            token = sample(self.logits, sampling, gen)
            out_ids.append(token)
            full = tok.decode(out_ids, skip_special_tokens=True)
            delta = "" if full.endswith("\ufffd") else full[len(text) :]
            text = text if full.endswith("\ufffd") else full
            done = token in self.lm.eos_ids or i + 1 == sampling.max_new_tokens
            if not done:
                if make_room is not None and self.pos + 1 > self.store.capacity:
                    make_room(sampling.max_new_tokens - i - 1)
                self.check_fits(1)
                self.warm(self.pos + 1)  # a context that outgrows the budget: once, at that token
                self.logits = self._forward([token], None, sparse=True)[-1]
            dt = max(0.0, time.perf_counter() - t0 - (compile_seconds() - c0))  # nor here
            if (i + 1) % RETHREAD_TOKENS == 0:
                self._set_threads()  # another job may have taken a core since the answer began
            stats.new_tokens = i + 1
            stats.decode_tok_s = stats.new_tokens / dt if dt > 0 else 0.0
            stats.context_tokens, stats.kv_bytes = len(self.tokens), self.store.nbytes_used()
            stats.attended_share = self.policy.attended_share()
            yield Step(token, "" if token in self.lm.eos_ids else delta, stats)
            if done:
                return

    def truncate(self, n_tokens: int) -> None:
        """Go back to the first `n_tokens` tokens (e.g. /reset to just the document)."""
        if n_tokens > len(self.tokens):
            raise ValueError("cannot truncate forward")
        if self.window is not None:
            self.window.truncate(n_tokens)  # ValueError (nothing cut) when its rows are gone
        if self.dropped and n_tokens < self.doc_end:
            if n_tokens < self.doc_end - self.kept_tail:  # into the evicted part: read it again
                n_tokens, self.dropped, self.doc_end, self.kept_tail = 0, 0, 0, 0
            else:  # into the document's last tokens, kept in order
                self.kept_tail -= self.doc_end - n_tokens
                self.doc_end = n_tokens
        if self.evictor is not None and n_tokens == 0:
            self.evictor.reset()
        self.store.truncate(n_tokens - self.dropped)
        del self.tokens[n_tokens:]
        self.policy.truncate(n_tokens - self.dropped)
        self.logits = None
