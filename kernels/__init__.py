"""Numba kernels for block-sparse decode: anchors, block scores, top-k, attention, a whole decode
step (scores, top-k and attention in one call), query votes; sparse prefill attention
(`prefill_index` builds MInference's per-head patterns, `prefill_sparse` attends over them);
GEMV over 16-bit and GGUF-quantised weights.

Imported as `ktlong.kernels`. Importing it (before any kernel compiles):
- (through `ktlong`, unless set) sets OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads collapse
  throughput on a busy machine; and GOMP_SPINCOUNT: an idle OpenMP thread spins ~0.3 ms before
  it sleeps. A decode step starts a parallel region every few dozen microseconds, and waking a
  sleeping thread costs ~45 us on a VM; the spin is too short to take much from other work;
- picks Numba's `omp` threading layer: `workqueue` aborts when two Python threads launch kernels
  at once (falls back to tbb, then workqueue, if omp is missing);
- points Numba's on-disk cache at `<KTLONG_HOME or ~/.ktlong>/numba-cache/<hash of every source
  file here>` (or `$NUMBA_CACHE_DIR/<hash>`), because Numba keys a cached kernel on its own file
  only and would keep stale code after a change in a helper module.
"""
from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Iterable
from pathlib import Path

import numba

import ktlong  # noqa: F401  (already imported, and with it OMP_WAIT_POLICY, GOMP_SPINCOUNT set)

_HERE = Path(__file__).resolve().parent


def source_hash(folder: Path = _HERE) -> str:
    """Hash of every kernel source file (and the Numba version): the compiled-cache key."""
    h = hashlib.sha256(numba.__version__.encode())
    for p in sorted(folder.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir(folder: Path = _HERE) -> Path:
    """Where compiled kernels are cached for the current sources."""
    base = os.environ.get("NUMBA_CACHE_DIR")
    if base:
        return Path(base) / f"ktlong-{source_hash(folder)}"
    home = Path(os.environ.get("KTLONG_HOME") or Path.home() / ".ktlong")
    return home / "numba-cache" / source_hash(folder)


def cache_is_cold(folder: Path = _HERE, parts: Iterable[str] | None = None) -> bool:
    """Whether kernels of the current sources still have to compile (tens of seconds).

    With `parts` (names of warm-up sets, see `ktlong.warmup`: decode attention for a KV type,
    sparse prefill, one weight type...): whether any of them is not compiled here yet (a set
    leaves the marker `cache_dir()/warm/<name>` once its kernels are). Without: whether no kernel
    at all is compiled on disk yet."""
    d = cache_dir(folder)
    if parts is not None:
        return any(not (d / "warm" / p).exists() for p in parts)
    return not any(d.rglob("*.nbi"))  # Numba files them in a subfolder


def _threading_layer() -> str:
    for name in ("omp", "tbb"):
        try:
            importlib.import_module(f"numba.np.ufunc.{name}pool")
            return name
        except ImportError:
            continue
    return "workqueue"


if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = _threading_layer()

_saved_cache_dir = numba.config.CACHE_DIR
try:
    _dir = cache_dir()
    _dir.mkdir(parents=True, exist_ok=True)
    numba.config.CACHE_DIR = str(_dir)  # read when each @njit(cache=True) below is applied
except OSError:
    pass  # unwritable home: Numba's default cache location
try:
    from . import prefill_index, prefill_sparse  # noqa: E402  (sparse prefill)
    from .anchors import (  # noqa: E402
        Q8_EXTRA,
        AnchorView,
        anchor_view,
        anchors_to_f64,
        compute_anchors,
        compute_anchors_ref,
        q8_encode,
        score_blocks,
        score_blocks_ref,
        select_blocks,
        topk_blocks,
        topk_blocks_ref,
        turned_back_ref,
    )
    from .attention import (  # noqa: E402
        LayerKV,
        Turns,
        attend_blocks,
        attend_blocks_ref,
        attend_layer,
        attend_merge,
        attend_rows,
        attend_rows_ref,
        layer_kv,
        merge_partials,
        merge_partials_ref,
        rope_turns,
        rows_kv,
        turned_ref,
    )
    from .gemv import gemv, gemv_ref  # noqa: E402
    from .layer import (  # noqa: E402
        add_norm,
        gated,
        gated_ref,
        qk_rope,
        rmsnorm,
        rmsnorm_ref,
        rope,
        rope_ref,
    )
    from .qlinear import dequant, dequant_rows, qgemv, qgemv2, qgemv_ref  # noqa: E402
    from .qmatmul import (  # noqa: E402
        INT8_GEMM,
        gemm_path,
        qgemm,
        qgemm_ref,
        qgemm_rounding,
        quantise_rows,
    )
    from .step import select_attend, select_attend_layer, select_attend_ref  # noqa: E402
    from .votes import block_lse, query_votes, query_votes_ref, turn_blocks  # noqa: E402
finally:
    numba.config.CACHE_DIR = _saved_cache_dir

from ._simd import f32_to_kv, kv_to_f64, put_token  # noqa: E402
from .threads import auto_threads, configure_threads  # noqa: E402

KV_KINDS = {"FP32": 0, "BF16": 1, "FP16": 2}

__all__ = [
    "INT8_GEMM", "KV_KINDS", "Q8_EXTRA", "add_norm", "anchor_view", "anchors_to_f64", "AnchorView",
    "attend_blocks", "attend_blocks_ref", "attend_layer", "attend_merge", "attend_rows",
    "attend_rows_ref", "auto_threads", "block_lse", "cache_dir", "cache_is_cold",
    "compute_anchors", "compute_anchors_ref", "configure_threads", "dequant", "dequant_rows",
    "f32_to_kv", "gated", "gated_ref", "gemm_path", "gemv", "gemv_ref", "kv_to_f64", "layer_kv",
    "LayerKV", "merge_partials", "merge_partials_ref", "prefill_index", "prefill_sparse",
    "put_token", "q8_encode", "qgemm", "qgemm_ref", "qgemm_rounding", "qgemv", "qgemv2",
    "qgemv_ref", "qk_rope", "quantise_rows", "query_votes", "query_votes_ref", "rmsnorm",
    "rmsnorm_ref", "rope", "rope_ref", "rope_turns", "rows_kv", "score_blocks", "score_blocks_ref",
    "select_attend", "select_attend_layer", "select_attend_ref", "select_blocks", "source_hash",
    "topk_blocks", "topk_blocks_ref", "turn_blocks", "turned_back_ref", "turned_ref", "Turns",
]
