"""The selection policy: which KV blocks each layer (and KV head) attends to at a decode step.

Every step attends to the init blocks, the local window (whole blocks from
`n_tokens - local_windows_len` on, the partial last block included) and up to
`second_select_num` context blocks chosen by their anchors (with `layer_budget: SQUEEZE`, a
per-layer number from ktlong.squeeze, the same in total). Dense layers and short contexts read
every block. Selections are reused between `token_step` tokens and within groups of
`layer_step` layers (KTransformers' semantics); a reused selection also keeps the blocks that
left the local window since it was made. With preselection, the prompt's last queries vote
(SnapKV) and later selections draw only from the winners plus blocks completed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ktlong import kernels, squeeze
from ktlong.config import Settings
from ktlong.kvstore import KVStore
from ktlong.model import ModelSpec


@dataclass
class Step:
    """One layer's blocks at one decode step: the init blocks `[0, n_init)`, `chosen` `[S, k]`
    from the context, and the local window `[local0, nb)`. A step that chooses afresh has
    `candidates` (the top `k` of them by anchor score are chosen) and gets `chosen` on commit."""

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

    def fixed(self, end: int) -> np.ndarray:
        """`[nf]` int32: the init blocks and the local window's up to `end`, ascending."""
        return np.concatenate([np.arange(self.n_init, dtype=np.int32),
                               np.arange(self.local0, end, dtype=np.int32)])

    def blocks(self, end: int | None = None) -> np.ndarray:
        """`[S, n]` int32: init, chosen and local blocks up to `end` (default: all), ascending."""
        fixed = self.fixed(self.nb if end is None else end)
        S, n = self.chosen.shape[0], self.n_init
        return np.ascontiguousarray(np.concatenate(
            [np.broadcast_to(fixed[:n], (S, n)), self.chosen,
             np.broadcast_to(fixed[n:], (S, fixed.size - n))], axis=1))


class SelectionPolicy:
    def __init__(self, settings: Settings, spec: ModelSpec, store: KVStore) -> None:
        s = settings
        self.s, self.store = s, store
        self.bs = s.block_size
        self.dense = s.attention == "DENSE"
        self.n_init = s.init_len // self.bs
        self.shared = s.head_select_mode == "SHARED"
        self.n_kv = spec.n_kv_heads
        self.scale = np.float32(spec.head_dim**-0.5)
        self._groups: dict[int, tuple[np.ndarray, int]] = {}  # group -> (selected [S, k], local0)
        self._preselected: dict[int, np.ndarray] = {}  # layer -> ascending block ids
        self._preselect_upto = 0  # blocks complete when the vote was taken
        self._dynamic_upto = [0] * spec.n_layers  # blocks with DYNAMIC (vote-based) anchors
        self.n_layers = spec.n_layers
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
        """Whether `on_prefill_end` uses the prompt's last queries (DYNAMIC or preselection)."""
        return not self.dense and (self.s.anchor_type == "DYNAMIC" or self.s.preselect_block)

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
        if cached is None or (layer % self.s.layer_step == 0 and n_tokens % self.s.token_step == 0):
            cand = self._candidates(layer, local0)  # ascending, every one < local0
            k = self.layer_k[layer]  # a layer_step group's k is one
            if 0 < k < cand.size:  # chosen by the kernel; committed with the choice
                self._ensure_anchors(layer, local0)
                return Step(layer, n_tokens, q, self.n_init, local0, nb, candidates=cand, k=k,
                            group=group)
            S = 1 if self.shared else self.n_kv
            chosen = np.broadcast_to(cand[:k], (S, min(k, cand.size))).copy()  # none or all
            self._groups[group] = (chosen, local0)
            return Step(layer, n_tokens, q, self.n_init, local0, nb, chosen)
        chosen, then = cached
        # blocks that left the local window since the choice stay attended
        return Step(layer, n_tokens, q, self.n_init, min(local0, then), nb, chosen)

    def commit(self, step: Step, chosen: np.ndarray | None = None) -> Step:
        """Record the step's choice (`chosen` [S, k], when it chose afresh) and its reads."""
        if chosen is not None:
            step.chosen = chosen
            self._groups[step.group] = (chosen, step.local0)
        self._read += step.n_init + step.chosen.shape[1] + step.nb - step.local0
        self._total += step.nb
        return step

    def select(self, layer: int, q: np.ndarray, n_tokens: int) -> np.ndarray:
        """q `[Hq, d]` f32 of the token at position n_tokens - 1 -> blocks `[S, n]` int32."""
        step = self.plan(layer, q, n_tokens)
        chosen = None
        if step.candidates is not None:
            chosen = kernels.select_blocks(q, self.store.anchors[layer], step.candidates, step.k,
                                           self.s.anchor_type == "QUEST", self.shared)
        return self.commit(step, chosen).blocks()

    def attend(self, step: Step, scale: float, local: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Exact attention on the CPU over the step's blocks (without the local window when
        `local` is False): out `[Hq, d]`, lse `[Hq]`. A step that chooses afresh scores, takes
        the top-k and attends in one kernel call, and is committed here."""
        kv, anchors = self.store.kernel_views(step.layer)
        end = step.nb if local else step.local0
        if step.candidates is None:
            self.commit(step)
            return kernels.attend_layer(kv, step.q, step.blocks(end), step.n_tokens, scale)
        if self.store.tier is not None:  # the KV is on disk: choose, ask for it, then attend
            chosen = kernels.select_blocks(step.q, self.store.anchors[step.layer],
                                           step.candidates, step.k,
                                           self.s.anchor_type == "QUEST", self.shared)
            self.store.prefetch(step.layer, chosen)
            self.commit(step, chosen)
            return kernels.attend_layer(kv, step.q, step.blocks(end), step.n_tokens, scale)
        out, lse, chosen = kernels.select_attend_layer(
            kv, anchors, step.q, step.candidates, step.k, self.s.anchor_type == "QUEST",
            self.shared, step.fixed(end), step.n_tokens, scale)
        self.commit(step, chosen)
        return out, lse

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
        )
        self.store.n_anchored[layer] = max(self.store.n_anchored[layer], last)
        if first < self.store.nb_base and self.store.mapped:
            self.store.release_mapped()  # a sweep over the mapped blocks: hand the pages back

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
            if self.store.mapped:
                self.store.release_mapped()  # the vote swept every mapped key of this layer
            if need_dyn:
                first = self.store.n_anchored[layer]
                self._anchors(layer, first, n_full, "DYNAMIC", votes)
                self._dynamic_upto[layer] = n_full
            if self.s.preselect_block:
                self._preselect(layer, votes, n_tokens)
        if self.s.preselect_block:
            self._preselect_upto = n_full

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

    def truncate(self, n_tokens: int) -> None:
        self._groups.clear()
        full = n_tokens // self.bs
        self._dynamic_upto = [min(x, full) for x in self._dynamic_upto]
        self._preselect_upto = min(self._preselect_upto, full)
        # blocks past the cut will hold other tokens (a new turn, or a context shift's)
        self._preselected = {layer: pre[pre < full] for layer, pre in self._preselected.items()}
