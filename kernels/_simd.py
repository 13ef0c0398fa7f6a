"""Scalar helpers that vectorise inside Numba loops: KV element -> float32, and a polynomial exp2.

KV dtype is carried by the array's element type (no runtime branch in hot loops):
float32 = FP32, uint16 = BF16 bits, int16 = FP16 bits (the wrappers view FP16 storage as int16).
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
KV_DTYPES = (np.float32, np.uint16, np.int16)  # storage view per kv_kind 0 FP32, 1 BF16, 2 FP16


def kv_view(a: np.ndarray, kv_kind: int) -> np.ndarray:
    """The view of KV storage `a` whose element type tells the kernels how to decode it."""
    want = KV_DTYPES[kv_kind]
    if a.dtype == want:
        return a
    if a.dtype.itemsize != np.dtype(want).itemsize:
        raise ValueError(f"kv_kind {kv_kind} needs {np.dtype(want).itemsize}-byte storage, got {a.dtype}")
    return a.view(want)


def kv_to_f64(a: np.ndarray, kv_kind: int) -> np.ndarray:
    """Decode KV storage to float64 in NumPy (for the references)."""
    if kv_kind == 0:
        return a.astype(np.float64)
    if kv_kind == 1:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.view(np.float16).astype(np.float64)


def f32_to_kv(x: np.ndarray, kv_kind: int) -> np.ndarray:
    """Encode float32 to KV storage (bf16 by round-to-nearest-even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
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
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
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
_LO, _HALF, _ONE = F32(-127.0), F32(0.5), F32(1.0)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def exp2_neg(x):
    """2**x for float32 x <= 0 (-inf gives 0); vectorises, unlike np.exp."""
    x = max(x, _LO)
    n = _trunc(x - _HALF)  # round to nearest for x <= 0
    f = x - n  # [-0.5, 0.5]
    p = ((((_P0 * f + _P1) * f + _P2) * f + _P3) * f + _P4) * f + _P5
    return (_ONE + f * p) * _pow2(n)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def qk_rows(qr, kf, nt, s):
    """s[r, t] = qr[r] . kf[t] for t < nt; qr [R, d], kf [CH, d] f32, s [R, CH]. 4 rows of kf per pass."""
    d = qr.shape[1]
    for r in range(qr.shape[0]):
        qh = qr[r]
        sh = s[r]
        t = 0
        while t + 4 <= nt:
            k0, k1, k2, k3 = kf[t], kf[t + 1], kf[t + 2], kf[t + 3]
            a0 = a1 = a2 = a3 = F32(0.0)
            for c in range(d):
                x = qh[c]
                a0 += x * k0[c]
                a1 += x * k1[c]
                a2 += x * k2[c]
                a3 += x * k3[c]
            sh[t], sh[t + 1], sh[t + 2], sh[t + 3] = a0, a1, a2, a3
            t += 4
        while t < nt:
            kt = kf[t]
            a0 = F32(0.0)
            for c in range(d):
                a0 += qh[c] * kt[c]
            sh[t] = a0
            t += 1
