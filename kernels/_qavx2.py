"""AVX2 building blocks for the quantised GEMV's int8 path on CPUs without AVX512-VNNI.

As llama.cpp's AVX2 kernels do: x is rounded to int8 once per call (per 32 channels for the
32-blocks, per 256 for the K-quants: `qlinear._quantise_x`), and a block's codes, as unsigned
bytes, meet 32 of x's codes in `vpmaddubsw` (pairs of products summed into int16 lanes); one
`vpmaddwd` then sums pairs of those into 8 int32 lanes, times a K-quant sub-block's scale or
times one. Q8_0's codes are signed: their magnitudes meet x's codes carrying the weight's sign
(`vpsignb`). No int16 sum overflows: 2 x 63 x 127 at most (Q6_K's 6-bit codes).

A step adds two 32-blocks (`q8_0_step8` ...; `..._1`: one) or one super-block (`q4k_step8`,
`q6k_step8`) of one row to the row's 8-lane float32 accumulator (summed once at the row's end).
Constant terms (Q4_0's -8, Q6_K's -32, Q4_1 / Q4_K's mins) use the sums of x's codes, so the
result is exactly W times the int8-rounded x, as on the VNNI path.
"""
from __future__ import annotations

import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._qvec import (
    _F16,
    _F32,
    _I8,
    _I16,
    _I32,
    _I64,
    _at,
    _call,
    _fma,
    _k,
    _k_scales,
    _load,
    _shuffle,
    _splat,
    _vt,
)
from ._vec import _VEC, W, vec

_FEATURES = llb.get_host_cpu_features().flatten()
llb.initialize_native_asmparser()  # for the one line of inline assembly (`_f16`)
AVX2 = W == 8 and all(f"+{f}" in _FEATURES for f in ("avx2", "fma", "f16c"))

Q4_0, Q4_1, Q8_0 = 2, 3, 8
_B32, _W16, _D8 = _vt(_I8, 32), _vt(_I16, 16), _vt(_I32, 8)


def _maddubs(builder, u, s):
    """Unsigned bytes u . signed bytes s, pairs summed: <16 x i16> (saturating; never here)."""
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [u, s])


def _maddwd(builder, a, b):
    """Words a . words b, pairs summed: <8 x i32>."""
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _D8, [a, b])


def _f16(builder, addr):
    """The f16 at integer address addr, as float32. Read into a general register first
    (`movzwl`, kept as is by inline assembly): a 16-bit load straight into a vector register
    merges into some register's other lanes, and when that register is the accumulator it chains
    each block to the one before."""
    word = builder.asm(ir.FunctionType(_I32, [_I64]), "movzwl ($1), $0", "=r,r", [addr],
                       side_effect=False)
    h = builder.bitcast(builder.trunc(word, _I16), _F16)
    return builder.fpext(h, _F32)


def _codegen_b32(qtype, nblk):
    nb = {Q8_0: 34, Q4_0: 18, Q4_1: 20}[qtype]

    def block(builder, o, xa, dx, sx):
        """Block at address o: (its dot with x's codes, int32 lanes; d x dx; Q4_1: m x dx x sx)."""
        x = _load(builder, xa, _B32)
        if qtype == Q8_0:
            q = _load(builder, _at(builder, o, 2), _B32)
            sign = "llvm.x86.avx2.psign.b"
            p = _maddubs(builder, _call(builder, sign, _B32, [q, q]),
                         _call(builder, sign, _B32, [x, q]))
        else:  # byte i: element i in its low nibble, element i + 16 in its high one
            q = _load(builder, _at(builder, o, 4 if qtype == Q4_1 else 2), _vt(_I8, 16))
            u = _shuffle(builder, builder.and_(q, _k(_I8, 16, 15)),
                         builder.lshr(q, _k(_I8, 16, 4)), list(range(32)))
            p = _maddubs(builder, u, x)
        t = _maddwd(builder, p, _k(_I16, 16, 1))
        if qtype == Q4_0:  # the codes' -8: -8 x (x's code sum), in lane 0
            t = builder.add(t, builder.insert_element(
                ir.Constant(_D8, None), builder.mul(sx, ir.Constant(_I32, -8)),
                ir.Constant(_I32, 0)))
        m = None
        if qtype == Q4_1:
            m = builder.fmul(builder.fmul(_f16(builder, _at(builder, o, 2)), dx),
                             builder.sitofp(sx, _F32))
        return builder.sitofp(t, _VEC), builder.fmul(_f16(builder, o), dx), m

    def codegen(context, builder, sig, args):
        acc, o, xa, fa, ia = args  # fa, ia: addresses of x's scales (float32), code sums (int32)
        v = m = None
        for b in range(nblk):  # v: the blocks' sum, off the accumulator's chain of additions
            dx = builder.load(builder.inttoptr(_at(builder, fa, 4 * b), _F32.as_pointer()))
            sx = builder.load(builder.inttoptr(_at(builder, ia, 4 * b), _I32.as_pointer()))
            t, d, mb = block(builder, _at(builder, o, nb * b), _at(builder, xa, 32 * b), dx, sx)
            v = (builder.fmul(t, _splat(builder, d)) if v is None
                 else _fma(builder, t, _splat(builder, d), v))
            m = mb if m is None else builder.fadd(m, mb)
        if m is not None:  # Q4_1's mins, in lane 0
            v = builder.fadd(v, builder.insert_element(ir.Constant(_VEC, None), m,
                                                       ir.Constant(_I32, 0)))
        return builder.fadd(acc, v)
    return codegen


def _make_b32(qtype, nblk):
    def step(typingctx, acc, o, xa, fa, ia):
        return vec(vec, o, xa, fa, ia), _codegen_b32(qtype, nblk)
    step.__name__ = f"b32_step8_{qtype}_{nblk}"
    return intrinsic(step)


# (acc, o, xa, fa, ia) -> acc: two blocks (`..._1`: one) at address o times x's codes at address xa
# (32 a block); fa, ia: the addresses of x's scale (float32) and code sum (int32) of each block
q8_0_step8, q4_0_step8, q4_1_step8 = (_make_b32(q, 2) for q in (Q8_0, Q4_0, Q4_1))
q8_0_step8_1, q4_0_step8_1, q4_1_step8_1 = (_make_b32(q, 1) for q in (Q8_0, Q4_0, Q4_1))


def _codegen_q4k(context, builder, sig, args):
    acc, o, xa, sa, dx = args
    hb = _load(builder, o, _vt(_I8, 16))
    sm = _k_scales(builder, hb)  # <16 x i32>: 8 mins, then 8 scales
    sc = builder.trunc(sm, _W16)
    t = ir.Constant(_D8, None)
    for c in range(4):  # 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
        q = _load(builder, _at(builder, o, 16 + 32 * c), _B32)
        for j, u in ((2 * c, builder.and_(q, _k(_I8, 32, 15))),
                     (2 * c + 1, builder.lshr(q, _k(_I8, 32, 4)))):
            p = _maddubs(builder, u, _load(builder, _at(builder, xa, 32 * j), _B32))
            t = builder.add(t, _maddwd(builder, p, _shuffle(builder, sc, sc, [8 + j] * 16)))
    mins = builder.mul(_shuffle(builder, sm, sm, list(range(8))), _load(builder, sa, _D8))
    d, dmin = (builder.fmul(_f16(builder, _at(builder, o, 2 * i)), dx) for i in (0, 1))
    acc = _fma(builder, builder.sitofp(t, _VEC), _splat(builder, d), acc)
    return _fma(builder, builder.sitofp(mins, _VEC), _splat(builder, builder.fneg(dmin)), acc)


def _codegen_q6k(context, builder, sig, args):
    acc, o, xa, sa, dx = args
    sc = builder.sext(_load(builder, _at(builder, o, 192), _vt(_I8, 16)), _W16)
    t = ir.Constant(_D8, None)
    for h in range(2):  # elements 128h + 32c + i: ql's nibble (c >> 1) of byte 32 (c & 1) + i,
        # qh's bits 2c, 2c + 1 of byte i as bits 4, 5
        qh = _load(builder, _at(builder, o, 128 + 32 * h), _B32)
        for c in range(4):
            ql = _load(builder, _at(builder, o, 64 * h + 32 * (c & 1)), _B32)
            lo = builder.lshr(ql, _k(_I8, 32, 4)) if c >> 1 else ql
            hi = (builder.shl(qh, _k(_I8, 32, 4 - 2 * c)) if c < 2 else
                  builder.lshr(qh, _k(_I8, 32, 2 * c - 4)) if c > 2 else qh)
            u = builder.or_(builder.and_(lo, _k(_I8, 32, 15)),
                            builder.and_(hi, _k(_I8, 32, 0x30)))
            p = _maddubs(builder, u, _load(builder, _at(builder, xa, 128 * h + 32 * c), _B32))
            j = 8 * h + 2 * c  # sub-blocks of 16: j in words 0-7, j + 1 in 8-15
            scales = _shuffle(builder, sc, sc, [j] * 8 + [j + 1] * 8)
            t = builder.add(t, _maddwd(builder, p, scales))
    sums = builder.trunc(_load(builder, sa, _vt(_I32, 16)), _W16)  # |sum of 16 codes| <= 2032
    t = builder.sub(t, builder.shl(_maddwd(builder, sc, sums), _k(_I32, 8, 5)))  # the -32
    d = builder.fmul(_f16(builder, _at(builder, o, 208)), dx)
    return _fma(builder, builder.sitofp(t, _VEC), _splat(builder, d), acc)


def _make_k(name, codegen):
    def step(typingctx, acc, o, xa, sa, dx):
        if dx != types.float32:
            return None
        return vec(vec, o, xa, sa, dx), codegen
    step.__name__ = name
    return intrinsic(step)


# (acc, o, xa, sa, dx) -> acc: the super-block at address o times x's 256 codes at address xa (in
# order; their scale dx). sa: x's code sums (int32) per 32 (Q4_K: 8 of them) or per 16 (Q6_K: 16)
q4k_step8 = _make_k("q4k_step8", _codegen_q4k)
q6k_step8 = _make_k("q6k_step8", _codegen_q6k)
