"""The selection policy: which KV blocks each layer (and KV head) attends to at a decode step.

Every step attends to the init blocks, the local window (whole blocks from
`n_tokens - local_windows_len` on, the partial last block included) and up to
`second_select_num` context blocks chosen by their anchors (with `layer_budget: SQUEEZE`, a
per-layer number from ktlong.squeeze, the same in total). Dense layers and short contexts read
every block. Selections are reused between `token_step` tokens and within groups of
`layer_step` layers (KTransformers' semantics); a reused selection also keeps the blocks that
left the local window since it was made. With preselection, the prompt's last queries vote
(SnapKV) and later selections draw only from the winners plus blocks completed afterwards. With
`question_blocks`, the same vote pins that many blocks per layer for the whole answer (the
question's tokens choose, not only the token being decoded), out of the `second_select_num`
budget. With `select_neighbours`, each chosen block brings the one after it (a fact that
straddles two blocks is read whole), still `second_select_num` blocks in all; with
`spread_blocks`, that many of them are each the best of an equal run of the document. With
`block_positions: COMPACT` the blocks before the local window are read as if they were the ones
just before it (`read_layout`): no key further than the step's budget from the query. With
`score_positions: NEAR` the blocks are scored the same way: anchors of keys turned back to position
0, the query turned to the local window's length, so each block is judged at the distance it
will be read from, not at its own (RoPE's decay would favour the near ones).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ktlong import kernels, squeeze
from ktlong.config import Settings
from ktlong.kvstore import KVStore
from ktlong.shift import rerotate, rotation
from ktlong.spec import ModelSpec

_NONE = np.zeros(0, np.int32)
VOTE_KEYS = 1 << 22  # question_layers 0: keys the question's votes read, summed over the layers


@dataclass
class Step:
    """One layer's blocks at one decode step: the init blocks `[0, n_init)`, the question's
    `pins`, `chosen` `[S, k]` from the context, and the local window `[local0, nb)`. A step that
    chooses afresh has `candidates` (the top `k` of them by anchor score are chosen) and gets
    `chosen` on commit."""

    layer: int
    n_tokens: int
    q: np.ndarray  # [Hq, d] f32
    n_init: int
    local0: int
    nb: int
    chosen: np.ndarray | None = None  # [S, k] int32, rows ascending
    candidates: np.ndarray | None = None  # [n] int32
    k: int = 0
    group: int = 0
    pins: np.ndarray = field(default_factory=lambda: _NONE)  # [m] int32 ascending, < local0

    def fixed(self, end: int) -> np.ndarray:
        """`[nf]` int32: the init blocks, the pins and the local window's up to `end`,
        ascending."""
        return np.concatenate([np.arange(self.n_init, dtype=np.int32), self.pins,
                               np.arange(self.local0, end, dtype=np.int32)])

    def blocks(self, end: int | None = None) -> np.ndarray:
        """`[S, n]` int32: init, pinned, chosen and local blocks up to `end` (default: all),
        ascending."""
        fixed = self.fixed(self.nb if end is None else end)
        S = self.chosen.shape[0]
        out = np.concatenate([np.broadcast_to(fixed, (S, fixed.size)), self.chosen], axis=1)
        return np.ascontiguousarray(np.sort(out, axis=1))


class SelectionPolicy:
    def __init__(self, settings: Settings, spec: ModelSpec, store: KVStore) -> None:
        s = settings
        self.s, self.store = s, store
        self.bs = s.block_size
        self.dense = s.attention in ("DENSE", "LOCRET")  # LOCRET reads every token it kept
        self.n_init = s.init_len // self.bs
        self.shared = s.head_select_mode == "SHARED"
        self.n_kv = spec.n_kv_heads
        self.scale = np.float32(spec.head_dim**-0.5)
        self._groups: dict[int, tuple[np.ndarray, int]] = {}  # group -> (selected [S, k], local0)
        self._preselected: dict[int, np.ndarray] = {}  # layer -> ascending block ids
        self._pins: dict[int, np.ndarray] = {}  # layer -> the question's blocks, ascending
        self.doc_start = 1  # tokens before the document: the chat template's (set by Session)
        self._head = False  # the init blocks topped the question's vote: their text read again
        self._head_kv: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # (local0, K, V)
        # the last question votes' rankings, best first: [n candidates] int32 block ids each
        self.vote_orders: deque[np.ndarray] = deque(maxlen=4)
        self.inv_freq: np.ndarray | None = None  # [rot/2] the model's RoPE frequencies
        self.head_dim = spec.head_dim
        self._turns: kernels.Turns | None = None  # block_positions COMPACT's query turns
        self._score_turn: tuple[int, np.ndarray, np.ndarray] | None = None  # (n_tokens, cos, sin)
        self._preselect_upto = 0  # blocks complete when the vote was taken
        self.n_layers = store.shape.n_layers  # the layers the store holds (spec.kv_layers)
        self._dynamic_upto = [0] * self.n_layers  # blocks with DYNAMIC (vote-based) anchors
        self.set_layer_budgets(store.layer_similarity())
        self.reset_counters()

    # --- budget ------------------------------------------------------------------------------
    def set_layer_budgets(self, sims: np.ndarray | None) -> None:
        """`layer_k` (selected blocks per step, per layer) and `layer_group`: with layer_budget
        SQUEEZE, from each layer's mean input/output cosine `sims` `[n_layers]` (ktlong.squeeze);
        UNIFORM, or no `sims` (a cache entry older than the measure), second_select_num each."""
        s, n = self.s, self.n_layers
        self.layer_sims = None if sims is None else [float(x) for x in sims]
        plan = squeeze.uniform(n, s.second_select_num, s.dense_layer_num)
        if s.layer_budget == "SQUEEZE" and sims is not None and len(sims) == n:
            plan = squeeze.layer_budgets(np.asarray(sims), s.second_select_num, s.squeeze_ratio,
                                         s.dense_layer_num, s.layer_step)
        self.layer_k, self.layer_group = plan.k, plan.group

    def budget_blocks(self, layer: int | None = None) -> int:
        """Blocks one step of `layer` reads at most (None: of the layer that reads most):
        init + selected + local window + the partial block."""
        k = max(self.layer_k) if layer is None else self.layer_k[layer]
        return self.n_init + k + self.s.local_windows_len // self.bs + 1

    def wants_votes(self) -> bool:
        """Whether `on_prefill_end` uses the prompt's last queries (DYNAMIC, preselection, the
        question's blocks)."""
        return self.vote_window() > 0

    def sparse_for(self, n_tokens: int) -> bool:
        """Whether a context of `n_tokens` is read sparsely (else every block is cheaper/equal)."""
        # some layer reads sparsely: the sparse layer with the smallest budget does first
        k = min(self.layer_k[self.s.dense_layer_num:], default=self.s.second_select_num)
        fixed = self.n_init + self.s.local_windows_len // self.bs + 1
        return not self.dense and -(-n_tokens // self.bs) > fixed + k

    # --- stats -------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self._read = self._total = 0

    def attended_share(self) -> float:
        return self._read / self._total if self._total else 1.0

    # --- selection ---------------------------------------------------------------------------
    def plan(self, layer: int, q: np.ndarray, n_tokens: int) -> Step:
        """q `[Hq, d]` f32 of the token at position n_tokens - 1 -> this layer's blocks, with the
        choice among the candidates still to make when the step chooses afresh."""
        nb = -(-n_tokens // self.bs)
        local0 = max(0, n_tokens - self.s.local_windows_len) // self.bs  # first local block
        if self.dense or layer < self.s.dense_layer_num or nb <= self.budget_blocks(layer):
            # every block: those before the window as "chosen" (a local-window device takes
            # the window)
            return Step(layer, n_tokens, q, 0, local0, nb, np.arange(local0, dtype=np.int32)[None])
        group = layer // self.s.layer_step
        cached = self._groups.get(group)
        pins = self._pins.get(layer, _NONE)
        if cached is None or (layer % self.s.layer_step == 0 and n_tokens % self.s.token_step == 0):
            pins = pins[pins < local0]
            cand = self._candidates(layer, local0)  # ascending, every one < local0
            if pins.size:  # both ascending, every pin a candidate or not
                cand = cand[~_sorted_in(cand, pins)]
            k = max(self.layer_k[layer] - pins.size, 0)  # a layer_step group's k is one
            if 0 < k < cand.size:  # chosen by the kernel; committed with the choice
                self._ensure_anchors(layer, local0)
                return Step(layer, n_tokens, q, self.n_init, local0, nb, candidates=cand, k=k,
                            group=group, pins=pins)
            S = 1 if self.shared else self.n_kv
            chosen = np.broadcast_to(cand[:k], (S, min(k, cand.size))).copy()  # none or all
            self._groups[group] = (chosen, local0)
            return Step(layer, n_tokens, q, self.n_init, local0, nb, chosen, pins=pins)
        chosen, then = cached
        # blocks that left the local window since the choice stay attended
        local0 = min(local0, then)
        pins = pins[pins < local0]
        if pins.size:
            pins = pins[~_sorted_in(pins, chosen[0] if chosen.shape[0] == 1 else
                                    np.unique(chosen))]
        return Step(layer, n_tokens, q, self.n_init, local0, nb, chosen, pins=pins)

    def commit(self, step: Step, chosen: np.ndarray | None = None) -> Step:
        """Record the step's choice (`chosen` [S, k], when it chose afresh) and its reads."""
        if chosen is not None:
            step.chosen = chosen
            self._groups[step.group] = (chosen, step.local0)
        self._read += step.n_init + step.pins.size + step.chosen.shape[1] + step.nb - step.local0
        self._total += step.nb
        return step

    def select(self, layer: int, q: np.ndarray, n_tokens: int) -> np.ndarray:
        """q `[Hq, d]` f32 of the token at position n_tokens - 1 -> blocks `[S, n]` int32."""
        step = self.plan(layer, q, n_tokens)
        chosen = None if step.candidates is None else self._choose(step)
        return self.commit(step, chosen).blocks()

    def _choose(self, step: Step) -> np.ndarray:
        """`[S, k]` int32 ascending: the step's top-k candidates by anchor score, each followed
        by the block after it with `select_neighbours`, or `spread_blocks` of them the best of
        their run of the document."""
        quest = self.s.anchor_type == "QUEST"
        anchors = self.store.anchors[step.layer]
        q = self.score_query(step)
        if not self._scores_apart():
            return kernels.select_blocks(q, anchors, step.candidates, step.k, quest, self.shared)
        scores = kernels.score_blocks(q, anchors, step.candidates, quest, self.shared)
        if self.s.spread_blocks:
            return spread_choice(scores, step.candidates, step.k, self.s.spread_blocks)
        return with_neighbours(scores, step.candidates, step.k)

    def anchor_freq(self) -> np.ndarray | None:
        """`[h]` the RoPE frequencies keys are turned back by before their anchors are taken
        (score_positions NEAR), or None: anchors of the keys as stored."""
        return self.inv_freq if self.s.score_positions == "NEAR" else None

    def score_query(self, step: Step) -> np.ndarray:
        """`[Hq, d]` f32: the query that scores the step's candidates; with score_positions NEAR
        turned from its own position to the local window's length (anchors sit at 0)."""
        if self.anchor_freq() is None:
            return step.q
        if self._score_turn is None or self._score_turn[0] != step.n_tokens:
            ang = (self.s.local_windows_len - (step.n_tokens - 1)) * self.inv_freq  # [h]
            self._score_turn = (step.n_tokens, np.cos(ang), np.sin(ang))
        _, c, s = self._score_turn
        h = c.size
        q = step.q.astype(np.float64)  # [Hq, d]
        out = step.q.copy()
        out[:, :h] = q[:, :h] * c - q[:, h:2 * h] * s
        out[:, h:2 * h] = q[:, h:2 * h] * c + q[:, :h] * s
        return out

    def _scores_apart(self) -> bool:
        """Whether the choice is made in NumPy from the kernel's scores (not in one kernel call
        with the attention)."""
        return self.s.select_neighbours or self.s.spread_blocks > 0

    def attend(self, step: Step, scale: float, local: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Exact attention on the CPU over the step's blocks (without the local window when
        `local` is False): out `[Hq, d]`, lse `[Hq]`. A step that chooses afresh scores, takes
        the top-k and attends in one kernel call, and is committed here. With block_positions
        COMPACT the blocks before the local window are read as one run of text ending where the
        window starts; else, with question_positions NEAR, the pins are read as the blocks just
        before the window (`read_layout`)."""
        if self._turned(step):
            out, lse = self._attend_turned(step, scale, local)
        else:
            out, lse = self._attend(step, scale, local)
        if self._head and step.n_init:
            out, lse = self._read_head(step, scale, out, lse)
        return out, lse

    def _read_head(self, step: Step, scale: float, out: np.ndarray,
                   lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """question_first_block: the init blocks' document tokens once more, as if they ended
        just before the local window (keys turned forward), merged into the step's attention.
        The sink and the chat template stay read only first."""
        got = self._head_kv.get(step.layer)
        if got is None or got[0] != step.local0:  # turned again when the window moves on
            a, b = self.doc_start, self.n_init * self.bs
            k, v = self.store.token_range(step.layer, a, b)  # [Hkv, n, d] f32
            rerotate(k, *rotation(torch.from_numpy(self.inv_freq), step.local0 * self.bs - b))
            got = self._head_kv[step.layer] = (step.local0, np.ascontiguousarray(k.numpy()),
                                               np.ascontiguousarray(v.numpy()))
        _, k, v = got
        kernels.attend_merge(step.q, k, v, scale, out, lse)  # out, lse: the kernel's own arrays
        return out, lse

    def _turned(self, step: Step) -> bool:
        """Whether some of the step's blocks are read at other positions than their own: with
        block_positions COMPACT (unless the step reads every block before the window, which
        are where they would go), or the question's blocks with question_positions NEAR."""
        if self.inv_freq is None:
            return False
        if self.s.block_positions == "COMPACT":
            return not (step.candidates is None and not step.n_init and not step.pins.size
                        and step.chosen.shape[1] == step.local0)
        return step.pins.size > 0 and self.s.question_positions == "NEAR"

    def turns(self, reach: int) -> kernels.Turns:
        """The query turns of shifts up to `reach` blocks (the table grows by doubling)."""
        if self._turns is None or self._turns.reach < reach:
            have = 0 if self._turns is None else self._turns.reach
            self._turns = kernels.rope_turns(self.inv_freq, self.bs, max(reach, 2 * have, 64),
                                             self.head_dim, self.store.kv_kind)
        return self._turns

    def _attend_turned(self, step: Step, scale: float,
                       local: bool) -> tuple[np.ndarray, np.ndarray]:
        """The step's attention with blocks read at other positions (`read_layout`), each with
        the query turned back by its shift; one kernel call."""
        kv, anchors = self.store.kernel_views(step.layer)
        end = step.nb if local else step.local0
        compact = self.s.block_positions == "COMPACT"
        near = self.s.question_positions == "NEAR"
        turns = self.turns(step.local0)
        if step.candidates is not None and (near or not compact) and not self._scores_apart():
            # one call with the choice: the fixed blocks' shifts are known before it, and
            # (COMPACT) the i-th chosen block of a row is read as block local0 - k - m + i
            n0, m = step.n_init, step.pins.size
            fixed = step.fixed(end)  # [init, pins, window]
            shifts = np.zeros(fixed.size, np.int32)
            if compact:
                shifts[:n0] = step.local0 - (n0 + step.k + m)
            if near:
                shifts[n0:n0 + m] = step.local0 - m + np.arange(m) - step.pins
            base = step.local0 - step.k - m if compact else -1
            out, lse, chosen = kernels.select_attend_layer(
                kv, anchors, step.q, step.candidates, step.k, self.s.anchor_type == "QUEST",
                self.shared, fixed, step.n_tokens, scale, shifts, base, turns,
                qscore=self.score_query(step), chosen=self._tier_choice(step))
            self.commit(step, chosen)
            return out, lse
        if step.candidates is not None:
            chosen = self._choose(step)
            if self.store.tier is not None:
                self.store.prefetch(step.layer, chosen)
            self.commit(step, chosen)
        else:
            self.commit(step)
        blocks, shifts = read_layout(step, end, compact, near)
        return kernels.attend_layer(kv, step.q, blocks, step.n_tokens, scale, shifts, turns)

    def _attend(self, step: Step, scale: float, local: bool) -> tuple[np.ndarray, np.ndarray]:
        kv, anchors = self.store.kernel_views(step.layer)
        end = step.nb if local else step.local0
        if step.candidates is None:
            self.commit(step)
            return kernels.attend_layer(kv, step.q, step.blocks(end), step.n_tokens, scale)
        if self._scores_apart():  # chosen apart, then read (a tier asked for them between)
            chosen = self._choose(step)
            if self.store.tier is not None:
                self.store.prefetch(step.layer, chosen)
            self.commit(step, chosen)
            return kernels.attend_layer(kv, step.q, step.blocks(end), step.n_tokens, scale)
        out, lse, chosen = kernels.select_attend_layer(
            kv, anchors, step.q, step.candidates, step.k, self.s.anchor_type == "QUEST",
            self.shared, step.fixed(end), step.n_tokens, scale, qscore=self.score_query(step),
            chosen=self._tier_choice(step))
        self.commit(step, chosen)
        return out, lse

    def _tier_choice(self, step: Step) -> np.ndarray | None:
        """With a disk tier: the step's choice made first, and its blocks asked for before the
        kernel reads them (the kernel then reads as if it had chosen: the same output to the
        bit, so the tier never changes an answer). None without one: the kernel chooses."""
        if self.store.tier is None:
            return None
        chosen = self._choose(step)
        self.store.prefetch(step.layer, chosen)
        return chosen

    def _candidates(self, layer: int, local0: int) -> np.ndarray:
        lo = self.n_init
        if self.s.preselect_block and layer in self._preselected:
            pre = self._preselected[layer]
            late = np.arange(max(lo, self._preselect_upto), local0, dtype=np.int32)
            return np.concatenate([pre[pre < local0], late]).astype(np.int32)
        return np.arange(lo, local0, dtype=np.int32)

    # --- anchors -----------------------------------------------------------------------------
    def _ensure_anchors(self, layer: int, upto: int) -> None:
        """Anchors for full blocks [n_anchored, upto); DYNAMIC falls back to MEAN past the vote."""
        first = self.store.n_anchored[layer]
        if upto <= first:
            return
        kind = self.s.anchor_type if self.s.anchor_type != "DYNAMIC" else "MEAN"
        self._anchors(layer, first, upto, kind, None)

    def complete_anchors(self) -> None:
        """Anchors for every full block of every layer (before the store is saved)."""
        for layer in range(self.store.shape.n_layers):
            self._ensure_anchors(layer, self.store.length // self.bs)

    def _anchors(
        self, layer: int, first: int, last: int, kind: str, token_scores: np.ndarray | None
    ) -> None:
        k_base, _, k_tail, _, nb_base = self.store.kernel_args(layer)
        kernels.compute_anchors(
            k_base,
            k_tail,
            nb_base,
            first,
            last,
            kind,
            self.s.anchor_num,
            self.store.anchors[layer],
            token_scores,
            kv_kind=self.store.kv_kind,
            inv_freq=self.anchor_freq(),
        )
        self.store.n_anchored[layer] = max(self.store.n_anchored[layer], last)
        if first < self.store.nb_base:
            self.store.check_resident()  # a sweep over the mapped blocks

    # --- prefill hooks -----------------------------------------------------------------------
    def on_prefill_end(self, captured: dict[int, torch.Tensor], n_tokens: int) -> None:
        """After a prefill: the last prompt queries `[Hq, W, d]` per layer vote over the context.

        DYNAMIC anchors come from the vote of the first prefill (the document); preselection
        is re-voted by every prefill (each question), since it must follow the question.
        SQUEEZE budgets follow the layers' similarities measured so far (the store's).
        """
        self._groups.clear()
        self.set_layer_budgets(self.store.layer_similarity())
        if self.dense or not captured or not self.sparse_for(n_tokens):
            return
        dynamic = self.s.anchor_type == "DYNAMIC"
        n_full = n_tokens // self.bs
        for layer, qw in captured.items():
            if layer < self.s.dense_layer_num:
                continue
            need_dyn = (
                dynamic and self.store.n_anchored[layer] < n_full and self._dynamic_upto[layer] == 0
            )
            if not (need_dyn or self.s.preselect_block):
                continue
            k_base, _, k_tail, _, nb_base = self.store.kernel_args(layer)
            votes = kernels.query_votes(
                np.ascontiguousarray(qw.numpy()),
                k_base,
                k_tail,
                nb_base,
                n_tokens,
                self.scale,
                self.store.kv_kind,
            )  # [Hkv, n]
            self.store.check_resident()  # the vote swept every mapped key of this layer
            if need_dyn:
                first = self.store.n_anchored[layer]
                self._anchors(layer, first, n_full, "DYNAMIC", votes)
                self._dynamic_upto[layer] = n_full
            if self.s.preselect_block:
                self._preselect(layer, votes, n_tokens)
        if self.s.preselect_block:
            self._preselect_upto = n_full
        if self.s.question_blocks:
            self._pin(captured, n_tokens)

    def _preselect(self, layer: int, votes: np.ndarray, n_tokens: int) -> None:
        """SnapKV: pool the vote over neighbouring tokens, sum per block, keep the best blocks."""
        w = self.s.preselect_pool
        v = torch.from_numpy(votes.sum(0))[None, None]  # [1, 1, n]
        if w > 1:
            v = torch.nn.functional.avg_pool1d(
                v, w, stride=1, padding=w // 2, count_include_pad=False
            )[..., :n_tokens]
        v = v[0, 0].numpy()
        n_full = n_tokens // self.bs
        per_block = v[: n_full * self.bs].reshape(n_full, self.bs).sum(1)
        local0 = max(0, n_tokens - self.s.local_windows_len) // self.bs
        cand = np.arange(self.n_init, local0, dtype=np.int32)
        keep = min(self.s.preselect_block_count, cand.size)
        best = cand[np.argsort(-per_block[cand], kind="stable")[:keep]]
        self._preselected[layer] = np.sort(best).astype(np.int32)

    def _pin(self, captured: dict[int, torch.Tensor], n_tokens: int) -> None:
        """The question's blocks, read by every layer for the whole answer: those holding the
        keys its last `question_window` queries attend to most. Each query row of each voting
        layer gives every block the largest attention share any of its heads gives the
        block's keys; a block's vote is its best share over the rows, summed over the layers.
        A max, not SnapKV's sum: one question token that finds its match (a name, a number)
        outvotes many that spread over look-alike sentences. With question_votes NEAR each
        block is voted on as it will be read, just before the local window (`near_votes`):
        past a model's trained length the votes at true distances go to the document's first
        blocks, whatever the question."""
        local0 = max(0, n_tokens - self.s.local_windows_len) // self.bs
        head = (self.s.question_first_block and self.n_init > 0 and self.inv_freq is not None
                and self.doc_start < self.n_init * self.bs)
        cand = np.arange(0 if head else self.n_init, local0, dtype=np.int32)
        self._head, self._head_kv = False, {}
        if cand.size <= self.n_init * head:
            self._pins = {}
            return
        vote = np.zeros(local0, np.float32)
        for layer in self.voting_layers(n_tokens):
            qw = captured.get(layer)
            if qw is None:
                continue
            q = np.ascontiguousarray(qw.numpy()[:, -self.s.question_window:])  # [Hq, W, d]
            if self.s.question_votes == "NEAR" and self.inv_freq is not None:  # as read
                vote += near_votes(self.store, layer, q, n_tokens, local0, self.inv_freq,
                                   float(self.scale), self.doc_start if head else 0)
                self.store.check_resident()
                continue
            W = q.shape[1]
            k_base, _, k_tail, _, nb_base = self.store.kernel_args(layer)
            best = np.zeros(local0, np.float32)
            for w in range(W):  # query w sits at position n_tokens - W + w
                v = kernels.query_votes(np.ascontiguousarray(q[:, w:w + 1]), k_base, k_tail,
                                        nb_base, n_tokens - W + w + 1, self.scale,
                                        self.store.kv_kind)  # [Hkv, n]
                v[:, : self.doc_start if head else 0] = 0.0  # the template votes for nothing
                per_block = v[:, : local0 * self.bs].reshape(-1, local0, self.bs).sum(2)
                np.maximum(best, per_block.max(0), out=best)
            vote += best
            self.store.check_resident()
        order = cand[np.argsort(-vote[cand], kind="stable")]
        self.vote_orders.append(order)
        if head:  # the init blocks are read anyway; first in the vote, their text again
            self._head = bool(order[0] < self.n_init)
            order, cand = order[order >= self.n_init], cand[cand >= self.n_init]
        m = min(self.s.question_blocks, cand.size)
        if self.s.select_neighbours:
            pins = with_neighbours(-np.arange(cand.size, dtype=np.float32)[None], order, m)[0]
        else:
            pins = np.sort(order[:m])
        pins = pins.astype(np.int32)
        self._pins = {layer: pins for layer in range(self.store.shape.n_layers)}

    def unpin(self) -> None:
        """Forget the pinned blocks (a document's last queries pinned them; no question did)."""
        self._pins = {}

    def pinned(self) -> np.ndarray:
        """`[m]` int32: the question's blocks every layer reads now (none without
        question_blocks, or before a question on a long enough context)."""
        return next(iter(self._pins.values()), _NONE)

    def voting_layers(self, n_tokens: int) -> list[int]:
        """The layers whose queries pick the question's blocks: `question_layers` of the sparse
        ones, evenly spaced; with 0, every one while their votes read at most VOTE_KEYS keys in
        all, else as many as that allows (at least 4)."""
        first, n = self.s.dense_layer_num, self.store.shape.n_layers
        count = self.s.question_layers or max(4, VOTE_KEYS // max(n_tokens, 1))
        if n - first <= count:
            return list(range(first, n))
        return sorted({int(round(x)) for x in np.linspace(first, n - 1, count)})

    def vote_window(self) -> int:
        """Last prompt queries a prefill keeps for the votes (0: none wanted)."""
        if self.dense:
            return 0
        w = self.s.preselect_window if (self.s.anchor_type == "DYNAMIC"
                                        or self.s.preselect_block) else 0
        return max(w, self.s.question_window if self.s.question_blocks else 0)

    def truncate(self, n_tokens: int) -> None:
        self._groups.clear()
        full = n_tokens // self.bs
        self._dynamic_upto = [min(x, full) for x in self._dynamic_upto]
        self._preselect_upto = min(self._preselect_upto, full)
        # blocks past the cut will hold other tokens (a new turn, or a context shift's)
        self._preselected = {layer: pre[pre < full] for layer, pre in self._preselected.items()}
        self._pins = {layer: pins[pins < full] for layer, pins in self._pins.items()}
        self._head_kv = {}  # a shift turns the tokens after the first blocks
        self._head = self._head and full >= self.n_init


def _sorted_in(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`[len(a)]` bool: which entries of a are in b (b ascending): np.isin without its sorts."""
    if not b.size:
        return np.zeros(a.size, bool)
    i = np.minimum(np.searchsorted(b, a), b.size - 1)
    return b[i] == a


NEAR_CHUNK = 256  # blocks a NEAR vote scores at once


def near_votes(store: KVStore, layer: int, q: np.ndarray, n_tokens: int, local0: int,
               inv_freq: np.ndarray, scale: float, skip: int = 0) -> np.ndarray:
    """`[local0]` f32: for each block before the local window, the largest attention share
    (summed over a KV head's query heads; the max over KV heads and query rows) that the
    queries q `[Hq, W, d]` (the prompt's last W, at positions n_tokens - W ...) give its keys
    when every such block is read just before the window (its keys turned forward by
    (local0 - 1 - b) blocks, so one product scores a run of blocks) and the window's keys where
    they are, causally. The first `skip` tokens draw their weight but vote for no block."""
    hkv, bs = store.shape.n_kv_heads, store.shape.block_size
    hq, w, d = q.shape
    g = hq // hkv
    qg = torch.from_numpy(q).float().reshape(hkv, g * w, d)  # rows (head in group, w)
    freq = torch.from_numpy(inv_freq)
    # the window's keys, at their own positions
    k_loc = store.key_range(layer, local0 * bs, n_tokens)  # [Hkv, n_loc, d]
    s_loc = (qg @ k_loc.transpose(1, 2)) * scale  # [Hkv, gW, n_loc]
    pos_q = (n_tokens - w + torch.arange(w)).repeat(g)  # [gW]
    late = torch.arange(local0 * bs, n_tokens)[None] > pos_q[:, None]  # [gW, n_loc]
    lse_loc = s_loc.masked_fill_(late, float("-inf")).logsumexp(-1)  # [Hkv, gW]
    lse = torch.empty(local0, hkv, g * w)  # per block: log of its keys' summed weights
    for b0 in range(0, local0, NEAR_CHUNK):
        b1 = min(local0, b0 + NEAR_CHUNK)
        k = store.key_range(layer, b0 * bs, b1 * bs)  # [Hkv, c * bs, d]
        cos, sin = rotation(freq, (local0 - 1 - torch.arange(b0, b1)) * bs)  # [c, rot]
        h = cos.shape[1] // 2
        kernels.turn_blocks(k.view(hkv, b1 - b0, bs, d).numpy(),
                            np.ascontiguousarray(cos[:, :h].numpy()),
                            np.ascontiguousarray(sin[:, :h].numpy()))
        sc = (qg @ k.transpose(1, 2)) * scale  # [Hkv, gW, c * bs]
        if b0 == 0 and skip:
            lse_loc = torch.logaddexp(lse_loc, sc[..., :skip].logsumexp(-1))
            sc[..., :skip] = float("-inf")
        lse[b0:b1] = torch.from_numpy(kernels.block_lse(sc.numpy(), bs))  # [c, Hkv, gW]
    total = torch.logaddexp(lse.logsumexp(0), lse_loc)  # [Hkv, gW]
    share = (lse - total).exp_().reshape(local0, hkv, g, w).sum(2)  # [local0, Hkv, W]
    return share.amax(dim=(1, 2)).numpy()


def read_layout(step: Step, end: int, compact: bool, pins_last: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    """The step's blocks `[S, n]` (init, chosen and pins, then the local window's up to `end`)
    and their shifts `[S, n]` int32. compact: the blocks before the window read as if they were
    its M predecessors, in document order or with the pins last; else only the pins move, to the
    m blocks before the window (pins_last)."""
    S, m = step.chosen.shape[0], step.pins.size
    init = np.arange(step.n_init, dtype=np.int32)
    far = np.concatenate([np.broadcast_to(init, (S, init.size)), step.chosen,
                          np.broadcast_to(step.pins, (S, m))], axis=1)  # [S, M]
    if compact and not pins_last:
        far = np.sort(far, axis=1)
    M = far.shape[1]
    window = np.arange(step.local0, end, dtype=np.int32)
    blocks = np.concatenate([far, np.broadcast_to(window, (S, window.size))], axis=1)
    shifts = np.zeros(blocks.shape, np.int32)
    if compact:
        shifts[:, :M] = step.local0 - M + np.arange(M) - far
    elif pins_last:
        shifts[:, M - m:M] = step.local0 - m + np.arange(m) - step.pins
    return blocks, shifts


def spread_choice(scores: np.ndarray, candidates: np.ndarray, k: int, m: int) -> np.ndarray:
    """`[S, k]` int32 ascending: per row of scores `[S, n]`, the best candidate of each of m
    equal runs of the candidates (in their order), then the best of the others until k."""
    n = candidates.size
    k, m = min(k, n), min(m, k, n)
    edges = np.linspace(0, n, m + 1).astype(np.int64)  # [m + 1]: run bounds, none empty
    out = np.empty((scores.shape[0], k), np.int32)
    for r, row in enumerate(scores):
        best = np.array([a + int(np.argmax(row[a:b])) for a, b in zip(edges[:-1], edges[1:],
                                                                        strict=True)], np.int64)
        rest = row.astype(np.float64, copy=True)
        rest[best] = -np.inf
        more = np.argsort(-rest, kind="stable")[:k - m]
        out[r] = np.sort(candidates[np.concatenate([best, more])])
    return out


def with_neighbours(scores: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """`[S, k]` int32 ascending: per row of scores `[S, n]`, the candidates in order of score,
    each followed by the next block when that is a candidate too, until k are taken."""
    n = candidates.size
    k = min(k, n)
    member = np.zeros(int(candidates.max()) + 2 if n else 1, bool)
    member[candidates] = True
    out = np.empty((scores.shape[0], k), np.int32)
    for r, row in enumerate(scores):
        best = candidates[np.argsort(-row, kind="stable")[:k]]  # [k] by score
        pairs = np.stack([best, best + 1], axis=1).ravel()  # [2k]: each one, then its successor
        pairs = pairs[member[pairs]]
        _, first = np.unique(pairs, return_index=True)
        out[r] = np.sort(pairs[np.sort(first)[:k]])
    return out
