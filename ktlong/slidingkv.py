"""The sliding-window layers' K,V (Gemma 3's local layers): a ring of the last tokens per layer.

A sliding-window layer's query at position p reads keys p - window + 1 .. p, so the layer keeps
only the last `window` tokens between forwards, whatever the document's length: these layers
never enter the KV store, block selection or the memory that grows with the context. Rows take
the store's KV type where it is FP32, FP16 or BF16, and BF16 where the store quantises its rows
(window x kv heads x head_dim: 0.5 MB a layer for Gemma 3 270M in BF16): a decode step reads every
row of every window, so their bytes count as the weights' do.

`pin()` marks a point the conversation may be cut back to (the document's end): from then on the
tokens from `pin - window` on are kept too, so `truncate(n)` works for any n >= pin - 1 (a cached
document re-feeds its last token). The prompt cache saves and restores the last `window` rows
(`state`, `load`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ktlong import kernels
from ktlong.kvstore import KV_TYPES, QUANT_KV

KEEP_PAST_PIN = 32768  # tokens kept after a pin before it is let go (a very long chat)
QUERY_TILE = 128  # a chunk's queries per attention call: each reads tile + window - 1 keys, not
# the whole chunk (Gemma 3 270M at a 1,024-token chunk: 2.2x less time in these layers)


def window_kind(kv_type: str) -> int:
    """The kv_kind of a window's rows under a store of kv_type: a quantised store's are bf16."""
    return 1 if kv_type in QUANT_KV else KV_TYPES[kv_type][2]


class SlidingKV:
    """Per sliding layer a buffer [Hkv, cap, d] of float32 or 16-bit rows: rows [off, off + n)
    hold positions [first, first + n). Rows fall out of the window by moving `off` (and
    `first`); the buffer is compacted only when full, so a decode step copies nothing but its own
    row."""

    def __init__(self, layers: tuple[int, ...], n_kv_heads: int, head_dim: int,
                 window: int, kv_type: str = "FP32") -> None:
        self.layers, self.window = layers, window
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.dtype = KV_TYPES[kv_type][1]  # quantised stores: bf16 rows
        self.kind = window_kind(kv_type)  # the attention kernel's kv_kind
        self.kb = {layer: self._empty(0) for layer in layers}
        self.vb = {layer: self._empty(0) for layer in layers}
        self.off = {layer: 0 for layer in layers}  # buffer row of the first kept position
        self.n = {layer: 0 for layer in layers}  # rows kept
        self.first = {layer: 0 for layer in layers}  # position of each layer's first row
        self.pin_at: int | None = None
        self._views: dict[int, tuple] = {}  # layer -> (kb, vb, k, v, kernel view): see _kernel_view

    def _empty(self, rows: int) -> torch.Tensor:
        return torch.empty(self.n_kv_heads, rows, self.head_dim, dtype=self.dtype)

    def __contains__(self, layer: int) -> bool:
        return layer in self.kb

    def length(self, layer: int) -> int:
        return self.first[layer] + self.n[layer]

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept rows: k, v [Hkv, n, d] (views)."""
        a, b = self.off[layer], self.off[layer] + self.n[layer]
        return self.kb[layer][:, a:b], self.vb[layer][:, a:b]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kb, self.vb) for t in d.values())

    def _room(self, layer: int, L: int) -> int:
        """The buffer row where L new rows go after the kept ones: the buffer is compacted (or
        grown) first when full."""
        off, n = self.off[layer], self.n[layer]
        kb, vb = self.kb[layer], self.vb[layer]
        if off + n + L > kb.shape[1]:
            cap = max(2 * (n + L), n + L + self.window)
            if cap > kb.shape[1] or off == 0:  # grow: a fresh, larger buffer
                nk = self._empty(cap)
                nv = torch.empty_like(nk)
            else:  # room enough once the dropped rows go: move the kept ones down
                nk, nv = kb, vb
            nk[:, :n] = kb[:, off:off + n].clone() if nk is kb else kb[:, off:off + n]
            nv[:, :n] = vb[:, off:off + n].clone() if nv is vb else vb[:, off:off + n]
            self.kb[layer], self.vb[layer], self.off[layer], off = nk, nv, 0, 0
        return off + n

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put L new rows (k, v [Hkv, L, d]) after the kept ones."""
        row, L = self._room(layer, k.shape[1]), k.shape[1]
        self.kb[layer][:, row:row + L] = k  # rounded to the rows' type
        self.vb[layer][:, row:row + L] = v
        self.n[layer] += L

    def _kernel_view(self, layer: int) -> tuple[np.ndarray, np.ndarray, kernels.LayerKV]:
        """The layer's buffers as NumPy arrays k, v [Hkv, cap, 1, d] (float32, float16, or bf16
        bits as uint16) and as the attention kernel reads them (one-row blocks), made again only
        when a buffer is replaced."""
        kb, vb = self.kb[layer], self.vb[layer]
        got = self._views.get(layer)
        if got is None or got[0] is not kb or got[1] is not vb:
            kn, vn = (_numpy(t)[:, :, None] for t in (kb, vb))
            got = (kb, vb, kn, vn, kernels.rows_kv(kn, vn, self.kind))
            self._views[layer] = got
        return got[2], got[3], got[4]

    def _trim(self, layer: int, end: int) -> None:
        """Drop the rows no query after position `end` reads (nor a cut back to the pin)."""
        keep = end - self.window  # one more than the next token reads: a re-feed
        if self.pin_at is not None:
            if end - self.pin_at > KEEP_PAST_PIN:
                self.pin_at = None
            else:
                keep = min(keep, self.pin_at - self.window)
        drop = max(0, keep - self.first[layer])
        self.off[layer] += drop
        self.n[layer] -= drop
        self.first[layer] += drop

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q `[Hq, L, d]`, k, v `[Hkv, L, d]` of the next L tokens -> out `[Hq, L, d]` f32."""
        first, L = self.first[layer], q.shape[1]
        start = self.length(layer)
        self._append(layer, k.float(), v.float())
        kk, vv = (t.float() for t in self.rows(layer))  # [Hkv, P + L, d]
        q = q.float()
        out = torch.empty_like(q)  # [Hq, L, d]
        for a in range(0, L, QUERY_TILE):  # each tile reads only its own window's keys
            b = min(L, a + QUERY_TILE)
            k0 = max(first, start + a - self.window + 1)  # the tile's first query reads from here
            qpos = torch.arange(start + a, start + b)[:, None]  # [T, 1]
            kpos = torch.arange(k0, start + b)[None, :]  # [1, K]
            mask = (kpos <= qpos) & (qpos - kpos < self.window)  # [T, K]
            rows = slice(k0 - first, start + b - first)
            out[:, a:b] = F.scaled_dot_product_attention(
                q[None, :, a:b], kk[None, :, rows], vv[None, :, rows], mask, scale=scale,
                enable_gqa=True)[0]
        self._trim(layer, start + L)
        k, v = self.rows(layer)  # a chunk's buffer, cut to the rows kept plus a window's room
        n = k.shape[1]
        self.kb[layer] = self._empty(n + self.window)
        self.vb[layer] = torch.empty_like(self.kb[layer])
        self.kb[layer][:, :n], self.vb[layer][:, :n], self.off[layer] = k, v, 0
        return out

    def attend_one(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   scale: float) -> np.ndarray:
        """One token: q [Hq, d], k, v [Hkv, d] float32 -> out [Hq, d] float32 over the last
        `window` rows (its own included), by the decode attention kernel on the session's
        threads."""
        start = self.length(layer)
        row = self._room(layer, 1)
        kn, vn, kv = self._kernel_view(layer)
        if self.kind == 1:  # rounded to bf16 as torch rounds (to nearest even)
            kernels.put_token(kn, vn, row, k, v)
        else:
            kn[:, row, 0] = k
            vn[:, row, 0] = v
        self.n[layer] += 1
        end = row + 1  # buffer rows [end - w, end): the window
        out = kernels.attend_rows(kv, q, end - min(self.window, self.n[layer]), end, scale)
        self._trim(layer, start + 1)
        return out

    def pin(self, n_tokens: int) -> None:
        self.pin_at = n_tokens

    def can_truncate(self, n_tokens: int) -> bool:
        need = max(0, n_tokens - (self.window - 1))  # the first row a next token reads
        return all(self.first[x] <= need and n_tokens <= self.length(x) for x in self.layers)

    def truncate(self, n_tokens: int) -> None:
        if not self.can_truncate(n_tokens):
            raise ValueError(f"the sliding-window layers no longer hold the tokens before "
                             f"{n_tokens}")
        for layer in self.layers:
            self.n[layer] = max(0, n_tokens - self.first[layer])

    def state(self, n_tokens: int) -> np.ndarray:
        """The last `window` rows before `n_tokens`: [layers, 2, Hkv, window, d] f32 (zeros
        before position 0)."""
        w = self.window
        out = np.zeros((len(self.layers), 2, self.n_kv_heads, w, self.head_dim), np.float32)
        for i, layer in enumerate(self.layers):
            a, b = max(0, n_tokens - w), n_tokens
            first = self.first[layer]
            if a < first or b > self.length(layer):
                raise ValueError("the window rows for that length are gone")
            k, v = self.rows(layer)
            out[i, 0, :, w - (b - a):] = k[:, a - first:b - first].float().numpy()
            out[i, 1, :, w - (b - a):] = v[:, a - first:b - first].float().numpy()
        return out

    def load(self, rows: np.ndarray, n_tokens: int) -> None:
        """Restore the state after `n_tokens` tokens from `state`'s rows."""
        w = self.window
        a = max(0, n_tokens - w)
        for i, layer in enumerate(self.layers):
            self.kb[layer] = torch.from_numpy(np.array(rows[i, 0, :, w - (n_tokens - a):])).to(
                self.dtype)
            self.vb[layer] = torch.from_numpy(np.array(rows[i, 1, :, w - (n_tokens - a):])).to(
                self.dtype)
            self.off[layer], self.n[layer] = 0, n_tokens - a
            self.first[layer] = a


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as NumPy: bf16 as its bits (uint16), the rest as it is."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
