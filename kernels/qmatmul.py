"""Quantised prefill GEMM: Y = X W^T for many token rows over GGUF weights, on int8 products.

- `quantise_rows(x, qtype)`: each token row rounded to int8 codes per group of channels (256 for
  K-quants, 32 for the 32-blocks: the rounding of the decode GEMV, kernels/qlinear.py, as
  llama.cpp's Q8_K / Q8_0 activations), with each sub-block's scale and scaled code sum.
- `qgemm(w, qtype, x)`: y [M, N] = W times the rounded x, exactly (up to float32 sums).

A work item takes 16 weight rows: their GGUF blocks are decoded once into unsigned codes laid out
for the tile products (kernels/_qtile.py: [sub-block, 4-channel group, row, 4] bytes) with each
sub-block's scale s and constant term z (value = s q + z; Q4_0's -8 d, Q8_0's +128 shift, the
K-quants' mins), a few hundred KB that stay in L2, then multiplied by every 16-token tile of
the chunk: AMX `tdpbsud` where the CPU has it, else AVX512-VNNI `vpdpbusd`, else AVX-VNNI's
256-bit `vpdpbusd`, else AVX2 `vpmaddubsw` (`GEMM_PATH`; `qgemm(path=...)` takes another the
CPU has). Sub-blocks are 32 channels (16 for Q6_K, whose scales are per 16). The items go to
both cores (prange).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._qtile import (
    AMX,
    AMX_BF16,
    AVX2,
    AVXVNNI,
    PEAK_OPS,
    VNNI512,
    amx16,
    amx32,
    avx2_4bit,
    avx2_5bit,
    avx2_6bit,
    avx2_q8,
    avxvnni16,
    avxvnni32,
    peak_amx_bf16,
    peak_amx_int8,
    peak_avx2,
    peak_vnni,
    vnni16,
    vnni32,
)
from ._qvec import codes16
from ._simd import F32, FASTMATH, readonly
from .qlinear import BLOCK, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _check, _u32, _x_scale
from .qlinear import _half1 as _half
from .threads import use_threads

GEMM_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
TILE = 16  # tokens a tile, weight rows a block
PAD = 64  # bytes past each row of x's codes


def sub_width(qtype: int) -> int:
    """Channels of a sub-block (one scale): 16 for Q6_K, else 32."""
    return 16 if qtype == Q6_K else 32


def x_group(qtype: int) -> int:
    """Channels that share one scale of x: 256 for K-quants, 32 for the 32-blocks."""
    return 256 if BLOCK[qtype][0] == 256 else 32


# the tile products, best first, and whether this CPU has each
GEMM_PATHS = ("amx", "avx512-vnni", "avx-vnni", "avx2")
HAVE_PATH = {"amx": AMX, "avx512-vnni": VNNI512, "avx-vnni": AVXVNNI, "avx2": AVX2}
GEMM_PATH = next((p for p in GEMM_PATHS if HAVE_PATH[p]), None)  # the one qgemm takes
INT8_GEMM = GEMM_PATH is not None  # whether this CPU has the int8 GEMM


def qgemm_rounding(qtype: int) -> tuple[int, int]:
    """How `quantise_rows` rounds x for `qtype`: (sub-block width, channels a scale); types with
    the same rounding can share one."""
    return sub_width(qtype), x_group(qtype)


def gemm_path(qtype: int, k: int) -> bool:
    """Whether `qgemm` runs this type and width on this CPU (AMX, AVX512-VNNI, AVX-VNNI or
    AVX2)."""
    return INT8_GEMM and qtype in GEMM_TYPES and k % x_group(qtype) == 0


@njit(fastmath=FASTMATH, cache=True, parallel=True)
def _quantise_rows(x, g, group, codes, dxs, sv):
    # x [M, K] f32 -> codes [M16, K] i8, dxs [M16, K/g] f32 (x's scale over sub-block j's
    # group), sv [M16, K/g] f32 (that scale x the sum of the codes of sub-block j); the rows past
    # M stay as given (zeros). No allocation here: a fill would be a parallel loop of its own
    m, k = x.shape
    xa0, qa0 = x.ctypes.data, codes.ctypes.data  # x and codes live past the loop
    for r in prange(m):
        xa, qa = xa0 + 4 * k * r, qa0 + codes.shape[1] * r
        for gi in range(k // group):
            dx, inv = _x_scale(xa + 4 * group * gi, group)
            for j in range(group * gi // g, group * (gi + 1) // g):
                s = 0
                for h in range(j * g // 16, (j + 1) * g // 16):
                    s += codes16(qa + 16 * h, xa + 64 * h, inv)
                dxs[r, j] = dx
                sv[r, j] = dx * F32(s)


@njit(fastmath=FASTMATH, cache=True)
def _unpack_row(w, qtype, tmp, s, z, m, signed):
    """Row w [row_bytes] -> its unsigned codes tmp [K] in channel order; scale and constant
    term of each sub-block into s[j, m], z[j, m]. `signed`: Q8_0's codes as they are (int8
    bits, no constant term), for the AVX2 product."""
    k = tmp.shape[0]
    if qtype == Q8_0:
        flip = np.uint8(0 if signed else 128)
        for b in range(k // 32):
            o = 34 * b
            d = _half(w, o)
            s[b, m], z[b, m] = d, F32(0 if signed else -128) * d
            for i in range(32):
                tmp[32 * b + i] = w[o + 2 + i] ^ flip
    elif qtype == Q4_0 or qtype == Q4_1:
        one = qtype == Q4_1
        nb = 20 if one else 18
        for b in range(k // 32):
            o = nb * b
            d = _half(w, o)
            s[b, m] = d
            z[b, m] = _half(w, o + 2) if one else F32(-8) * d
            qo = o + (4 if one else 2)
            for i in range(16):
                q = w[qo + i]
                tmp[32 * b + i] = q & np.uint8(15)
                tmp[32 * b + 16 + i] = q >> np.uint8(4)
    elif qtype == Q5_0 or qtype == Q5_1:
        one = qtype == Q5_1
        nb = 24 if one else 22
        for b in range(k // 32):
            o = nb * b
            ho = o + (4 if one else 2)
            d = _half(w, o)
            s[b, m] = d
            z[b, m] = _half(w, o + 2) if one else F32(-16) * d
            h = _u32(w, ho)
            for i in range(16):
                q = w[ho + 4 + i]
                tmp[32 * b + i] = (q & np.uint8(15)) | np.uint8(((h >> i) & 1) << 4)
                tmp[32 * b + 16 + i] = (q >> np.uint8(4)) | np.uint8(((h >> (i + 16)) & 1) << 4)
    elif qtype == Q6_K:
        for b in range(k // 256):
            o = 210 * b
            d = _half(w, o + 208)
            for j in range(16):
                sc = d * F32(np.int8(w[o + 192 + j]))
                s[16 * b + j, m], z[16 * b + j, m] = sc, F32(-32) * sc
            for h in range(2):
                for c in range(4):
                    lo, ho = o + 64 * h + 32 * (c & 1), o + 128 + 32 * h
                    ls, hs = np.uint8(4 * (c >> 1)), np.uint8(2 * c)
                    y = 256 * b + 128 * h + 32 * c
                    for i in range(32):
                        tmp[y + i] = ((w[lo + i] >> ls) & np.uint8(15)) | (
                            ((w[ho + i] >> hs) & np.uint8(3)) << np.uint8(4))
    else:  # Q4_K, Q5_K
        five = qtype == Q5_K
        nb = 176 if five else 144
        for b in range(k // 256):
            o = nb * b
            d, dmin = _half(w, o), _half(w, o + 2)
            for j in range(8):
                if j < 4:
                    sc, mn = w[o + 4 + j] & 63, w[o + 8 + j] & 63
                else:
                    sc = (w[o + 8 + j] & 15) | ((w[o + j] >> 6) << 4)
                    mn = (w[o + 8 + j] >> 4) | ((w[o + 4 + j] >> 6) << 4)
                s[8 * b + j, m], z[8 * b + j, m] = d * F32(sc), -dmin * F32(mn)
            qo = o + (48 if five else 16)
            for c in range(4):
                y = 256 * b + 64 * c
                for i in range(32):
                    q = w[qo + 32 * c + i]
                    lo, hi = q & np.uint8(15), q >> np.uint8(4)
                    if five:
                        hb = w[o + 16 + i] >> np.uint8(2 * c)
                        lo |= (hb & np.uint8(1)) << np.uint8(4)
                        hi |= (hb & np.uint8(2)) << np.uint8(3)
                    tmp[y + i] = lo
                    tmp[y + 32 + i] = hi


@njit(fastmath=FASTMATH, cache=True)
def _unpack(w, qtype, r0, r1, tmp, wb, s, z, signed):
    """Rows r0:r1 (at most 16) of w -> the block wb [K / 4 * 16] u32 (codes of row m, channels
    4c..4c+3, at word 16c + m), s, z [nsub, 16] f32; rows past r1 are zeros."""
    for m in range(16):
        if r0 + m < r1:
            _unpack_row(w[r0 + m], qtype, tmp, s, z, m, signed)
            t32 = tmp.view(np.uint32)
            for c in range(t32.shape[0]):
                wb[16 * c + m] = t32[c]
        else:
            for c in range(wb.shape[0] // 16):
                wb[16 * c + m] = 0
            s[:, m] = 0
            z[:, m] = 0


BLOCKS = 4  # weight blocks of 16 rows a work item: each token tile's codes are read from L3
# once for the item, then from L2 for its other blocks (one block an item: 0.5x the speed)


@njit(nogil=True, cache=True)
def _item(w, qtype, b0, b1, k, nsub, signed):
    """Weight blocks b0:b1 of 16 rows, unpacked: wb [BLOCKS, K / 4 * 16] u32, s, z
    [BLOCKS, nsub, 16] f32 (`_unpack`)."""
    n = w.shape[0]
    tmp = np.empty(k, np.uint8)
    wb = np.empty((BLOCKS, k // 4 * 16), np.uint32)
    s = np.empty((BLOCKS, nsub, 16), F32)
    z = np.empty((BLOCKS, nsub, 16), F32)
    for b in range(b0, b1):
        _unpack(w, qtype, 16 * b, min(n, 16 * b + 16), tmp, wb[b - b0], s[b - b0], z[b - b0],
                signed)
    return wb, s, z


# The GEMM, one function a family of tile products (each compiles only where the CPU has its
# instructions): w [N, row_bytes] u8; codes [M16, K + PAD] i8; dxs, sv [M16, K/g] f32 ->
# out [M16, N16] f32. Work items of BLOCKS weight blocks go to the threads; each product's
# addresses are taken inside the loop (Numba frees an array after its last use)

@njit(nogil=True, cache=True, inline="always")
def _tile_args(codes, dxs, sv, wb, s, z, out, t, b, b0, nsub):
    """A tile product's arguments: token tile t against weight block b of the item that starts
    at block b0 (wb, s, z from `_item`)."""
    xs, n16, i = codes.shape[1], out.shape[1], b - b0
    k = xs - PAD
    return (codes.ctypes.data + 16 * t * xs, xs, dxs.ctypes.data + 64 * t * nsub,
            sv.ctypes.data + 64 * t * nsub, wb.ctypes.data + i * 16 * k,  # 16 rows x k codes
            s.ctypes.data + i * 64 * nsub, z.ctypes.data + i * 64 * nsub, nsub,
            out.ctypes.data + 4 * (16 * t * n16 + 16 * b), 4 * n16)


@njit(parallel=True, nogil=True, cache=True)
def _qgemm(w, qtype, codes, dxs, sv, out, g, amx):
    # AMX (`amx`) or AVX512-VNNI
    k = codes.shape[1] - PAD
    nsub = k // g
    amx = amx and nsub % 2 == 0  # the AMX loop takes sub-blocks in pairs
    nblk = (w.shape[0] + 15) // 16
    for it in prange((nblk + BLOCKS - 1) // BLOCKS):
        b0, b1 = it * BLOCKS, min(nblk, it * BLOCKS + BLOCKS)
        wb, s, z = _item(w, qtype, b0, b1, k, nsub, False)
        for t in range(codes.shape[0] // 16):
            for b in range(b0, b1):
                a = _tile_args(codes, dxs, sv, wb, s, z, out, t, b, b0, nsub)
                if amx and g == 32:
                    amx32(*a)
                elif amx:
                    amx16(*a)
                elif g == 32:
                    vnni32(*a)
                else:
                    vnni16(*a)


@njit(parallel=True, nogil=True, cache=True)
def _qgemm_avxvnni(w, qtype, codes, dxs, sv, out, g):
    # AVX-VNNI: 256-bit vpdpbusd
    k = codes.shape[1] - PAD
    nsub = k // g
    nblk = (w.shape[0] + 15) // 16
    for it in prange((nblk + BLOCKS - 1) // BLOCKS):
        b0, b1 = it * BLOCKS, min(nblk, it * BLOCKS + BLOCKS)
        wb, s, z = _item(w, qtype, b0, b1, k, nsub, False)
        for t in range(codes.shape[0] // 16):
            for b in range(b0, b1):
                a = _tile_args(codes, dxs, sv, wb, s, z, out, t, b, b0, nsub)
                if g == 32:
                    avxvnni32(*a)
                else:
                    avxvnni16(*a)


@njit(parallel=True, nogil=True, cache=True)
def _qgemm_avx2(w, qtype, codes, dxs, sv, out, g):
    # AVX2: vpmaddubsw + vpmaddwd, the int16 sums by the type's code range (kernels/_qtile.py)
    k = codes.shape[1] - PAD
    nsub = k // g
    nblk = (w.shape[0] + 15) // 16
    for it in prange((nblk + BLOCKS - 1) // BLOCKS):
        b0, b1 = it * BLOCKS, min(nblk, it * BLOCKS + BLOCKS)
        wb, s, z = _item(w, qtype, b0, b1, k, nsub, True)
        for t in range(codes.shape[0] // 16):
            for b in range(b0, b1):
                a = _tile_args(codes, dxs, sv, wb, s, z, out, t, b, b0, nsub)
                if qtype == Q8_0:
                    avx2_q8(*a)
                elif qtype == Q6_K:
                    avx2_6bit(*a)
                elif qtype == Q5_0 or qtype == Q5_1 or qtype == Q5_K:
                    avx2_5bit(*a)
                else:
                    avx2_4bit(*a)


def quantise_rows(x: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] float32 rounded for `qtype`'s GEMM: (codes [M16, K + PAD] int8, dxs [M16, K/g],
    sv [M16, K/g] float32), M16 = M rounded up to a tile (the extra rows are zeros)."""
    x = readonly(x, np.dtype(F32))
    if x.ndim != 2 or x.shape[1] % x_group(qtype):
        raise ValueError(f"x must be [M, K] with K a multiple of {x_group(qtype)}, got "
                         f"{x.shape}")
    use_threads()
    m16, k = -(-x.shape[0] // TILE) * TILE, x.shape[1]
    g = sub_width(qtype)
    # a row of codes is K + 64 bytes: at K (a multiple of 4 KB) a tile's 16 rows would fall in
    # one L1 set
    codes = np.zeros((m16, k + PAD), np.int8)
    dxs, sv = np.zeros((m16, k // g), F32), np.zeros((m16, k // g), F32)
    _quantise_rows(x, g, x_group(qtype), codes, dxs, sv)
    return codes, dxs, sv


def qgemm(w: np.ndarray, qtype: int, x: np.ndarray,
          xq: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
          path: str | None = None) -> np.ndarray:
    """y [M, N] = W times x rounded to int8 (`quantise_rows`; pass `xq` to reuse a rounding
    of the same x for another matrix of the same sub-block width): w [N, row_bytes] uint8 in
    `qtype`, x [M, K] float32. `path`: the tile product (one of GEMM_PATHS this CPU has;
    default the best, GEMM_PATH)."""
    m, k = x.shape
    w = _check(w, qtype, k)
    path = GEMM_PATH if path is None else path
    if not gemm_path(qtype, k):
        raise ValueError(f"no int8 GEMM for type {qtype} at width {k} on this CPU")
    if not HAVE_PATH.get(path, False):
        raise ValueError(f"no {path} int8 GEMM on this CPU (it has: "
                         f"{', '.join(p for p in GEMM_PATHS if HAVE_PATH[p])})")
    codes, dxs, sv = quantise_rows(x, qtype) if xq is None else xq
    n = w.shape[0]
    out = np.empty((codes.shape[0], -(-n // TILE) * TILE), F32)
    use_threads()
    g = sub_width(qtype)
    if path == "avx2":
        _qgemm_avx2(w, qtype, codes, dxs, sv, out, g)
    elif path == "avx-vnni":
        _qgemm_avxvnni(w, qtype, codes, dxs, sv, out, g)
    else:
        _qgemm(w, qtype, codes, dxs, sv, out, g, path == "amx")
    return out[:m, :n]


def qgemm_ref(w: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
    """float64 reference of `qgemm`: the `gguf` package's dequantisation times x rounded as
    `quantise_rows` rounds it (codes x scale, per group of channels)."""
    import gguf

    codes, dxs, _ = quantise_rows(x, qtype)
    g = sub_width(qtype)
    m, k = x.shape
    xr = codes[:m, :k].astype(np.float64) * np.repeat(dxs[:m], g, axis=1)
    wd = gguf.quants.dequantize(np.asarray(w), gguf.GGMLQuantizationType(qtype))
    return xr @ wd.astype(np.float64).T


@njit(parallel=True, nogil=True, cache=True)
def _peak(kind, n, threads):
    # `threads` items of n turns of one instruction's loop (PEAK_OPS), one a thread
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        if kind == 0:
            out[t] = peak_vnni(n)
        elif kind == 1:
            out[t] = peak_amx_int8(n)
        else:
            out[t] = peak_amx_bf16(n)
    return out


@njit(parallel=True, nogil=True, cache=True)
def _peak_avx2(kind, n, threads):
    # `_peak` of the AVX2 loop, apart: it compiles where AVX-512 does not
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        out[t] = peak_avx2(n)
    return out


PEAK_KINDS = ("vnni", "amx-int8", "amx-bf16", "avx2")


def peak_kinds() -> tuple[str, ...]:
    """The dot-product instructions this CPU has, of those `peak` measures."""
    have = {"vnni": VNNI512, "amx-int8": AMX, "amx-bf16": AMX_BF16, "avx2": AVX2}
    return tuple(k for k in PEAK_KINDS if have[k])


def peak(kind: str, threads: int, seconds: float = 0.3) -> float:
    """Operations a second (a multiply and an add each) of the dot-product instruction `kind`
    ("vnni": AVX512-VNNI vpdpbusd; "amx-int8": tdpbusd; "amx-bf16": tdpbf16ps; "avx2":
    vpmaddubsw with the vpaddw that sums its int16 pairs, the AVX2 product's bound) on `threads`
    threads, each running it on independent registers or tiles for about `seconds`: the
    arithmetic limit of a kernel built on it."""
    import time

    if kind not in peak_kinds():
        raise ValueError(f"this CPU has no {kind}")
    k = PEAK_KINDS.index(kind)
    run = _peak_avx2 if kind == "avx2" else _peak
    use_threads()
    run(k, 1, threads)  # compiled, threads awake
    n = 1000
    while True:
        t0 = time.perf_counter()
        run(k, n, threads)
        dt = time.perf_counter() - t0
        if dt >= seconds / 4:
            break
        n *= 4
    best = dt
    for _ in range(3):
        t0 = time.perf_counter()
        run(k, n, threads)
        best = min(best, time.perf_counter() - t0)
    return PEAK_OPS[kind] * n * threads / best
