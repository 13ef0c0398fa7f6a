"""How much KV cache a model needs per length, how much memory and disk are free, what fits.

Two places for the KV cache (`kv_tier`):
- RAM: `n` tokens need `KV(n) * 1.10 + weights + 2 GiB` of DRAM — 10% on the KV for anchors,
  partial blocks and the chat's own turns, the weights (they live in DRAM unless a GPU holds
  them), and 2 GiB for the OS, Python and torch.
- DISK: the KV goes to a memory-mapped file under `cache_dir/tier` (`KV(n)` rounded up to whole
  blocks, reserved at once for `max_seq_len`; 1 GiB of the file system is kept free besides).
  DRAM then holds the weights, the 2 GiB, the block anchors (`(head_dim + 4) * anchor_num` bytes
  per KV head per block per layer) and the KV one decode step reads, which the page cache must
  keep to decode at DRAM speed: init + local window + selected blocks + the partial block of each
  sparse layer (16,640 tokens with the default profile), every token of a dense layer.
On the GPU, prefill holds the weights plus one layer's K,V for the whole context and one chunk's
activations (about 1 GiB). Sizes print in decimal GB.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from ktlong.config import FULL_CONTEXT, MAX_SEQ_LEN, Settings, ktlong_home
from ktlong.errors import KtlongError
from ktlong.spec import trained_context

GIB = 1024**3
OS_RESERVE = 2 * GIB  # OS + Python + torch
KV_MARGIN = 0.10  # anchors, partial blocks, the chat's own turns
DISK_RESERVE = 1 * GIB  # left free on the disk tier's file system
ANCHOR_EXTRA = 4  # bytes after an anchor's head_dim codes: its scale (kernels/anchors.Q8_EXTRA)
GPU_ACTIVATIONS = 1 * GIB  # one prefill chunk's activations
LENGTHS = (("4K", 4096), ("32K", 32768), ("64K", 65536), ("128K", 131072), ("256K", 262144),
           ("512K", 524288), ("1M", 1048576))
SHOWN_KV_TYPES = ("BF16", "Q8_0", "Q4_0")  # memcheck's comparison, most precise first
DISK_KV_TYPES = ("Q8_0", "Q4_0")  # offered with the disk tier: decode reads fewer pages
_UNLIMITED = 1 << 60  # cgroup v1 writes ~2**63 for "no limit"
_DEFAULTS = Settings()


@dataclass(frozen=True)
class ReferenceShape:
    """The fields of `ktlong.spec.ModelSpec` that sizing reads, for when no model is given."""

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


def kv_types_for(spec: Any, kv_types: Sequence[str] = SHOWN_KV_TYPES) -> list[str]:
    """Those of `kv_types` the model's head_dim allows: Q8_0 and Q4_0 need a multiple of 32."""
    return [t for t in kv_types if t not in ("Q8_0", "Q4_0") or spec.head_dim % 32 == 0]


def kv_layer_count(spec: Any) -> int:
    """The layers whose KV grows with the context (a sliding-window layer's does not)."""
    return spec.n_layers - len(getattr(spec, "sliding_layers", ()))


def kv_bytes_per_token(spec: Any, kv_type: str) -> int:
    """K and V of every layer that reads the whole context: 2 * layers * kv_heads * row bytes."""
    return 2 * kv_layer_count(spec) * spec.n_kv_heads * kv_row_bytes(kv_type, spec.head_dim)


def window_bytes(spec: Any) -> int:
    """The sliding-window layers' rows (ktlong/slidingkv.py: `window` float32 rows a layer),
    the same at any context length."""
    n = len(getattr(spec, "sliding_layers", ()))
    return 2 * n * spec.n_kv_heads * spec.head_dim * 4 * getattr(spec, "sliding_window", 0)


def resolve_tier(spec: Any, settings: Any, free_bytes: int | None = None) -> str:
    """RAM or DISK for `settings.kv_tier` (AUTO: RAM when max_seq_len's KV, with the weights,
    fits in free DRAM)."""
    if settings.kv_tier != "AUTO":
        return settings.kv_tier
    free = free_dram_bytes() if free_bytes is None else free_bytes
    return "RAM" if dram_need(spec, settings.kv_type, settings.max_seq_len) <= free else "DISK"


def dram_need(spec: Any, kv_type: str, tokens: int, weights_in_dram: bool = True) -> int:
    kv = kv_bytes_per_token(spec, kv_type) * tokens + window_bytes(spec)
    return int(kv * (1 + KV_MARGIN)) + (spec.weights_bytes if weights_in_dram else 0) + OS_RESERVE


def gpu_need(spec: Any, kv_type: str, tokens: int) -> int:
    """Prefill peak on the device: weights + one layer's K,V at `tokens` + one chunk."""
    one_layer = kv_bytes_per_token(spec, kv_type) * tokens // kv_layer_count(spec)
    return spec.weights_bytes + one_layer + GPU_ACTIVATIONS


def recommend_max_seq_len(spec: Any, kv_type: str, free_bytes: int,
                          weights_in_dram: bool = True, cap: int | None = None) -> int:
    """Largest multiple of 1024 tokens whose `dram_need` fits in `free_bytes`, capped at `cap`
    (default `length_cap`: the model's own max positions); 0 when not even 1024 tokens fit."""
    usable = free_bytes - OS_RESERVE - (spec.weights_bytes if weights_in_dram else 0)
    usable -= window_bytes(spec) * (1 + KV_MARGIN)
    per_token = kv_bytes_per_token(spec, kv_type) * (1 + KV_MARGIN)
    tokens = max(min(int(usable / per_token), MAX_SEQ_LEN) // 1024 * 1024, 0)
    return min(tokens, length_cap(spec) if cap is None else cap)


def step_tokens(settings: Any) -> int:
    """Tokens one decode step reads per sparse layer: init + selected + local window + the
    partial block (`SelectionPolicy.budget_blocks` blocks)."""
    bs = settings.block_size
    return (settings.init_len // bs + settings.second_select_num
            + settings.local_windows_len // bs + 1) * bs


def anchor_bytes(spec: Any, tokens: int, settings: Any = _DEFAULTS) -> int:
    """The block anchors (always in DRAM): one 8-bit row with its scale per anchor, KV head,
    block and layer."""
    blocks = -(-tokens // settings.block_size)
    return (kv_layer_count(spec) * spec.n_kv_heads * blocks * settings.anchor_num
            * (spec.head_dim + ANCHOR_EXTRA))


def resident_bytes(spec: Any, kv_type: str, tokens: int, settings: Any = _DEFAULTS) -> int:
    """Disk tier: the KV one decode step reads, which the page cache keeps in DRAM."""
    n_layers = kv_layer_count(spec)
    per_layer = kv_bytes_per_token(spec, kv_type) // n_layers
    dense = n_layers if settings.attention in ("DENSE", "LOCRET") \
        else min(settings.dense_layer_num, n_layers)
    window = min(tokens, step_tokens(settings))
    return per_layer * (dense * tokens + (n_layers - dense) * window)


def disk_tier_dram(spec: Any, kv_type: str, tokens: int, settings: Any = _DEFAULTS,
                   weights_in_dram: bool = True) -> int:
    """DRAM the disk tier needs for `tokens`: weights, OS, anchors, one step's KV."""
    return ((spec.weights_bytes if weights_in_dram else 0) + OS_RESERVE
            + anchor_bytes(spec, tokens, settings) + resident_bytes(spec, kv_type, tokens,
                                                                    settings))


def disk_need(spec: Any, kv_type: str, tokens: int, settings: Any = _DEFAULTS) -> int:
    """Bytes of the disk tier's file for a store of `tokens` tokens: whole blocks of KV."""
    bs = settings.block_size
    return kv_bytes_per_token(spec, kv_type) * (-(-tokens // bs) * bs)


def longest(fits: Callable[[int], bool], cap: int) -> int:
    """The longest context that `fits` (monotone): `cap` itself, else the largest multiple of
    1024 below it; 0 when not even 1024 tokens fit."""
    if cap <= 0:
        return 0
    if fits(cap):
        return cap
    lo, hi = 0, (cap - 1) // 1024  # fits(lo * 1024) (lo = 0: nothing), not fits((hi + 1) * 1024)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * 1024):
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def length_cap(spec: Any) -> int:
    """The longest max_seq_len worth having: the model's own positions (or the largest)."""
    return min(spec.max_positions, MAX_SEQ_LEN) if spec.max_positions and \
        spec.max_positions > 0 else MAX_SEQ_LEN


def longest_disk_tier(spec: Any, kv_type: str, free_dram: int, free_disk: int,
                      settings: Any = _DEFAULTS, weights_in_dram: bool = True,
                      cap: int | None = None) -> int:
    """Longest context the disk tier holds, up to `cap` (default `length_cap`): its file fits on
    free disk (less DISK_RESERVE) and its DRAM part in free DRAM."""
    def fits(n: int) -> bool:
        return (disk_need(spec, kv_type, n, settings) <= free_disk - DISK_RESERVE
                and disk_tier_dram(spec, kv_type, n, settings, weights_in_dram) <= free_dram)

    return longest(fits, length_cap(spec) if cap is None else cap)


def full_context(spec: Any, settings: Any = None) -> int:
    """The context memcheck aims for: 1M tokens when the attention is SPARSE (a decode step reads
    blocks, none from further than the budget, so a model reads past its trained length), else
    the model's own positions, at most 1M."""
    if settings is not None and settings.attention == "SPARSE":
        return FULL_CONTEXT
    return min(length_cap(spec), FULL_CONTEXT)


def tokens_label(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 200000 -> '200,000'."""
    if n and n % (1 << 20) == 0:
        return f"{n >> 20:,}M"
    return f"{n >> 10:,}K" if n and n % 1024 == 0 else f"{n:,}"


@dataclass(frozen=True)
class Choice:
    """memcheck's recommendation: what `--write` puts in config.yaml, and why (one line)."""

    max_seq_len: int
    kv_type: str
    kv_tier: str
    why: str


def choose(spec: Any, free_dram: int, free_disk: int | None, kv_types: Sequence[str] = (),
           settings: Any = _DEFAULTS, weights_in_dram: bool = True) -> Choice:
    """The best setting that fits. With no `kv_types` given, BF16 > Q8_0 > Q4_0 in RAM when one
    holds the full context (the model's own, at most 1M; with SPARSE attention the length is
    then what fits, up to 1M); else the disk tier (Q8_0 if it reaches as far as Q4_0) when it
    reaches further than any RAM option; else the longest RAM option. With one `kv_types` (the
    user's --kv-type), only the tier and the length are chosen."""
    fixed = bool(kv_types)
    types = [t.upper() for t in kv_types] if fixed else kv_types_for(spec)
    full = full_context(spec)
    reach = full_context(spec, settings)  # SPARSE: past the model's own, read with blocks
    ram = {t: recommend_max_seq_len(spec, t, free_dram, weights_in_dram, cap=reach)
           for t in types}
    for t in types:
        if ram[t] >= full:
            miss = [f"{u} {tokens_label(ram[u])}" for u in types[: types.index(t)]]
            past = (f", and {tokens_label(ram[t])} in all, past it read with blocks"
                    if ram[t] > full else "")
            return Choice(ram[t], t, "RAM", f"{t} holds the full context ({tokens_label(full)}) "
                          f"in free RAM{past}" + (f"; more precise types do not (at most "
                                                  f"{', '.join(miss)})" if miss else ""))
    best_ram = max(types, key=lambda t: ram[t])  # the first (most precise) among equals
    disk_types = types if fixed else [t for t in types if t in DISK_KV_TYPES]
    disk = {t: 0 if free_disk is None else
            longest_disk_tier(spec, t, free_dram, free_disk, settings, weights_in_dram)
            for t in disk_types}
    best_disk = max(disk_types, key=lambda t: disk[t]) if disk_types else None
    in_ram = (f"in free RAM at most {tokens_label(ram[best_ram])} tokens fit ({best_ram})"
              if ram[best_ram] else "not even 1K tokens fit in free RAM")
    if best_disk is not None and min(disk[best_disk], full) > ram[best_ram]:
        n = min(disk[best_disk], full)
        reach = "the full context" if n >= full else "the most"
        return Choice(n, best_disk, "DISK", f"{in_ram}; with the KV on disk {best_disk} reaches "
                      f"{reach} ({tokens_label(n)})")
    if not ram[best_ram]:
        return Choice(0, best_ram, "RAM", in_ram + " and the disk tier does not fit either")
    return Choice(ram[best_ram], best_ram, "RAM",
                  f"{in_ram}; the full context ({tokens_label(full)}) fits nowhere and the "
                  "disk tier reaches no further")


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


def stays_resident(nbytes: int, free_bytes: int | None = None) -> bool:
    """Whether a mapped file of nbytes (a prompt-cache entry) is kept whole in memory: at most
    half the free DRAM. Larger ones are read a step's blocks at a time and handed back."""
    return nbytes <= (free_dram_bytes() if free_bytes is None else free_bytes) // 2


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


def tier_folder(settings: Any) -> Path:
    """Where the disk tier's file goes: `cache_dir/tier` (default `$KTLONG_HOME/cache/tier`)."""
    return Path(settings.cache_dir or ktlong_home() / "cache").expanduser() / "tier"


def free_disk_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds `folder` (or its nearest existing parent)."""
    p = Path(folder).expanduser().absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    return int(psutil.disk_usage(str(p)).free)


# --- the preflight ------------------------------------------------------------------------------

def room_problem(spec: Any, settings: Any, tokens: int, free_dram: int | None = None,
                 free_disk: int | None = None, weights_in_dram: bool = True) -> KtlongError | None:
    """Why `tokens` tokens do not fit where `settings.kv_tier` puts the KV, or None.

    RAM tier: DRAM for their KV (`dram_need`). DISK tier: disk for the tier file (sized for
    `max_seq_len`, reserved at once) and DRAM for the anchors and one decode step
    (`disk_tier_dram`). `weights_in_dram=False` once the weights are loaded (no longer free).
    """
    free = free_dram_bytes() if free_dram is None else free_dram
    kv = settings.kv_type
    tier = resolve_tier(spec, settings, free)
    folder = tier_folder(settings)

    def disk_free() -> int:
        return free_disk_bytes(folder) if free_disk is None else free_disk

    head = f"{tokens:,} tokens of {kv} KV cache ({gb(kv_bytes_per_token(spec, kv) * tokens)})"
    smaller = "" if kv == "Q4_0" else "a smaller kv_type (--kv-type Q4_0), "
    memcheck = "; `ktlong memcheck` shows what fits"
    if tier == "RAM":
        need = dram_need(spec, kv, tokens, weights_in_dram)
        if need <= free:
            return None
        disk_ok = (disk_need(spec, kv, settings.max_seq_len, settings) + DISK_RESERVE
                   <= disk_free()
                   and disk_tier_dram(spec, kv, tokens, settings, weights_in_dram) <= free)
        return KtlongError(
            f"{head} need {gb(need)} of RAM with kv_tier RAM but {gb(free)} is free",
            hint=("set kv_tier: DISK (--set kv_tier=DISK) to keep the KV in a file in "
                  f"{folder}" if disk_ok else f"use {smaller}a shorter document or a smaller "
                  "model") + memcheck)
    file, have = disk_need(spec, kv, settings.max_seq_len, settings), disk_free()
    if file + DISK_RESERVE > have:
        fits = max(have - DISK_RESERVE, 0) // kv_bytes_per_token(spec, kv) // 1024 * 1024
        return KtlongError(
            f"the KV disk tier needs {gb(file)} in {folder} for max_seq_len "
            f"{settings.max_seq_len:,} ({kv}), and {DISK_RESERVE // GIB} GiB kept free, but "
            f"{gb(have)} is free there",
            hint=(f"lower max_seq_len to {tokens_label(fits)} or less, " if fits >= tokens
                  else "") + "free disk space or move it with --cache-dir"
            + ("" if kv == "Q4_0" else " or use --kv-type Q4_0") + memcheck)
    need = disk_tier_dram(spec, kv, tokens, settings, weights_in_dram)
    if need > free:
        return KtlongError(
            f"{head} need {gb(need)} of RAM even with the KV on disk (the OS, the anchors and one "
            f"decode step's blocks) but {gb(free)} is free",
            hint=f"use {smaller}a shorter document or a smaller model" + memcheck)
    return None


def check_room(spec: Any, settings: Any, tokens: int, weights_in_dram: bool = True) -> None:
    """Raise `room_problem`'s refusal, if any (free DRAM and disk read now)."""
    problem = room_problem(spec, settings, tokens, weights_in_dram=weights_in_dram)
    if problem is not None:
        raise problem


# --- the memcheck table -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    label: str
    tokens: int
    kv_type: str
    kv_bytes: int
    dram_need: int  # RAM tier: DRAM
    fits_dram: bool
    disk_tier_dram: int  # disk tier: DRAM (weights, OS, anchors, one step's KV)
    disk_need: int  # disk tier: the file
    fits_disk_tier: bool | None  # None: free disk not known
    gpu_need: int | None
    fits_gpu: bool | None
    past_trained: bool  # longer than the model's trained context: read with blocks


def lengths_of(spec: Any) -> list[tuple[str, int]]:
    """The standard lengths plus the model's own max positions, labelled."""
    lengths = list(LENGTHS)
    if spec.max_positions and spec.max_positions not in dict(LENGTHS).values():
        lengths.append(("model max", spec.max_positions))
        lengths.sort(key=lambda x: x[1])
    return [(label + " (model max)" if n == spec.max_positions and label != "model max"
             else label, n) for label, n in lengths]


def locret_rows(settings: Any) -> int:
    """KV rows per layer attention LOCRET holds while it reads a document of any length."""
    from ktlong.locret import chunk_len

    return settings.locret_budget + chunk_len(settings)


def length_rows(spec: Any, kv_type: str, free_dram: int, free_gpu: int | None,
                free_disk: int | None = None, settings: Any = _DEFAULTS) -> list[Row]:
    """One row per standard length plus the model's own max positions, for one kv_type."""
    kv_type = kv_type.upper()
    in_dram = free_gpu is None  # a GPU holds the weights
    trained = trained_context(spec)
    rows = []
    held = locret_rows(settings) if settings.attention == "LOCRET" else None
    for label, n in lengths_of(spec):
        n_kv = n if held is None else min(n, held)  # LOCRET: the budget, however long
        need = dram_need(spec, kv_type, n_kv, weights_in_dram=in_dram)
        tier_dram = disk_tier_dram(spec, kv_type, n, settings, weights_in_dram=in_dram)
        disk = disk_need(spec, kv_type, n, settings)
        fits_disk = None if free_disk is None else (tier_dram <= free_dram
                                                    and disk <= free_disk - DISK_RESERVE)
        g = gpu_need(spec, kv_type, n) if free_gpu is not None else None
        rows.append(Row(label, n, kv_type, kv_bytes_per_token(spec, kv_type) * n_kv, need,
                        need <= free_dram, tier_dram, disk, fits_disk,
                        g, None if g is None or free_gpu is None else g <= free_gpu,
                        0 < trained < n))
    return rows


def _measured(spec: Any) -> dict[str, Any] | None:
    """The answers `bench accuracy` measured on this model (ktlong.measured), if any."""
    from ktlong.measured import for_spec

    m = for_spec(spec)
    if m is None:
        return None
    return {"model": m.model, "results": [f for f, _ in m.results], "haystack": m.haystack,
            "profile": m.profile,
            "cells": [dict(zip(("task", "tokens", "right", "asked"), c, strict=True))
                      for c in m.cells], "line": m.line()}


def report(spec: Any, kv_type: str | None, free_dram: int, free_gpu: int | None,
           free_disk: int | None = None, settings: Any = _DEFAULTS,
           disk_folder: Path | str | None = None) -> dict[str, Any]:
    """Everything memcheck shows, as plain data (also its --json output).

    `kv_type` None compares BF16, Q8_0 and Q4_0 (those the head_dim allows); a type (the user's
    --kv-type) narrows the table and the recommendation to it. `free_disk` None leaves the disk
    tier out (unknown).
    """
    types = [kv_type.upper()] if kv_type else kv_types_for(spec)
    if not kv_types_for(spec, types):
        raise KtlongError(f"kv_type {types[0]} needs a head_dim that is a multiple of 32; this "
                          f"model's is {spec.head_dim}", hint="use kv_type BF16 (--kv-type BF16)")
    gpu = free_gpu is not None
    rows = [r for t in types for r in length_rows(spec, t, free_dram, free_gpu, free_disk,
                                                   settings)]
    rows.sort(key=lambda r: r.tokens)  # stable: each length's types stay in order
    in_dram = not gpu
    full = full_context(spec, settings)
    longest_by_type = {t: {"RAM": recommend_max_seq_len(spec, t, free_dram, in_dram, cap=full),
                           "DISK": None if free_disk is None else
                           longest_disk_tier(spec, t, free_dram, free_disk, settings, in_dram,
                                             cap=full)}
                       for t in types}
    choice = choose(spec, free_dram, free_disk, [kv_type] if kv_type else (), settings, in_dram)
    return {
        "model": spec.path,
        "reference": isinstance(spec, ReferenceShape),
        "arch": spec.arch,
        "n_layers": spec.n_layers, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "sliding_layers": len(getattr(spec, "sliding_layers", ())),
        "sliding_window": getattr(spec, "sliding_window", 0),
        "max_positions": spec.max_positions,
        "trained_context": trained_context(spec),
        "attention": settings.attention,
        "full_context": full,
        "kv_type": kv_type.upper() if kv_type else None,  # the --kv-type asked for, if any
        "kv_types": types,
        "kv_bytes_per_token": {t: kv_bytes_per_token(spec, t) for t in types},
        "weights_bytes": spec.weights_bytes,
        "weights_estimated": getattr(spec, "weights_estimated", False),  # no weight files
        "weights_on": "GPU" if gpu else "DRAM",
        "free_dram_bytes": free_dram,
        "free_gpu_bytes": free_gpu,
        "free_disk_bytes": free_disk,
        "disk_folder": None if disk_folder is None else str(disk_folder),
        "disk_reserve_bytes": DISK_RESERVE,
        "step_tokens": step_tokens(settings),
        "measured": _measured(spec),
        "headroom": f"KV + {KV_MARGIN:.0%} + {OS_RESERVE // GIB} GiB for the OS"
                    + ("" if gpu else " + weights"),
        "disk_headroom": ("" if gpu else "weights + ") + f"{OS_RESERVE // GIB} GiB for the OS "
                         f"+ anchors + one decode step's KV ({step_tokens(settings):,} tokens "
                         "per sparse layer)",
        "rows": [asdict(r) for r in rows],
        "longest": longest_by_type,
        "longest_in_dram": max(v["RAM"] for v in longest_by_type.values()),
        "longest_with_disk": None if free_disk is None else max(
            max(v["RAM"], v["DISK"] or 0) for v in longest_by_type.values()),
        "locret": {"rows": locret_rows(settings), "budget": settings.locret_budget,
                   "kv_bytes": {t: kv_bytes_per_token(spec, t) * locret_rows(settings)
                                for t in types}},
        "recommended": asdict(choice),
        "recommended_max_seq_len": choice.max_seq_len,
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


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS now (glibc's malloc_trim), e.g. after a long
    document was tokenised: the tokenizer's scratch would otherwise stay in RSS. No-op off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
