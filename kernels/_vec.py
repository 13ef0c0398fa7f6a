"""Explicit float32 vectors for Numba: W lanes (16 = one zmm with AVX-512, else 8 = one ymm).

Hot loops address rows by raw address (`row_addr`) and 2-D arrays by (row, col), never through
array views: a view costs two atomic reference-count updates, shared between threads.
A KV row of d channels is read in groups of 2W channels, each as two vectors (e, o):
  BF16: W uint32 words hold channel pairs: e = even channels, o = odd channels (shift / mask,
        no shuffles); FP32 / FP16 / Q8_0: e = the group's first W channels, o = the next W;
  Q4_0: W code bytes: e = their low nibbles, o = their high nibbles (kvquant.py's layout).
Queries and accumulators use the same packed order (see `packed_channels`).
"""
from __future__ import annotations

import os

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ._simd import _HALF, _LO, _ONE, _P0, _P1, _P2, _P3, _P4, _P5, _ZERO

W = 16 if "+avx512f" in llb.get_host_cpu_features().flatten() else 8
_I32 = ir.IntType(32)


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
    pos = np.arange(-(-d // (2 * W)) * 2 * W)
    grp, lane = pos // (2 * W), pos % (2 * W)
    if kv_kind == 1:
        ch = grp * 2 * W + 2 * (lane % W) + lane // W
    elif kv_kind == 4:  # code byte grp*W + lane % W; its high nibble is 16 channels on
        byte = grp * W + lane % W
        ch = byte // 16 * 32 + byte % 16 + 16 * (lane // W)
    else:
        ch = pos
    return np.where(ch < d, ch, -1)


def _item_ptr(context, builder, sig, args, extra=()):
    """Pointer to element arr[args[1], ..., args[n]] of the array args[0] (+ constant indices)."""
    aryty = sig.args[0]
    a = context.make_array(aryty)(context, builder, args[0])
    n = aryty.ndim - len(extra)
    inds = [context.cast(builder, args[i], sig.args[i], types.intp) for i in range(1, n + 1)]
    inds += [context.get_constant(types.intp, i) for i in extra]
    shape = cgutils.unpack_tuple(builder, a.shape)
    strides = cgutils.unpack_tuple(builder, a.strides)
    return cgutils.get_item_pointer2(context, builder, a.data, shape, strides, aryty.layout, inds)


def _is_array(a, ndim, dtype=None):
    return isinstance(a, types.Array) and a.ndim == ndim and (dtype is None or a.dtype == dtype)


@intrinsic
def row_addr(typingctx, arr, j, b, t):
    """Address of arr[j, b, t, 0] of a 4-D array (a row of the KV store), as an integer."""
    if not _is_array(arr, 4):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args, extra=(0,))
        return builder.ptrtoint(ptr, context.get_value_type(types.intp))
    return types.intp(arr, j, b, t), codegen


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
        one = builder.insert_element(ir.Constant(_VEC, None), args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, W), None))
    return vec(x), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_VEC, [_VEC] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{W}f32")
        return builder.call(fn, args)
    return vec(vec, vec, vec), codegen


@intrinsic
def vload(typingctx, arr, r, c):
    """arr[r, c:c + W] of a 2-D float32 array with contiguous rows (no bounds check)."""
    if not _is_array(arr, 2, types.float32):
        return None

    def codegen(context, builder, sig, args):
        p = _item_ptr(context, builder, sig, args)
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4)
    return vec(arr, r, c), codegen


@intrinsic
def vstore(typingctx, arr, r, c, v):
    """arr[r, c:c + W] = v for a 2-D float32 array with contiguous rows (no bounds check)."""
    if not _is_array(arr, 2, types.float32):
        return None

    def codegen(context, builder, sig, args):
        p = _item_ptr(context, builder, sig, args)
        builder.store(args[3], builder.bitcast(p, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, r, c, vec), codegen


def _masked_load(builder, ptr, first, n, vty):
    """Load a vector of type vty from ptr; lanes with first + lane >= n read as 0 (not touched).
    A whole vector (first + W <= n, the common case) is a plain load."""
    lim = lim_n = builder.trunc(builder.sub(n, first), _I32)
    ivec = ir.VectorType(_I32, W)
    lim = builder.insert_element(ir.Constant(ivec, None), lim, ir.Constant(_I32, 0))
    lim = builder.shuffle_vector(lim, lim, ir.Constant(ivec, None))
    mask = builder.icmp_signed("<", ir.Constant(ivec, list(range(W))), lim)
    sfx = {ir.FloatType(): "f32", _I32: "i32", ir.IntType(16): "i16", ir.IntType(8): "i8"}[
        vty.element]
    fnty = ir.FunctionType(vty, [vty.as_pointer(), _I32, mask.type, vty])
    fn = cgutils.get_or_insert_function(builder.module, fnty,
                                        f"llvm.masked.load.v{W}{sfx}.p0v{W}{sfx}")
    vptr = builder.bitcast(ptr, vty.as_pointer())
    full = builder.icmp_signed(">=", lim_n, ir.Constant(_I32, W))
    with builder.if_else(full, likely=True) as (then, otherwise):
        with then:
            plain = builder.load(vptr, align=1 if vty.element == ir.IntType(8) else 2)  # no mask
            b_plain = builder.basic_block
        with otherwise:
            masked = builder.call(fn, [vptr, ir.Constant(_I32, 2), mask, ir.Constant(vty, None)])
            b_masked = builder.basic_block
    out = builder.phi(vty)
    out.add_incoming(plain, b_plain)
    out.add_incoming(masked, b_masked)
    return out


@intrinsic
def vload2(typingctx, tag, addr, d, grp):
    """Channel group `grp` (channels 2W*grp ..) of the d-channel KV row at address `addr`, as
    float32 vectors (e, o), zeros past d. The element type comes from `tag` (any KV array):
    float32 (FP32), uint16 (BF16 bits, d even), int16 (FP16 bits), int8 (8-bit codes, read as
    their integer values), int32 (a Q8_0 row) or uint32 (a Q4_0 row); quantised rows have
    d % 32 == 0 and are scaled by their block's float16 scale.
    """
    if not isinstance(tag, types.Array) or tag.dtype not in (types.float32, types.uint16,
                                                             types.int16, types.int8,
                                                             types.int32, types.uint32):
        return None
    dt = tag.dtype

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        n = context.cast(builder, args[2], sig.args[2], types.intp)
        g2 = builder.mul(context.cast(builder, args[3], sig.args[3], types.intp),
                         ir.Constant(intp, 2 * W))  # first channel of the group
        if dt in (types.int32, types.uint32):
            return context.make_tuple(builder, sig.return_type,
                                      _quant_pair(builder, dt == types.uint32, args[1], n, g2))
        if dt == types.uint16:  # W words of channel pairs: shift / mask, no shuffles
            two = ir.Constant(intp, 2)
            wvec = ir.VectorType(_I32, W)
            w0 = builder.sdiv(g2, two)
            words = builder.gep(builder.inttoptr(args[1], _I32.as_pointer()), [w0])
            x = _masked_load(builder, words, w0, builder.sdiv(n, two), wvec)
            e = builder.bitcast(builder.shl(x, ir.Constant(wvec, [16] * W)), _VEC)
            o = builder.bitcast(builder.and_(x, ir.Constant(wvec, [0xFFFF0000] * W)), _VEC)
        else:
            ety = {types.float32: ir.FloatType(), types.int16: ir.IntType(16),
                   types.int8: ir.IntType(8)}[dt]
            base = builder.inttoptr(args[1], ety.as_pointer())
            g2w = builder.add(g2, ir.Constant(intp, W))
            src = ir.VectorType(ety, W)
            e = _masked_load(builder, builder.gep(base, [g2]), g2, n, src)
            o = _masked_load(builder, builder.gep(base, [g2w]), g2w, n, src)
            if dt == types.int16:
                half = ir.VectorType(ir.HalfType(), W)
                e = builder.fpext(builder.bitcast(e, half), _VEC)
                o = builder.fpext(builder.bitcast(o, half), _VEC)
            elif dt == types.int8:
                e = builder.sitofp(builder.sext(e, ir.VectorType(_I32, W)), _VEC)
                o = builder.sitofp(builder.sext(o, ir.VectorType(_I32, W)), _VEC)
        return context.make_tuple(builder, sig.return_type, [e, o])
    return types.UniTuple(vec, 2)(tag, addr, d, grp), codegen


def _quant_pair(builder, q4, addr, d, g2):
    """(e, o) of channel group starting at channel g2 of a Q8_0 / Q4_0 row at address addr."""
    i8, i16, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
    ivec = ir.VectorType(_I32, W)
    base = builder.inttoptr(addr, i8.as_pointer())
    if q4:
        x = builder.load(builder.bitcast(builder.gep(base, [builder.lshr(g2, ir.Constant(i64, 1))]),
                                         ir.VectorType(i8, W).as_pointer()), align=1)
        x = builder.zext(x, ivec)
        eight = ir.Constant(ivec, [8] * W)
        e = builder.sub(builder.and_(x, ir.Constant(ivec, [15] * W)), eight)
        o = builder.sub(builder.lshr(x, ir.Constant(ivec, [4] * W)), eight)
        codes = builder.lshr(d, ir.Constant(i64, 1))
    else:
        src = ir.VectorType(i8, W).as_pointer()
        g2w = builder.add(g2, ir.Constant(i64, W))
        e, o = (builder.sext(builder.load(builder.bitcast(builder.gep(base, [g]), src), align=1),
                             ivec) for g in (g2, g2w))
        codes = d
    # the block's float16 scale: at byte codes + 2 * (g2 // 32)
    blk = builder.lshr(g2, ir.Constant(i64, 5))
    off = builder.add(codes, builder.shl(blk, ir.Constant(i64, 1)))
    h = builder.load(builder.bitcast(builder.gep(base, [off]), i16.as_pointer()), align=1)
    s = builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())
    sv = builder.insert_element(ir.Constant(_VEC, None), s, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(sv, sv, ir.Constant(ivec, None))
    return (builder.fmul(builder.sitofp(e, _VEC), sv), builder.fmul(builder.sitofp(o, _VEC), sv))


def _sum_tree(builder, v0, v1, v2, v3):
    """One shuffle tree for the lane sums of four vectors: lanes 0, W/4, W/2, 3W/4 of the result
    hold v0's .. v3's sums."""
    def shuf(x, y, idx):
        return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, W), idx))

    def add(x, y):
        return builder.fadd(x, y, flags=("reassoc",))
    h, q = W // 2, W // 4
    lo_half = list(range(h)) + list(range(W, W + h))
    hi_half = list(range(h, W)) + list(range(W + h, 2 * W))
    ab = add(shuf(v0, v1, lo_half), shuf(v0, v1, hi_half))  # [a | b] halves
    cd = add(shuf(v2, v3, lo_half), shuf(v2, v3, hi_half))
    lo = [i for grp in (0, h, W, W + h) for i in range(grp, grp + q)]  # [a | b | c | d]
    v = add(shuf(ab, cd, lo), shuf(ab, cd, [i + q for i in lo]))
    gs = q
    while gs > 1:  # fold each quarter onto its first lane
        gs //= 2
        v = add(v, shuf(v, v, [i ^ gs for i in range(W)]))
    return v


@intrinsic
def vsum4(typingctx, arr, r, c, a0, a1, a2, a3):
    """arr[r, c:c + 4] = the lane sums of a0..a3 (one shuffle tree for all four)."""
    if not _is_array(arr, 2, types.float32):
        return None

    def codegen(context, builder, sig, args):
        v, q = _sum_tree(builder, *args[3:]), W // 4
        quad = ir.VectorType(ir.FloatType(), 4)
        lanes = ir.Constant(ir.VectorType(_I32, 4), [0, q, 2 * q, 3 * q])
        sums = builder.shuffle_vector(v, v, lanes)
        p = _item_ptr(context, builder, sig, args)
        builder.store(sums, builder.bitcast(p, quad.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, r, c, vec, vec, vec, vec), codegen


@intrinsic
def hsum4(typingctx, a0, a1, a2, a3):
    """The lane sums of a0..a3 (vsum4's tree), as 4 float32."""
    def codegen(context, builder, sig, args):
        v, q = _sum_tree(builder, *args), W // 4
        out = [builder.extract_element(v, ir.Constant(_I32, j * q)) for j in range(4)]
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(types.float32, 4)(vec, vec, vec, vec), codegen


@intrinsic
def vsplat4(typingctx, arr, r, c):
    """Four vectors, each arr[r, c + k] in every lane (k = 0..3)."""
    if not _is_array(arr, 2, types.float32):
        return None

    def codegen(context, builder, sig, args):
        p = _item_ptr(context, builder, sig, args)
        out = []
        for k in range(4):
            x = builder.load(builder.gep(p, [ir.Constant(_I32, k)]), align=4)
            one = builder.insert_element(ir.Constant(_VEC, None), x, ir.Constant(_I32, 0))
            out.append(builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, W), None)))
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(vec, 4)(arr, r, c), codegen


def _binop(op):
    @intrinsic
    def fn(typingctx, a, b):
        def codegen(context, builder, sig, args):
            x, y = args
            if op == "max":
                return builder.select(builder.fcmp_ordered(">", x, y), x, y)
            return getattr(builder, op)(x, y)
        return vec(vec, vec), codegen
    return fn


vadd, vsub, vmul, vmax = _binop("fadd"), _binop("fsub"), _binop("fmul"), _binop("max")


def _reduce(kind):
    @intrinsic
    def fn(typingctx, v):
        def codegen(context, builder, sig, args):
            if kind == "fadd":
                fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), _VEC])
                f = cgutils.get_or_insert_function(builder.module, fnty,
                                                   f"llvm.vector.reduce.fadd.v{W}f32")
                return builder.call(f, [ir.Constant(ir.FloatType(), 0.0), args[0]],
                                    fastmath=("reassoc",))
            fnty = ir.FunctionType(ir.FloatType(), [_VEC])
            f = cgutils.get_or_insert_function(builder.module, fnty,
                                               f"llvm.vector.reduce.fmax.v{W}f32")
            return builder.call(f, [args[0]], fastmath=("nnan",))  # scores are never NaN
        return types.float32(vec), codegen
    return fn


vhsum, vhmax = _reduce("fadd"), _reduce("fmax")


@intrinsic
def vexp2_neg(typingctx, v):
    """Lane-wise exp2_neg: 2**x for x <= 0, 0 below 2**-125."""
    def codegen(context, builder, sig, args):
        def k(x):
            return ir.Constant(_VEC, [float(x)] * W)
        x = args[0]
        y = builder.select(builder.fcmp_ordered(">", x, k(_LO)), x, k(_LO))
        trunc = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]),
                                               f"llvm.trunc.v{W}f32")
        n = builder.call(trunc, [builder.fsub(y, k(_HALF))])
        f = builder.fsub(y, n)
        fm = ("contract",)  # let multiply-adds fuse
        p = k(_P0)
        for c in (_P1, _P2, _P3, _P4, _P5):
            p = builder.fadd(builder.fmul(p, f, flags=fm), k(c), flags=fm)
        p = builder.fadd(builder.fmul(f, p, flags=fm), k(_ONE), flags=fm)
        ivec = ir.VectorType(_I32, W)
        e = builder.add(builder.fptosi(n, ivec), ir.Constant(ivec, [127] * W))
        r = builder.fmul(p, builder.bitcast(builder.shl(e, ir.Constant(ivec, [23] * W)), _VEC))
        return builder.select(builder.fcmp_ordered(">", x, k(_LO)), r, k(_ZERO))
    return vec(vec), codegen


@intrinsic
def prefetch(typingctx, addr):
    """Hint the cache to fetch the line at integer address `addr` (into L2)."""
    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(_I32, 0),
                          ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(addr), codegen


_X86 = llb.get_process_triple().split("-")[0] in ("x86_64", "i386", "i686")
_POSIX = os.name == "posix"


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """Atomically arr[i] += v (sequentially consistent) on a 1-D int64 array; the old value."""
    if not _is_array(arr, 1, types.int64):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2],
                                                            types.int64), "seq_cst")
    return types.int64(arr, i, v), codegen


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] of a 1-D int64 array, read atomically with acquire order (never hoisted out of a
    loop: for spinning on a flag another thread sets with fetch_add)."""
    if not _is_array(arr, 1, types.int64):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_item_ptr(context, builder, sig, args), "acquire", 8)
    return types.int64(arr, i), codegen


@intrinsic
def cpu_relax(typingctx):
    """One turn of a wait loop: `sched_yield` where there is one (POSIX), so that a waiting thread
    hands its core to the thread it waits for if the machine is busy (~0.3 us otherwise); else
    the x86 `pause` hint."""
    def codegen(context, builder, sig, args):
        if _POSIX:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        elif _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        else:
            return context.get_dummy_value()
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def load_f32(typingctx, addr):
    """The float32 at integer address `addr` (any alignment)."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.FloatType().as_pointer())
        return builder.load(p, align=1)
    return types.float32(addr), codegen


@intrinsic
def load_f16(typingctx, addr):
    """The float16 at integer address `addr` (any alignment), as float32."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.HalfType().as_pointer())
        return builder.fpext(builder.load(p, align=1), ir.FloatType())
    return types.float32(addr), codegen


def _splat_i32(builder, x):
    vty = ir.VectorType(_I32, W)
    v = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, None), ir.Constant(vty, [0] * W))


@intrinsic
def vbits(typingctx, addr, shift, mask):
    """(byte >> shift) & mask of the W bytes at integer address `addr`, as float32 lanes (a
    quantised weight's codes: nibbles, Q6_K's high bits)."""
    def codegen(context, builder, sig, args):
        b = builder.load(builder.inttoptr(args[0], ir.VectorType(ir.IntType(8), W).as_pointer()),
                         align=1)
        v = builder.zext(b, ir.VectorType(_I32, W))
        sh = _splat_i32(builder, context.cast(builder, args[1], sig.args[1], types.int32))
        m = _splat_i32(builder, context.cast(builder, args[2], sig.args[2], types.int32))
        return builder.sitofp(builder.and_(builder.lshr(v, sh), m), _VEC)
    return vec(addr, shift, mask), codegen


@intrinsic
def vsbytes(typingctx, addr):
    """The W signed bytes at integer address `addr`, as float32 lanes (Q8_0's codes)."""
    def codegen(context, builder, sig, args):
        b = builder.load(builder.inttoptr(args[0], ir.VectorType(ir.IntType(8), W).as_pointer()),
                         align=1)
        return builder.sitofp(builder.sext(b, ir.VectorType(_I32, W)), _VEC)
    return vec(addr), codegen


@intrinsic
def store_f32(typingctx, addr, x):
    """Write the float32 x at integer address `addr` (any alignment)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.FloatType().as_pointer())
        builder.store(args[1], p, align=1)
        return context.get_dummy_value()
    return types.none(addr, x), codegen


@intrinsic
def touch(typingctx, addr):
    """Load the byte at integer address `addr` and drop it; unlike a prefetch, never skipped, so
    it starts the page walk (and the hardware prefetcher) for that address's page."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        builder.load_atomic(p, "monotonic", 1)  # an atomic load is never removed as unused
        return context.get_dummy_value()
    return types.none(addr), codegen
