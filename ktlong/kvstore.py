"""The KV store: every layer's keys and values in DRAM (or memory-mapped), cut into blocks.

Layout per layer, per segment: `[Hkv, blocks, block_size, row]`, so each head-block is one
contiguous run the kernels read in one sweep. Two segments (docs/internals.md):
- base: read-only full blocks, usually a memory-mapped prompt-cache entry (may be empty);
- tail: the blocks new tokens are written to: RAM, or with the disk tier (`tier_dir`) a file
  mapping: the page cache keeps what decode reads every step (init, local window) in RAM and
  writes the rest back to the disk.
A row is one token of one KV head: head_dim values as float32, as uint16 bit patterns (BF16,
FP16: Numba cannot read float16/bfloat16 arrays), or as bytes of Q8_0 / Q4_0 blocks
(kernels/kvquant.py). Anchors are always in RAM. No policy lives here: which blocks to read is
`selection`'s business.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ktlong import kernels
from ktlong.errors import KtlongError
from ktlong.kernels import Q8_EXTRA, kvquant

# kv_type -> (numpy storage dtype, torch dtype of a device copy (GPU local window, prefill
# mirror), kernel kind)
KV_TYPES = {
    "FP32": (np.float32, torch.float32, 0),
    "BF16": (np.uint16, torch.bfloat16, 1),
    "FP16": (np.uint16, torch.float16, 2),
    "Q8_0": (np.uint8, torch.bfloat16, kvquant.Q8_0),
    "Q4_0": (np.uint8, torch.bfloat16, kvquant.Q4_0),
}
QUANT_KV = ("Q8_0", "Q4_0")
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


def row_elems(kv_type: str, head_dim: int) -> int:
    """Elements of the storage dtype in one row (bytes, for the quantised types)."""
    kind = KV_TYPES[kv_type][2]
    return kvquant.row_bytes(kind, head_dim) // np.dtype(KV_TYPES[kv_type][0]).itemsize


def check_kv_type(kv_type: str, head_dim: int) -> None:
    if kv_type not in KV_TYPES:
        raise KtlongError(f"kv_type {kv_type} is not one of {', '.join(KV_TYPES)}")
    if kv_type in QUANT_KV and head_dim % kvquant.QBLOCK:
        raise KtlongError(f"kv_type {kv_type} needs a head_dim that is a multiple of "
                          f"{kvquant.QBLOCK}; this model's is {head_dim}",
                          hint="use kv_type BF16 (--kv-type BF16)")


def _torch_view(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array as a torch tensor without a copy (read-only arrays too: only read)."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        t = torch.from_numpy(a)
    else:  # a cache-mapped array: torch warns that it is read-only; it is only read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
    return t if dtype is None else t.view(dtype)


def _quantise(x: torch.Tensor, kind: int) -> np.ndarray:
    """float32 [..., d] -> uint8 rows [..., row_bytes]; bit-equal to kvquant.encode_ref."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, d // kvquant.QBLOCK, kvquant.QBLOCK)  # [..., nb, 32]
    if kind == kvquant.Q8_0:
        scale = (blocks.abs().amax(-1) / 127.0).half()
        lo, hi = -127, 127
    else:
        big = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))[..., 0]
        scale = (big / -8.0).half()
        lo, hi = -8, 7
    s = scale.float().unsqueeze(-1)
    q = torch.where(s != 0, torch.round(blocks / s), 0.0).clamp_(lo, hi).to(torch.int16)
    out = torch.zeros((*lead, kvquant.row_bytes(kind, d)), dtype=torch.uint8)
    nc = kvquant.code_bytes(kind, d)
    if kind == kvquant.Q8_0:
        out[..., :nc] = q.to(torch.int8).view(torch.uint8).reshape(*lead, d)
    else:
        c = (q + 8).to(torch.uint8)
        out[..., :nc] = (c[..., :16] | (c[..., 16:] << 4)).reshape(*lead, nc)
    out[..., nc : nc + 2 * (d // kvquant.QBLOCK)] = scale.view(torch.uint8).reshape(*lead, -1)
    return out.numpy()


def _dequantise(a: np.ndarray, kind: int) -> torch.Tensor:
    """uint8 rows [..., row_bytes] -> float32 [..., d] (a new tensor)."""
    d = kvquant.head_dim_of(kind, a.shape[-1])
    t = _torch_view(a)
    lead, nc, nb = t.shape[:-1], kvquant.code_bytes(kind, d), d // kvquant.QBLOCK
    scale = t[..., nc : nc + 2 * nb].contiguous().view(torch.float16).float()  # [..., nb]
    if kind == kvquant.Q8_0:
        q = t[..., :d].contiguous().view(torch.int8).float()
    else:
        c = t[..., :nc].reshape(*lead, nb, 16).to(torch.int16)
        q = (torch.cat([c & 15, c >> 4], -1) - 8).float()
    return (q.reshape(*lead, nb, kvquant.QBLOCK) * scale.unsqueeze(-1)).reshape(*lead, d)


def to_storage(x: torch.Tensor, kv_type: str) -> np.ndarray:
    """[..., d] float tensor (any device) -> numpy array in the store's storage dtype."""
    _, tdtype, kind = KV_TYPES[kv_type]
    if kv_type in QUANT_KV:
        return _quantise(x.detach().to(device="cpu", dtype=torch.float32), kind)
    x = x.detach().to(device="cpu", dtype=tdtype).contiguous()
    if kv_type == "FP32":
        return x.numpy()
    return x.view(torch.int16).numpy().view(np.uint16)


def from_storage(a: np.ndarray, kv_type: str) -> torch.Tensor:
    """Numpy storage array -> float32 torch tensor (a copy); quantised rows [..., row_bytes] give
    [..., head_dim]."""
    _, tdtype, kind = KV_TYPES[kv_type]
    if kv_type in QUANT_KV:
        return _dequantise(a, kind)
    if kv_type == "FP32":
        return torch.from_numpy(np.array(a, dtype=np.float32))  # always a copy (a may be read-only)
    return _torch_view(a.view(np.int16), tdtype).float()


def _file_rss() -> int:
    """Bytes of file-backed (and shared) pages resident in this process: /proc/self/statm."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except OSError:  # no procfs (not Linux): never release early
        return 0


HUGE_REGION = 8 << 20  # bytes a head's tail region holds before it takes 2 MB pages


def _advise(a: np.ndarray, advice: int) -> bool:
    """madvise the whole pages inside array `a`'s memory; False where the OS refuses."""
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page
    end = (a.ctypes.data + a.nbytes) // page * page
    if end <= start:
        return False
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _punch(m: mmap.mmap, start: int, n: int) -> None:
    """Free the file's pages under bytes [start, start + n) of the shared mapping `m` (page
    aligned): they read as zeros again."""
    m.madvise(mmap.MADV_REMOVE, start, n)


class TierFile:
    """The disk tier's file: an anonymous-after-creation file under `folder`, mapped shared.

    The file is unlinked as soon as it is mapped, so a killed process leaves nothing behind and
    no later run can mistake a half-written tier for a valid one; the space is freed when the
    mapping closes. Pages the process touches stay in the page cache while memory allows."""

    def __init__(self, folder: Path, nbytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kv-tier-", suffix=".tmp", dir=folder)
        try:
            os.unlink(name)
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))  # reserve now: no SIGBUS when full
            except OSError as e:
                raise KtlongError(
                    f"the KV disk tier needs {nbytes / 1e9:.1f} GB in {folder}: {e.strerror}",
                    hint="free disk space, move it with --cache-dir, or lower max_seq_len",
                ) from None
            self.mmap = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.mmap.madvise(mmap.MADV_RANDOM)  # decode reads scattered blocks
        self.offset = 0

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, int]:
        """The next `shape` array of the file (page-aligned), and its offset in the file."""
        off = self.offset
        a = np.frombuffer(self.mmap, dtype, int(np.prod(shape)), off).reshape(shape)
        self.offset += KVStore.tail_bytes(shape, dtype)
        return a, off

    def clear(self, start: int, end: int) -> None:
        """Bytes [start, end) read as zeros again; their whole pages go back to the file system
        (a hole punched through the mapping) where it can, else they stay reserved."""
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, end // page * page
        if a >= b:
            self.mmap[start:end] = bytes(end - start)
            return
        self.mmap[start:a] = bytes(a - start)
        self.mmap[b:end] = bytes(end - b)
        try:
            _punch(self.mmap, a, b - a)
        except (AttributeError, OSError):  # no hole punching here: zero the pages instead
            for o in range(a, b, 1 << 26):
                self.mmap[o:min(b, o + (1 << 26))] = bytes(min(b, o + (1 << 26)) - o)

    def prefetch(self, runs: list[tuple[int, int]]) -> None:
        """Start reading the byte runs (offset, length) into the page cache, all at once (the
        kernel queues them; a page fault would read one page at a time, waiting for each)."""
        page = mmap.PAGESIZE
        for off, n in runs:
            a = off // page * page
            self.mmap.madvise(mmap.MADV_WILLNEED, a, off + n - a)


class KVStore:
    """K, V and block anchors for every layer of one conversation.

    `capacity` is the most tokens the store can hold (max_seq_len). Tail arrays come from
    np.zeros (or a fresh sparse file with the disk tier), so pages are only touched as tokens
    are written.
    """

    def __init__(
        self,
        shape: StoreShape,
        capacity: int,
        base: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
        base_anchors: list[np.ndarray] | None = None,
        nb_base: int | None = None,
        tier_dir: Path | None = None,
    ) -> None:
        check_kv_type(shape.kv_type, shape.head_dim)
        self.shape = shape
        self.capacity = capacity
        dtype, _, self.kv_kind = KV_TYPES[shape.kv_type]
        L, H, bs, d = shape.n_layers, shape.n_kv_heads, shape.block_size, shape.head_dim
        row = self.row = row_elems(shape.kv_type, d)
        self.nb_cap = -(-capacity // bs)
        if base is None:
            empty = np.zeros((H, 0, bs, row), dtype)
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
        self.tier_dir = tier_dir
        self.tier: TierFile | None = None
        self._new_tail(self.nb_cap - self.nb_base)
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
        # how much each layer changes the hidden state (SqueezeAttention, ktlong/squeeze.py):
        # the sum over the prefilled tokens of cos(layer input, layer output), and their count;
        # kept with the KV so that a prompt-cache entry brings it back
        self.layer_cos_sum = np.zeros(L, np.float64)
        self.layer_cos_tokens = 0
        # a prompt-cache entry's sliding-window rows (ktlong.slidingkv), for the session it opens
        self.window_rows: np.ndarray | None = None
        # mapped KV (a cache entry's base, the disk tier): pages a step reads (and their
        # neighbours: the page cache works in large folios) stay mapped, and in RSS, until
        # released; `check_resident` bounds them
        maps = {id(a._mmap): a._mmap for a in self.k_base + self.v_base
                if isinstance(a, np.memmap) and a._mmap is not None}
        self._maps = list(maps.values()) + ([self.tier.mmap] if self.tier else [])
        self.block_bytes = 2 * H * bs * row * np.dtype(dtype).itemsize  # K + V, all heads
        self.map_cap = self.step_cap = MAP_CAP_MIN  # step_cap: two decode steps' reads
        self._whole = 1 << 62  # mapped bytes (bound_residency): a cap past them is never reached
        self._file_rss0 = _file_rss() if self._maps else 0

    def _new_tail(self, nb_tail: int) -> None:
        """Fresh (zero) tail arrays of `nb_tail` blocks per layer: RAM, or a new tier file."""
        s, dtype = self.shape, KV_TYPES[self.shape.kv_type][0]
        tail_shape = (s.n_kv_heads, nb_tail, s.block_size, self.row)
        if self.tier_dir is not None:
            self.tier = TierFile(self.tier_dir,
                                 2 * s.n_layers * self.tail_bytes(tail_shape, dtype))
            self.k_tail, self.v_tail, self._tier_off = [], [], []
            for _ in range(s.n_layers):
                (k, ko), (v, vo) = self.tier.array(tail_shape, dtype), self.tier.array(
                    tail_shape, dtype)
                self.k_tail.append(k)
                self.v_tail.append(v)
                self._tier_off.append((ko, vo))
        else:
            self.k_tail = [np.zeros(tail_shape, dtype) for _ in range(s.n_layers)]
            self.v_tail = [np.zeros(tail_shape, dtype) for _ in range(s.n_layers)]
            # 4 KB pages until a head's region holds HUGE_REGION bytes: its first token would
            # otherwise bring in a 2 MB page (NumPy asks for them), 1 GB at 8B widths for a
            # short document; past that the 2 MB pages save the decode's TLB misses
            small = getattr(mmap, "MADV_NOHUGEPAGE", None)
            self._huge_from = max(1, HUGE_REGION // (self.row * np.dtype(dtype).itemsize))
            self._huge = [small is None or not all(_advise(t[layer], small)
                                                    for t in (self.k_tail, self.v_tail))
                          for layer in range(s.n_layers)]

    def detach_base(self, nb: int) -> None:
        """Use only the base's first `nb` blocks: the rest, and the tail, are copied into a new
        tail (RAM, or a new tier file) `nb_base - nb` blocks longer, so tokens from block `nb` on
        can be rewritten (a context shift inside a /load-ed conversation). Memory for both tails
        is held while copying."""
        if nb >= self.nb_base:
            return
        old_tier = self.tier
        moved, used = self.nb_base - nb, -(-self.length // self.shape.block_size) - self.nb_base
        k_old, v_old = self.k_tail, self.v_tail
        self._new_tail(self.nb_cap - nb)
        for layer in range(self.shape.n_layers):
            for new, base, old in ((self.k_tail, self.k_base, k_old),
                                   (self.v_tail, self.v_base, v_old)):
                new[layer][:, :moved] = base[layer][:, nb : self.nb_base]
                new[layer][:, moved : moved + used] = old[layer][:, :used]
        del k_old, v_old
        if old_tier is not None:
            self._maps.remove(old_tier.mmap)
        if self.tier is not None:
            self._maps.append(self.tier.mmap)
        self.nb_base = nb
        self._views = [None] * self.shape.n_layers  # the kernels' views of the old arrays

    def adopt_base(self, src: KVStore) -> None:
        """Read blocks [nb_base, src.nb_base) from `src`'s memory-mapped base, a prompt-cache
        entry just written from this store (the same tokens), and give this store's copy of
        them on the disk tier back to the file system: a saved document is on disk once, not
        twice. The tail stays where it is in the tier file, laid out again for the blocks from
        `src.nb_base` on. Nothing to do for a RAM tail."""
        drop = src.nb_base - self.nb_base
        if self.tier is None or drop <= 0:
            return
        bs, L = self.shape.block_size, self.shape.n_layers
        keep = -(-self.length // bs) - src.nb_base  # blocks the new tail holds
        blk = self.block_bytes // (2 * self.shape.n_kv_heads)  # one head-block of K (or V)
        for layer in range(L):
            for i, tails in enumerate((self.k_tail, self.v_tail)):
                old = tails[layer]  # [H, T, bs, row]
                H, T = old.shape[:2]
                off, t = self._tier_off[layer][i], T - drop
                new = np.frombuffer(self.tier.mmap, old.dtype, H * t * bs * self.row,
                                    off).reshape(H, t, bs, self.row)
                for h in range(H):  # each head moves back: its destination precedes its source
                    new[h, :keep] = old[h, drop:drop + keep]
                for h in range(H):  # what the new layout leaves free reads as zeros again
                    self.tier.clear(off + (h * t + keep) * blk, off + (h + 1) * t * blk)
                self.tier.clear(off + H * t * blk, off + H * T * blk)
                tails[layer] = new
        self.k_base, self.v_base, self.nb_base = src.k_base, src.v_base, src.nb_base
        self._maps += [m for m in src._maps if m not in self._maps]
        self._views = [None] * L
        self._file_rss0 = _file_rss()

    @staticmethod
    def tail_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
        """Bytes of one tail array in the tier file (page-aligned)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE

    # --- sizes -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens held by every layer (layers differ only in the middle of a prefill)."""
        return min(self.lengths)

    def nbytes_used(self) -> int:
        s = self.shape
        return self.length * s.n_layers * self.block_bytes // s.block_size

    # --- the layers' similarities --------------------------------------------------------------
    def add_layer_cos(self, sums: np.ndarray, n_tokens: int) -> None:
        """Add one prefill's per-layer sums of cosines `[n_layers]` over its `n_tokens`."""
        self.layer_cos_sum += np.asarray(sums, np.float64)
        self.layer_cos_tokens += n_tokens

    def layer_similarity(self) -> np.ndarray | None:
        """`[n_layers]` mean cosine of each layer's input and output hidden states over the
        prefilled tokens; None when nothing was measured (e.g. an older cache entry)."""
        if not self.layer_cos_tokens:
            return None
        return self.layer_cos_sum / self.layer_cos_tokens

    def copy_layer_cos(self, src: KVStore) -> None:
        """Take `src`'s measured similarities (a store copied or converted from it)."""
        self.layer_cos_sum = src.layer_cos_sum.copy()
        self.layer_cos_tokens = src.layer_cos_tokens

    # --- writing -----------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append k, v `[Hkv, n, d]` to `layer`; returns the position of the first new token."""
        return self.write_rows(layer, to_storage(k, self.shape.kv_type),
                               to_storage(v, self.shape.kv_type))

    def write_f32(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        """Append one token's k, v `[Hkv, d]` float32 (a decode step)."""
        if self.shape.kv_type in QUANT_KV:
            return self.write(layer, torch.from_numpy(k)[:, None], torch.from_numpy(v)[:, None])
        kind = KV_TYPES[self.shape.kv_type][2]
        if kind == 2:
            return self.write_rows(layer, kernels.f32_to_kv(k, kind)[:, None],
                                   kernels.f32_to_kv(v, kind)[:, None])
        start, off = self._room(layer, 1)  # FP32, BF16: encoded and placed in one kernel call
        kernels.put_token(self.k_tail[layer], self.v_tail[layer], off,
                          np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32))
        return self._wrote(layer, start, off, 1)

    def write_rows(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        """Append rows already in the storage format, `[Hkv, n, row]`."""
        n = k.shape[1]
        start, off = self._room(layer, n)
        H = self.shape.n_kv_heads
        self.k_tail[layer].reshape(H, -1, self.row)[:, off : off + n] = k
        self.v_tail[layer].reshape(H, -1, self.row)[:, off : off + n] = v
        return self._wrote(layer, start, off, n)

    def _room(self, layer: int, n: int) -> tuple[int, int]:
        """(first position, its row in the tail) of n tokens to append to `layer`, or the error
        of a full store."""
        start = self.lengths[layer]
        if start + n > self.capacity:
            raise KtlongError(
                f"the conversation needs {start + n} tokens but max_seq_len is {self.capacity}",
                hint="raise max_seq_len (ktlong memcheck) or /reset",
            )
        return start, start - self.nb_base * self.shape.block_size

    def _wrote(self, layer: int, start: int, off: int, n: int) -> int:
        """Count n tokens appended to `layer` at `start` (tail row `off`); returns start."""
        self.lengths[layer] = start + n
        if self.tier is None and not self._huge[layer] and off + n >= self._huge_from:
            for t in (self.k_tail, self.v_tail):
                _advise(t[layer], mmap.MADV_HUGEPAGE)
            self._huge[layer] = True
        return start

    def rewrite(self, layer: int, k: torch.Tensor, v_rows: np.ndarray) -> None:
        """Replace `layer`'s tokens by k `[Hkv, n, d]` float32 and v rows already in the storage
        format (a Locret eviction); its anchors are taken again when the blocks are."""
        if self.nb_base:
            raise ValueError("cannot rewrite a store with a read-only base segment")
        self.lengths[layer] = 0
        self.n_anchored[layer] = 0
        self.write_rows(layer, to_storage(k, self.shape.kv_type), v_rows)

    def truncate(self, n_tokens: int) -> None:
        """Forget every token from `n_tokens` on (the base segment cannot be cut)."""
        bs = self.shape.block_size
        if n_tokens < self.nb_base * bs:
            raise ValueError("cannot truncate into the read-only base segment")
        full = n_tokens // bs
        if n_tokens == 0:  # a new prompt: its own similarities (a shorter cut keeps the sums)
            self.layer_cos_sum[:] = 0.0
            self.layer_cos_tokens = 0
        for layer in range(self.shape.n_layers):
            self.lengths[layer] = min(self.lengths[layer], n_tokens)
            self.n_anchored[layer] = min(self.n_anchored[layer], full)

    def prefetch(self, layer: int, blocks: np.ndarray) -> None:
        """Ask the disk tier for the head-blocks a step is about to read, `blocks` [S, n]
        ascending (S 1: every KV head; else one row per KV head); neighbours are merged into one
        run. Nothing to do for a RAM tail."""
        if self.tier is None:
            return
        H = self.shape.n_kv_heads
        nb_tail = self.k_tail[layer].shape[1]
        blk = self.block_bytes // (2 * H)  # one head-block of K (or V)
        runs = []
        for j in range(H):
            ids = blocks[0 if blocks.shape[0] == 1 else j].astype(np.int64) - self.nb_base
            ids = ids[ids >= 0]
            if ids.size == 0:
                continue
            cut = np.flatnonzero(np.diff(ids) != 1) + 1  # runs of consecutive blocks
            for run in np.split(ids, cut):
                for base in self._tier_off[layer]:  # K, V
                    runs.append((base + (j * nb_tail + int(run[0])) * blk, len(run) * blk))
        self.tier.prefetch(runs)

    # --- a memory-mapped base: bounded residency ---------------------------------------------
    @property
    def mapped(self) -> bool:
        return bool(self._maps)

    def mapped_bytes(self) -> int:
        """Bytes of the files mapped under the store (a cache entry's base, the disk tier)."""
        return sum(len(m) for m in self._maps)

    def bound_residency(self, step_bytes: int) -> None:
        """Set `map_cap` for decoding: a mapped entry that stays resident (memory.stays_resident)
        stays mapped whole (a released page that a later step picks is faulted back in); a larger
        one, or the disk tier, keeps two steps' reads (`step_bytes` each) mapped."""
        from ktlong.memory import stays_resident

        self.step_cap = max(MAP_CAP_MIN, 2 * step_bytes)
        self._whole = whole = self.mapped_bytes()
        fits = self.tier is None and stays_resident(whole)
        self.map_cap = max(self.map_cap, whole + MAP_CAP_MIN if fits else self.step_cap)

    def check_resident(self) -> None:
        """Release the mapped pages once more than `map_cap` bytes of them are resident."""
        if (self._maps and self.map_cap <= self._whole
                and _file_rss() - self._file_rss0 > self.map_cap):
            self.release_mapped()

    def release_mapped(self) -> None:
        """Unmap the base's resident pages from this process (the OS page cache keeps them, so
        re-reading one is a minor fault): RSS stays near one working set, not the file size."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)
        # what stays resident is other files (e.g. weights mapped since): the new zero
        self._file_rss0 = _file_rss()

    # --- reading -----------------------------------------------------------------------------
    def row_range(
        self, layer: int, start: int, end: int, heads: slice = slice(None)
    ) -> tuple[np.ndarray, np.ndarray]:
        """K, V rows of tokens [start, end) of KV heads `heads` in the storage format,
        `[heads, end - start, row]` (views where one segment holds them all, else copies)."""
        H, row = self.shape.n_kv_heads, self.row
        split = self.nb_base * self.shape.block_size
        parts_k, parts_v = [], []
        if start < split:
            e = min(end, split)
            parts_k.append(self.k_base[layer].reshape(H, -1, row)[heads, start:e])
            parts_v.append(self.v_base[layer].reshape(H, -1, row)[heads, start:e])
        if end > split:
            s = max(start, split) - split
            parts_k.append(self.k_tail[layer].reshape(H, -1, row)[heads, s : end - split])
            parts_v.append(self.v_tail[layer].reshape(H, -1, row)[heads, s : end - split])
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return np.concatenate(parts_k, axis=1), np.concatenate(parts_v, axis=1)

    def token_range(
        self, layer: int, start: int, end: int, heads: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens [start, end) of KV heads `heads` as float32 tensors
        `[heads, end - start, d]` (copies)."""
        k, v = self.row_range(layer, start, end, heads)
        kt, vt = from_storage(k, self.shape.kv_type), from_storage(v, self.shape.kv_type)
        if start < self.nb_base * self.shape.block_size or self.tier is not None:
            self.check_resident()  # a dense sweep over mapped KV reads it segment by segment
        return kt, vt

    def key_range(self, layer: int, start: int, end: int) -> torch.Tensor:
        """K of tokens [start, end) as a float32 tensor `[Hkv, end - start, d]` (a copy)."""
        k, _ = self.row_range(layer, start, end, slice(None))
        kt = from_storage(k, self.shape.kv_type)
        if start < self.nb_base * self.shape.block_size or self.tier is not None:
            self.check_resident()
        return kt

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
