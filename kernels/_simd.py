"""Scalar Numba helpers: KV element decoding, a vectorising exp2, KV storage conversions.

Inside the kernels the KV format is carried by the array's element type (no branch in hot loops):
float32 = FP32, uint16 = BF16 bits, int16 = FP16 bits, int32 = Q8_0 rows, uint32 = Q4_0 rows
(kvquant.py). Entry points take KV viewed as that type (`kv_view`), so a kernel compiles for the
formats a run uses only: a cold start compiles one format's code, not five.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
NEG_INF = np.float32(-np.inf)
LOG2E = 1.4426950408889634
LN2 = np.float32(0.6931471805599453)

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no nnan/ninf: -inf is a real value here


KV_DTYPES = {0: F32, 1: np.uint16, 2: np.int16, 3: np.int32, 4: np.uint32}  # kv_kind -> the
# element type that carries its format inside the kernels


def kv_view(name: str, a: np.ndarray, kv_kind: int) -> np.ndarray:
    """KV storage [Hkv, nb, bs, row] (float32, uint16 bits, or uint8 quantised rows) as a
    read-only view in the element type of its format (KV_DTYPES)."""
    size = 4 if kv_kind == 0 else 2 if kv_kind <= 2 else 1
    if a.ndim != 4 or not a.flags.c_contiguous or a.dtype.itemsize != size:
        raise ValueError(f"{name} must be a C-contiguous [Hkv, nb, bs, row] array of "
                         f"{size}-byte elements for kv_kind {kv_kind}, got {a.dtype} {a.shape}")
    if kv_kind == 1 and a.shape[3] % 2:
        raise ValueError("BF16 KV needs an even head_dim")
    if kv_kind >= 3 and a.shape[3] % 4:
        raise ValueError(f"{name}: quantised KV rows are a multiple of 4 bytes, got {a.shape[3]}")
    v = a.view(KV_DTYPES[kv_kind], np.ndarray)  # C-contiguous (checked): no copy
    v.flags.writeable = False
    return v


def readonly_bytes(a: np.ndarray) -> np.ndarray:
    """A read-only uint8 view of `a` (see `readonly`)."""
    return readonly(a.view(np.uint8))


def readonly(a: np.ndarray, dtype=None) -> np.ndarray:
    """A read-only C-contiguous view (a copy only to fix dtype or layout). Memory-mapped cache
    entries are read-only and Numba compiles a separate kernel for them, so every input a kernel
    only reads is passed read-only: one compiled signature for RAM and mmap alike."""
    if (type(a) is np.ndarray and a.ndim and (dtype is None or a.dtype == dtype)
            and a.flags.c_contiguous):  # the common case, in as few NumPy calls as can be
        if not a.flags.writeable:
            return a
        v = a.view()
    else:
        v = np.ascontiguousarray(a, dtype=dtype).view()
    v.flags.writeable = False
    return v


def kv_to_f64(a: np.ndarray, kv_kind: int) -> np.ndarray:
    """Decode KV storage to float64 in NumPy (for the references)."""
    if kv_kind >= 3:
        from .kvquant import decode_ref, head_dim_of
        return decode_ref(a, kv_kind, head_dim_of(kv_kind, a.shape[-1]))
    if kv_kind == 0:
        return a.astype(np.float64)
    if kv_kind == 1:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.view(np.float16).astype(np.float64)


def f32_to_kv(x: np.ndarray, kv_kind: int) -> np.ndarray:
    """Encode float32 to KV storage (bf16 by round-to-nearest-even; Q8_0 / Q4_0 rows)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if kv_kind >= 3:
        from .kvquant import encode_ref
        return encode_ref(x, kv_kind)
    if kv_kind == 0:
        return x
    if kv_kind == 2:
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@intrinsic
def to_f32(typingctx, x):
    """KV element -> float32: identity, bf16 bits (shift left 16, bit-cast), fp16 bits (fpext)."""
    if x == types.float32:
        def codegen(context, builder, sig, args):
            return args[0]
    elif x == types.uint16:
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(wide, ir.FloatType())
    elif x == types.int16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    else:
        return None
    return types.float32(x), codegen


@intrinsic
def _trunc(typingctx, x):
    """Round a float32 toward zero (llvm.trunc, one vector instruction)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.trunc", [ir.FloatType()])
        return builder.call(fn, [args[0]])
    return types.float32(x), codegen


@intrinsic
def _pow2(typingctx, n):
    """2**n for a float32 holding an integer in [-127, 127], built from exponent bits."""
    if n != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        e = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(i32, 23)), ir.FloatType())
    return types.float32(n), codegen


# Cephes exp2f minimax polynomial on [-0.5, 0.5]: 2**f = 1 + f * P(f), relative error ~1e-7.
_P0, _P1, _P2 = F32(1.535336188319500e-4), F32(1.339887440266574e-3), F32(9.618437357674640e-3)
_P3, _P4, _P5 = F32(5.550332471162809e-2), F32(2.402264791363012e-1), F32(6.931472028550421e-1)
_LO, _HALF, _ONE, _ZERO = F32(-125.0), F32(0.5), F32(1.0), F32(0.0)


@njit(fastmath=FASTMATH, cache=True)
def exp2_neg(x):
    """2**x for float32 x <= 0; 0 below 2**-125 (no denormals: they stall FMAs). Vectorises."""
    y = max(x, _LO)
    n = _trunc(y - _HALF)  # round to nearest for y <= 0
    f = y - n  # [-0.5, 0.5]
    p = ((((_P0 * f + _P1) * f + _P2) * f + _P3) * f + _P4) * f + _P5
    r = (_ONE + f * p) * _pow2(n)
    return r if x > _LO else _ZERO


@intrinsic
def to_bf16(typingctx, x):
    """float32 -> bf16 bits (uint16), rounded to nearest even."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        u = builder.add(u, builder.add(odd, ir.Constant(i32, 0x7FFF)))
        return builder.trunc(builder.lshr(u, ir.Constant(i32, 16)), ir.IntType(16))
    return types.uint16(x), codegen


def put_token(k_dst: np.ndarray, v_dst: np.ndarray, t: int, k: np.ndarray, v: np.ndarray) -> None:
    """Row t (= block t // bs, row t % bs) of every head of k_dst, v_dst [H, nb, bs, d] = one
    token's k, v [H, d] float32: copied (float32 arrays) or as bfloat16 bits (uint16 arrays,
    `to_bf16`). A decode step's write in one call."""
    (_put_bf16 if k_dst.dtype == np.uint16 else _put_f32)(k_dst, v_dst, t, k, v)


@njit(nogil=True, cache=True)
def _put_bf16(k_dst, v_dst, t, k, v):
    b, i = t // k_dst.shape[2], t % k_dst.shape[2]
    for h in range(k.shape[0]):
        for c in range(k.shape[1]):
            k_dst[h, b, i, c] = to_bf16(k[h, c])
            v_dst[h, b, i, c] = to_bf16(v[h, c])


@njit(nogil=True, cache=True)
def _put_f32(k_dst, v_dst, t, k, v):
    b, i = t // k_dst.shape[2], t % k_dst.shape[2]
    k_dst[:, b, i, :] = k
    v_dst[:, b, i, :] = v
