"""Compile every Numba kernel a run will use before anything is timed, and keep compile time out
of the timings.

A kernel compiles (2–4 s a signature; tens of seconds for a whole run) the first time it meets a
new signature, and is then loaded from Numba's on-disk cache (`ktlong.kernels.cache_dir()`). So
that the first prefill and the first decode step of a new version (or a new model's weight types)
do not pay it, `warm_up(lm, settings, n_tokens)` runs each kernel once on tiny inputs through the
same code (store, selection policy, attention router, weight modules) the run uses, so the
signatures are the run's own. Warm-up is split into parts (decode attention read whole, the sparse
decode's choice and votes, sparse prefill for the patterns of the plan, GEMV/dequant for one weight
type), and only the parts a context of `n_tokens` uses are run: a short document's first answer
compiles no sparse kernel. The chat warms for its document before reading it; a `Session` warms
for each prefill and answer before it starts (so a context that grows sparse compiles then, not in
the middle of a token). A part warmed once leaves a marker beside the compiled kernels, and a part
without one is announced first ("compiling kernels, once, ~N s").

`compile_seconds()` is the running total of time spent compiling in this process (Numba's
`numba:compile` events); the engine subtracts what accrues during a prefill or a decode from its
stats, so a signature the warm-up missed still never shows up as slow tokens, and
`unwarmed_signatures()` lists what ran outside a warm-up (the tests hold it empty).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba.core import event

Note = Callable[[str], None]

# seconds a cold part takes to compile on a 2-core machine (refined by the measured times, per part
# and per kind, kept in <numba-cache>/warmup-times.json, which outlive a version's cache folder)
ESTIMATE_S = {"decode": 34.0, "sparse": 17.0, "prefill": 27.0, "weights": 4.0}

_lock = threading.RLock()
_done: set[str] = set()  # parts warmed in this process
_warmed: set[tuple[Any, Any]] = set()  # (dispatcher, signature) that appeared inside warm_up


class _CompileClock(event.Listener):
    """Sums the wall time of outermost Numba compilations (nested ones are inside them)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._depth = 0
        self._t0 = 0.0

    def on_start(self, ev: Any) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def on_end(self, ev: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.total += time.perf_counter() - self._t0


_CLOCK = _CompileClock()
event.register("numba:compile", _CLOCK)  # compiles run under Numba's global lock: one at a time


def compile_seconds() -> float:
    """Seconds this process has spent compiling Numba kernels so far."""
    return _CLOCK.total


def unwarmed_signatures() -> dict[str, set[Any]]:
    """Kernel name -> the signatures this process compiled or loaded outside `warm_up`: what
    a warm-up missed (nothing, where every kernel ran first in a warm-up)."""
    out: dict[str, set[Any]] = {}
    for d, sig in _signatures() - _warmed:
        out.setdefault(d.__name__, set()).add(sig)
    return out


def _signatures() -> set[tuple[Any, Any]]:
    return {(d, sig) for d in _dispatchers() for sig in d.signatures}


def compile_stats() -> tuple[int, int]:
    """(signatures loaded from the disk cache, signatures compiled) over every kernel imported."""
    hits = misses = 0
    for d in _dispatchers():
        st = d.stats
        hits += sum(st.cache_hits.values())
        misses += sum(st.cache_misses.values())
    return hits, misses


def _dispatchers() -> Iterator[Any]:
    from numba.core.registry import CPUDispatcher

    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("ktlong.kernels") or mod is None:
            continue
        for obj in vars(mod).values():
            if isinstance(obj, CPUDispatcher) and id(obj) not in seen:
                seen.add(id(obj))
                yield obj


# --- parts ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Part:
    key: str  # names the signatures it compiles (its marker's name)
    kind: str  # decode | prefill | weights (for the estimate)
    run: Callable[[], None]


def _dense_reach(settings: Any) -> int | None:
    """The longest context every layer reads whole under `settings` (the selection policy's
    test, with the smallest budget any layer may get); None: any (a dense profile)."""
    s = settings
    if s.attention in ("DENSE", "LOCRET"):
        return None
    k = s.second_select_num if s.layer_budget == "UNIFORM" else 0
    fixed = s.init_len // s.block_size + s.local_windows_len // s.block_size + 1
    return (fixed + k) * s.block_size


def sparse_at(settings: Any, n_tokens: int) -> bool:
    """Whether a context of n_tokens may be read sparsely under `settings`."""
    reach = _dense_reach(settings)
    return reach is not None and n_tokens > reach


def same_parts_until(settings: Any, n_tokens: int, dense_below: int | None = None) -> int:
    """The longest context that needs no part a context of n_tokens does not (`parts` changes
    only past these lengths): a session warmed for n_tokens need not ask again before it."""
    from ktlong.config import reads_patterns
    from ktlong.minference import DENSE_BELOW

    edges = [_dense_reach(settings)]
    if reads_patterns(settings):
        edges.append(DENSE_BELOW if dense_below is None else dense_below)
    return min((e for e in edges if e is not None and e >= n_tokens), default=1 << 62)


def parts(lm: Any, settings: Any, n_tokens: int | None = None,
          dense_below: int | None = None) -> list[Part]:
    """What `warm_up` would run for this model and settings, in order: for a context of up to
    n_tokens (None: any length); a prefill reads through its patterns past `dense_below` tokens
    (default: ktlong.minference.DENSE_BELOW)."""
    from ktlong.config import reads_patterns
    from ktlong.minference import DENSE_BELOW

    dense_below = DENSE_BELOW if dense_below is None else dense_below

    s = settings
    local = bool(s.gpu_local_window and lm.device.type == "cuda")
    votes = int(s.preselect_block) + 2 * int(s.question_blocks > 0) \
        + 4 * int(s.question_blocks > 0 and s.question_votes == "NEAR")
    out = [Part(f"decode-{s.kv_type}-{s.anchor_type}-local{int(local)}", "decode",
                lambda: _attention(lm, s, None, sparse=False))]
    if n_tokens is None or sparse_at(s, n_tokens):
        out.append(Part(f"sparse-{s.kv_type}-{s.anchor_type}-{s.attention}-pre{votes}"
                        f"-nb{int(s.select_neighbours or s.spread_blocks > 0)}-local{int(local)}",
                        "sparse", lambda: _attention(lm, s, None)))
    if reads_patterns(s) and (n_tokens is None or n_tokens > dense_below):
        from ktlong.minference import resolve_plan

        kinds = sorted({p.kind for row in resolve_plan(lm.spec, s).layers for p in row})
        out.append(Part(f"prefill-{s.kv_type}-{'+'.join(kinds)}-{lm.device.type}", "prefill",
                        lambda: _attention(lm, s, kinds)))
    for key, fn in _weight_parts(lm.model, s.prefill_matmul).items():
        out.append(Part(key, "weights", fn))
    if lm.device.type == "cpu":
        out.append(Part("layer-ops", "weights", _layer_ops))
        if lm.spec.sliding_layers:
            out.append(Part(f"window-{s.kv_type}", "weights", lambda: _window_rows(s.kv_type)))
    return out


def _marker(key: str) -> Path:
    from ktlong import kernels

    return kernels.cache_dir() / "warm" / key


def _times_file() -> Path:
    from ktlong import kernels

    return kernels.cache_dir().parent / "warmup-times.json"


def _estimate(cold: list[Part]) -> float:
    try:
        known = json.loads(_times_file().read_text())
    except (OSError, ValueError):
        known = {}
    return sum(float(known.get(p.key, known.get(p.kind, ESTIMATE_S[p.kind]))) for p in cold)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def warm_up(lm: Any, settings: Any, note: Note | None = None,
            n_tokens: int | None = None, dense_below: int | None = None) -> float:
    """Load or compile every kernel `lm` under `settings` will run over a context of up to
    n_tokens (None: any; once per process and configuration); says so through `note` (default:
    a line on stderr) when some must compile. Returns the seconds spent compiling."""
    with _lock:
        todo = [p for p in parts(lm, settings, n_tokens, dense_below) if p.key not in _done]
        if not todo:
            return 0.0
        from ktlong import kernels

        cold = [p for p in todo if kernels.cache_is_cold(parts=[p.key])]
        if cold:
            (note or _stderr)(f"compiling kernels, once, ~{_estimate(cold):.0f} s "
                              f"(cached in {kernels.cache_dir()})")
        c0, had = compile_seconds(), _signatures()
        for p in todo:
            t0 = compile_seconds()
            p.run()
            _done.add(p.key)
            if p in cold:  # the same Part objects
                _mark(p, compile_seconds() - t0)
        _warmed.update(_signatures() - had)
        return compile_seconds() - c0


def _mark(p: Part, seconds: float) -> None:
    try:
        m = _marker(p.key)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(f"{seconds:.1f}\n")
        if seconds > 1.0:  # a real compile: keep it as the next version's estimate
            f = _times_file()
            try:
                known = json.loads(f.read_text())
            except (OSError, ValueError):
                known = {}
            known[p.key] = known[p.kind] = round(seconds, 1)
            tmp = f.with_name(f"{f.name}.{os.getpid()}")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, f)
    except OSError:
        pass  # an unwritable cache: the next run says it compiles again


def work_clock() -> float:
    """`time.perf_counter()` less the compile time so far: intervals on it leave compiling out
    (for benchmarks that time with their own stamps)."""
    return time.perf_counter() - compile_seconds()


# --- weights -------------------------------------------------------------------------------------
def _weight_parts(model: Any, prefill_matmul: str) -> dict[str, Callable[[], None]]:
    """One warm-up per distinct weight kernel signature: decode GEMV (one row), prefill tiles
    (two rows, dequantised to the precisions `prefill_matmul` multiplies in on this CPU) and
    embedding rows, on the first two rows of a real tensor of each type."""
    from ktlong.weights import (
        GatedMLP,
        HalfLinear,
        QuantEmbedding,
        QuantLinear,
        _int8_linear,
        bf16_prefill,
    )

    widths = [m.in_features if isinstance(m, (HalfLinear, QuantLinear)) else
              m.down_proj.out_features for m in model.modules()
              if isinstance(m, (HalfLinear, QuantLinear, GatedMLP))]  # as set_prefill_matmul
    tiles = tuple(sorted({torch.bfloat16 if bf16_prefill(w, prefill_matmul) else torch.float32
                          for w in widths}, key=str))
    mm = "+".join(str(t).removeprefix("torch.") for t in tiles)
    out: dict[str, Callable[[], None]] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            k = mod.in_features
            int8 = _int8_linear(mod, prefill_matmul)  # prefill in the int8 GEMM
            out.setdefault(f"weights-{mod.qt.name}-k{k % 256 == 0:d}{k % 64 == 0:d}-{mm}"
                           + ("-int8" if int8 else ""),
                           lambda m=mod, i=int8: _quant_linear(m, tiles, i))
        elif isinstance(mod, QuantEmbedding):
            out.setdefault(f"weights-emb-{mod.table.qt.name}", lambda m=mod: _quant_embedding(m))
        elif isinstance(mod, HalfLinear):
            out.setdefault(f"weights-{str(mod.half).removeprefix('torch.')}",
                           lambda m=mod: _half_linear(m))
        elif type(mod) is torch.nn.Linear and mod.weight.dtype == torch.float32:
            out.setdefault("weights-float32", _f32_linear)  # the CPU decoder's GEMV of it
    return out


def _f32_linear() -> None:
    from ktlong import kernels

    kernels.gemv(np.zeros((2, 8), np.float32), np.zeros(8, np.float32), 0)


def _quant_linear(mod: Any, tiles: tuple[torch.dtype, ...], int8: bool = False) -> None:
    from ktlong.weights import QuantLinear

    small = QuantLinear(mod.raw[:2], mod.qt.name, mod.in_features)
    with torch.inference_mode():
        small(torch.zeros(1, mod.in_features))  # decode: (q)gemv
        for dt in tiles:  # prefill: tiles dequantised to float32 or bf16
            small.mm_dtype = dt
            small(torch.zeros(2, mod.in_features))
        if int8:  # prefill: the int8 GEMM (rounding x, the tile products)
            small.int8 = True
            small(torch.zeros(2, mod.in_features))


def _quant_embedding(mod: Any) -> None:
    from ktlong.weights import QuantEmbedding, QuantLinear

    t = mod.table
    small = QuantLinear(t.raw[:2], t.qt.name, t.in_features)
    with torch.inference_mode():
        QuantEmbedding(small, torch.float32)(torch.zeros(2, dtype=torch.long))


def _half_linear(mod: Any) -> None:
    from ktlong.weights import HalfLinear

    small = HalfLinear(mod.bits[:2], None, mod.half)
    with torch.inference_mode():
        small(torch.zeros(1, mod.in_features))


def _layer_ops() -> None:
    """The decode step's own small kernels (ktlong.decoder): norms of a vector and of heads,
    RoPE, the gated activation."""
    import numpy as np

    from ktlong import kernels

    x, w = np.ones(8, np.float32), np.ones(8, np.float32)
    kernels.rmsnorm(x, w, 1e-6, False, np.empty_like(x))
    x2 = np.ones((2, 8), np.float32)
    kernels.rmsnorm(x2, w, 1e-6, True, x2)
    kernels.rope(x2, w, w)
    kernels.qk_rope(x2, x2, w, w, 1e-6, 1e-6, True, w, w)
    kernels.add_norm(x, x.copy(), w, 1e-6, w, 1e-6, True, np.empty_like(x))
    kernels.gated(x, w, False)


def _window_rows(kv_type: str) -> None:
    """Attention over a sliding window's rows (ktlong.slidingkv), in the rows' format."""
    from ktlong import kernels
    from ktlong.slidingkv import window_kind

    kind = window_kind(kv_type)
    rows = np.zeros((1, 4, 8), np.uint16 if kind else np.float32)  # [Hkv, cap, d]
    kernels.attend_rows(kernels.rows_kv(rows, rows, kind), np.ones((2, 8), np.float32), 1, 3,
                        0.5)


# --- attention -----------------------------------------------------------------------------------
def _attention(lm: Any, settings: Any, prefill_kinds: list[str] | None,
               sparse: bool = True) -> None:
    """A two-layer store of the run's KV type, head_dim and block size (one KV head): a prefill
    (layer 0 dense, layer 1 sparse), its votes and anchors, then sparse decode steps — through
    the run's own router and policy. With `prefill_kinds`, only the prefill, each MInference
    pattern kind in turn; without `sparse`, decode steps that read every block and the anchors
    (a context the budget covers)."""
    from ktlong.attention import AttentionRouter
    from ktlong.kvstore import KVStore, StoreShape
    from ktlong.selection import SelectionPolicy

    bs, d = settings.block_size, lm.spec.head_dim
    hkv, hq = 1, 2
    n0 = 12 * bs - 3  # 12 blocks, the last one partial
    ws = dataclasses.replace(
        settings, init_len=bs, local_windows_len=2 * bs, second_select_num=2, dense_layer_num=1,
        layer_step=1, token_step=1, preselect_block_count=4, max_seq_len=16 * bs,
        question_blocks=min(settings.question_blocks, 1),
        preselect_window=min(settings.preselect_window, 64),
        question_window=min(settings.question_window, 8), prefill_vertical=16,
        prefill_slash=16, prefill_patterns="")
    if not sparse:  # every block read: no choice, no vote
        ws = dataclasses.replace(ws, attention="DENSE", preselect_block=False, question_blocks=0,
                                 anchor_type="MEAN" if ws.anchor_type == "DYNAMIC"
                                 else ws.anchor_type)
    spec = dataclasses.replace(lm.spec, n_layers=2, n_heads=hq, n_kv_heads=hkv, sliding_layers=())
    dev = lm.device
    local = dev if settings.gpu_local_window and dev.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)

    def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (torch.randn(h, n, d, generator=gen).to(dev) for h in (hq, hkv, hkv))
        return q, k, v

    scale = float(d**-0.5)
    plans: list[Any] = [None]
    if prefill_kinds is not None:
        from ktlong.minference import ChunkAttention, HeadPattern, Plan

        pattern = {"ashape": HeadPattern("ashape", bs, bs), "vs": HeadPattern("vs", 16, 16),
                   "block": HeadPattern("block", 1)}
        plans = []
        for kind in prefill_kinds:
            ca = ChunkAttention(Plan(((pattern[kind],) * hq,) * 2, "warm-up"))
            ca.dense_below = 0
            plans.append(ca)
    for ca in plans:
        store = KVStore(StoreShape(2, hkv, d, bs, settings.kv_type, settings.anchor_num),
                        ws.max_seq_len)
        policy = SelectionPolicy(ws, spec, store)
        router = AttentionRouter(store, policy, dev, local, ca)
        with torch.inference_mode():
            # the document: the engine's prefill (a forward of n0 tokens)
            capture = policy.vote_window()
            router.begin(sparse=False, capture=min(capture, n0), total=n0)
            q, k, v = qkv(n0)
            for layer in range(2):
                router.attend(layer, q, k, v, scale)
            policy.on_prefill_end(router.captured, n0)
            if prefill_kinds is not None:
                continue
            if ws.question_blocks and ws.question_votes == "NEAR":  # the question's vote
                from ktlong.selection import near_votes

                qw = q[:, -ws.question_window:].float().cpu().numpy()  # [Hq, W, d]
                freq = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)  # [d/2]
                near_votes(store, 1, qw, n0, (n0 - ws.local_windows_len) // bs, freq, scale)
            for _ in range(3):  # decode steps (a later turn's prefill goes the same way)
                router.begin(sparse=True, capture=0, total=1)
                q, k, v = qkv(1)
                for layer in range(2):
                    if dev.type == "cpu":  # the CPU decode step's way in (ktlong.decoder)
                        router.attend_one(layer, q[:, 0].numpy(), k[:, 0].numpy(),
                                          v[:, 0].numpy(), scale)
                    else:
                        router.attend(layer, q, k, v, scale)
        policy.complete_anchors()  # before a prompt-cache save
    if sparse and prefill_kinds is None:  # question_first_block: the first block read again
        from ktlong import kernels

        x, kv = np.zeros((2, d), np.float32), np.zeros((1, 3, d), np.float32)
        kernels.attend_merge(x, kv, kv, scale, x.copy(), np.zeros(2, np.float32))

