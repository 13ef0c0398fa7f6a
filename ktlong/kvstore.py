"""The KV store: every layer's keys and values in DRAM (or memory-mapped), cut into blocks.

Layout per layer, per segment: `[Hkv, blocks, block_size, head_dim]`, so each head-block is one
contiguous run the kernels read in one sweep. Two segments (docs/internals.md):
- base: read-only full blocks, usually a memory-mapped prompt-cache entry (may be empty);
- tail: RAM blocks that new tokens are written to.
Half-precision KV is kept as uint16 bit patterns (Numba cannot read float16/bfloat16 arrays).
No policy lives here: which blocks to read is `selection`'s business.
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ktlong import kernels
from ktlong.errors import KtlongError
from ktlong.kernels import Q8_EXTRA

# kv_type -> (numpy storage dtype, torch dtype of the values, kernel kind)
KV_TYPES = {
    "FP32": (np.float32, torch.float32, 0),
    "BF16": (np.uint16, torch.bfloat16, 1),
    "FP16": (np.uint16, torch.float16, 2),
}
KV_BYTES = {"FP32": 4, "BF16": 2, "FP16": 2}
# resident bytes of a memory-mapped base before its pages are unmapped (at least this; the
# engine raises it to two decode steps' reads so a step rarely re-faults its own blocks)
MAP_CAP_MIN = 128 << 20


@dataclass(frozen=True)
class StoreShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_type: str
    anchor_num: int


def to_storage(x: torch.Tensor, kv_type: str) -> np.ndarray:
    """[..., d] float tensor (any device) -> numpy array in the store's storage dtype."""
    _, tdtype, _ = KV_TYPES[kv_type]
    x = x.detach().to(device="cpu", dtype=tdtype).contiguous()
    if kv_type == "FP32":
        return x.numpy()
    return x.view(torch.int16).numpy().view(np.uint16)


def from_storage(a: np.ndarray, kv_type: str) -> torch.Tensor:
    """Numpy storage array -> float32 torch tensor of the same shape (a copy)."""
    if kv_type == "FP32":
        return torch.from_numpy(np.array(a, dtype=np.float32))  # always a copy (a may be read-only)
    _, tdtype, _ = KV_TYPES[kv_type]
    bits = np.ascontiguousarray(a).view(np.int16)
    if bits.flags.writeable:
        return torch.from_numpy(bits).view(tdtype).float()
    with warnings.catch_warnings():  # a read-only (cache-mapped) array: only read, .float() copies
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(bits).view(tdtype).float()


def _file_rss() -> int:
    """Bytes of file-backed (and shared) pages resident in this process: /proc/self/statm."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except OSError:  # no procfs (not Linux): never release early
        return 0


class KVStore:
    """K, V and block anchors for every layer of one conversation.

    `capacity` is the most tokens the store can hold (max_seq_len). Tail arrays come from
    np.zeros, so pages are only touched as tokens are written.
    """

    def __init__(
        self,
        shape: StoreShape,
        capacity: int,
        base: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
        base_anchors: list[np.ndarray] | None = None,
        nb_base: int | None = None,
    ) -> None:
        if shape.kv_type not in KV_TYPES:
            raise KtlongError(f"kv_type {shape.kv_type} is not one of {', '.join(KV_TYPES)}")
        self.shape = shape
        self.capacity = capacity
        dtype, _, self.kv_kind = KV_TYPES[shape.kv_type]
        L, H, bs, d = shape.n_layers, shape.n_kv_heads, shape.block_size, shape.head_dim
        self.nb_cap = -(-capacity // bs)
        if base is None:
            empty = np.zeros((H, 0, bs, d), dtype)
            base = ([empty] * L, [empty] * L)
        self.k_base, self.v_base = list(base[0]), list(base[1])
        # blocks of the base in use: the arrays may hold more (a mapped file's last block is
        # copied to the tail instead, so the newest token stays writable)
        self.nb_base = self.k_base[0].shape[1] if nb_base is None else nb_base
        if self.nb_base * bs > capacity:
            raise KtlongError(
                f"the cached context ({self.nb_base * bs} tokens) is longer than "
                f"max_seq_len ({capacity})",
                hint="raise max_seq_len (ktlong memcheck)",
            )
        nb_tail = self.nb_cap - self.nb_base
        self.k_tail = [np.zeros((H, nb_tail, bs, d), dtype) for _ in range(L)]
        self.v_tail = [np.zeros((H, nb_tail, bs, d), dtype) for _ in range(L)]
        # Q8 rows [H, nb_cap, A, d + 4] (8-bit codes, float32 scale; kernels/anchors.py):
        # scoring reads every candidate's anchors each step, so their bytes are what a 1M-token
        # step pays beyond a 16K one
        self.anchors = [
            np.zeros((H, self.nb_cap, shape.anchor_num, d + Q8_EXTRA), np.uint8) for _ in range(L)
        ]
        self.n_anchored = [0] * L  # blocks [0, n_anchored) have anchors
        self._views: list[tuple[kernels.LayerKV, kernels.AnchorView] | None] = [None] * L
        if base_anchors is not None:
            for layer, a in enumerate(base_anchors):
                self.anchors[layer][:, : a.shape[1]] = a
                self.n_anchored[layer] = a.shape[1]
        self.lengths = [self.nb_base * bs] * L  # tokens written, per layer
        # a mapped base: pages a step reads (and their neighbours: the page cache works in
        # large folios) stay mapped, and in RSS, until released; `check_resident` bounds them
        maps = {id(a._mmap): a._mmap for a in self.k_base + self.v_base
                if isinstance(a, np.memmap) and a._mmap is not None}
        self._maps = list(maps.values())
        self.block_bytes = 2 * H * bs * d * KV_BYTES[shape.kv_type]  # K + V, all heads
        self.map_cap = MAP_CAP_MIN
        self._file_rss0 = _file_rss() if self._maps else 0

    # --- sizes -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens held by every layer (layers differ only in the middle of a prefill)."""
        return min(self.lengths)

    def nbytes_used(self) -> int:
        s = self.shape
        per_token = 2 * s.n_layers * s.n_kv_heads * s.head_dim * KV_BYTES[s.kv_type]
        return self.length * per_token

    # --- writing -----------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append k, v `[Hkv, n, d]` to `layer`; returns the position of the first new token."""
        start, n = self.lengths[layer], k.shape[1]
        if start + n > self.capacity:
            raise KtlongError(
                f"the conversation needs {start + n} tokens but max_seq_len is {self.capacity}",
                hint="raise max_seq_len (ktlong memcheck) or /reset",
            )
        off = start - self.nb_base * self.shape.block_size
        H, d = self.shape.n_kv_heads, self.shape.head_dim
        self.k_tail[layer].reshape(H, -1, d)[:, off : off + n] = to_storage(k, self.shape.kv_type)
        self.v_tail[layer].reshape(H, -1, d)[:, off : off + n] = to_storage(v, self.shape.kv_type)
        self.lengths[layer] = start + n
        return start

    def truncate(self, n_tokens: int) -> None:
        """Forget every token from `n_tokens` on (the base segment cannot be cut)."""
        bs = self.shape.block_size
        if n_tokens < self.nb_base * bs:
            raise ValueError("cannot truncate into the read-only base segment")
        full = n_tokens // bs
        for layer in range(self.shape.n_layers):
            self.lengths[layer] = min(self.lengths[layer], n_tokens)
            self.n_anchored[layer] = min(self.n_anchored[layer], full)

    # --- a memory-mapped base: bounded residency ---------------------------------------------
    @property
    def mapped(self) -> bool:
        return bool(self._maps)

    def check_resident(self) -> None:
        """Release the mapped pages once more than `map_cap` bytes of them are resident."""
        if self._maps and _file_rss() - self._file_rss0 > self.map_cap:
            self.release_mapped()

    def release_mapped(self) -> None:
        """Unmap the base's resident pages from this process (the OS page cache keeps them, so
        re-reading one is a minor fault): RSS stays near one working set, not the file size."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)
        # what stays resident is other files (e.g. weights mapped since): the new zero
        self._file_rss0 = _file_rss()

    # --- reading -----------------------------------------------------------------------------
    def token_range(
        self, layer: int, start: int, end: int, heads: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens [start, end) of KV heads `heads` as float32 tensors
        `[heads, end - start, d]` (copies)."""
        H, d = self.shape.n_kv_heads, self.shape.head_dim
        split = self.nb_base * self.shape.block_size
        parts_k, parts_v = [], []
        if start < split:
            e = min(end, split)
            parts_k.append(self.k_base[layer].reshape(H, -1, d)[heads, start:e])
            parts_v.append(self.v_base[layer].reshape(H, -1, d)[heads, start:e])
        if end > split:
            s = max(start, split) - split
            parts_k.append(self.k_tail[layer].reshape(H, -1, d)[heads, s : end - split])
            parts_v.append(self.v_tail[layer].reshape(H, -1, d)[heads, s : end - split])
        kt = [from_storage(p, self.shape.kv_type) for p in parts_k]
        vt = [from_storage(p, self.shape.kv_type) for p in parts_v]
        if start < split:
            self.check_resident()  # a dense sweep over the base reads it segment by segment
        if len(kt) == 1:
            return kt[0], vt[0]
        return torch.cat(kt, dim=1), torch.cat(vt, dim=1)

    def kernel_views(self, layer: int) -> tuple[kernels.LayerKV, kernels.AnchorView]:
        """The layer's K/V and anchors as the kernels read them, made on first use (the arrays
        never change, so neither do they): a decode step skips a dozen NumPy checks and views."""
        views = self._views[layer]
        if views is None:
            views = self._views[layer] = (
                kernels.layer_kv(*self.kernel_args(layer), self.kv_kind),
                kernels.anchor_view(self.anchors[layer]),
            )
        return views

    def kernel_args(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """(k_base, v_base, k_tail, v_tail, nb_base) for `ktlong.kernels`."""
        return (
            self.k_base[layer],
            self.v_base[layer],
            self.k_tail[layer],
            self.v_tail[layer],
            self.nb_base,
        )
