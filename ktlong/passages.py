"""What an answer read: the document passages its sparse attention gave the most weight.

Built on what `ktlong inspect attention` records (`attnmap.SelectionRecorder`: each decode
step's query and the blocks it read, per layer). For up to `MAX_STEPS` steps spread over the
answer, each layer's softmax over the tokens of the blocks the step read is recomputed from the
store's keys, as the sparse kernel computed it (only those blocks are fetched, so a 1M-token
context costs what the answer's reads cost). A token's weight is summed over layers, query heads
and steps; a block's score is its document tokens' weight (the template head before the document,
where the attention sink lies, never counts). The top blocks, among those the selection picked
(before the local window, read at every step, unless the whole document lies inside it), are
merged where they touch and returned with their text, so a user can check what the answer rests
on; `share` is their part of all the weight.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ktlong.attnmap import StepRecord, local_start

MAX_STEPS = 6  # answer steps whose exact attention is recomputed (spread over the answer)
MAX_CHARS = 600  # a passage's text is cut to this many characters


@dataclass(frozen=True)
class Passage:
    start: int  # first token, counted from the document's start
    end: int  # one past the last token
    share: float  # of the answer's attention mass (all layers, heads, observed steps)
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sample(steps: list[int], n: int) -> list[int]:
    if len(steps) <= n:
        return steps
    return [steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)]


def token_scores(records: list[StepRecord], keys: Any, scale: float, block_size: int,
                 n_tokens: int) -> np.ndarray:
    """`[n_tokens]` f32: each token's weight in the sparse attention the recorded steps computed
    (a step's softmax over the tokens of the blocks it read, per query head), summed over
    layers, heads and up to MAX_STEPS steps per layer. Only the blocks read are fetched:
    `keys(layer, a, b)` gives K `[Hkv, b - a, d]` of tokens [a, b)."""
    bs = block_size
    score = np.zeros(n_tokens, np.float64)
    by_layer: dict[int, list[StepRecord]] = {}
    for r in records:
        by_layer.setdefault(r.layer, []).append(r)
    for layer, recs in by_layer.items():
        for r in _sample(recs, MAX_STEPS):
            n = min(r.n_tokens, n_tokens)
            union = np.unique(r.blocks)
            union = union[union * bs < n]
            runs = np.split(union, np.flatnonzero(np.diff(union) != 1) + 1)
            parts = [keys(layer, int(run[0]) * bs, min(int(run[-1] + 1) * bs, n))
                     for run in runs if run.size]
            k = np.concatenate(parts, axis=1).astype(np.float32)  # [Hkv, m, d]
            tok = np.concatenate([np.arange(int(run[0]) * bs, min(int(run[-1] + 1) * bs, n))
                                  for run in runs if run.size])  # [m] token of each key
            Hq, S, Hkv = r.q.shape[0], r.blocks.shape[0], k.shape[0]
            for row in range(S):  # 1 (SHARED) or Hkv (SEPARATE) rows of blocks
                read = np.isin(tok // bs, r.blocks[row])  # [m]
                heads = np.flatnonzero(np.arange(Hq) * S // Hq == row)
                kh = k[heads // (Hq // Hkv)][:, read]  # [g, m_read, d]
                s = np.einsum("gmd,gd->gm", kh, r.q[heads]) * scale
                p = np.exp(s - s.max(-1, keepdims=True))
                score[tok[read]] += (p / p.sum(-1, keepdims=True)).sum(0)
    return score.astype(np.float32)


def top_passages(session: Any, records: list[StepRecord], scale: float, doc: tuple[int, int],
                 decode: Any, k: int = 3) -> list[Passage]:
    """The `k` blocks of the document tokens `doc` = [start, end) that the recorded steps gave
    the most attention (adjacent ones merged), best first. Empty when nothing was recorded or
    the store does not hold every token at its position (LOCRET keeps a subset)."""
    store = session.store
    if not records or session.dropped or k <= 0:
        return []
    bs = store.shape.block_size
    n_tokens = max(r.n_tokens for r in records)

    def keys(layer: int, a: int, b: int) -> np.ndarray:
        return store.key_range(layer, a, b).numpy()

    score = token_scores(records, keys, scale, bs, n_tokens)
    total = float(score.sum())
    first, last = doc[0] // bs, -(-doc[1] // bs)  # blocks holding document tokens
    if total <= 0 or first >= last:
        return []
    inside = np.zeros(n_tokens, bool)
    inside[doc[0]:doc[1]] = True
    per_block = np.add.reduceat(np.where(inside, score, 0), np.arange(0, n_tokens, bs))
    cand = np.arange(first, min(last, per_block.size))
    # the selection's own picks: blocks before the local window (read at every step), unless
    # the whole document lies in the window
    local0 = local_start(min(r.n_tokens for r in records), session.settings)
    picked = cand[(cand < local0) & (per_block[cand] > 0)]
    if picked.size:
        cand = picked
    best = sorted(cand[np.argsort(-per_block[cand], kind="stable")[:k]].tolist())
    runs: list[list[int]] = []
    for b in best:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    out = []
    for run in runs:
        a, b = max(run[0] * bs, doc[0]), min((run[-1] + 1) * bs, doc[1])
        text = decode(session.tokens[a:b]).strip()
        if len(text) > MAX_CHARS:
            text = text[:MAX_CHARS].rstrip() + "…"
        out.append(Passage(a - doc[0], b - doc[0], round(float(per_block[run].sum()) / total, 4),
                           text))
    return sorted(out, key=lambda p: -p.share)
