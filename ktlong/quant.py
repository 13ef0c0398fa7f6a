"""GGUF weight formats: the block layouts ktlong keeps as they are in the file.

A GGUF tensor of shape [rows, k] is stored row after row; each row is k / block elements cut into
blocks of `block` elements, each `nbytes` bytes. The kernels (kernels/qlinear.py) read these bytes
straight from the memory-mapped file. This module knows the sizes, quantises (for the benchmark's
model generator and tests: plain min/max rounding, not llama.cpp's search) and dequantises through
the `gguf` package's reference code.

Layouts (ggml's, little-endian; f16 = IEEE half):
- Q8_0  [32]:  d f16 | q int8[32]                  x = d * q
- Q4_0  [32]:  d f16 | qs u8[16]                   x[i] = d * ((qs[i] & 15) - 8), x[i+16]: >> 4
- Q4_1  [32]:  d, m f16 | qs u8[16]                x[i] = d * (qs[i] & 15) + m, x[i+16]: >> 4
- Q5_0  [32]:  d f16 | qh u32 | qs u8[16]          x[i] = d * (q[i] - 16), 5-bit q[i]: the nibble
               as Q4_0 (qs[i] & 15, x[i+16]: qs[i] >> 4) | bit i of qh << 4
- Q5_1  [32]:  d, m f16 | qh u32 | qs u8[16]       x[i] = d * q[i] + m, q[i] as Q5_0's
- Q4_K  [256]: d, dmin f16 | scales u8[12] | qs u8[128]
               8 sub-blocks of 32, 6-bit scale sc and min m each: x = d*sc*q - dmin*m;
               qs[32c + i]: low nibble = sub-block 2c element i, high nibble = sub-block 2c+1
- Q5_K  [256]: as Q4_K with qh u8[32] before qs: bit j of qh[i] is bit 4 of sub-block j's i
- Q6_K  [256]: ql u8[128] | qh u8[64] | scales int8[16] | d f16; 16 sub-blocks of 16:
               x = d * sc * (q - 32), q 6 bits: element h*128 + c*32 + i (h < 2, c < 4) has its
               low 4 bits in ql[h*64 + (c&1)*32 + i] (low nibble for c < 2) and its high 2 bits
               at bit 2c of qh[h*32 + i]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QType:
    name: str
    ggml: int  # ggml's type id, which is also the kernels' `qtype`
    block: int  # elements per block
    nbytes: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.nbytes

    def tensor_bytes(self, rows: int, k: int) -> int:
        return rows * self.row_bytes(k)


TYPES = {t.name: t for t in (
    QType("F32", 0, 1, 4),
    QType("F16", 1, 1, 2),
    QType("Q4_0", 2, 32, 18),
    QType("Q4_1", 3, 32, 20),
    QType("Q5_0", 6, 32, 22),
    QType("Q5_1", 7, 32, 24),
    QType("Q8_0", 8, 32, 34),
    QType("Q4_K", 12, 256, 144),
    QType("Q5_K", 13, 256, 176),
    QType("Q6_K", 14, 256, 210),
    QType("BF16", 30, 1, 2),
)}
BY_ID = {t.ggml: t for t in TYPES.values()}
QK_K = 256


def dequantize_ref(raw: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """Reference dequantisation (the `gguf` package's): raw [rows, row_bytes] -> [rows, k] f32."""
    import gguf

    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, TYPES[qtype].row_bytes(k))
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """x [rows, k] float -> [rows, row_bytes] uint8 in `qtype`'s layout."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    t = TYPES[qtype]
    if k % t.block:
        raise ValueError(f"{qtype} needs rows of a multiple of {t.block} elements, got {k}")
    if qtype in ("F32", "F16"):
        return x.astype(np.float32 if qtype == "F32" else np.float16).view(np.uint8)
    blocks = x.reshape(-1, t.block)
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):
        import gguf

        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype]).view(np.uint8)
    out = {"Q4_K": _q4k, "Q5_K": _q5k, "Q6_K": _q6k}[qtype](blocks)  # [n_blocks, nbytes]
    return out.reshape(rows, t.row_bytes(k))


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def _scale_min(sub: np.ndarray, levels: int):
    """Per sub-block scale and min for q in [0, levels]: sub [n, 8, 32] -> 6-bit sc, m [n, 8],
    d, dmin [n] f16-rounded, and q [n, 8, 32]."""
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n, 8]; a positive min is 0 (the min is subtracted)
    scale = (sub.max(axis=-1) - lo) / levels
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)  # [n]
    dmin = ((-lo).max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        step = d[:, None] * sc  # [n, 8]
        q = np.where(step[..., None] > 0,
                     np.rint((sub + (dmin[:, None] * m)[..., None]) / step[..., None]), 0)
    return sc.astype(np.uint8), m.astype(np.uint8), d, dmin, q.clip(0, levels).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [n, 8] -> the 12-byte K-quant scale field [n, 12]."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q4k(blocks: np.ndarray) -> np.ndarray:
    sc, m, d, dmin, q = _scale_min(blocks.reshape(-1, 8, 32), 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c, 2c+1
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales(sc, m), qs], axis=1)


def _q5k(blocks: np.ndarray) -> np.ndarray:
    sc, m, d, dmin, q = _scale_min(blocks.reshape(-1, 8, 32), 31)
    lo = q & 15
    qs = (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales(sc, m), qh, qs], axis=1)


def _q6k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # [n, 16]
    scale = -big / 32  # signed, as ggml: the largest |x| maps to -32
    d = (np.abs(scale).max(axis=-1) / 127).astype(np.float16).astype(np.float32)  # [n]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127)
        step = d[:, None] * sc
        q = np.where(step[..., None] != 0, np.rint(sub / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, h, c, i]
    ql = np.empty((q.shape[0], 2, 2, 32), np.uint8)  # [n, h, c & 1, i]
    ql[:] = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for c in range(4):
        qh |= (q[:, :, c] >> 4) << (2 * c)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
