"""Attention glue: the function transformers calls for every layer, writing K,V into the store.

transformers hands us post-RoPE `query [1, Hq, L, d]`, `key/value [1, Hkv, L, d]` of the tokens in
flight (we pass no transformers Cache, so nothing else keeps K,V). The router appends K,V to the
KVStore and computes attention from the store:
- dense: chunk queries against the layer's whole past, tiled with an online softmax, so no
  `[L, context]` matrix ever exists; on CUDA the current layer's KV is mirrored on the device;
  `prefill` WINDOW reads init_len + prefill_window of it, MINFERENCE each head's sparse pattern
  (ktlong.minference), AUTO the patterns inside the model's trained context, the window past
  it;
- sparse: per token, the selection policy picks blocks and a Numba kernel attends to them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ktlong.config import window_reads
from ktlong.kvstore import KV_TYPES, KVStore
from ktlong.minference import ChunkAttention
from ktlong.slidingkv import SlidingKV

ATTN_IMPLEMENTATION = "ktlong"  # name registered with transformers' AttentionInterface

TILE_ELEMS = 1 << 24  # max floats in one [Hkv, g*L, T] score tile (64 MB)
PAST_SEGMENT_ELEMS = 1 << 19  # max floats of one head's past K per fused-kernel call (2 MB)
# torch's fused CPU flash attention returning (out, logsumexp); private, so looked up defensively
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over two disjoint key sets: out [..., n, d], lse [..., n].
    Overwrites o1 and o2 (no temporaries the size of the output)."""
    lse = torch.logaddexp(l1, l2)
    o1.mul_(torch.exp(l1 - lse)[..., None])
    return o1.add_(o2.mul_(torch.exp(l2 - lse)[..., None])), lse


def ktlong_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    router: AttentionRouter | None = kwargs.get("ktlong")
    if router is None:
        raise RuntimeError("ktlong attention runs only inside a ktlong Session")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = router.attend(module.layer_idx, query[0], key[0], value[0], scale)  # [Hq, L, d]
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None  # [1, L, Hq, d]


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ktlong_attention)


class AttentionRouter:
    """Per-session state the attention function needs: store, policy, mode, captured queries."""

    def __init__(
        self,
        store: KVStore,
        policy: Any,
        device: torch.device,
        local_device: torch.device | None = None,
        chunk_attention: ChunkAttention | None = None,
        window: SlidingKV | None = None,
        kv_layers: tuple[int, ...] | None = None,
    ) -> None:
        self.store, self.policy, self.device = store, policy, device
        self.window = window  # the sliding-window layers' rings (Gemma 3), outside the store
        # model layer -> store layer: the store holds only the layers that read the whole context
        self.kv_index = {li: i for i, li in enumerate(kv_layers or range(store.shape.n_layers))}
        self.chunk_attention = chunk_attention  # MINFERENCE prefill: per-head sparse patterns
        self.patterns = chunk_attention is not None  # this forward reads through them
        self.auto_reach = 0  # AUTO: the longest context read through them (minference.auto_reach)
        self.attn_s = 0.0  # seconds in prefill attention (dense or sparse) since begin()
        # decode: the local window attends on this device (the GPU) while the CPU kernel reads
        # the init + selected blocks; the two partial results merge by log-sum-exp
        self.local = LocalWindow(store, local_device) if local_device is not None else None
        self.sparse = False  # set by the engine for each forward
        self.capture = 0  # keep the last `capture` queries of each layer (for votes / anchors)
        self.captured: dict[int, torch.Tensor] = {}  # layer -> [Hq, W, d] float32 (cpu)
        self.evictor: Any = None  # LOCRET: keeps each layer's KV to a budget (ktlong.locret)
        self._dev_layer = -1  # layer whose KV is mirrored on the device (CUDA prefill)
        self._dev_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self, sparse: bool, capture: int = 0, total: int = 0) -> None:
        """Start a forward over `total` new tokens."""
        self.sparse, self.capture, self.captured = sparse, capture, {}
        self._dev_layer, self._dev_kv, self._total = -1, None, total
        self.attn_s = 0.0
        if self.chunk_attention is not None and not sparse:  # a sparse forward never reads it
            fresh = ChunkAttention(self.chunk_attention.plan)  # no pooled keys yet
            fresh.dense_below = self.chunk_attention.dense_below
            self.chunk_attention = fresh
            self.patterns = not self.auto_reach or self.store.length + total <= self.auto_reach

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q `[Hq, L, d]`, k, v `[Hkv, L, d]` of model layer `layer` -> attention output
        `[Hq, L, d]` float32."""
        if self.window is not None and layer in self.window:
            return self.window.attend(layer, q.cpu(), k.cpu(), v.cpu(), scale).to(q.device)
        layer = self.kv_index[layer]
        start = self.store.write(layer, k, v)
        if self.capture:  # only the last rows are copied: the chunk's q is the layer's biggest
            prev = self.captured.get(layer)
            qc = q[:, -self.capture :].to("cpu", torch.float32, copy=True)  # [Hq, <= W, d]
            if prev is not None:  # the window spans two chunks
                qc = torch.cat([prev, qc], 1)[:, -self.capture :].clone()
            self.captured[layer] = qc
        if self.sparse:
            return self._sparse(layer, q, k, v, start, scale)
        if self.device.type == "cuda":
            self._mirror(layer, k, v, start)
        t0 = time.perf_counter()
        ca = self.chunk_attention
        if ca is not None and self.patterns and q.shape[1] > 1 \
                and start + q.shape[1] > ca.dense_below:
            out = self._minference(layer, q, start, scale)
        else:
            out = self._dense(layer, q, start, scale)
        if self.evictor is not None and self.evictor.active:
            self.evictor.after_chunk(layer, q, k, v, start, scale, self.store)
            self._dev_layer, self._dev_kv = -1, None  # the layer's rows moved
        self.attn_s += time.perf_counter() - t0
        return out

    def attend_one(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   scale: float) -> np.ndarray:
        """A decode step of model layer `layer` on the CPU (ktlong.decoder): q [Hq, d], k, v
        [Hkv, d] float32 -> attention output [Hq, d] float32."""
        if self.window is not None and layer in self.window:
            return self.window.attend_one(layer, q, k, v, scale)
        layer = self.kv_index[layer]  # (a GPU local window means a CUDA model: no decoder)
        start = self.store.write_f32(layer, k, v)
        step = self.policy.plan(layer, q, start + 1)
        return self.policy.attend(step, scale)[0]

    def _minference(self, layer: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """Each head's sparse pattern (index built on the CPU; attention by the Numba kernel, or
        by plain torch over the layer's device mirror on CUDA)."""
        from ktlong.minference import attend_chunk_torch, build_index

        ca = self.chunk_attention
        kv = self.store.kernel_views(layer)[0]
        qn = q.detach().float().cpu().numpy()  # [Hq, L, d]
        if self._dev_kv is None or self._dev_layer != layer:
            return torch.from_numpy(ca.attend(layer, kv, qn, start, scale)).to(q.device)
        n = start + q.shape[1]
        index = build_index(ca.plan.layers[layer], kv, qn, start, scale, ca._pooled(layer, kv, n))
        ca.count(index, start, q.shape[1])
        dk, dv = self._dev_kv
        return attend_chunk_torch(q, dk[:, :n], dv[:, :n], start, index, scale)

    # --- dense: tiled online softmax over the store (or its device mirror) --------------------
    def _tile(self, layer: int, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._dev_kv is not None and self._dev_layer == layer:
            k, v = self._dev_kv
            return k[:, t0:t1].float(), v[:, t0:t1].float()
        k, v = self.store.token_range(layer, t0, t1)
        return k.to(self.device), v.to(self.device)

    def _mirror(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep this layer's KV on the GPU during a prefill: the past is uploaded once per layer."""
        tdtype = KV_TYPES[self.store.shape.kv_type][1]
        if self._dev_layer != layer:
            self._dev_kv = None  # free the previous layer first: one layer's KV on the device
            cap = start + self._total
            H, d = k.shape[0], k.shape[-1]
            dk = torch.empty((H, cap, d), dtype=tdtype, device=self.device)
            dv = torch.empty_like(dk)
            if start:
                pk, pv = self.store.token_range(layer, 0, start)
                dk[:, :start], dv[:, :start] = pk.to(self.device), pv.to(self.device)
            self._dev_layer, self._dev_kv = layer, (dk, dv)
        dk, dv = self._dev_kv
        n = k.shape[1]
        dk[:, start : start + n], dv[:, start : start + n] = k.to(tdtype), v.to(tdtype)

    def _past(self, start: int) -> list[tuple[int, int, int]]:
        """Token ranges (a, b, turn) before `start` that a prefill chunk starting there attends,
        their keys read `turn` positions later than their own: all of them, or with
        `prefill_window` W the first init_len tokens and the last W (StreamingLLM-style). With
        block_positions COMPACT the first tokens are read as the ones just before the window, so
        no key lies further from a query than init_len + W + the chunk: a model never sees a
        distance it was not trained on while it reads the document."""
        s = self.policy.s
        reach = window_reads(s)
        if not reach or start <= reach or self.patterns:  # AUTO's first chunks under its patterns
            return [(0, start, 0)]
        w, init = s.prefill_window, s.init_len
        turn = start - w - init if (s.block_positions == "COMPACT"
                                    and self.policy.inv_freq is not None) else 0
        return [(0, init, turn), (start - w, start, 0)] if init else [(start - w, start, 0)]

    def _turned(self, k: torch.Tensor, turn: int) -> torch.Tensor:
        """Keys `[..., d]` float32 rotated `turn` positions on (RoPE adds angles), as a copy."""
        if not turn:
            return k
        from ktlong.shift import rerotate, rotation

        cos, sin = rotation(torch.from_numpy(self.policy.inv_freq), turn)
        return rerotate(k.clone(), cos.to(k.device), sin.to(k.device))

    def _dense(self, layer: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        if q.device.type == "cpu" and _FLASH_CPU is not None:
            return self._dense_flash(layer, q, start, scale)
        return self._dense_tiled(layer, q, start, scale)

    def _dense_flash(self, layer: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """torch's fused CPU flash kernel, which also returns the log-sum-exp: one KV head at a
        time (its query heads folded into rows, so K is never repeated and the temporaries are a
        head's, not the layer's), over the past in segments, then the causal chunk."""
        Hq, L, d = q.shape
        Hkv = self.store.shape.n_kv_heads
        g = Hq // Hkv
        out = torch.empty(L, Hq, d)  # token-major: the caller's [1, L, Hq * d] is a free view
        seg = max(1024, PAST_SEGMENT_ELEMS // d)
        past = self._past(start)
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            qh = q[heads].float().reshape(1, 1, g * L, d)  # row j*L + i: head h*g + j, token i
            o = lse = None
            for a, b, turn in past:
                for t0 in range(a, b, seg):
                    k, v = self.store.token_range(layer, t0, min(b, t0 + seg), slice(h, h + 1))
                    k = self._turned(k, turn)
                    op, lp = _FLASH_CPU(qh, k[None], v[None], 0.0, False, scale=scale)[:2]
                    o, lse = (op, lp) if o is None else _merge(o, lse, op, lp)
            oc = torch.empty(1, 1, g * L, d)  # the causal square, one query head per call
            lc = torch.empty(1, 1, g * L)
            k, v = self.store.token_range(layer, start, start + L, slice(h, h + 1))  # [1, L, d]
            for j in range(g):
                rows = slice(j * L, (j + 1) * L)
                oc[:, :, rows], lc[:, :, rows] = _FLASH_CPU(
                    qh[:, :, rows], k[None], v[None], 0.0, True, scale=scale
                )[:2]
            o = oc if o is None else _merge(o, lse, oc, lc)[0]
            out[:, heads] = o.view(g, L, d).transpose(0, 1)
        return out.transpose(0, 1)  # [Hq, L, d]

    def _dense_tiled(self, layer: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """Any device: tiles of the past + chunk with an online softmax (no fused kernel)."""
        Hq, L, d = q.shape
        Hkv = self.store.shape.n_kv_heads
        g = Hq // Hkv
        end = start + L
        qg = (q.float() * scale).reshape(Hkv, g * L, d)  # row j*L + i: head h = kv*g + j, token i
        qpos = (start + torch.arange(L, device=q.device)).repeat(g)  # [g*L]
        m = torch.full((Hkv, g * L), float("-inf"), device=q.device)
        denom = torch.zeros((Hkv, g * L), device=q.device)
        acc = torch.zeros((Hkv, g * L, d), device=q.device)
        tile = max(256, TILE_ELEMS // (Hq * L))
        tiles = [(t0, min(b, t0 + tile), turn)
                 for a, b, turn in self._past(start) + [(start, end, 0)]
                 for t0 in range(a, b, tile)]
        for t0, t1, turn in tiles:
            kt, vt = self._tile(layer, t0, t1)  # [Hkv, T, d]
            kt = self._turned(kt, turn)
            s = torch.bmm(qg, kt.transpose(1, 2))  # [Hkv, g*L, T]
            if t1 > start + 1:  # the tile reaches this chunk: causal mask
                kpos = torch.arange(t0, t1, device=q.device)
                s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            corr = torch.exp(m - m_new)
            denom = denom * corr + p.sum(-1)
            acc = acc * corr[..., None] + torch.bmm(p, vt)
            m = m_new
        return (acc / denom[..., None]).reshape(Hq, L, d)

    # --- sparse: per token, policy picks blocks, Numba kernel attends -------------------------
    def _sparse(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                start: int, scale: float) -> torch.Tensor:
        """Per token: the policy picks blocks and the CPU kernel reads them.

        With a local-window device (the GPU), the window's blocks are attended there while the
        CPU kernel reads the init + selected blocks in a worker thread; the two merge by LSE.
        """
        from ktlong import kernels

        Hq, L, d = q.shape
        bs = self.store.shape.block_size
        qn = q.detach().float().cpu().numpy()  # [Hq, L, d]
        out = np.empty((Hq, L, d), np.float32)
        for i in range(L):
            n_tokens = start + i + 1
            qi = np.ascontiguousarray(qn[:, i])  # [Hq, d]
            step = self.policy.plan(layer, qi, n_tokens)
            if self.local is None:
                out[:, i] = self.policy.attend(step, scale)[0]
                continue
            job = None
            if (step.candidates is not None or step.n_init + step.pins.size
                    + step.chosen.shape[1] > 0):
                job = _POOL.submit(self.policy.attend, step, scale, False)  # init + selected
            else:
                self.policy.commit(step)
            o_dev, lse_dev = self.local.attend(layer, q[:, i], step.local0 * bs, n_tokens, scale,
                                               k[:, : i + 1], v[:, : i + 1], start)
            o, lse = o_dev.float().cpu().numpy(), lse_dev.float().cpu().numpy()
            if job is not None:
                o, lse = kernels.merge_partials(*job.result(), o, lse)
            out[:, i] = o
        return torch.from_numpy(out).to(q.device)


class LocalWindow:
    """The newest tokens of every layer kept on a device for the local window's attention.

    Per layer a `[Hkv, cap, d]` buffer (KV dtype) holding tokens [first, first + n): appended to
    as tokens arrive, compacted to the window when full, and rebuilt from the store when it does
    not reach back far enough (after a prefill or a cache load).
    """

    def __init__(self, store: KVStore, device: torch.device) -> None:
        self.store, self.device = store, device
        self.tdtype = KV_TYPES[store.shape.kv_type][1]
        self.buf: dict[int, list[Any]] = {}  # layer -> [k_buf, v_buf, first, n]

    def _rebuild(self, layer: int, t0: int, n_tokens: int) -> None:
        k, v = self.store.token_range(layer, t0, n_tokens)  # [Hkv, T, d] f32
        H, T, d = k.shape
        kb = torch.empty((H, max(2 * T, 256), d), dtype=self.tdtype, device=self.device)
        vb = torch.empty_like(kb)
        kb[:, :T], vb[:, :T] = k.to(self.device), v.to(self.device)
        self.buf[layer] = [kb, vb, t0, T]

    def _advance(
        self,
        layer: int,
        t0: int,
        n_tokens: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        new_start: int,
    ) -> bool:
        """Bring the buffer up to `n_tokens` from this forward's tokens; False if it cannot."""
        entry = self.buf.get(layer)
        if entry is None:
            return False
        kb, vb, first, n = entry
        if first > t0 or not new_start <= first + n <= n_tokens:
            return False
        add, j = n_tokens - (first + n), first + n - new_start
        if n + add > kb.shape[1]:  # full: keep only the window
            drop = t0 - first
            kb[:, : n - drop] = kb[:, drop:n].clone()
            vb[:, : n - drop] = vb[:, drop:n].clone()
            first, n = t0, n - drop
            if n + add > kb.shape[1]:
                return False
        kb[:, n : n + add] = k_new[:, j : j + add].to(self.device, self.tdtype)
        vb[:, n : n + add] = v_new[:, j : j + add].to(self.device, self.tdtype)
        entry[2:] = [first, n + add]
        return True

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        t0: int,
        n_tokens: int,
        scale: float,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        new_start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[Hq, d]` over tokens [t0, n_tokens) -> (out `[Hq, d]`, lse `[Hq]`) on the device.

        `k_new, v_new` `[Hkv, m, d]` are this forward's tokens from `new_start` (already stored).
        """
        if not self._advance(layer, t0, n_tokens, k_new, v_new, new_start):
            self._rebuild(layer, t0, n_tokens)
        kb, vb, first, n = self.buf[layer]
        kw, vw = kb[:, t0 - first : n].float(), vb[:, t0 - first : n].float()  # [Hkv, T, d]
        Hkv, Hq = kw.shape[0], q.shape[0]
        qg = (q.float().to(self.device) * scale).reshape(Hkv, Hq // Hkv, -1)  # [Hkv, g, d]
        s = torch.bmm(qg, kw.transpose(1, 2))  # [Hkv, g, T]
        lse = torch.logsumexp(s, -1)  # [Hkv, g]
        o = torch.bmm(torch.exp(s - lse[..., None]), vw)  # [Hkv, g, d]
        return o.reshape(Hq, -1), lse.reshape(Hq)


_POOL = ThreadPoolExecutor(1, "ktlong-cpu-attn")  # the CPU kernel runs here during the GPU part
