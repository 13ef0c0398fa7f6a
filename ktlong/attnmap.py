"""How much of the exact attention the block selection keeps: recall, overlap and the block map.

`SelectionRecorder` wraps a session's `policy.commit` and keeps what every decode step asked for
(layer, query, context length) and got (blocks). `analyse` then recomputes each step's exact
softmax attention over the whole context in NumPy from the store's keys and measures:
- recall: the share of the attention mass (per query head, averaged over heads) that falls in the
  blocks the policy selected;
- overlap: Jaccard of consecutive steps' chosen blocks (init and local window left out), and the
  recall the previous step's blocks would have had (what `token_step` reuse would keep);
- a map of which context blocks each layer read, with init and local-window blocks told apart.
Plain functions returning dataclasses; nothing here draws on a terminal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ktlong.config import Settings

# block kinds in BlockMap.kind
UNREAD_OR_SELECTED, INIT, LOCAL = 0, 1, 2
TOKEN_CHUNK = 1 << 15  # tokens of K read from the store at once (a multiple of any block size)


@dataclass
class StepRecord:
    """One committed step of the policy: one layer at one decode step."""

    layer: int
    n_tokens: int  # context length including the token being decoded
    q: np.ndarray  # [Hq, d] float32, post-RoPE
    blocks: np.ndarray  # [S, n] int32, ascending


class SelectionRecorder:
    """Context manager: record every step a session's policy commits (the router commits one per
    layer per decoded token; `policy.select` commits too)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.records: list[StepRecord] = []

    def __enter__(self) -> SelectionRecorder:
        inner = self.policy.commit  # the bound method

        def commit(step: Any, chosen: np.ndarray | None = None) -> Any:
            step = inner(step, chosen)
            self.records.append(StepRecord(step.layer, step.n_tokens,
                                           np.array(step.q, np.float32, copy=True), step.blocks()))
            return step

        self.policy.commit = commit  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        del self.policy.commit


@dataclass
class LayerStats:
    layer: int
    recall: float  # mean over steps of the head-averaged recall
    recall_min: float  # worst step
    recall_per_step: list[float]
    overlap: float  # mean Jaccard of consecutive chosen-block sets (1.0 with one step)
    reuse_recall: float  # mean recall had the previous step's blocks been reused (token_step 2)
    blocks_read: float  # mean blocks read per step
    blocks_total: float  # mean context blocks per step
    dense: bool  # every step read every block


@dataclass
class BlockMap:
    """Which context blocks each layer read over the observed steps."""

    block_size: int
    n_blocks: int  # context blocks at the last step
    doc_blocks: int  # blocks holding document tokens (the rest: question and answer)
    kind: np.ndarray  # [n_blocks] int8: INIT, LOCAL (in the window at some step) or 0
    share: np.ndarray  # [n_layers, n_blocks] f32: share of (steps x selection rows) reading it


@dataclass
class AttentionReport:
    layers: list[LayerStats]
    map: BlockMap
    mean_recall: float
    worst_layer: int
    steps: int  # decode steps observed
    advice: str = ""  # the summary in words
    info: dict[str, Any] = field(default_factory=dict)  # model, tokens, settings, answer text

    def to_dict(self) -> dict[str, Any]:
        kinds = "".join(".IL"[k] for k in self.map.kind.tolist())
        return {**self.info, "steps": self.steps, "mean_recall": self.mean_recall,
                "worst_layer": self.worst_layer, "summary": self.advice,
                "layers": [vars(s) for s in self.layers],
                "map": {"block_size": self.map.block_size, "n_blocks": self.map.n_blocks,
                        "doc_blocks": self.map.doc_blocks,
                        "kind": kinds,  # per block: I init, L local window, . other
                        "share": np.round(self.map.share, 3).tolist()}}


# --- exact attention per block ------------------------------------------------------------------

def block_mass(q: np.ndarray, n_tokens: np.ndarray, keys: Any, scale: float,
               block_size: int) -> np.ndarray:
    """Exact softmax attention mass per block: `[T, Hq, nb]` f32, each `[t, h]` row sums to 1.

    q `[T, Hq, d]` are T queries of one layer, query t attending tokens `[0, n_tokens[t])`;
    `keys(a, b)` returns K of tokens [a, b) as `[Hkv, b - a, d]` float32 (read in chunks, so a
    1M-token layer is never copied whole). Query head h reads KV head `h // (Hq // Hkv)`.
    """
    T, Hq, d = q.shape
    n_max = int(n_tokens.max())
    nb = -(-n_max // block_size)
    blse = np.full((T, Hq, nb), -np.inf, np.float32)  # log-sum-exp of scores within each block
    chunk = max(block_size, TOKEN_CHUNK // block_size * block_size)
    for t0 in range(0, n_max, chunk):
        t1 = min(n_max, t0 + chunk)
        k = np.asarray(keys(t0, t1), np.float32)  # [Hkv, c, d]
        Hkv, c = k.shape[0], t1 - t0
        qg = q.reshape(T, Hkv, Hq // Hkv, d)
        s = np.einsum("tkgd,kcd->tkgc", qg, k, optimize=True).reshape(T, Hq, c) * scale
        pos = np.arange(t0, t1)
        s = np.where(pos[None, None, :] < n_tokens[:, None, None], s, -np.inf)  # per query length
        cb = -(-c // block_size)
        pad = cb * block_size - c
        if pad:
            s = np.concatenate([s, np.full((T, Hq, pad), -np.inf, np.float32)], axis=2)
        s = s.reshape(T, Hq, cb, block_size)
        m = s.max(-1)  # [T, Hq, cb]
        m_safe = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            blse[:, :, t0 // block_size:t0 // block_size + cb] = (
                np.log(np.exp(s - m_safe[..., None]).sum(-1)) + m_safe)
    top = blse.max(-1, keepdims=True)
    p = np.exp(blse - top)
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def recall_of(mass: np.ndarray, blocks: np.ndarray) -> float:
    """Head-averaged share of one step's mass `[Hq, nb]` in `blocks` `[S, n]` (S = 1 or Hkv)."""
    Hq, nb = mass.shape
    S = blocks.shape[0]
    rows = np.zeros((S, nb), bool)
    for r in range(S):
        rows[r, blocks[r][blocks[r] < nb]] = True
    per_head = rows[np.arange(Hq) * S // Hq]  # [Hq, nb]: head h reads row h // (Hq // S)
    return float((mass * per_head).sum(-1).mean())


def _jaccard(a: set[int], b: set[int]) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def local_start(n_tokens: int, s: Settings) -> int:
    """First block of the local window at a context of `n_tokens` (as the policy computes it)."""
    return max(0, n_tokens - s.local_windows_len) // s.block_size


def _chosen(blocks: np.ndarray, n_init: int, local0: int) -> list[set[int]]:
    return [{b for b in row.tolist() if n_init <= b < local0} for row in blocks]


# --- the analysis -------------------------------------------------------------------------------

def layer_stats(layer: int, recs: list[StepRecord], mass: np.ndarray,
                s: Settings) -> LayerStats:
    """Recall, overlap and reuse for one layer's steps (in decode order); `mass` `[T, Hq, nb]`."""
    n_init = s.init_len // s.block_size
    recalls, overlaps, reuse, read, total = [], [], [], [], []
    dense = True
    for t, r in enumerate(recs):
        nb = -(-r.n_tokens // s.block_size)
        m = mass[t, :, :nb]
        recalls.append(recall_of(m, r.blocks))
        read.append(r.blocks.shape[1])
        total.append(nb)
        dense &= r.blocks.shape[1] == nb
        if t == 0:
            continue
        prev = recs[t - 1]
        local0 = local_start(r.n_tokens, s)
        now, before = _chosen(r.blocks, n_init, local0), _chosen(prev.blocks, n_init, local0)
        overlaps.append(float(np.mean([_jaccard(a, b) for a, b in zip(now, before, strict=True)])))
        # reusing the previous selection keeps its blocks and adds the blocks made since
        prev_nb = -(-prev.n_tokens // s.block_size)
        grown = np.arange(prev_nb - 1, nb, dtype=np.int32)
        rows = [np.union1d(row, grown) for row in prev.blocks]
        width = max(len(x) for x in rows)
        padded = np.stack([np.pad(x, (0, width - len(x)), constant_values=x[-1]) for x in rows])
        reuse.append(recall_of(m, padded))
    return LayerStats(layer=layer, recall=float(np.mean(recalls)), recall_min=float(min(recalls)),
                      recall_per_step=recalls,
                      overlap=float(np.mean(overlaps)) if overlaps else 1.0,
                      reuse_recall=float(np.mean(reuse)) if reuse else float(np.mean(recalls)),
                      blocks_read=float(np.mean(read)), blocks_total=float(np.mean(total)),
                      dense=bool(dense))


def block_map(by_layer: dict[int, list[StepRecord]], n_layers: int, s: Settings,
              doc_tokens: int) -> BlockMap:
    """Per layer and context block: share of steps (x selection rows) that read it."""
    bs = s.block_size
    n_last = max(r.n_tokens for recs in by_layer.values() for r in recs)
    n_first = min(r.n_tokens for recs in by_layer.values() for r in recs)
    nb = -(-n_last // bs)
    kind = np.zeros(nb, np.int8)
    kind[local_start(n_first, s):] = LOCAL
    kind[: min(s.init_len // bs, nb)] = INIT
    share = np.zeros((n_layers, nb), np.float32)
    for layer, recs in by_layer.items():
        rows = 0
        for r in recs:
            for row in r.blocks:
                share[layer, row] += 1
                rows += 1
        share[layer] /= max(rows, 1)
    return BlockMap(block_size=bs, n_blocks=nb, doc_blocks=-(-doc_tokens // bs), kind=kind,
                    share=share)


def analyse(records: list[StepRecord], store: Any, s: Settings, scale: float,
            doc_tokens: int) -> AttentionReport:
    """Recall, overlap and the block map from recorded decode steps and the store's keys."""
    if not records:
        raise ValueError("no decode step was recorded")
    by_layer: dict[int, list[StepRecord]] = {}
    for r in records:
        by_layer.setdefault(r.layer, []).append(r)
    stats = []
    for layer in sorted(by_layer):
        recs = by_layer[layer]
        q = np.stack([r.q for r in recs])  # [T, Hq, d]
        n = np.array([r.n_tokens for r in recs])

        def keys(a: int, b: int, layer: int = layer) -> np.ndarray:
            return store.token_range(layer, a, b)[0].numpy()

        mass = block_mass(q, n, keys, scale, s.block_size)
        stats.append(layer_stats(layer, recs, mass, s))
    worst = min(stats, key=lambda x: x.recall)
    mean = float(np.mean([x.recall for x in stats]))
    bmap = block_map(by_layer, store.shape.n_layers, s, doc_tokens)
    report = AttentionReport(layers=stats, map=bmap, mean_recall=mean, worst_layer=worst.layer,
                             steps=len(by_layer[worst.layer]))
    report.advice = advise(report, s)
    return report


def advise(r: AttentionReport, s: Settings) -> str:
    """One or two sentences: does the profile keep the attention, and what to change if not."""
    worst = next(x for x in r.layers if x.layer == r.worst_layer)
    head = (f"mean recall {r.mean_recall:.1%} over {len(r.layers)} layers x {r.steps} tokens, "
            f"worst layer {worst.layer} ({worst.recall:.1%})")
    if all(x.dense for x in r.layers):
        return head + ": every step read every block, so attention is exact."
    tips = []
    good = r.mean_recall >= 0.95 and worst.recall >= 0.85
    if not good:
        # early layers attend broadly: reading them densely is the usual fix (KTransformers)
        early = [x for x in r.layers if x.layer < max(1, len(r.layers) // 4) and not x.dense]
        rest = [x.recall for x in r.layers if x not in early and not x.dense]
        bad_early = [x for x in early if rest and x.recall < float(np.mean(rest)) - 0.1]
        if bad_early:
            n = max(x.layer for x in bad_early) + 1
            tips.append(f"set dense_layer_num to {n} (layer{'s 0-' if n > 1 else ' '}"
                        f"{n - 1} read{'' if n > 1 else 's'} poorly)")
        if s.preselect_block:
            tips.append(f"raise preselect_block_count (now {s.preselect_block_count}) or turn "
                        "preselect_block off")
        tips.append(f"raise second_select_num (now {s.second_select_num}, try "
                    f"{max(2 * s.second_select_num, 8)})")
    overlap = float(np.mean([x.overlap for x in r.layers]))
    loss = float(np.mean([x.recall - x.reuse_recall for x in r.layers]))
    if s.token_step > 1 and overlap < 0.7:
        tips.append(f"lower token_step (now {s.token_step}): consecutive selections share only "
                    f"{overlap:.0%} of their blocks")
    elif s.token_step == 1 and r.steps > 1 and good and loss < 0.02:
        tips.append(f"token_step 2 would cost about {max(loss, 0):.1%} recall, if decode speed "
                    "matters more")
    verdict = ("the profile keeps the attention" if good else
               "the profile keeps most of the attention" if r.mean_recall >= 0.8 else
               "the selection misses much of the attention")
    return f"{head}: {verdict}" + ("; " + "; ".join(tips) if tips else "") + "."
