"""Recall for a LOCRET document: before each question, the passages holding its rarest words.

A LOCRET read keeps a fixed budget of the document's KV; what it dropped is gone from the KV but
not from the token ids (4 bytes a token, kept anyway). `passages` cuts the document into
STRIDE-token segments and scores each window of two segments by the question's distinct tokens
it holds, each weighted by its inverse segment frequency (log(segments / segments holding it);
a token in more than an eighth of them not at all). The best windows, widened by `side` tokens
either side (the fact with its own neighbours: what a small model reads well), are re-read in
document order right before the question, as /read attachments are, up to `budget` tokens.
The KV grows by at most that for the turn, however long the document.

It finds what shares a rare word with the question; a question that shares none with its answer
is read through the kept budget alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

STRIDE = 16  # tokens per segment; a window is two segments
COMMON = 8  # a token in more than 1/COMMON of the segments is a common word: it does not count
SIDE = 64  # tokens re-read either side of a window


def passages(doc: Sequence[int], question: Sequence[int], budget: int,
             side: int = SIDE, skip: int = 0) -> list[tuple[int, int]]:
    """Spans `(start, end)` of `doc` (token ids) to re-read before `question` (token ids), in
    document order, at most `budget` tokens in all; none when no window holds a question token
    that is not one of the document's common words. The first `skip` tokens (the template's
    head) are never chosen."""
    d = np.asarray(doc, np.int64)
    n = d.size
    q = np.unique(np.asarray(question, np.int64))
    if budget <= 0 or n <= skip or q.size == 0:
        return []
    seg = np.arange(n) // STRIDE  # [n] each token's segment
    n_seg = int(seg[-1]) + 1
    score = np.zeros(n_seg)  # [segments] score of the window starting at each segment
    for t in q:
        at = np.flatnonzero(d[skip:] == t) + skip
        if at.size == 0:
            continue
        held = np.zeros(n_seg, bool)
        held[seg[at]] = True
        w = np.log(n_seg / held.sum())
        if w < np.log(COMMON):
            continue
        score += w * (held | np.r_[held[1:], False])  # in the window's first or second segment
    spans: list[tuple[int, int]] = []
    used = 0
    for s in np.argsort(-score, kind="stable"):
        if score[s] <= 0:
            break
        a = max(skip, int(s) * STRIDE - side)
        z = min(n, (int(s) + 2) * STRIDE + side)
        if any(a < y and x < z for x, y in spans):
            continue  # overlaps a better window's passage
        if used + z - a > budget:
            break
        spans.append((a, z))
        used += z - a
    return sorted(spans)


def prefix(tokenizer: Any, doc: Sequence[int], question: str, budget: int,
           skip: int = 0) -> tuple[str, int]:
    """The text to put before `question`: the `passages` of `doc` (its token ids; the first
    `skip` the template's head), each followed by the conversation's separator; and how many
    there are (("", 0) for none)."""
    from ktlong.conversation import SEP

    q = tokenizer(question, add_special_tokens=False)["input_ids"]
    spans = passages(doc, q, budget, skip=skip)
    return "".join(tokenizer.decode([int(t) for t in doc[a:z]]) + SEP for a, z in spans), \
        len(spans)
