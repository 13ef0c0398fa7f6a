"""AVX512-VNNI building blocks for the quantised GEMV (kernels/qlinear.py).

Each `dp*` takes 64 weights of one row as unsigned 8-bit codes and 64 int8 activations (one
`vpdpbusd`): lane i of the int32 result gains the dot product of weights 4i..4i+3 with the same
activations, so lanes 0-7 cover the first 32 weights, 8-15 the next 32 (4 lanes = 16 weights).
Addresses are plain integers (the row's bytes in the mapped file, the activation codes); every
vector is carried in a `vec` (16 float32 lanes) and bit-cast where used.
"""
from __future__ import annotations

import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._vec import _VEC, W, vec

_FEATURES = llb.get_host_cpu_features().flatten()
VNNI = W == 16 and all(f"+{f}" in _FEATURES for f in ("avx512bw", "avx512vnni", "avx512vl"))

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_B32, _B64 = ir.VectorType(_I8, 32), ir.VectorType(_I8, 64)
_I32X16 = ir.VectorType(_I32, 16)


def _load(builder, addr, vty):
    return builder.load(builder.inttoptr(addr, vty.as_pointer()), align=1)


def _splat8(v, vty=_B32):
    return ir.Constant(vty, [v] * vty.count)


def _cat(builder, a, b):
    """Two <32 x i8> -> one <64 x i8> (a first)."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))


def _dpbusd(builder, acc, u, s):
    fnty = ir.FunctionType(_I32X16, [_I32X16] * 3)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
    r = builder.call(fn, [builder.bitcast(acc, _I32X16), builder.bitcast(u, _I32X16),
                          builder.bitcast(s, _I32X16)])
    return builder.bitcast(r, _VEC)


def _shr(builder, v, n, vty=_B32):
    """Lane-wise logical right shift of a byte vector by a runtime amount n (int64)."""
    one = builder.insert_element(ir.Constant(vty, None), builder.trunc(n, _I8),
                                 ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.lshr(v, builder.shuffle_vector(one, ir.Constant(vty, None), zeros))


@intrinsic
def dp4(typingctx, acc, qa, xa):
    """4-bit codes: 32 bytes at qa, low nibbles are weights 0-31, high nibbles 32-63."""
    def codegen(context, builder, sig, args):
        q = _load(builder, args[1], _B32)
        lo = builder.and_(q, _splat8(15))
        hi = builder.lshr(q, _splat8(4))
        return _dpbusd(builder, args[0], _cat(builder, lo, hi), _load(builder, args[2], _B64))
    return vec(vec, qa, xa), codegen


@intrinsic
def dp5(typingctx, acc, qa, ha, sh, xa):
    """As dp4, plus bit 4 of each weight from the 32 bytes at ha: bit `sh` for weights 0-31,
    bit sh + 1 for 32-63."""
    def codegen(context, builder, sig, args):
        q = _load(builder, args[1], _B32)
        h = _shr(builder, _load(builder, args[2], _B32), args[3])
        lo = builder.or_(builder.and_(q, _splat8(15)),
                         builder.shl(builder.and_(h, _splat8(1)), _splat8(4)))
        hi = builder.or_(builder.lshr(q, _splat8(4)),
                         builder.shl(builder.and_(h, _splat8(2)), _splat8(3)))
        return _dpbusd(builder, args[0], _cat(builder, lo, hi), _load(builder, args[4], _B64))
    return vec(vec, qa, ha, sh, xa), codegen


@intrinsic
def dp6(typingctx, acc, la, ls, ha, hs, xa):
    """6-bit codes: low 4 bits from the 64 bytes at la (shifted right by ls), high 2 bits from the
    32 bytes at ha (shifted right by hs for weights 0-31, hs + 2 for 32-63)."""
    def codegen(context, builder, sig, args):
        lo4 = builder.and_(_shr(builder, _load(builder, args[1], _B64), args[2], _B64),
                           _splat8(15, _B64))
        h = _load(builder, args[3], _B32)
        h = _shr(builder, h, args[4])
        h0 = builder.and_(h, _splat8(3))
        h1 = builder.and_(builder.lshr(h, _splat8(2)), _splat8(3))
        hi2 = builder.shl(_cat(builder, h0, h1), _splat8(4, _B64))
        return _dpbusd(builder, args[0], builder.or_(lo4, hi2), _load(builder, args[5], _B64))
    return vec(vec, la, ls, ha, hs, xa), codegen


@intrinsic
def dp8x2(typingctx, acc, qa, qb, xa):
    """Signed 8-bit codes, 32 at qa then 32 at qb, offset by +128 to make them unsigned (the
    caller subtracts 128 x the activation sums)."""
    def codegen(context, builder, sig, args):
        q = _cat(builder, _load(builder, args[1], _B32), _load(builder, args[2], _B32))
        return _dpbusd(builder, args[0], builder.xor(q, _splat8(128, _B64)),
                       _load(builder, args[3], _B64))
    return vec(vec, qa, qb, xa), codegen


@intrinsic
def dp40x2(typingctx, acc, qa, qb, xa):
    """Q4_0 codes of two blocks: 16 bytes at qa (low nibbles weights 0-15, high 16-31), then
    16 bytes at qb (weights 32-63)."""
    def codegen(context, builder, sig, args):
        b16 = ir.VectorType(_I8, 16)
        a, b = _load(builder, args[1], b16), _load(builder, args[2], b16)
        ab = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        lo = builder.and_(ab, _splat8(15))
        hi = builder.lshr(ab, _splat8(4))
        order = [i for blk in (0, 16) for i in (*range(blk, blk + 16), *range(32 + blk, 48 + blk))]
        q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), order))
        return _dpbusd(builder, args[0], q, _load(builder, args[3], _B64))
    return vec(vec, qa, qb, xa), codegen


@intrinsic
def cvt_fma(typingctx, p, s, acc):
    """acc + float(p's int32 lanes) * s."""
    def codegen(context, builder, sig, args):
        pf = builder.sitofp(builder.bitcast(args[0], _I32X16), _VEC)
        fnty = ir.FunctionType(_VEC, [_VEC] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{W}f32")
        return builder.call(fn, [pf, args[1], args[2]])
    return vec(vec, vec, vec), codegen


def _lanes(builder, args):
    """W lanes, each of the n values repeated over W / n consecutive lanes."""
    n = len(args)
    v = ir.Constant(ir.VectorType(ir.FloatType(), n), None)
    for i, a in enumerate(args):
        v = builder.insert_element(v, a, ir.Constant(_I32, i))
    idx = [i * n // W for i in range(W)]
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, W), idx))


@intrinsic
def lanes2(typingctx, a, b):
    if (a, b) != (types.float32,) * 2:
        return None
    return vec(a, b), lambda context, builder, sig, args: _lanes(builder, args)


@intrinsic
def lanes4(typingctx, a, b, c, d):
    if (a, b, c, d) != (types.float32,) * 4:
        return None
    return vec(a, b, c, d), lambda context, builder, sig, args: _lanes(builder, args)


@intrinsic
def ld_u8(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _I8.as_pointer()), align=1)
    return types.uint8(addr), codegen


@intrinsic
def ld_i8(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _I8.as_pointer()), align=1)
    return types.int8(addr), codegen


@intrinsic
def ld_f16(typingctx, addr):
    """The IEEE half at integer address addr, as float32."""
    def codegen(context, builder, sig, args):
        h = builder.load(builder.inttoptr(args[0], ir.HalfType().as_pointer()), align=1)
        return builder.fpext(h, ir.FloatType())
    return types.float32(addr), codegen
