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


def _q40x2(builder, qa, qb):
    """The 64 nibble codes of two Q4_0-style blocks (16 bytes at qa, 16 at qb) in weight order:
    <64 x i8>."""
    b16 = ir.VectorType(_I8, 16)
    a, b = _load(builder, qa, b16), _load(builder, qb, b16)
    ab = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    lo = builder.and_(ab, _splat8(15))
    hi = builder.lshr(ab, _splat8(4))
    order = [i for blk in (0, 16) for i in (*range(blk, blk + 16), *range(32 + blk, 48 + blk))]
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), order))


@intrinsic
def dp40x2(typingctx, acc, qa, qb, xa):
    """Q4_0 codes of two blocks: 16 bytes at qa (low nibbles weights 0-15, high 16-31), then
    16 bytes at qb (weights 32-63)."""
    def codegen(context, builder, sig, args):
        q = _q40x2(builder, args[1], args[2])
        return _dpbusd(builder, args[0], q, _load(builder, args[3], _B64))
    return vec(vec, qa, qb, xa), codegen


@intrinsic
def dp50x2(typingctx, acc, qa, qb, ha, hb, xa):
    """Q5_0 / Q5_1 codes of two blocks: nibbles as dp40x2 (qa, qb), bit 4 of weight i of each
    block from bit i of the little-endian uint32 at ha (first block), hb (second): the 64 bits
    become a mask that selects 16 into the bytes (kmov + a masked move)."""
    def codegen(context, builder, sig, args):
        q = _q40x2(builder, args[1], args[2])
        i64 = ir.IntType(64)
        ha, hb = (builder.zext(_load(builder, a, _I32), i64) for a in (args[3], args[4]))
        bits = builder.or_(ha, builder.shl(hb, ir.Constant(i64, 32)))
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 64))
        h = builder.select(mask, _splat8(16, _B64), _splat8(0, _B64))
        return _dpbusd(builder, args[0], builder.or_(q, h), _load(builder, args[5], _B64))
    return vec(vec, qa, qb, ha, hb, xa), codegen


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


@intrinsic
def ld_u32(typingctx, addr):
    """The little-endian uint32 at integer address addr (any alignment)."""
    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _I32.as_pointer()), align=1)
    return types.uint32(addr), codegen


def _ivec(builder, v):
    return builder.bitcast(v, _I32X16)


@intrinsic
def vmul_i32(typingctx, a, b):
    """Lane-wise int32 a * b (vectors carried in vec bits)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.mul(_ivec(builder, args[0]), _ivec(builder, args[1])),
                               _VEC)
    return vec(vec, vec), codegen


@intrinsic
def vadd_i32(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.add(_ivec(builder, args[0]), _ivec(builder, args[1])),
                               _VEC)
    return vec(vec, vec), codegen


def _zext_bytes(builder, words, signed=False):
    """<n x i32> words -> their 4n bytes widened to <4n x i32>."""
    n = words.type.count * 4
    b = builder.bitcast(words, ir.VectorType(_I8, n))
    return (builder.sext if signed else builder.zext)(b, ir.VectorType(_I32, n))


def _word_vec(builder, words):
    v = ir.Constant(ir.VectorType(_I32, len(words)), None)
    for i, w in enumerate(words):
        v = builder.insert_element(v, w, ir.Constant(_I32, i))
    return v


@intrinsic
def k4_lanes(typingctx, sc_lo, sc_hi):
    """The 8 K-quant sub-block scales (bytes of sc_lo, then sc_hi) as the int32 lanes of 4
    vectors, one per 64 weights: lanes 0-7 scale 2c, lanes 8-15 scale 2c + 1."""
    if (sc_lo, sc_hi) != (types.uint32,) * 2:
        return None

    def codegen(context, builder, sig, args):
        s8 = _zext_bytes(builder, _word_vec(builder, args))  # <8 x i32>
        out = []
        for c in range(4):
            idx = [2 * c] * 8 + [2 * c + 1] * 8
            v = builder.shuffle_vector(s8, s8, ir.Constant(ir.VectorType(_I32, 16), idx))
            out.append(builder.bitcast(v, _VEC))
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(vec, 4)(sc_lo, sc_hi), codegen


@intrinsic
def q6_lanes(typingctx, sa):
    """Q6_K's 16 signed sub-block scales at address sa as the int32 lanes of 4 vectors, one per
    64 weights: 4 lanes (16 weights) per scale."""
    def codegen(context, builder, sig, args):
        b = builder.load(builder.inttoptr(args[0], ir.VectorType(_I8, 16).as_pointer()), align=1)
        s16 = builder.sext(b, _I32X16)
        out = []
        for u in range(4):
            idx = [4 * u + i // 4 for i in range(16)]
            v = builder.shuffle_vector(s16, s16, ir.Constant(ir.VectorType(_I32, 16), idx))
            out.append(builder.bitcast(v, _VEC))
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(vec, 4)(sa), codegen


@intrinsic
def dot_scales(typingctx, s_lo, s_hi, ba):
    """Sum over 8 sub-blocks of scale (bytes of s_lo, s_hi) x the int32 at ba + 4j (the
    activation codes' sum over sub-block j), as int32."""
    if (s_lo, s_hi) != (types.uint32,) * 2:
        return None

    def codegen(context, builder, sig, args):
        s8 = _zext_bytes(builder, _word_vec(builder, args[:2]))
        v8 = ir.VectorType(_I32, 8)
        b = builder.load(builder.inttoptr(args[2], v8.as_pointer()), align=1)
        fnty = ir.FunctionType(_I32, [v8])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.vector.reduce.add.v8i32")
        return builder.call(fn, [builder.mul(s8, b)])
    return types.int32(s_lo, s_hi, ba), codegen


@intrinsic
def dot_q6_scales(typingctx, sa, ba):
    """Sum over 16 sub-blocks of Q6_K's signed scale at sa + j x the int32 at ba + 4j."""
    def codegen(context, builder, sig, args):
        b8 = builder.load(builder.inttoptr(args[0], ir.VectorType(_I8, 16).as_pointer()), align=1)
        b = builder.load(builder.inttoptr(args[1], _I32X16.as_pointer()), align=1)
        fnty = ir.FunctionType(_I32, [_I32X16])
        fn = cgutils.get_or_insert_function(builder.module, fnty,
                                            "llvm.vector.reduce.add.v16i32")
        return builder.call(fn, [builder.mul(builder.sext(b8, _I32X16), b)])
    return types.int32(sa, ba), codegen
