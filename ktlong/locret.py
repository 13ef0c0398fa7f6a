"""Locret: retaining heads score each token's KV, and a prefill keeps only a fixed budget of it.

A retaining head is a small FFN per layer, `score = silu(x W1) W2`, on one token's features
`x = [q, k, v]` (every query head, every KV head; q and k turned back to position 0, so the
score carries no position; `features`). It predicts the token's causal importance per KV head:
the largest scaled logit `q.k / sqrt(d)` any later query of the same GQA group gives it
(`cis_labels`; trained by `ktlong.trainheads`).

`Evictor` runs inside a LOCRET prefill: after each chunk of the document goes through a layer,
the chunk's rows are scored (by the heads, or by a baseline: the chunk's own last queries as
H2O/SnapKV do, or recency as StreamingLLM does), the last `locret_stabilisers` rows are kept
whatever their score, and each KV head keeps its `locret_budget` best rows. SURPRISE needs the
chunk's last layer first: every layer keeps the chunk's rows until the model's next-token
log-probabilities rank the chunk's tokens (one ranking for every layer and head: a line scores
the mean of its TOP largest surprisals), then each layer keeps its budget. The kept rows are
rewritten in document order at positions 0..budget-1 (keys re-rotated from a float32 copy turned
back to position 0, so no rounding accumulates), so every distance a query reads stays within
budget + chunk: a model reads a document of any length without a distance it was not trained on,
and the KV held stays budget + chunk rows per layer, however long the document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ktlong.errors import KtlongError

HEADS_FORMAT = 1
HIDDEN = 64  # a head's hidden width
OBSERVE = 32  # ATTENTION: the chunk's last queries that score the rows
SEGMENT = 64  # SURPRISE: longest run of tokens scored as one (a line is shorter)
TOP = 3  # SURPRISE: a line's score is the mean of its TOP largest surprisals (/ TOP if shorter)
LOGIT_ROWS = 64  # SURPRISE: rows of the output head computed at a time (64 x vocab floats)


# --- RoPE: keys to position 0 and back ----------------------------------------------------------
def rotate(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x `[H, n, d]` rotated by `positions` `[n]` (negative: turned back); a float32 copy
    (ktlong.shift's rotation, one angle per token)."""
    from ktlong.shift import rerotate, rotation

    return rerotate(x.float().clone(), *rotation(inv_freq, positions))


def turned_back(x: torch.Tensor, inv_freq: torch.Tensor | None, pos0: int) -> torch.Tensor:
    """x `[H, n, d]` post-RoPE of tokens at pos0.. turned back to position 0 (float32 copy)."""
    if inv_freq is None:
        return x.float().clone()
    return rotate(x, inv_freq, -torch.arange(pos0, pos0 + x.shape[1], dtype=torch.float64))


# --- features and labels ----------------------------------------------------------------------
def features(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int,
             inv_freq: torch.Tensor | None) -> torch.Tensor:
    """q `[Hq, n, d]`, k, v `[Hkv, n, d]` post-RoPE of tokens at pos0.. -> `[n, F]` float32,
    F = (Hq + 2 Hkv) d: q and k turned back to position 0, each part scaled to unit RMS."""
    return _feature_rows(turned_back(q, inv_freq, pos0), turned_back(k, inv_freq, pos0), v)


def _feature_rows(q0: torch.Tensor, k0: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`features` of q and k already turned back to position 0."""
    parts = []
    for t in (q0, k0, v):
        t = t.float().transpose(0, 1).reshape(q0.shape[1], -1)  # [n, H d]
        parts.append(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))
    return torch.cat(parts, -1)


def cis_labels(q: torch.Tensor, k: torch.Tensor, n_prompt: int, scale: float) -> torch.Tensor:
    """Causal importance of the prompt's KV: q `[Hq, n, d]`, k `[Hkv, n, d]` post-RoPE over
    prompt + answer -> `[Hkv, n_prompt]`, the largest `scale * q.k` that an answer query
    (positions n_prompt..n-1) of the KV head's group gives each prompt token."""
    hq, hkv = q.shape[0], k.shape[0]
    qa = q[:, n_prompt:].float().reshape(hkv, hq // hkv * (q.shape[1] - n_prompt), -1)
    logits = torch.einsum("gad,gkd->gak", qa, k[:, :n_prompt].float()) * scale
    return logits.amax(1)  # [Hkv, n_prompt]


# --- the heads ----------------------------------------------------------------------------------
class RetainingHeads(torch.nn.Module):
    """One FFN per layer: features `[n, F]` -> scores `[n, Hkv]`."""

    def __init__(self, n_layers: int, n_in: int, n_kv_heads: int, hidden: int = HIDDEN,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(n_layers, n_in, hidden, generator=g)
                                     * n_in ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(n_layers, hidden, n_kv_heads, generator=g)
                                     * hidden ** -0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(n_layers, n_kv_heads))

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x @ self.w1[layer]) @ self.w2[layer] + self.b2[layer]


def head_loss(pred: torch.Tensor, label: torch.Tensor, alpha: float) -> torch.Tensor:
    """Smooth-L1 to the labels plus `alpha` x the squared step between neighbours' scores
    (pred, label `[n, Hkv]`)."""
    fit = torch.nn.functional.smooth_l1_loss(pred, label)
    return fit + alpha * (pred[1:] - pred[:-1]).pow(2).mean()


# --- the heads file -----------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadsMeta:
    fingerprint: str  # the model's (ModelSpec.fingerprint)
    model: str  # its name, for messages
    n_layers: int
    n_in: int
    n_kv_heads: int
    hidden: int
    steps: int = 0
    examples: int = 0


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_heads(path: Path, heads: RetainingHeads, meta: HeadsMeta) -> None:
    """Write the heads (float16) with the model's identity and a checksum, atomically."""
    from safetensors.torch import save_file

    tensors = {n: p.detach().to(torch.float16).contiguous() for n, p in heads.named_parameters()}
    info = {k: str(v) for k, v in meta.__dict__.items()}
    info.update(format=str(HEADS_FORMAT), sha256=_digest(tensors))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=info)
    tmp.replace(path)


def load_heads(path: Path, spec: Any) -> tuple[RetainingHeads, HeadsMeta]:
    """The heads in `path` for the model `spec`; one clear line if they are damaged or were
    trained for another model."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            info = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise KtlongError(f"{path}: not a retaining-heads file ({e})",
                          hint="train them again with `ktlong train-heads`") from None
    if info.get("format") != str(HEADS_FORMAT) or info.get("sha256") != _digest(tensors):
        raise KtlongError(f"{path}: the retaining heads are damaged (checksum mismatch)",
                          hint="train them again with `ktlong train-heads`")
    meta = HeadsMeta(info["fingerprint"], info["model"], *(int(info[k]) for k in (
        "n_layers", "n_in", "n_kv_heads", "hidden", "steps", "examples")))
    if meta.fingerprint != spec.fingerprint:
        raise KtlongError(f"{path}: these retaining heads were trained for {meta.model}, "
                          f"not for {Path(spec.path).name}",
                          hint=f"run `ktlong train-heads --model {spec.path}`")
    heads = RetainingHeads(meta.n_layers, meta.n_in, meta.n_kv_heads, meta.hidden)
    with torch.no_grad():
        for n, p in heads.named_parameters():
            p.copy_(tensors[n].float())
    return heads.eval(), meta


def heads_dir() -> Path:
    from ktlong.config import ktlong_home

    return ktlong_home() / "heads"


def heads_path(spec: Any) -> Path:
    """Where `ktlong train-heads` saves a model's heads (next to the config)."""
    return heads_dir() / f"{spec.fingerprint[:16]}.safetensors"


def shipped_path(spec: Any) -> Path:
    return Path(__file__).parent / "heads" / f"{spec.fingerprint[:16]}.safetensors"


def find_heads(spec: Any, settings: Any) -> Path:
    """The heads file a LOCRET session uses: `locret_heads`, else the user's, else shipped."""
    if settings.locret_heads:
        p = Path(settings.locret_heads).expanduser()
        if not p.is_file():
            raise KtlongError(f"locret_heads: no file {p}",
                              hint="point it at a file `ktlong train-heads` wrote")
        return p
    for p in (heads_path(spec), shipped_path(spec)):
        if p.is_file():
            return p
    raise KtlongError(f"no retaining heads for {Path(spec.path).name} (attention LOCRET "
                      "scores the KV with them)",
                      hint=f"run `ktlong train-heads --model {spec.path}` first")


def chunk_len(settings: Any) -> int:
    """A LOCRET prefill's chunk: the CPU's on every device, so the kept tokens do not depend
    on where the model runs."""
    from ktlong.config import CHUNK_AUTO

    return settings.chunk_size or CHUNK_AUTO[False]


# --- eviction during a prefill ------------------------------------------------------------------
class Evictor:
    """Keeps each layer's KV to `locret_budget` rows during a document's prefill (see the module
    docstring). Per store layer: `k0` `[Hkv, m, d]` the kept keys turned back to position 0
    (float32), `scores` `[Hkv, m]` their scores; the store holds the same m rows."""

    def __init__(self, settings: Any, inv_freq: torch.Tensor | None,
                 heads: RetainingHeads | None, n_layers: int,
                 breaks: np.ndarray | None = None) -> None:
        self.budget, self.stab = settings.locret_budget, settings.locret_stabilisers
        self.scorer, self.init_len = settings.locret_scores, settings.init_len
        self.inv_freq, self.heads = inv_freq, heads
        self.deferred = self.scorer == "SURPRISE"  # evicts after the chunk's last layer
        self.breaks = breaks  # SURPRISE: [vocab] bool, the tokens that end a line
        self.active = False  # set by the session while a document is read
        self.k0: list[torch.Tensor | None] = [None] * n_layers
        self.scores: list[torch.Tensor | None] = [None] * n_layers
        self.index: list[torch.Tensor | None] = [None] * n_layers  # [Hkv, m] the rows' tokens
        self.reset()

    def reset(self) -> None:
        n = len(self.k0)
        self.k0, self.scores, self.index = [None] * n, [None] * n, [None] * n
        self.evicted = 0  # rows dropped per layer and head since reset()
        self.read = 0  # SURPRISE: the document's tokens ranked so far
        self.next_lp: torch.Tensor | None = None  # [vocab] log-probs of the token after them
        self.seg_start = 0  # the open segment's first token
        self.seg_top = np.zeros(0)  # its TOP largest surprisals so far, ascending

    def _score(self, slot: int, q: torch.Tensor, k0: torch.Tensor, v: torch.Tensor,
               start: int, scale: float, store: Any) -> torch.Tensor:
        """Scores `[Hkv, C]` of the chunk's rows (k0: its keys turned back to position 0);
        ATTENTION also raises the kept rows' scores."""
        hkv, n = k0.shape[0], k0.shape[1]
        if self.scorer == "HEADS":
            with torch.no_grad():
                q0 = turned_back(q.cpu(), self.inv_freq, start)
                return self.heads(slot, _feature_rows(q0, k0, v.cpu())).T.float()  # [Hkv, C]
        if self.scorer == "RECENT":  # newer rows score higher; the document's first rows stay
            s = torch.arange(start, start + n, dtype=torch.float32).expand(hkv, n).clone()
            s[:, : max(0, self.init_len - start)] = float("inf")
            return s
        # ATTENTION: the chunk's last queries' largest logit to every row (kept and new)
        w = min(OBSERVE, n)
        kk, _ = store.token_range(slot, 0, start + n)  # [Hkv, m + C, d]
        qo = q[:, -w:].float().cpu().reshape(hkv, -1, w, q.shape[-1])  # [Hkv, g, W, d]
        logit = torch.einsum("hgwd,hkd->hgwk", qo, kk) * scale
        qpos = torch.arange(start + n - w, start + n)
        logit.masked_fill_(torch.arange(start + n)[None] > qpos[:, None], float("-inf"))
        s = logit.amax((1, 2))  # [Hkv, m + C]
        old = self.scores[slot]
        if old is not None:
            self.scores[slot] = torch.maximum(old, s[:, :start])
        return s[:, start:]

    def after_chunk(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    start: int, scale: float, store: Any) -> None:
        """The chunk's k, v `[Hkv, C, d]` (at positions start..) were written to store layer
        `slot` and attended: score them, then keep the budget (SURPRISE: later, `after_layers`)."""
        k0_new = turned_back(k.cpu(), self.inv_freq, start)
        s_new = torch.zeros(k0_new.shape[:2]) if self.deferred \
            else self._score(slot, q, k0_new, v, start, scale, store)
        old_k0, old_s, old_i = self.k0[slot], self.scores[slot], self.index[slot]
        k0 = k0_new if old_k0 is None else torch.cat([old_k0, k0_new], 1)  # [Hkv, M, d]
        s = s_new if old_s is None else torch.cat([old_s, s_new], 1)  # [Hkv, M]
        first = 0 if old_i is None else int(old_i[0, -1]) + 1  # the chunk's first token
        i_new = torch.arange(first, first + k.shape[1]).expand(k.shape[0], -1)
        idx = i_new if old_i is None else torch.cat([old_i, i_new], 1)  # [Hkv, M]
        self.k0[slot], self.scores[slot], self.index[slot] = k0, s, idx
        if not self.deferred:
            self._keep(slot, store)

    def after_layers(self, hidden: torch.Tensor, ids: list[int],
                     head: Callable[[torch.Tensor], torch.Tensor], store: Any) -> None:
        """SURPRISE, after the chunk went through every layer: hidden `[C, hidden]` its last
        layer's rows, ids its C tokens, head(rows) -> logits `[rows, vocab]`. Scores each token
        by its segment's (a line, at most SEGMENT tokens) TOP largest surprisals (the document's
        first init_len tokens are always kept), then every layer keeps its budget."""
        if not self.deferred:
            return
        carried = self.seg_start  # the segment open when the chunk began
        s = self._pooled(self._surprisal(hidden, ids, head), ids)  # [C] the chunk's scores
        first = self.read - len(ids)
        for slot, (sc, idx) in enumerate(zip(self.scores, self.index, strict=True)):
            if sc is None or idx is None:
                continue
            sc[:, -len(ids):] = torch.from_numpy(s).float()
            if carried < first:  # its earlier rows take its score (s[0]) too
                old = (idx >= carried) & (idx < first)
                sc[old] = torch.clamp(sc[old], min=float(s[0]))
            self._keep(slot, store)

    def _surprisal(self, hidden: torch.Tensor, ids: list[int],
                   head: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
        """`[C]` nats, -log p(token | the tokens before it); the document's first token: 0."""
        n, t = len(ids), torch.as_tensor(np.asarray(ids, np.int64))
        out = np.zeros(n, np.float64)
        if self.next_lp is not None:
            out[0] = -float(self.next_lp[t[0]])
        for a in range(0, n, LOGIT_ROWS):
            b = min(n, a + LOGIT_ROWS)
            lp = torch.log_softmax(head(hidden[a:b]).float(), -1).cpu()  # [b - a, vocab]
            nxt = t[a + 1 : b + 1]  # the tokens these rows predict
            out[a + 1 : a + 1 + nxt.numel()] = -lp[torch.arange(nxt.numel()), nxt].double().numpy()
            if b == n:
                self.next_lp = lp[-1].clone()
        self.read += n
        return out

    def _pooled(self, surprise: np.ndarray, ids: list[int]) -> np.ndarray:
        """Each token's score: the sum of its segment's TOP largest surprisals over TOP, the
        open segment carried from chunk to chunk (`seg_start`, `seg_top`; `after_layers` raises
        its earlier rows)."""
        first = self.read - len(ids)
        out = np.empty_like(surprise)
        ends = self.breaks[np.asarray(ids)] if self.breaks is not None \
            else np.zeros(len(ids), bool)
        a = 0
        for i in range(len(ids)):
            tok = first + i
            self.seg_top = np.sort(np.append(self.seg_top, surprise[i]))[-TOP:]
            if ends[i] or tok - self.seg_start + 1 >= SEGMENT or i == len(ids) - 1:
                out[a : i + 1] = self.seg_top.sum() / TOP
                if ends[i] or tok - self.seg_start + 1 >= SEGMENT:  # the segment closes
                    self.seg_start, self.seg_top, a = tok + 1, np.zeros(0), i + 1
        n_init = max(0, min(len(ids), self.init_len - first))
        out[:n_init] = np.inf  # the first tokens: attention sinks and the template's head
        return out

    def _keep(self, slot: int, store: Any) -> None:
        """Keep layer `slot`'s `budget` best rows (the last `stab` whatever their score)."""
        k0, s, idx = self.k0[slot], self.scores[slot], self.index[slot]
        assert k0 is not None and s is not None and idx is not None
        m = k0.shape[1]
        if m <= self.budget:
            return
        pick = s.clone()
        pick[:, max(0, m - self.stab):] = float("inf")  # the stabilisers
        keep = torch.topk(pick, self.budget, dim=1).indices.sort(dim=1).values  # [Hkv, b]
        k0 = torch.gather(k0, 1, keep[..., None].expand(-1, -1, k0.shape[-1]))
        self.k0[slot], self.scores[slot] = k0, torch.gather(s, 1, keep)
        self.index[slot] = torch.gather(idx, 1, keep)
        _, v_rows = store.row_range(slot, 0, m)  # [Hkv, M, row] storage
        v_rows = np.take_along_axis(v_rows, keep.numpy()[..., None], axis=1)
        k_new = k0 if self.inv_freq is None else rotate(
            k0, self.inv_freq, torch.arange(self.budget, dtype=torch.float64))
        store.rewrite(slot, k_new, v_rows)
        self.evicted += m - self.budget


def line_breaks(tokenizer: Any, vocab: int) -> np.ndarray | None:
    """`[vocab]` bool: the tokens that end a line (their text holds a newline); None without a
    tokenizer."""
    if tokenizer is None:
        return None
    texts = tokenizer.batch_decode([[i] for i in range(min(vocab, len(tokenizer)))])
    out = np.zeros(vocab, bool)
    for i, t in enumerate(texts):
        out[i] = "\n" in t
    return out
