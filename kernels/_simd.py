"""Scalar helpers that vectorise inside Numba loops: KV element -> float32, and a polynomial exp2.

KV dtype is carried by the array's element type (no runtime branch in hot loops):
float32 = FP32, uint16 = BF16 bits, int16 = FP16 bits (the wrappers view FP16 storage as int16).
"""
from __future__ import annotations

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

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



# --- explicit float32 vectors: W lanes (16 = one zmm with AVX-512, else 8 = one ymm) -------------
# A KV row of d channels is read in groups of 2W channels, each as two vectors (e, o):
#   BF16: W uint32 words hold channel pairs: e = even channels, o = odd channels (shift / mask,
#         no shuffles); FP32 / FP16: e = the group's first W channels, o = the next W.
# Queries and accumulators use the same packed order (see `packed_channels`).
W = 16 if "+avx512f" in llb.get_host_cpu_features().flatten() else 8


class VecType(types.Type):
    def __init__(self):
        super().__init__(name=f"f32x{W}")


vec = VecType()
_VEC = ir.VectorType(ir.FloatType(), W)


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def packed_channels(d: int, kv_kind: int) -> np.ndarray:
    """Original channel of each packed position (-1 = padding): [n_groups * 2W] int64."""
    ng = -(-d // (2 * W))
    pos = np.arange(ng * 2 * W)
    grp, lane = pos // (2 * W), pos % (2 * W)
    if kv_kind == 1:
        ch = grp * 2 * W + 2 * (lane % W) + lane // W
    else:
        ch = pos
    return np.where(ch < d, ch, -1)


def _row_ptr(context, builder, aryty, ary, offset):
    a = context.make_array(aryty)(context, builder, ary)
    return a, builder.gep(a.data, [offset])


@intrinsic
def vzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, None)
    return vec(), codegen


@intrinsic
def vsplat(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        one = builder.insert_element(ir.Constant(_VEC, None), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), W), None))
    return vec(x), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c."""
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.fma", [_VEC])
        return builder.call(fn, args)
    return vec(vec, vec, vec), codegen


@intrinsic
def vsum(typingctx, v):
    """Sum of the lanes (tree order)."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), _VEC])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.fadd.v{W}f32")
        return builder.call(fn, [ir.Constant(ir.FloatType(), 0.0), args[0]], fastmath=("reassoc",))
    return types.float32(vec), codegen


@intrinsic
def vload(typingctx, row, start):
    """W floats of a 1-D C-contiguous float32 array from `start` (no bounds check)."""
    if not (isinstance(row, types.Array) and row.dtype == types.float32 and row.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        _, p = _row_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4)
    return vec(row, start), codegen


@intrinsic
def vstore(typingctx, row, start, v):
    """Store W floats into a 1-D C-contiguous float32 array at `start` (no bounds check)."""
    if not (isinstance(row, types.Array) and row.dtype == types.float32 and row.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        _, p = _row_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(p, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(row, start, vec), codegen


def _gather(builder, data, first, n, convert):
    """Lanes first..first+W-1 of data[:n], 0 past n (in-bounds scalar loads; partial groups only)."""
    out = ir.Constant(_VEC, None)
    last = builder.sub(n, ir.Constant(n.type, 1))
    for lane in range(W):
        i = builder.add(first, ir.Constant(n.type, lane))
        ok = builder.icmp_signed("<", i, n)
        x = convert(builder.load(builder.gep(data, [builder.select(ok, i, last)])))
        x = builder.select(ok, x, ir.Constant(ir.FloatType(), 0.0))
        out = builder.insert_element(out, x, ir.Constant(ir.IntType(32), lane))
    return out


@intrinsic
def vload2(typingctx, row, grp):
    """Group `grp` (channels 2W*grp ..) of a KV row as float32 vectors (e, o); zeros past the row.

    row: 1-D C-contiguous float32 (FP32), uint16 (BF16 bits, even length) or int16 (FP16 bits).
    """
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"):
        return None
    dt = row.dtype
    if dt not in (types.float32, types.uint16, types.int16):
        return None
    i32, i16 = ir.IntType(32), ir.IntType(16)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        n = builder.extract_value(a.shape, 0)
        g2 = builder.mul(args[1], ir.Constant(n.type, 2 * W))  # first channel of the group
        full = builder.icmp_signed("<=", builder.add(g2, ir.Constant(n.type, 2 * W)), n)
        if dt == types.uint16:  # channel pairs as uint32 words
            words = builder.bitcast(a.data, i32.as_pointer())
            w0, nw = builder.sdiv(g2, ir.Constant(n.type, 2)), builder.sdiv(n, ir.Constant(n.type, 2))
            wvec = ir.VectorType(i32, W)
            with builder.if_else(full, likely=True) as (then, other):
                with then:
                    xa = builder.load(builder.bitcast(builder.gep(words, [w0]), wvec.as_pointer()),
                                      align=2)
                    ba = builder.block
                with other:
                    xb = builder.bitcast(_gather(builder, words, w0, nw,
                                                 lambda x: builder.bitcast(x, ir.FloatType())), wvec)
                    bb = builder.block
            x = builder.phi(wvec)
            x.add_incoming(xa, ba)
            x.add_incoming(xb, bb)
            e = builder.bitcast(builder.shl(x, ir.Constant(wvec, [16] * W)), _VEC)
            o = builder.bitcast(builder.and_(x, ir.Constant(wvec, [0xFFFF0000] * W)), _VEC)
        else:
            if dt == types.float32:
                conv = lambda x: x  # noqa: E731
                src = ir.VectorType(ir.FloatType(), W)
            else:
                conv = lambda x: builder.fpext(builder.bitcast(x, ir.HalfType()), ir.FloatType())  # noqa: E731
                src = ir.VectorType(i16, W)

            def vec_at(first):
                v = builder.load(builder.bitcast(builder.gep(a.data, [first]), src.as_pointer()),
                                 align=2)
                return v if dt == types.float32 else builder.fpext(
                    builder.bitcast(v, ir.VectorType(ir.HalfType(), W)), _VEC)
            g2w = builder.add(g2, ir.Constant(n.type, W))
            with builder.if_else(full, likely=True) as (then, other):
                with then:
                    ea, oa = vec_at(g2), vec_at(g2w)
                    ba = builder.block
                with other:
                    eb, ob = _gather(builder, a.data, g2, n, conv), _gather(builder, a.data, g2w, n, conv)
                    bb = builder.block
            e, o = builder.phi(_VEC), builder.phi(_VEC)
            e.add_incoming(ea, ba)
            e.add_incoming(eb, bb)
            o.add_incoming(oa, ba)
            o.add_incoming(ob, bb)
        return context.make_tuple(builder, sig.return_type, [e, o])
    return types.UniTuple(vec, 2)(row, grp), codegen


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
