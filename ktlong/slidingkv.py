"""The sliding-window layers' K,V (Gemma 3's local layers): a ring of the last tokens per layer.

A sliding-window layer's query at position p reads keys p - window + 1 .. p, so the layer keeps
only the last `window` tokens between forwards, whatever the document's length: these layers
never enter the KV store, block selection or the memory that grows with the context. Rows are
float32 (window x kv heads x head_dim: ~1 MB a layer for Gemma 3 270M).

`pin()` marks a point the conversation may be cut back to (the document's end): from then on the
tokens from `pin - window` on are kept too, so `truncate(n)` works for any n >= pin - 1 (a cached
document re-feeds its last token). The prompt cache saves and restores the last `window` rows
(`state`, `load`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

KEEP_PAST_PIN = 32768  # tokens kept after a pin before it is let go (a very long chat)


class SlidingKV:
    def __init__(self, layers: tuple[int, ...], n_kv_heads: int, head_dim: int,
                 window: int) -> None:
        self.layers, self.window = layers, window
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        empty = torch.empty(n_kv_heads, 0, head_dim)
        self.k = {layer: empty for layer in layers}  # layer -> [Hkv, T, d] f32
        self.v = {layer: empty for layer in layers}
        self.first = {layer: 0 for layer in layers}  # position of each layer's first row
        self.pin_at: int | None = None

    def __contains__(self, layer: int) -> bool:
        return layer in self.k

    def length(self, layer: int) -> int:
        return self.first[layer] + self.k[layer].shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for d in (self.k, self.v) for t in d.values())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q `[Hq, L, d]`, k, v `[Hkv, L, d]` of the next L tokens -> out `[Hq, L, d]` f32."""
        first, L = self.first[layer], q.shape[1]
        start = self.length(layer)
        kk = torch.cat([self.k[layer], k.float()], 1)  # [Hkv, P + L, d]
        vv = torch.cat([self.v[layer], v.float()], 1)
        qpos = torch.arange(start, start + L)[:, None]  # [L, 1]
        kpos = torch.arange(first, start + L)[None, :]  # [1, P + L]
        mask = (kpos <= qpos) & (qpos - kpos < self.window)  # [L, P + L]
        out = F.scaled_dot_product_attention(q.float()[None], kk[None], vv[None], mask,
                                             scale=scale, enable_gqa=True)[0]  # [Hq, L, d]
        keep = start + L - self.window  # one more than the next token reads: a re-feed
        if self.pin_at is not None:
            if start + L - self.pin_at > KEEP_PAST_PIN:
                self.pin_at = None
            else:
                keep = min(keep, self.pin_at - self.window)
        drop = max(0, keep - first)
        self.k[layer], self.v[layer] = kk[:, drop:].clone(), vv[:, drop:].clone()
        self.first[layer] = first + drop
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
            keep = max(0, n_tokens - self.first[layer])
            self.k[layer], self.v[layer] = self.k[layer][:, :keep], self.v[layer][:, :keep]

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
            out[i, 0, :, w - (b - a):] = self.k[layer][:, a - first:b - first].numpy()
            out[i, 1, :, w - (b - a):] = self.v[layer][:, a - first:b - first].numpy()
        return out

    def load(self, rows: np.ndarray, n_tokens: int) -> None:
        """Restore the state after `n_tokens` tokens from `state`'s rows."""
        w = self.window
        a = max(0, n_tokens - w)
        for i, layer in enumerate(self.layers):
            self.k[layer] = torch.from_numpy(np.array(rows[i, 0, :, w - (n_tokens - a):]))
            self.v[layer] = torch.from_numpy(np.array(rows[i, 1, :, w - (n_tokens - a):]))
            self.first[layer] = a
