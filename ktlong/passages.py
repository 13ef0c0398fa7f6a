"""What an answer read: the document passages its sparse attention gave the most weight.

Built on `ktlong.attnmap` (what `ktlong inspect attention` measures): a `SelectionRecorder` keeps
each decode step's query and selected blocks, `block_mass` recomputes that step's exact softmax
mass per block from the store's keys, and a block's score is the mass that fell on it *through
the selection* (the blocks a step did not read score nothing for that step). Scores are summed
over layers, query heads and up to `MAX_STEPS` steps spread over the answer; the top blocks inside
the document (past the always-read first `init_len` tokens, the attention sink, and before the
local window, read at every step, unless the document lies wholly inside it) are merged where they
touch and returned with their text, so a user can check what the answer rests on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ktlong.attnmap import StepRecord, block_mass, local_start

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


def block_scores(records: list[StepRecord], keys: Any, scale: float, block_size: int,
                 n_tokens: int) -> np.ndarray:
    """`[nb]` f32: each block's attention mass through the selection, summed over the recorded
    layers, query heads and up to MAX_STEPS decode steps; `keys(layer, a, b)` gives K
    `[Hkv, b - a, d]` of tokens [a, b)."""
    nb = -(-n_tokens // block_size)
    by_layer: dict[int, list[StepRecord]] = {}
    for r in records:
        by_layer.setdefault(r.layer, []).append(r)
    score = np.zeros(nb, np.float64)
    for layer, recs in by_layer.items():
        recs = _sample(recs, MAX_STEPS)
        q = np.stack([r.q for r in recs])  # [T, Hq, d]
        n = np.array([r.n_tokens for r in recs])
        mass = block_mass(q, n, lambda a, b, layer=layer: keys(layer, a, b), scale,
                          block_size)  # [T, Hq, nb_t]
        T, Hq, nbt = mass.shape
        for t, r in enumerate(recs):
            S = r.blocks.shape[0]  # 1 (SHARED) or Hkv (SEPARATE) rows of blocks
            read = np.zeros((S, nbt), bool)
            for row in range(S):
                b = r.blocks[row]
                read[row, b[b < nbt]] = True
            per_head = read[np.arange(Hq) * S // Hq]  # [Hq, nbt]
            score[: min(nb, nbt)] += (mass[t] * per_head).sum(0)[:nb]
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

    score = block_scores(records, keys, scale, bs, n_tokens)
    total = float(score.sum())
    lo = max(doc[0], session.settings.init_len)
    first, last = -(-lo // bs), -(-doc[1] // bs)  # whole blocks past the sink, in the document
    if total <= 0 or first >= last:
        return []
    cand = np.arange(first, last)
    # the selection's own picks: blocks before the local window (read at every step), unless
    # the whole document lies in the window
    local0 = local_start(min(r.n_tokens for r in records), session.settings)
    picked = cand[(cand < local0) & (score[cand] > 0)]
    if picked.size:
        cand = picked
    best = sorted(cand[np.argsort(-score[cand], kind="stable")[:k]].tolist())
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
        out.append(Passage(a - doc[0], b - doc[0], round(float(score[run].sum()) / total, 4),
                           text))
    return sorted(out, key=lambda p: -p.share)
