"""How much KV cache a model needs per length, how much memory is free, and which max_seq_len fits.

Budget for `n` tokens in DRAM: `KV(n) * 1.10 + weights + 2 GiB` — 10% on the KV for anchors,
partial blocks and the chat's own turns, the weights (they live in DRAM unless a GPU holds them),
and 2 GiB for the OS, Python and torch. On the GPU, prefill holds the weights plus one layer's K,V
for the whole context and one chunk's activations (about 1 GiB). Sizes print in decimal GB.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from ktlong.config import MAX_SEQ_LEN

GIB = 1024**3
OS_RESERVE = 2 * GIB  # OS + Python + torch
KV_MARGIN = 0.10  # anchors, partial blocks, the chat's own turns
GPU_ACTIVATIONS = 1 * GIB  # one prefill chunk's activations
LENGTHS = (("4K", 4096), ("32K", 32768), ("64K", 65536), ("128K", 131072), ("256K", 262144),
           ("512K", 524288), ("1M", 1048576))
_UNLIMITED = 1 << 60  # cgroup v1 writes ~2**63 for "no limit"


@dataclass(frozen=True)
class ReferenceShape:
    """The fields of `ktlong.model.ModelSpec` that sizing reads, for when no model is given."""

    path: str = "reference shape: an 8B GQA model in BF16 (Llama-3.1-8B: 32 layers, 8 KV heads, " \
                "head_dim 128)"
    arch: str = "llama"
    n_layers: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    weights_bytes: int = 16_060_522_496
    max_positions: int = 131072


REFERENCE = ReferenceShape()


def kv_row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) for one KV head: head_dim values, or Q8_0 / Q4_0 blocks of
    32 values with a float16 scale each (kernels/kvquant.py, rounded up to 4 bytes)."""
    kv_type = kv_type.upper()
    if kv_type in ("Q8_0", "Q4_0"):
        per32 = 34 if kv_type == "Q8_0" else 18
        return -(-per32 * head_dim // 32 // 4) * 4
    return head_dim * (4 if kv_type == "FP32" else 2)


def kv_bytes_per_token(spec: Any, kv_type: str) -> int:
    """K and V of every layer: 2 * layers * kv_heads * bytes per head row."""
    return 2 * spec.n_layers * spec.n_kv_heads * kv_row_bytes(kv_type, spec.head_dim)


def resolve_tier(spec: Any, settings: Any, free_bytes: int | None = None) -> str:
    """RAM or DISK for `settings.kv_tier` (AUTO: RAM when max_seq_len's KV, with the weights,
    fits in free DRAM)."""
    if settings.kv_tier != "AUTO":
        return settings.kv_tier
    free = free_dram_bytes() if free_bytes is None else free_bytes
    return "RAM" if dram_need(spec, settings.kv_type, settings.max_seq_len) <= free else "DISK"


def dram_need(spec: Any, kv_type: str, tokens: int, weights_in_dram: bool = True) -> int:
    kv = kv_bytes_per_token(spec, kv_type) * tokens
    return int(kv * (1 + KV_MARGIN)) + (spec.weights_bytes if weights_in_dram else 0) + OS_RESERVE


def gpu_need(spec: Any, kv_type: str, tokens: int) -> int:
    """Prefill peak on the device: weights + one layer's K,V at `tokens` + one chunk."""
    one_layer = kv_bytes_per_token(spec, kv_type) * tokens // spec.n_layers
    return spec.weights_bytes + one_layer + GPU_ACTIVATIONS


def recommend_max_seq_len(spec: Any, kv_type: str, free_bytes: int,
                          weights_in_dram: bool = True) -> int:
    """Largest multiple of 1024 tokens whose `dram_need` fits in `free_bytes`, capped at the
    model's own max positions and the largest max_seq_len; 0 when not even 1024 tokens fit."""
    usable = free_bytes - OS_RESERVE - (spec.weights_bytes if weights_in_dram else 0)
    per_token = kv_bytes_per_token(spec, kv_type) * (1 + KV_MARGIN)
    tokens = max(min(int(usable / per_token), MAX_SEQ_LEN) // 1024 * 1024, 0)
    if spec.max_positions and spec.max_positions > 0:
        tokens = min(tokens, spec.max_positions)
    return tokens


# --- free memory --------------------------------------------------------------------------------

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_free_bytes(root: Path = Path("/sys/fs/cgroup"),
                      proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Memory left under this process's cgroup limit (v2 or v1), or None without a limit.

    Usage counts reclaimable page cache, so the inactive file pages are taken off it (as docker
    stats does).
    """
    dirs = [root]
    try:  # v2: "0::/some/path" names our own cgroup below the mount
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::/") and len(line) > 4:
                dirs.insert(0, root / line[4:])
    except OSError:
        pass
    for d in dirs:  # v2
        limit = _read_int(d / "memory.max")
        usage = _read_int(d / "memory.current")
        if limit is not None and usage is not None:
            used = usage - _stat_value(d / "memory.stat", "inactive_file")
            return max(limit - max(used, 0), 0)
    for d in (root / "memory", root):  # v1
        limit = _read_int(d / "memory.limit_in_bytes")
        usage = _read_int(d / "memory.usage_in_bytes")
        if limit is not None and usage is not None and limit < _UNLIMITED:
            used = usage - _stat_value(d / "memory.stat", "total_inactive_file")
            return max(limit - max(used, 0), 0)
    return None


def free_dram_bytes() -> int:
    """psutil's available memory, capped by what the cgroup still allows."""
    available = int(psutil.virtual_memory().available)
    cg = cgroup_free_bytes()
    return available if cg is None else min(available, cg)


def free_gpu_bytes() -> int | None:
    """Free memory on the current CUDA device, or None without torch or CUDA.

    Imports torch only when a GPU device node exists (on Linux), so memcheck stays fast on CPUs.
    """
    if sys.platform.startswith("linux") and not any(
            Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
        return None
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


# --- the memcheck table -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    label: str
    tokens: int
    kv_bytes: int
    dram_need: int
    fits_dram: bool
    gpu_need: int | None
    fits_gpu: bool | None


def length_rows(spec: Any, kv_type: str, free_dram: int, free_gpu: int | None) -> list[Row]:
    """One row per standard length plus the model's own max positions."""
    lengths = list(LENGTHS)
    if spec.max_positions and spec.max_positions not in dict(LENGTHS).values():
        lengths.append(("model max", spec.max_positions))
        lengths.sort(key=lambda x: x[1])
    rows = []
    for label, n in lengths:
        if n == spec.max_positions and label != "model max":
            label += " (model max)"
        need = dram_need(spec, kv_type, n, weights_in_dram=free_gpu is None)
        g = gpu_need(spec, kv_type, n) if free_gpu is not None else None
        rows.append(Row(label, n, kv_bytes_per_token(spec, kv_type) * n, need, need <= free_dram,
                        g, None if g is None or free_gpu is None else g <= free_gpu))
    return rows


def report(spec: Any, kv_type: str, free_dram: int, free_gpu: int | None) -> dict[str, Any]:
    """Everything memcheck shows, as plain data (also its --json output)."""
    kv_type = kv_type.upper()
    gpu = free_gpu is not None
    return {
        "model": spec.path,
        "reference": isinstance(spec, ReferenceShape),
        "arch": spec.arch,
        "n_layers": spec.n_layers, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "max_positions": spec.max_positions,
        "kv_type": kv_type,
        "kv_bytes_per_token": kv_bytes_per_token(spec, kv_type),
        "weights_bytes": spec.weights_bytes,
        "weights_estimated": getattr(spec, "weights_estimated", False),  # no weight files
        "weights_on": "GPU" if gpu else "DRAM",
        "free_dram_bytes": free_dram,
        "free_gpu_bytes": free_gpu,
        "headroom": f"KV + {KV_MARGIN:.0%} + {OS_RESERVE // GIB} GiB for the OS"
                    + ("" if gpu else " + weights"),
        "rows": [asdict(r) for r in length_rows(spec, kv_type, free_dram, free_gpu)],
        "recommended_max_seq_len": recommend_max_seq_len(spec, kv_type, free_dram,
                                                          weights_in_dram=not gpu),
    }


def size(n: float) -> str:
    """Bytes in decimal units: 1536 -> '1.5 KB'."""
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} GB"


def gb(n: int | float) -> str:
    """Decimal gigabytes, 3 significant digits: 17179869184 -> '17.2 GB'."""
    return f"{n / 1e9:.3g} GB"


HEAP_MMAP_THRESHOLD = 1 << 20  # freed blocks this big go back to the OS at once


@functools.cache
def limit_heap_retention() -> bool:
    """Make glibc return every freed block of 1 MB or more to the OS at once.

    glibc raises its mmap threshold (up to 32 MB) after big frees, so prefill activations freed
    chunk after chunk stay in the heap, and in RSS, for the rest of the chat (tests/test_memory.py
    shows the pattern). A fixed threshold stops that; the cost is a page fault per fresh
    page of each big tensor, small beside the matmuls that fill it. No-op off glibc; once per
    process (every Session calls it).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-3, HEAP_MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
