"""AVX512-VNNI building blocks for the quantised GEMV (kernels/qlinear.py).

x is rounded to int8 codes once per call and laid out so that each step reads its codes as whole
64-byte vectors. A step takes one row's weights for 128 (a group of four 32-blocks) or 256 (a
K-quant super-block) of its columns and adds them to the row's float32 accumulator (16 lanes,
summed at the end): the weights' codes go to `vpdpbusd` as unsigned bytes beside 64 x codes
(int32 lane i gains the dot product of 4 weights with 4 codes).

- 32-block step (`step32(qtype, tail)`): the four blocks' bytes come in two (Q8_0: three)
  unaligned 64-byte loads, and one byte shuffle (`vpermt2b`) per 64 codes puts them in the order
  of x's codes; one word shuffle gathers the four f16 scales (and mins); Q5's qh words go into
  place by one more, and `vpmultishiftqb` moves each bit to its code. The int32 result holds block
  b in lanes 4b..4b+3, so one `fma` with the lanes' scales (block scale x x's scale) adds the
  group. A block's constant term (Q4_0's -8, Q5_0's -16, the +128 that makes Q8_0's codes
  unsigned) is an integer the accumulator of `vpdpbusd` starts from (from a table of x's code
  sums); Q4_1 / Q5_1's mins are one more `fma` on 4 lanes. A tail step (the last two blocks of a
  row of 4n + 2) does the same on half-width vectors.
- K-quant step (`q4k_step`, `q5k_step`, `q6k_step`): four `vpdpbusd` (sub-block dots, each within
  int16), then `vpdpwssd` multiplies them by the 6-bit (Q6_K: 8-bit) sub-block scales and sums
  in int32 (Q4_K / Q5_K: two of them, each over two dots packed into words; Q6_K: four); the
  scales are unpacked with byte shuffles. One `fma` scales the super-block by
  d x dx; Q4_K / Q5_K's mins are one `vpmaddwd` against x's sub-block sums and one `fma` (8
  lanes), Q6_K's -32 is an integer start value.

Addresses are plain integers (the row's bytes in the mapped file, the tables of x); every vector
is carried in a `vec` (16 float32 lanes) and bit-cast where used. `absmax16` and `codes16` (the
rounding of x) work on 16 explicit lanes, so the AVX2 path (kernels/_qavx2.py) uses them too.
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

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
# 32-blocks: bytes a block, offsets of qs, the min m and qh (d is at 0)
LAYOUT32 = {Q8_0: (34, 2, None, None), Q4_0: (18, 2, None, None), Q4_1: (20, 4, 2, None),
            Q5_0: (22, 6, None, 2), Q5_1: (24, 8, 2, 4)}

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32, _F16 = ir.FloatType(), ir.HalfType()
_I32X16, _F32X16 = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


def _vt(ty, n):
    return ir.VectorType(ty, n)


def _k(ty, n, v):
    """A constant vector of n lanes: v in every lane, or the list v."""
    return ir.Constant(_vt(ty, n), v if isinstance(v, list) else [v] * n)


def _load(builder, addr, vty):
    return builder.load(builder.inttoptr(addr, vty.as_pointer()), align=1)


def _at(builder, addr, off):
    return builder.add(addr, ir.Constant(addr.type, off)) if off else addr


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, _k(_I32, len(idx), idx))


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _dpbusd(builder, acc, u, s, lanes=16):
    """acc + (u's unsigned bytes . s's signed bytes, 4 at a time): <lanes x i32>."""
    ty = _vt(_I32, lanes)
    return _call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", ty,
                 [builder.bitcast(v, ty) for v in (acc, u, s)])


def _dpwssd(builder, acc, a, b):
    """acc + (a's signed words . b's signed words, 2 at a time): <16 x i32>."""
    return _call(builder, "llvm.x86.avx512.vpdpwssd.512", _I32X16,
                 [builder.bitcast(v, _I32X16) for v in (acc, a, b)])


def _fma(builder, a, b, c):
    return _call(builder, f"llvm.fma.v{W}f32", _VEC, [a, b, c])


def _splat(builder, x):
    one = builder.insert_element(ir.Constant(_VEC, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _k(_I32, W, 0))


class _Bytes:
    """A row's bytes from address `base` read by equal unaligned loads at the byte offsets
    `starts` (each `size` bytes); `pick` gathers bytes or 16-bit words at given offsets into one
    vector by one shuffle of at most two of the loads."""

    def __init__(self, builder, base, starts, size):
        self.b, self.size = builder, size
        self.loads = [(s, _load(builder, _at(builder, base, s), _vt(_I8, size))) for s in starts]

    def pick(self, offsets, word=False):
        n = 2 if word else 1

        def inside(start, f):
            return start <= f and f + n <= start + self.size and (f - start) % n == 0
        for i, (sa, va) in enumerate(self.loads):
            for sb, vb in self.loads[i:]:
                if all(inside(sa, f) or inside(sb, f) for f in offsets):
                    if word:
                        wt = _vt(_I16, self.size // 2)
                        va, vb = self.b.bitcast(va, wt), self.b.bitcast(vb, wt)
                    idx = [(f - sa) // n if inside(sa, f) else (self.size + f - sb) // n
                           for f in offsets]
                    return _shuffle(self.b, va, vb, idx)
        raise ValueError(f"no two loads at {[s for s, _ in self.loads]} hold {offsets}")


def _halves(builder, words):
    """<n x i16> f16 bits -> <n x float>."""
    n = words.type.count
    return builder.fpext(builder.bitcast(words, _vt(_F16, n)), _vt(_F32, n))


def _insert_low(builder, v, low):
    """v with its first lanes replaced by the vector `low`."""
    n, m = low.type.count, v.type.count
    return _shuffle(builder, v, _shuffle(builder, low, low, list(range(n)) * (m // n)),
                    [m + i for i in range(n)] + list(range(n, m)))


def _fma_low(builder, a, b, v):
    """v with a * b added to its first lanes (as many as a has): an fma on fewer lanes."""
    n = a.type.count
    low = _call(builder, f"llvm.fma.v{n}f32", a.type,
                [a, b, _shuffle(builder, v, v, list(range(n)))])
    return _insert_low(builder, v, low)


def _low(builder, v, ty, n):
    """The first n lanes of the 64-byte vector v seen as lanes of type ty."""
    v = builder.bitcast(v, _vt(ty, 16 if ty == _F32 else 512 // ty.width))
    return v if n == v.type.count else _shuffle(builder, v, v, list(range(n)))


def _codegen32(qtype, tail):
    nb, qs, m, qh = LAYOUT32[qtype]
    blocks = (0, 1) if tail else (0, 1, 2, 3)  # a tail step: two blocks on half vectors
    lanes = 4 * len(blocks)  # int32 lanes of the blocks' dot products (4 a block)
    if qtype == Q8_0:
        starts, size = ((0, 4) if tail else (0, 64, 72)), 64
    else:
        starts, size = ((0, 2 * nb - 32) if tail else (0, 4 * nb - 64)), 32 if tail else 64

    def codegen(context, builder, sig, args):
        acc, o, x1, x2, sx, f2, i1, i2 = args
        src = _Bytes(builder, o, starts, size)
        if qtype == Q8_0:  # 32 codes a block: blocks 0, 1 in u1 (lanes 0-7, 8-15), 2, 3 in u2
            flip = _k(_I8, 64, 128)  # the +128 that makes the codes unsigned
            u1 = builder.xor(src.pick([b * nb + qs + i for b in (0, 1) for i in range(32)]), flip)
            p1 = _dpbusd(builder, i1, u1, x1)
            pick4 = [i + 8 * c for c in range(4) for i in range(4)]  # 4 lanes of each block
            if tail:
                p = builder.add(_shuffle(builder, p1, p1, pick4[:8]),
                                _shuffle(builder, p1, p1, [i + 4 for i in pick4[:8]]))
            else:
                u2 = builder.xor(src.pick([b * nb + qs + i for b in (2, 3) for i in range(32)]),
                                 flip)
                p2 = _dpbusd(builder, i2, u2, x2)
                p = builder.add(_shuffle(builder, p1, p2, pick4),
                                _shuffle(builder, p1, p2, [i + 4 for i in pick4]))
        else:  # 16 codes a block in each of u1 (elements 0-15) and u2 (16-31)
            nbytes = 16 * len(blocks)
            q = src.pick([b * nb + qs + i for b in blocks for i in range(16)])
            u1 = builder.and_(q, _k(_I8, nbytes, 15))
            u2 = builder.lshr(q, _k(_I8, nbytes, 4))
            if qh is not None:  # bit 4 of element i of block b (byte 16b + i of u1, of u2 for
                # i + 16) is bit i of qh. With qh in both 64-bit words of those bytes,
                # vpmultishiftqb takes bits i - 4 .. i + 3 (wrapping) of the word to byte i
                h = src.pick([b * nb + qh + 2 * (w % 2) for b in blocks for w in range(8)], True)
                h = builder.bitcast(h, _vt(_I8, nbytes))
                us = []
                for u, first in ((u1, -4), (u2, 12)):
                    ctrl = _k(_I8, nbytes, [(first + i) % 64 for _ in blocks for i in range(16)])
                    moved = _call(builder, f"llvm.x86.avx512.pmultishift.qb.{8 * nbytes}",
                                  _vt(_I8, nbytes), [ctrl, h])
                    us.append(builder.or_(u, builder.and_(moved, _k(_I8, nbytes, 16))))
                u1, u2 = us
            start = (ir.Constant(_vt(_I32, lanes), None) if m is not None
                     else _low(builder, i1, _I32, lanes))
            p = _dpbusd(builder, start, u1, _low(builder, x1, _I8, nbytes), lanes)
            p = _dpbusd(builder, p, u2, _low(builder, x2, _I8, nbytes), lanes)
        d_at = [b * nb for b in blocks for _ in range(4)]  # d of block b in lanes 4b..4b+3
        part = _low(builder, acc, _F32, lanes)
        if m is None:
            d = _halves(builder, src.pick(d_at, True))
        else:  # one shuffle for d and the 4 mins; the mins' term in 4 lanes (cheaper than 16)
            # (a tail's lanes 2, 3 repeat blocks 0, 1: their dx x sums are 0)
            m_at = [b * nb + m for b in blocks] * (4 // len(blocks))
            h = src.pick(d_at + m_at * (lanes // 4), True)
            d = _halves(builder, _shuffle(builder, h, h, list(range(lanes))))
            mins = _halves(builder, _shuffle(builder, h, h, [lanes + i for i in range(4)]))
            part = _fma_low(builder, mins, _low(builder, f2, _F32, 4), part)
        scale = builder.fmul(d, _low(builder, sx, _F32, lanes))
        part = _call(builder, f"llvm.fma.v{lanes}f32", part.type,
                     [builder.sitofp(p, part.type), scale, part])
        return part if lanes == W else _insert_low(builder, acc, part)
    return codegen


def _make_step32(qtype, tail):
    def step(typingctx, acc, o, x1, x2, sx, f2, i1, i2):
        return vec(vec, o, vec, vec, vec, vec, vec, vec), _codegen32(qtype, tail)
    step.__name__ = f"step32_{qtype}{'_tail' if tail else ''}"
    return intrinsic(step)


STEP32 = {(t, tail): _make_step32(t, tail) for t in LAYOUT32 for tail in (False, True)}


def step32(qtype, tail):
    """The step intrinsic `(acc, o, x1, x2, sx, f2, i1, i2) -> acc` for a group of four blocks
    of `qtype` at address o (with `tail`: two blocks). x1, x2: x's 128 codes in the order the
    type's step reads them; sx: x's scale of block b in lanes 4b..4b+3; Q4_1 / Q5_1: f2 holds
    dx x (block b's code sum) in lane b; Q4_0 / Q5_0: i1 holds -offset x (code sum)
    in lane 4b; Q8_0: i1, i2 hold -128 x (code sum) of blocks 0, 1 in lanes 0, 8 and of blocks
    2, 3 in lanes 0, 8. Unused arguments are ignored."""
    return STEP32[qtype, tail]


def _k_scales(builder, hb):
    """Q4_K / Q5_K header bytes (d, dmin f16, 12 bytes of 6-bit scales and mins) -> the 8
    mins then the 8 scales, <16 x i32>."""
    v16 = _vt(_I8, 16)
    zero = ir.Constant(v16, None)
    # scale bytes s[i] sit at 4 + i. m0-3 = s4-7 & 63, m4-7 = (s8-11 >> 4) | (s4-7 >> 6) << 4,
    # sc0-3 = s0-3 & 63, sc4-7 = (s8-11 & 15) | (s0-3 >> 6) << 4
    p = _shuffle(builder, hb, hb, [8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6, 7, 12, 13, 14, 15])
    q = _shuffle(builder, hb, zero, [16] * 4 + [8, 9, 10, 11] + [16] * 4 + [4, 5, 6, 7])
    w8 = _vt(_I16, 8)
    p4 = builder.bitcast(builder.lshr(builder.bitcast(p, w8), _k(_I16, 8, 4)), v16)
    p = _shuffle(builder, p, p4, [0, 1, 2, 3, 20, 21, 22, 23] + list(range(8, 16)))
    p = builder.and_(p, _k(_I8, 16, [63] * 4 + [15] * 4 + [63] * 4 + [15] * 4))
    q = builder.bitcast(builder.lshr(builder.bitcast(q, w8), _k(_I16, 8, 2)), v16)
    return builder.zext(builder.or_(p, builder.and_(q, _k(_I8, 16, 0x30))), _I32X16)


def _codegen_k45(five):
    qs = 48 if five else 16

    def codegen(context, builder, sig, args):
        acc, o, x0, x1, x2, x3, dx, tab = args
        hb = _load(builder, o, _vt(_I8, 16))
        sm = _k_scales(builder, hb)
        qa = _load(builder, _at(builder, o, qs), _vt(_I8, 64))
        qb = _load(builder, _at(builder, o, qs + 64), _vt(_I8, 64))
        lo, sh = _k(_I8, 64, 15), _k(_I8, 64, 4)
        # sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) in lanes 0-7, 8-15 (x's codes in that order)
        us = [builder.and_(qa, lo), builder.lshr(qa, sh), builder.and_(qb, lo),
              builder.lshr(qb, sh)]
        subs = ((0, 2), (1, 3), (4, 6), (5, 7))
        if five:  # bit 4 of sub-block j's element i: bit j of qh[i], shifted there in 16-bit
            # lanes (the bits that cross into the other byte are masked off)
            qh = _load(builder, _at(builder, o, 16), _vt(_I8, 32))
            qh = builder.bitcast(_shuffle(builder, qh, qh, list(range(32)) * 2), _vt(_I16, 32))
            for j, (a, b) in enumerate(subs):
                n = [4 - a] * 16 + [4 - b] * 16 if a < 4 else [a - 4] * 16 + [b - 4] * 16
                moved = (builder.shl if a < 4 else builder.lshr)(qh, _k(_I16, 32, n))
                moved = builder.and_(builder.bitcast(moved, _vt(_I8, 64)), _k(_I8, 64, 16))
                us[j] = builder.or_(us[j], moved)
        zero = ir.Constant(_I32X16, None)
        # |p| <= 4 * 31 * 127: an int16, so two p's pack into one vector of words (no saturation)
        # and one vpdpwssd scales both: two multiplies and two word shuffles where one per p took
        # four of each (ad hoc, 8B widths: 1.10x the GEMV's speed in cache, 1.05x from memory
        # on one thread)
        ps = [_dpbusd(builder, zero, u, x) for u, x in zip(us, (x0, x1, x2, x3), strict=True)]
        s16 = builder.trunc(sm, _vt(_I16, 16))  # 8 mins, then 8 scales, as words
        t = zero
        for h in (0, 1):  # p_2h holds sub-blocks 4h + (0, 2), p_2h+1 sub-blocks 4h + (1, 3)
            pk = _call(builder, "llvm.x86.avx512.packssdw.512", _vt(_I16, 32),
                       [ps[2 * h], ps[2 * h + 1]])
            # word 8L + k of pk: lane 4L + k of p_2h (k < 4), else lane 4L + k - 4 of p_2h+1
            sub = [4 * h + (k >= 4) + 2 * (lane >= 2) for lane in range(4) for k in range(8)]
            t = _dpwssd(builder, t, pk, _shuffle(builder, s16, s16, [8 + i for i in sub]))
        w16 = _vt(_I16, 16)
        mins = _call(builder, "llvm.x86.avx2.pmadd.wd", _vt(_I32, 8),
                     [builder.bitcast(_low(builder, sm, _I32, 8), w16),
                      builder.bitcast(_low(builder, tab, _I32, 8), w16)])  # m_j * -sum_j
        dd = builder.fpext(builder.bitcast(_shuffle(builder, hb, hb, [0, 1, 2, 3]),
                                           _vt(_F16, 2)), _vt(_F32, 2))
        d = builder.fmul(builder.extract_element(dd, ir.Constant(_I32, 0)), dx)
        dmin = builder.fmul(builder.extract_element(dd, ir.Constant(_I32, 1)), dx)
        acc = _fma_low(builder, builder.sitofp(mins, _vt(_F32, 8)),  # on 8 lanes
                       _low(builder, _splat(builder, dmin), _F32, 8), acc)
        return _fma(builder, builder.sitofp(t, _VEC), _splat(builder, d), acc)
    return codegen


def _codegen_q6k(context, builder, sig, args):
    acc, o, x0, x1, x2, x3, dx, tab = args
    lo, sh = _k(_I8, 64, 15), _k(_I8, 64, 4)
    w32 = _vt(_I16, 32)
    us = []
    for h in (0, 1):  # elements 128h + (0-63 | 64-127): low nibbles of ql | their high nibbles
        ql = _load(builder, _at(builder, o, 64 * h), _vt(_I8, 64))
        qh = _load(builder, _at(builder, o, 128 + 32 * h), _vt(_I8, 32))
        qh = builder.bitcast(_shuffle(builder, qh, qh, list(range(32)) * 2), w32)
        # bits 2c, 2c + 1 of qh to bits 4, 5: c = 0 | 1 for the low nibbles, 2 | 3 for the high
        hl = builder.shl(qh, _k(_I16, 32, [4] * 16 + [2] * 16))
        hh = builder.lshr(qh, _k(_I16, 32, [0] * 16 + [2] * 16))
        top = [builder.and_(builder.bitcast(v, _vt(_I8, 64)), _k(_I8, 64, 0x30)) for v in (hl, hh)]
        us += [builder.or_(builder.and_(ql, lo), top[0]), builder.or_(builder.lshr(ql, sh), top[1])]
    sc = _load(builder, _at(builder, o, 192), _vt(_I8, 16))
    s_words = builder.zext(builder.sext(sc, _vt(_I16, 16)), _I32X16)  # high words 0
    t = builder.mul(builder.sext(sc, _I32X16), builder.bitcast(tab, _I32X16))  # -32 sc_j sum_j
    for j, (u, x) in enumerate(zip(us, (x0, x1, x2, x3), strict=True)):
        p = _dpbusd(builder, ir.Constant(_I32X16, None), u, x)  # |p| <= 4 * 63 * 127
        first = 4 * j  # sub-blocks of 16: 4 lanes each
        t = _dpwssd(builder, t, p, _shuffle(builder, s_words, s_words,
                                              [first + i // 4 for i in range(16)]))
    d = builder.fpext(_load(builder, _at(builder, o, 208), _F16), _F32)
    return _fma(builder, builder.sitofp(t, _VEC), _splat(builder, builder.fmul(d, dx)), acc)


def _make_k_step(name, codegen):
    def step(typingctx, acc, o, x0, x1, x2, x3, dx, tab):
        if dx != types.float32:
            return None
        return vec(vec, o, vec, vec, vec, vec, dx, vec), codegen
    step.__name__ = name
    return intrinsic(step)


# (acc, o, x0, x1, x2, x3, dx, tab) -> acc: the super-block at address o; x0-x3: its 256 codes
# (Q4_K / Q5_K: sub-blocks of 32 in the order 0 2 1 3 4 6 5 7; Q6_K: in order), dx their scale;
# tab: Q4_K / Q5_K: -(code sums of sub-blocks 0-7) in lanes 0-7; Q6_K: -32 x
# (code sums of sub-blocks of 16) in lanes 0-15
q4k_step = _make_k_step("q4k_step", _codegen_k45(False))
q5k_step = _make_k_step("q5k_step", _codegen_k45(True))
q6k_step = _make_k_step("q6k_step", _codegen_q6k)


@intrinsic
def absmax16(typingctx, addr):
    """The largest |x| of the 16 float32 at integer address `addr`."""
    def codegen(context, builder, sig, args):
        v = builder.bitcast(_load(builder, args[0], _F32X16), _I32X16)
        v = builder.and_(v, _k(_I32, 16, 0x7FFFFFFF))  # |x| by its bits: an integer max
        m = _call(builder, "llvm.vector.reduce.umax.v16i32", _I32, [v])
        return builder.bitcast(m, _F32)
    return types.float32(addr), codegen


@intrinsic
def codes16(typingctx, dst, src, inv):
    """The 16 float32 at address src times inv, rounded to the nearest integer (ties to even) as
    int8 codes at address dst; returns the codes' sum (int32)."""
    if inv != types.float32:
        return None

    def codegen(context, builder, sig, args):
        inv = builder.insert_element(ir.Constant(_F32X16, None), args[2], ir.Constant(_I32, 0))
        inv = _shuffle(builder, inv, inv, [0] * 16)
        v = builder.fmul(_load(builder, args[1], _F32X16), inv)
        c = builder.fptosi(_call(builder, "llvm.rint.v16f32", _F32X16, [v]), _I32X16)
        c8 = builder.trunc(c, _vt(_I8, 16))
        builder.store(c8, builder.inttoptr(args[0], c8.type.as_pointer()), align=1)
        return _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [builder.sext(c8, _I32X16)])
    return types.int32(dst, src, inv), codegen


@intrinsic
def ldv(typingctx, addr):
    """The 64 bytes at integer address `addr` (any alignment), as a vec."""
    def codegen(context, builder, sig, args):
        return _load(builder, args[0], _VEC)
    return vec(addr), codegen


