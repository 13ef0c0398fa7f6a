"""Context shift: drop a span of the conversation and move the later tokens' KV down over it.

llama.cpp's K-shift (shared/seeds/llamacpp-kv-cache.txt): RoPE rotations add, so a key
computed at position `i` becomes the key of position `i + delta` by one more rotation of
angle `delta * inv_freq`; values carry no position and move as they are. The tokens that move
keep the K,V they were computed with (they saw the dropped span), as in llama.cpp: what changes is
their position, so the model reads them as the nearer past they now are.

`plan(tokens, ids)` aligns what the store holds (`tokens`) with the conversation the caller wants
next (`ids`, e.g. re-rendered without its oldest turns): the common prefix stays in place (the
document is never moved), and the longest run of `tokens` ending with its last token that `ids`
still holds after the prefix is kept; what lies between is dropped, and the few `ids` before the
kept run that the store lacks (e.g. the chat template's text before the first kept question,
which the re-rendering tokenises anew) are the `gap`. `apply(session, plan)` does it on a
`Session`: cut the store back to the prefix, prefill the gap, then copy the kept run's rows down
in chunks, K through float32 (`KVStore.row_range` -> rotate -> `KVStore.write_rows`, so every
kv_type and the disk tier work; quantised K rows are re-encoded), V rows as stored.

Exactness: a re-rotated float32 key differs from one rotated afresh at its new position by the
rounding of the two angles (float32 `pos * inv_freq`, ~6e-8 x the angle): ~1e-4 relative at a
few thousand positions. BF16/FP16 keys are rounded again after the rotation (2^-9 / 2^-12
relative), Q8_0/Q4_0 keys quantised again (their own step); each shift a token goes through adds
that once. RoPE types whose frequencies depend on the sequence length (`dynamic`) are rotated
with the model's current `inv_freq`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ktlong.kvstore import from_storage, to_storage
from ktlong.tokenids import common_prefix

MIN_REUSE = 16  # shorter runs are prefilled again rather than moved
MOVE_CHUNK = 4096  # tokens of one layer moved at a time (bounded temporaries)


@dataclass(frozen=True)
class ShiftPlan:
    """What a shift does to a store holding `n` tokens: tokens `[0, keep)` stay, `[keep,
    keep + drop)` go, `gap` ids are prefilled at `keep`, and the last `moved` tokens follow them,
    their keys rotated by `delta` positions (negative: they move towards the document)."""

    keep: int
    drop: int
    gap: tuple[int, ...]
    moved: int

    @property
    def delta(self) -> int:
        return len(self.gap) - self.drop


def _suffix_match(t: np.ndarray, n: int, ids: np.ndarray, j: int, cap: int) -> int:
    """Length (at most `cap`) of the common suffix of t[:n] and ids[:j + 1], compared in
    growing windows so a short match costs a short compare."""
    m, w = 0, 8
    while m < cap:
        w2 = min(cap, m + w)
        diff = np.flatnonzero(t[n - w2 : n - m] != ids[j + 1 - w2 : j + 1 - m])
        if diff.size:
            return m + (w2 - m - 1 - int(diff[-1]))
        m, w = w2, w * 8
    return m


def plan(tokens: list[int], ids: list[int], min_reuse: int = MIN_REUSE) -> ShiftPlan | None:
    """How to turn a store holding `tokens` into one holding a prefix of `ids` while reusing the
    most K,V; None when no run of at least `min_reuse` tokens can be moved (then cutting back to
    the common prefix and prefilling is all there is to do)."""
    n = len(tokens)
    p = common_prefix(tokens, ids)
    if p >= n or p >= len(ids):
        return None  # `ids` continue the store, or are a prefix of it: nothing to move
    t = np.asarray(tokens, np.int64)
    v = np.asarray(ids, np.int64)
    # the store's last token lands at j (< n: the kept run moves down, never up)
    best_m, best_j = 0, -1
    for j in (np.flatnonzero(v[p : min(n, len(ids))] == t[n - 1]) + p).tolist():
        cap = min(n - p, j + 1 - p)
        if cap <= best_m:
            continue
        m = _suffix_match(t, n, v, j, cap)
        if m > best_m:
            best_m, best_j = m, j
    if best_m < min_reuse:
        return None
    e, q = n - best_m, best_j + 1 - best_m
    return ShiftPlan(keep=p, drop=e - p, gap=tuple(ids[p:q]), moved=best_m)


# --- RoPE ---------------------------------------------------------------------------------------
def rope_inv_freq(model: Any) -> torch.Tensor:
    """The loaded model's RoPE frequencies `[rot / 2]` float64 on the CPU (rope scaling such as
    llama3's or YaRN's is already in them; an attention scaling factor multiplies cos and sin of
    both rotations alike, so it is in the stored keys once and stays there)."""
    rotary = model.model.rotary_emb
    return rotary.inv_freq.detach().to("cpu", torch.float64)


def rotation(inv_freq: torch.Tensor,
             delta: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[rot]` float32 of angle `delta * inv_freq`, laid out as the model's (halves);
    `[n, rot]` for deltas `[n]` (one per token)."""
    if isinstance(delta, torch.Tensor):
        ang = delta.double()[:, None] * inv_freq.double()[None]  # float64: no added rounding
    else:
        ang = inv_freq * float(delta)
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def rerotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys `[..., d]` float32 rotated once more (Llama's rotate_half layout: channel j pairs
    with j + rot/2), in place; channels past `rot` (partial rotary) stay."""
    rot = cos.shape[-1]
    x = k[..., :rot]
    half = torch.cat([-x[..., rot // 2 :], x[..., : rot // 2]], -1)
    k[..., :rot] = x * cos + half * sin
    return k


# --- applying a plan ------------------------------------------------------------------------------
def move_keys(store: Any, src: int, n: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Append the `n` tokens that sit (past the store's length) at `src`, every layer, keys
    rotated by (cos, sin): `MOVE_CHUNK` tokens at a time, read before they are overwritten
    (the destination is below `src`)."""
    kv_type = store.shape.kv_type
    for layer in range(store.shape.n_layers):
        if store.lengths[layer] > src:
            raise ValueError("the tokens to move must lie past the store's length")
        for a in range(src, src + n, MOVE_CHUNK):
            b = min(src + n, a + MOVE_CHUNK)
            k_rows, v_rows = store.row_range(layer, a, b)
            k = rerotate(from_storage(k_rows, kv_type), cos, sin)
            store.write_rows(layer, to_storage(k, kv_type), np.array(v_rows))


def apply(session: Any, p: ShiftPlan) -> None:
    """Do `p` on `session` (engine.Session): afterwards it holds `tokens[:keep] + gap +
    tokens[-moved:]`; the logits of its last token are kept (the one it held before)."""
    store = session.store
    old, logits = list(session.tokens), session.logits
    n, e = len(old), p.keep + p.drop
    bs = store.shape.block_size
    if p.keep < store.nb_base * bs:  # a mapped conversation (/load): copy what moves out of it
        store.detach_base(p.keep // bs)
    session.truncate(p.keep)  # lengths, anchors of the touched blocks, the policy's choices
    if p.gap:
        session.prefill(list(p.gap))
    cos, sin = rotation(rope_inv_freq(session.lm.model), p.delta)
    move_keys(store, e, p.moved, cos, sin)
    session.tokens.extend(old[e:n])
    session.policy.truncate(len(session.tokens))  # selections cached during the gap
    if session.router.local is not None:  # a GPU local window holds the old positions
        session.router.local.buf.clear()
    session.logits = logits
    session.stats.context_tokens = len(session.tokens)
    session.stats.kv_bytes = store.nbytes_used()
