"""MInference sparse prefill: each query head reads its document chunk through one pattern.

Patterns (Jiang et al., 2024), per query head:
- `ashape A B`: the first A tokens and the B tokens before each query block (StreamingLLM);
- `vs A B`: A vertical lines (key columns) and B diagonals (query - key offsets), the ones that
  the chunk's last 64 queries weigh most (softmax against every key, summed per column and per
  diagonal); the 30 first columns and 64 nearest diagonals always count;
- `block A`: per query block of 64 tokens the A key blocks whose mean key best matches the
  block's mean query, plus the first block and the block's own.

A plan holds one pattern per (layer, query head): the model's tuned file (`ktlong tune prefill`,
`$KTLONG_HOME/patterns/<model>-<fingerprint>.yaml`, or the `prefill_patterns` path), else every
head `vs prefill_vertical prefill_slash`. The CPU runs `ktlong.kernels.prefill_sparse`; CUDA
runs `attend_chunk_torch` (plain torch over the same index, also what the tests run on the CPU).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ktlong.config import Settings, ktlong_home, reads_patterns, window_reads
from ktlong.errors import KtlongError

KINDS = ("ashape", "vs", "block")
LAST_Q = 64  # queries that estimate the vertical and slash lines
FORCED_COLS, FORCED_DIAGS = 30, 64  # always kept by vs heads (sinks; the local band)
DENSE_BELOW = 4096  # a chunk ending within this many tokens is attended densely (cheaper)


@dataclass(frozen=True)
class HeadPattern:
    kind: str  # ashape | vs | block
    a: int  # ashape: first tokens; vs: vertical lines; block: key blocks per query block
    b: int = 0  # ashape: local tokens; vs: diagonals

    def text(self) -> str:
        return f"{self.kind} {self.a}" + (f" {self.b}" if self.kind != "block" else "")

    def cost(self, n: int) -> float:
        """Keys a query reads on average over a document of n tokens (for the search)."""
        if self.kind == "ashape":
            return min(n / 2, self.a + self.b + 32)
        if self.kind == "vs":
            return min(n / 2, self.a + self.b + 64)
        return min(n / 2, (self.a + 2) * 64)


def parse_head(text: str, where: str) -> HeadPattern:
    parts = str(text).split()
    try:
        kind, nums = parts[0].lower(), [int(x) for x in parts[1:]]
    except (IndexError, ValueError):
        kind, nums = "", []
    want = {"ashape": 2, "vs": 2, "block": 1}.get(kind)
    if want is None or len(nums) != want or min(nums) < 0:
        raise KtlongError(f"{where}: bad head pattern {text!r}",
                          hint="use 'ashape INIT LOCAL', 'vs VERTICAL SLASH' or 'block K'")
    return HeadPattern(kind, *nums)


@dataclass(frozen=True)
class Plan:
    """One pattern per layer and query head; `source` says where it came from."""

    layers: tuple[tuple[HeadPattern, ...], ...]
    source: str

    def fingerprint(self) -> str:
        text = "\n".join(" | ".join(p.text() for p in row) for row in self.layers)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_plan(spec: Any, s: Settings) -> Plan:
    head = HeadPattern("vs", s.prefill_vertical, s.prefill_slash)
    row = (head,) * spec.n_heads
    return Plan((row,) * len(spec.kv_layers),
                f"default (vs {s.prefill_vertical} {s.prefill_slash})")


def tuned_path(spec: Any) -> Path:
    """Where `ktlong tune prefill` writes the model's patterns."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(spec.path).stem or "model")[:48]
    return ktlong_home() / "patterns" / f"{name}-{spec.fingerprint[:12]}.yaml"


def write_plan(path: Path, spec: Any, plan: Plan, header: str) -> None:
    from ktlong.configfile import atomic_write

    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"model: {spec.fingerprint}", f"heads: {spec.n_heads}", "layers:"]
    for row in plan.layers:
        lines.append("  - [" + ", ".join(p.text() for p in row) + "]")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "\n".join(lines) + "\n")


def read_plan(path: Path, spec: Any) -> Plan:
    """A pattern file, checked against the model (its fingerprint and shape)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise KtlongError(f"cannot read the prefill pattern file {path}: {e}",
                          hint="re-run `ktlong tune prefill`, or set prefill_patterns to another "
                               "file") from None
    fix = "re-run `ktlong tune prefill` for this model"
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise KtlongError(f"{path}: expected `model`, `heads` and a `layers` list", hint=fix)
    if data.get("model") != spec.fingerprint:
        raise KtlongError(f"{path} was tuned for another model (fingerprint "
                          f"{str(data.get('model'))[:12]}, this one {spec.fingerprint[:12]})",
                          hint=fix)
    rows = data["layers"]
    if len(rows) != len(spec.kv_layers) or any(not isinstance(r, list) or len(r) != spec.n_heads
                                         for r in rows):
        raise KtlongError(f"{path}: needs {len(spec.kv_layers)} layers of {spec.n_heads} heads",
                          hint=fix)
    layers = tuple(tuple(parse_head(t, f"{path}: layer {li}") for t in row)
                   for li, row in enumerate(rows))
    return Plan(layers, str(path))


def resolve_plan(spec: Any, s: Settings) -> Plan:
    """The plan a MINFERENCE prefill uses: prefill_patterns, else the tuned file, else default."""
    if s.prefill_patterns:
        p = Path(s.prefill_patterns).expanduser()
        if not p.is_file():
            raise KtlongError(f"prefill_patterns file {p} does not exist",
                              hint="make one with `ktlong tune prefill`, or leave it empty")
        return read_plan(p, spec)
    p = tuned_path(spec)
    return read_plan(p, spec) if p.is_file() else default_plan(spec, s)


def auto_reach(spec: Any, s: Settings) -> int:
    """prefill AUTO reads a context up to this long through the patterns, a longer one through
    the window: the model's trained context and a sixteenth (a document of that length, with the
    chat template and a question), or the window's reach where that is longer or the trained
    context unknown (0: always the patterns)."""
    from ktlong.spec import trained_context

    t = trained_context(spec)
    return max(window_reads(s), t + t // 16) if t else window_reads(s)


def prefill_key(spec: Any, s: Settings) -> dict[str, Any]:
    """What of the settings changes the KV a prefill writes (for cache keys): nothing for an
    exact prefill (so older entries stay valid), the window, the patterns, or both (AUTO: which
    one reads a prompt follows from its length and the model, both in the key)."""
    key: dict[str, Any] = {}
    if window_reads(s):
        key = {"prefill_window": s.prefill_window, "init_len": s.init_len,
               "init_positions": s.block_positions}
    if reads_patterns(s):
        key.update(prefill=s.prefill, patterns=resolve_plan(spec, s).fingerprint())
    return key


# --- a chunk's index ----------------------------------------------------------------------------
def _groups(row: tuple[HeadPattern, ...]) -> dict[HeadPattern, np.ndarray]:
    """Heads sharing a pattern (one index builder call each)."""
    out: dict[HeadPattern, list[int]] = {}
    for h, p in enumerate(row):
        out.setdefault(p, []).append(h)
    return {p: np.array(hs) for p, hs in out.items()}


def _topk_forced(x: np.ndarray, k: int, forced: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[:, forced] = np.inf
    from ktlong.kernels.prefill_index import topk_sorted

    return topk_sorted(x, k)


def build_index(row: tuple[HeadPattern, ...], kv: Any, q: np.ndarray, start: int, scale: float,
                pooled: np.ndarray | None) -> Any:
    """The index of a chunk: q [Hq, L, d] float32 at positions start..; kv the layer's
    LayerKV (chunk included); pooled [Hkv, nkb, d] mean keys of 64-token blocks (block heads)."""
    from ktlong.kernels import prefill_index as pi
    from ktlong.kernels import prefill_sparse as ps

    hq, length, d = q.shape
    n, g = start + length, hq // kv.hkv
    heads, parts = [], []
    for p, hs in _groups(row).items():
        if p.kind == "ashape":
            parts.append(pi.ashape_index(len(hs), start, length, p.a, p.b))
        elif p.kind == "vs":
            qw = q[hs, -min(LAST_Q, length):]
            vert, slash = ps.vs_estimate(kv, qw, hs // g, n, scale)
            cols = _topk_forced(vert, p.a, np.arange(min(FORCED_COLS, n)))
            diags = _topk_forced(slash, max(p.b, 1), np.arange(min(FORCED_DIAGS, n)))
            parts.append(pi.vs_index(cols, diags, start, length, pi.LONE_COST))
        else:
            nqb = pi.n_qblocks(length)
            qp = np.zeros((len(hs), nqb * pi.QB, d), np.float32)
            qp[:, :length] = q[hs]
            cnt = np.minimum(pi.QB, length - np.arange(nqb) * pi.QB)  # rows per query block
            qpool = qp.reshape(len(hs), nqb, pi.QB, d).sum(2) / cnt[None, :, None]
            scores = np.einsum("hbd,hkd->hbk", qpool, pooled[hs // g])  # [Hs, nqb, nkb]
            parts.append(pi.block_index(scores.astype(np.float32), start, length, p.a))
        heads.append(hs)
    return pi.pack_index(heads, parts, hq, pi.n_qblocks(length))


class ChunkAttention:
    """Sparse prefill of one forward, layer by layer: the plan, and pooled keys per layer
    (block heads), extended chunk by chunk."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.dense_below = DENSE_BELOW
        self.needs_pool = [any(p.kind == "block" for p in row) for row in plan.layers]
        self.pooled: dict[int, tuple[int, np.ndarray]] = {}  # layer -> (full blocks, [Hkv, nb, d])
        self.index_s = 0.0  # time spent estimating and building indexes
        self.attend_s = 0.0
        # (query, key) pairs computed in register tiles and as lone diagonals; causal dense's
        self.pairs = self.lone_pairs = self.dense_pairs = 0

    def _pooled(self, layer: int, kv: Any, n: int) -> np.ndarray | None:
        from ktlong.kernels import prefill_index as pi
        from ktlong.kernels import prefill_sparse as ps

        if not self.needs_pool[layer]:
            return None
        full, have = self.pooled.get(layer, (0, np.zeros((kv.hkv, 0, kv.d), np.float32)))
        nkb, nfull = -(-n // pi.QB), n // pi.QB
        new = ps.pool_keys(kv, full, nkb, n)  # [Hkv, nkb - full, d], the last maybe partial
        out = np.concatenate([have[:, :full], new], 1)
        self.pooled[layer] = (nfull, out)
        return out

    def count(self, index: Any, start: int, length: int) -> None:
        from ktlong.kernels.prefill_index import index_pairs

        tiled, lone, dense = index_pairs(index, start, length)
        self.pairs += tiled
        self.lone_pairs += lone
        self.dense_pairs += dense

    def attend(self, layer: int, kv: Any, q: np.ndarray, start: int, scale: float) -> np.ndarray:
        """q [Hq, L, d] float32 -> [Hq, L, d] float32 (the CPU kernels)."""
        import time

        from ktlong.kernels import prefill_sparse as ps

        t0 = time.perf_counter()
        index = build_index(self.plan.layers[layer], kv, q, start, scale,
                            self._pooled(layer, kv, start + q.shape[1]))
        t1 = time.perf_counter()
        self.count(index, start, q.shape[1])
        out = ps.sparse_attend(kv, q, start, index, scale)
        self.index_s += t1 - t0
        self.attend_s += time.perf_counter() - t1
        return out


def attend_chunk_torch(q: Any, k: Any, v: Any, start: int, index: Any, scale: float,
                       max_elems: int = 1 << 26) -> Any:
    """The index's attention in plain torch (the CUDA path): q [Hq, L, d], k, v [Hkv, n, d]
    on one device -> [Hq, L, d] float32. Per head, query blocks are batched: each block's keys
    gathered into rows padded to the longest, and each row's lone-diagonal keys beside them;
    masked (padding, causal, a diagonal key the block already holds), softmax, times V."""
    import torch

    from ktlong.kernels import prefill_index as pi

    hq, length, d = q.shape
    g, n = hq // k.shape[0], k.shape[1]
    nqb, QB = pi.n_qblocks(length), pi.QB
    dev = q.device
    out = torch.empty((hq, length, d), dtype=torch.float32, device=dev)
    qpad = torch.zeros((hq, nqb * QB, d), dtype=torch.float32, device=dev)
    qpad[:, :length] = q.float() * scale
    qpos = start + torch.arange(nqb * QB, device=dev).view(nqb, QB)  # [nqb, QB]
    for h in range(hq):
        pos, cnt = pi.index_positions(index, h)  # [nqb, P] int64 (padded), [nqb]
        dg, dcnt = pi.index_diags(index, h)  # [nqb, D] int64 (padded), [nqb]
        lone = bool(dcnt.any())
        pos_t = torch.from_numpy(pos).to(dev)
        valid = torch.arange(pos.shape[1], device=dev)[None] < torch.from_numpy(cnt).to(
            dev)[:, None]  # [nqb, P]
        dg_t = torch.from_numpy(dg).to(dev)
        dvalid = torch.arange(dg.shape[1], device=dev)[None] < torch.from_numpy(dcnt).to(
            dev)[:, None]  # [nqb, D]
        per_block = pos.shape[1] + (QB * dg.shape[1] + n if lone else 0)
        step = max(1, max_elems // max(1, per_block * d))
        kh, vh = k[h // g].float(), v[h // g].float()
        for b0 in range(0, nqb, step):
            b1 = min(nqb, b0 + step)
            nb = b1 - b0
            qb = qpad[h, b0 * QB: b1 * QB].view(nb, QB, d)
            kk, vv = kh[pos_t[b0:b1]], vh[pos_t[b0:b1]]  # [nb, P, d]
            s = torch.bmm(qb, kk.transpose(1, 2))
            ok = valid[b0:b1, None, :] & (pos_t[b0:b1, None, :] <= qpos[b0:b1, :, None])
            s = s.masked_fill(~ok, float("-inf"))
            if lone:
                key = qpos[b0:b1, :, None] - dg_t[b0:b1, None, :]  # [nb, QB, D]
                held = torch.zeros((nb, n + 1), dtype=torch.bool, device=dev)  # block's keys
                held.scatter_(1, torch.where(valid[b0:b1], pos_t[b0:b1], n), True)  # n: padding
                kc = key.clamp(0, n - 1)
                dok = dvalid[b0:b1, None, :] & (key >= 0) & (key < n) & ~held.gather(
                    1, kc.view(nb, -1)).view(kc.shape)
                sd = torch.einsum("bqd,bqkd->bqk", qb, kh[kc])
                s = torch.cat([s, sd.masked_fill(~dok, float("-inf"))], -1)
            p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no visible key -> zeros
            o = torch.bmm(p[..., : kk.shape[1]], vv)
            if lone:
                o = o + torch.einsum("bqk,bqkd->bqd", p[..., kk.shape[1]:], vh[kc])
            o = o.reshape(-1, d)
            e = min(length, b1 * QB) - b0 * QB
            out[h, b0 * QB: b0 * QB + e] = o[:e]
    return out
