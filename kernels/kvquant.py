"""Quantised KV rows (Q8_0, Q4_0): the format, a NumPy reference, and Numba row helpers.

A row is one token's key (or value) for one KV head: d channels in blocks of 32, each block with
one scale, as llama.cpp's q8_0 / q4_0, but laid out so a kernel reads codes in one sweep:
  Q8_0: bytes [0, d)       int8 codes, channel c at byte c
  Q4_0: bytes [0, d/2)     block b at bytes 16b..16b+15: byte 16b+j holds channel 32b+j in its
                           low nibble, 32b+j+16 in its high one, as q + 8 (llama.cpp's order)
  then d/32 float16 scales (block b's at 2b), zero-padded to a multiple of 4 bytes.
Value = q * scale. Q8_0: scale = max|x| / 127; Q4_0: scale = -x_m / 8 where x_m is the block's
value of largest magnitude (so it lands exactly on q = -8). q = round-half-even(x / scale) with the
float16 scale, clipped. Storage arrays are uint8 [Hkv, blocks, bs, row_bytes]; kernels view them as
int32 (Q8_0) or uint32 (Q4_0) words, so the row format is carried by the element type.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ._simd import F32, to_f32

Q8_0, Q4_0 = 3, 4  # kv_kind of the two formats (0 FP32, 1 BF16, 2 FP16)
QBLOCK = 32
_PER_BLOCK = {Q8_0: 34, Q4_0: 18}  # bytes per 32 channels: codes + one float16 scale


def row_bytes(kind: int, d: int) -> int:
    """Bytes of one stored row of d channels."""
    if kind == 0:
        return 4 * d
    if kind in (1, 2):
        return 2 * d
    return -(-_PER_BLOCK[kind] * d // QBLOCK // 4) * 4


def code_bytes(kind: int, d: int) -> int:
    """Bytes of a quantised row's codes (its scales follow)."""
    return d if kind == Q8_0 else d // 2


def encode_ref(x: np.ndarray, kind: int) -> np.ndarray:
    """NumPy quantisation of float32 rows x [..., d] (d % 32 == 0) -> uint8 [..., row_bytes]."""
    x = np.ascontiguousarray(x, F32)
    d = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], d // QBLOCK, QBLOCK)  # [..., nb, 32]
    if kind == Q8_0:
        scale = (np.abs(blocks).max(-1) / F32(127)).astype(np.float16)
        lo, hi = -127, 127
    else:
        idx = np.abs(blocks).argmax(-1)[..., None]
        scale = (np.take_along_axis(blocks, idx, -1)[..., 0] / F32(-8)).astype(np.float16)
        lo, hi = -8, 7
    s = scale.astype(F32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.rint(blocks / s), F32(0))
    q = np.clip(q, lo, hi).astype(np.int16)
    if kind == Q8_0:
        codes = q.astype(np.int8).view(np.uint8).reshape(*x.shape[:-1], d)
    else:
        c = (q + 8).astype(np.uint8)
        codes = (c[..., :16] | (c[..., 16:] << 4)).reshape(*x.shape[:-1], d // 2)
    out = np.zeros((*x.shape[:-1], row_bytes(kind, d)), np.uint8)
    nc = code_bytes(kind, d)
    out[..., :nc] = codes
    out[..., nc:nc + 2 * (d // QBLOCK)] = scale.view(np.uint8).reshape(*x.shape[:-1],
                                                                        2 * (d // QBLOCK))
    return out


def decode_ref(a: np.ndarray, kind: int, d: int) -> np.ndarray:
    """NumPy dequantisation of rows a [..., row_bytes] -> float64 [..., d]."""
    a = np.ascontiguousarray(a, np.uint8)
    nc, nb = code_bytes(kind, d), d // QBLOCK
    scale = a[..., nc:nc + 2 * nb].copy().view(np.float16).astype(np.float64)  # [..., nb]
    if kind == Q8_0:
        q = a[..., :d].view(np.int8).astype(np.float64)
    else:
        c = a[..., :nc].reshape(*a.shape[:-1], nb, 16).astype(np.int16)
        q = (np.concatenate([c & 15, c >> 4], -1) - 8).astype(np.float64)
    q = q.reshape(*a.shape[:-1], nb, QBLOCK)
    return (q * scale[..., None]).reshape(*a.shape[:-1], d)


def head_dim_of(kind: int, row: int) -> int:
    """d of a stored row of `row` elements of the storage array (bytes, for the quantised
    formats): the inverse of row_bytes."""
    if kind in (0, 1, 2):
        return row
    return row * QBLOCK // _PER_BLOCK[kind] // QBLOCK * QBLOCK


# --- inside the kernels ---------------------------------------------------------------------------
def kv_dim(a):
    """Channels of a KV row array (any ndim, last axis = one row) of a storage dtype."""
    raise NotImplementedError  # compiled only (see the overload)


def kv_row_bytes(a, d):
    """Bytes of one row of d channels in the storage format of `a`'s element type."""
    raise NotImplementedError


def row_to_f32(r, out):
    """out[:d] = the d channels of the stored row r (1-D, storage dtype) as float32."""
    raise NotImplementedError


@overload(kv_dim, inline="always")
def _kv_dim(a):
    if a.dtype == types.int32:
        return lambda a: (a.shape[-1] * 4 * QBLOCK // 34) // QBLOCK * QBLOCK
    if a.dtype == types.uint32:
        return lambda a: (a.shape[-1] * 4 * QBLOCK // 18) // QBLOCK * QBLOCK
    return lambda a: a.shape[-1]


@overload(kv_row_bytes, inline="always")
def _kv_row_bytes(a, d):
    if a.dtype == types.int32:
        return lambda a, d: (d + d // 16 + 3) // 4 * 4
    if a.dtype == types.uint32:
        return lambda a, d: (d // 2 + d // 16 + 3) // 4 * 4
    return lambda a, d: d * a.itemsize


@overload(row_to_f32, inline="always")
def _row_to_f32(r, out):
    if r.dtype == types.int32:
        def q8(r, out):
            d = out.shape[0]
            codes, scales = r.view(np.int8), r.view(np.int16)
            for b in range(d // QBLOCK):
                s = to_f32(scales[d // 2 + b])
                for c in range(b * QBLOCK, (b + 1) * QBLOCK):
                    out[c] = F32(codes[c]) * s
        return q8
    if r.dtype == types.uint32:
        def q4(r, out):
            d = out.shape[0]
            codes, scales = r.view(np.uint8), r.view(np.int16)
            for b in range(d // QBLOCK):
                s = to_f32(scales[d // 4 + b])
                for j in range(16):
                    x = np.int32(codes[16 * b + j])
                    out[QBLOCK * b + j] = F32((x & 15) - 8) * s
                    out[QBLOCK * b + j + 16] = F32((x >> 4) - 8) * s
        return q4

    def plain(r, out):
        for c in range(out.shape[0]):
            out[c] = to_f32(r[c])
    return plain
