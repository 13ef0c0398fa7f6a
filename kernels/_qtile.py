"""Int8 tile products for the quantised prefill GEMM (kernels/qmatmul.py), written in LLVM IR.

One call multiplies a tile of 16 token rows by a block of 16 weight rows over the whole input
width, a sub-block of G channels at a time (G = 32, or 16 for Q6_K), and adds each sub-block's
int32 dot products to 16 float32 accumulators (one vector of the 16 weight rows per token):

    acc[m] += float(C_j[m]) * dx[m, j] * s_j + sv[m, j] * z_j

C_j [16 tokens, 16 rows] int32: token m's int8 codes . row r's unsigned codes over sub-block j;
s_j, z_j [16 rows]: the weights' scale and constant term of sub-block j (value = s q + z);
dx[m, j]: token m's scale there, sv[m, j] = dx x (sum of its codes there).

- AMX (`amx=True`): C_j is one `tdpbsud` (tokens' signed codes as tile A, 16 x G bytes read in
  place from the rows of codes; the weight block's unsigned codes as tile B, G/4 rows of 16 x 4
  bytes), stored to a 1 KB buffer on the stack and read back a token at a time. Two sub-blocks a
  loop turn, on two sets of tiles.
- AVX512-VNNI: the same product, a token at a time: G/4 `vpdpbusd` of the weight block's rows
  (64 bytes: 4 codes of each of the 16 weight rows) with token m's 4 codes broadcast.
- AVX-VNNI and AVX2 (no AVX-512 needed): each 64-byte row of the block as two 256-bit halves
  (weight rows 0-7, 8-15). AVX-VNNI: 256-bit `vpdpbusd`. AVX2: `vpmaddubsw` (unsigned codes .
  token codes, pairs summed in int16), as many summed in int16 as the codes' range allows
  (4-bit codes 8, 5-bit 4, Q6_K's 6-bit 2; x's codes are within +-127), then `vpmaddwd` by ones
  into int32. Q8_0's codes come signed on this path (`qmatmul._unpack`, no +128 shift): their
  magnitudes meet the token codes carrying their signs (`vpsignb`), as llama.cpp's AVX2 kernels
  do, since 2 x 255 x 127 would not fit in int16. A loop over the 16 tokens inside each
  sub-block (16 ymm registers hold one token's work), accumulators in a buffer on the stack.

Addresses are plain integers; the caller lays out the buffers (kernels/qmatmul.py)."""
from __future__ import annotations

import ctypes

import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._vec import W

_FEATURES = llb.get_host_cpu_features().flatten()
_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_F32 = ir.FloatType()
_VF, _VI = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
_B32, _W16, _D8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
_PTR = _I8.as_pointer()


def _amx_allowed() -> bool:
    """Whether this process may use AMX tiles: the CPU has AMX-INT8 and the kernel grants the
    tile data state (Linux asks each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM)."""
    if not all(f"+{f}" in _FEATURES for f in ("amx-tile", "amx-int8", "avx512f")):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arch_prctl, req_perm, xtiledata = 158, 0x1023, 18  # x86-64 syscall numbers
        return libc.syscall(arch_prctl, req_perm, xtiledata) == 0
    except (OSError, AttributeError):
        return False


VNNI512 = W == 16 and all(f"+{f}" in _FEATURES for f in ("avx512bw", "avx512vnni"))
AMX = VNNI512 and _amx_allowed()
AVX2 = all(f"+{f}" in _FEATURES for f in ("avx2", "fma"))
# 256-bit vpdpbusd: AVX-VNNI (VEX), or AVX512-VNNI with VL (EVEX)
AVXVNNI = AVX2 and ("+avxvnni" in _FEATURES or all(f"+{f}" in _FEATURES for f in (
    "avx512vnni", "avx512vl")))


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _ptr(builder, addr, ty=_I8):
    return builder.inttoptr(addr, ty.as_pointer())


def _add(builder, a, off):
    return builder.add(a, ir.Constant(a.type, off)) if isinstance(off, int) else builder.add(a, off)


def _splat(builder, x, vty):
    one = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, vty.count), None))


def _b(v):
    return ir.Constant(_I8, v)


def _tile_config(builder, g):
    """ldtilecfg: tiles 0 / 3 = C (16 x 64 bytes), 1 / 4 = A (16 x g), 2 / 5 = B (g / 4 x 64)."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
    cfg.align = 64
    base = builder.bitcast(cfg, _PTR)
    builder.store(ir.Constant(ir.ArrayType(_I8, 64), None), cfg)
    builder.store(_b(1), base)  # palette 1
    for t, (rows, colsb) in enumerate(((16, 64), (16, g), (g // 4, 64)) * 2):
        builder.store(ir.Constant(_I16, colsb),
                      builder.bitcast(builder.gep(base, [ir.Constant(_I32, 16 + 2 * t)]),
                                      _I16.as_pointer()))
        builder.store(_b(rows), builder.gep(base, [ir.Constant(_I32, 48 + t)]))
    _call(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [base])


def _post(builder, accs, c_of, dxa, sva, j, s_j, z_j, nsub):
    """accs[m] += float(C[m]) * dx[m, j] * s_j + sv[m, j] * z_j for the 16 tokens m."""
    fma = "llvm.fma.v16f32"
    out = []
    for m, a in enumerate(accs):
        off = builder.add(builder.mul(ir.Constant(_I64, m), nsub), j)  # token m's entry j
        dx = builder.load(_ptr(builder, builder.add(dxa, builder.shl(off, ir.Constant(_I64, 2))),
                               _F32), align=4)
        sv = builder.load(_ptr(builder, builder.add(sva, builder.shl(off, ir.Constant(_I64, 2))),
                               _F32), align=4)
        c = builder.fmul(builder.sitofp(c_of(m), _VF), _splat(builder, dx, _VF))
        a = _call(builder, fma, _VF, [c, s_j, a])
        out.append(_call(builder, fma, _VF, [_splat(builder, sv, _VF), z_j, a]))
    return out


def _c_vnni512(builder, g, wj, xj, xstride):
    """c_of(m): token m's C over the sub-block at wj, xj: G/4 `vpdpbusd` on 16 lanes."""
    wv = [builder.load(_ptr(builder, _add(builder, wj, 64 * k), _VI), align=4)
          for k in range(g // 4)]

    def c_of(m):
        c = ir.Constant(_VI, None)
        row = _add(builder, xj, builder.mul(ir.Constant(_I64, m), xstride))
        for k in range(g // 4):
            x4 = builder.load(_ptr(builder, _add(builder, row, 4 * k), _I32), align=1)
            c = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI,
                      [c, wv[k], _splat(builder, x4, _VI)])
        return c
    return c_of


def _c_ymm(builder, g, wj, xj, xstride, kind):
    """c_of(m) in 256-bit halves (weight rows 0-7, 8-15), AVX-512 not needed: `kind` "vnni":
    AVX-VNNI `vpdpbusd`; an int n: AVX2 `vpmaddubsw` (unsigned codes . token codes, pairs to
    int16), n of them summed in int16, then `vpmaddwd` by ones (pairs to int32); "sign": the same
    on signed codes (Q8_0), their magnitudes . the token codes carrying their signs (`vpsignb`),
    one at a time. n x 2 x (largest code) x 127 must fit in int16."""
    wv = [[builder.load(_ptr(builder, _add(builder, wj, 64 * k + 32 * h), _B32), align=4)
           for h in range(2)] for k in range(g // 4)]
    if kind == "sign":
        mag = [[_call(builder, "llvm.x86.avx2.psign.b", _B32, [w, w]) for w in wk] for wk in wv]
    run = 1 if kind == "sign" else kind
    ones = ir.Constant(_W16, [1] * 16)

    def c_of(m):
        row = _add(builder, xj, builder.mul(m, xstride))
        xb = []  # token m's 4 codes of group k, in each of the 8 lanes
        for k in range(g // 4):
            x4 = builder.load(_ptr(builder, _add(builder, row, 4 * k), _I32), align=1)
            xb.append(builder.bitcast(_splat(builder, x4, _D8), _B32))
        halves = []
        for h in range(2):
            c = ir.Constant(_D8, None)
            if kind == "vnni":
                for k in range(g // 4):
                    c = _call(builder, "llvm.x86.avx512.vpdpbusd.256", _D8,
                              [c, builder.bitcast(wv[k][h], _D8), builder.bitcast(xb[k], _D8)])
                halves.append(c)
                continue
            for k0 in range(0, g // 4, run):
                s16 = None
                for k in range(k0, k0 + run):
                    if kind == "sign":
                        x = _call(builder, "llvm.x86.avx2.psign.b", _B32, [xb[k], wv[k][h]])
                        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [mag[k][h], x])
                    else:
                        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [wv[k][h], xb[k]])
                    s16 = p if s16 is None else builder.add(s16, p)
                c = builder.add(c, _call(builder, "llvm.x86.avx2.pmadd.wd", _D8, [s16, ones]))
            halves.append(c)
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI, list(range(16))))
    return c_of


def _codegen_ymm(g, kind):
    """The 256-bit products (`_c_ymm`): a loop over sub-blocks, inside it a loop over the 16
    tokens (not unrolled: 16 ymm registers hold one token's work), each token's accumulator
    read from and written back to a buffer on the stack."""
    def codegen(context, builder, sig, args):
        xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride = args
        fn = builder.function
        acc = cgutils.alloca_once(builder, ir.ArrayType(_VF, 16))  # [token] of <16 x f32>
        acc.align = 64
        builder.store(ir.Constant(ir.ArrayType(_VF, 16), None), acc)
        zero, one = ir.Constant(_I64, 0), ir.Constant(_I64, 1)
        pre = builder.block
        jloop, mloop = fn.append_basic_block("qtile.j"), fn.append_basic_block("qtile.m")
        jnext, done = fn.append_basic_block("qtile.jnext"), fn.append_basic_block("qtile.done")
        builder.cbranch(builder.icmp_unsigned(">", nsub, zero), jloop, done)
        builder.position_at_end(jloop)
        j = builder.phi(_I64)
        j.add_incoming(zero, pre)
        s_j = builder.load(_ptr(builder, builder.add(sa, builder.shl(j, ir.Constant(_I64, 6))),
                                _VF), align=4)
        z_j = builder.load(_ptr(builder, builder.add(za, builder.shl(j, ir.Constant(_I64, 6))),
                                _VF), align=4)
        wj = builder.add(wb, builder.mul(j, ir.Constant(_I64, 16 * g)))
        xj = builder.add(xa, builder.mul(j, ir.Constant(_I64, g)))
        c_of = _c_ymm(builder, g, wj, xj, xstride, kind)
        builder.branch(mloop)
        builder.position_at_end(mloop)
        m = builder.phi(_I64)
        m.add_incoming(zero, jloop)
        off = builder.shl(builder.add(builder.mul(m, nsub), j), ir.Constant(_I64, 2))
        dx = builder.load(_ptr(builder, builder.add(dxa, off), _F32), align=4)
        sv = builder.load(_ptr(builder, builder.add(sva, off), _F32), align=4)
        c = builder.fmul(builder.sitofp(c_of(m), _VF), _splat(builder, dx, _VF))
        am = builder.gep(acc, [ir.Constant(_I32, 0), m])
        a = _call(builder, "llvm.fma.v16f32", _VF, [c, s_j, builder.load(am, align=64)])
        builder.store(_call(builder, "llvm.fma.v16f32", _VF, [_splat(builder, sv, _VF), z_j, a]),
                      am, align=64)
        mn = builder.add(m, one)
        m.add_incoming(mn, builder.block)
        builder.cbranch(builder.icmp_unsigned("<", mn, ir.Constant(_I64, 16)), mloop, jnext)
        builder.position_at_end(jnext)
        jn = builder.add(j, one)
        j.add_incoming(jn, jnext)
        builder.cbranch(builder.icmp_unsigned("<", jn, nsub), jloop, done)
        builder.position_at_end(done)
        for t in range(16):
            dst = _add(builder, out, builder.mul(ir.Constant(_I64, t), ostride))
            v = builder.load(builder.gep(acc, [ir.Constant(_I32, 0), ir.Constant(_I32, t)]),
                             align=64)
            builder.store(v, _ptr(builder, dst, _VF), align=4)
        return context.get_dummy_value()
    return codegen


def _codegen(g, kind):
    """AMX (`kind` "amx") or AVX512-VNNI ("vnni512"): the 16 tokens' accumulators in registers."""
    if kind not in ("amx", "vnni512"):
        return _codegen_ymm(g, kind)
    amx = kind == "amx"

    def codegen(context, builder, sig, args):
        xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride = args
        fn = builder.function
        if amx:
            cbuf = cgutils.alloca_once(builder, ir.ArrayType(_VI, 32))  # C of two sub-blocks
            cbuf.align = 64
            cb0 = builder.ptrtoint(cbuf, _I64)
            _tile_config(builder, g)
        c64 = ir.Constant(_I64, 64)

        def product(j, slot):  # AMX: C of sub-block j into tile set `slot`, then its buffer
            wj = _add(builder, wb, builder.mul(j, ir.Constant(_I64, 16 * g)))
            xj = _add(builder, xa, builder.mul(j, ir.Constant(_I64, g)))
            tc, ta, tb = _b(3 * slot), _b(3 * slot + 1), _b(3 * slot + 2)
            v = ir.VoidType()
            _call(builder, "llvm.x86.tilezero", v, [tc])
            _call(builder, "llvm.x86.tileloadd64", v, [ta, _ptr(builder, xj), xstride])
            _call(builder, "llvm.x86.tileloadd64", v, [tb, _ptr(builder, wj), c64])
            _call(builder, "llvm.x86.tdpbsud", v, [tc, ta, tb])
            _call(builder, "llvm.x86.tilestored64", v,
                  [tc, _ptr(builder, _add(builder, cb0, 1024 * slot)), c64])

        def sub(accs, j, slot):
            s_j = builder.load(_ptr(builder, _add(builder, sa, builder.shl(j, ir.Constant(
                _I64, 6))), _VF), align=4)
            z_j = builder.load(_ptr(builder, _add(builder, za, builder.shl(j, ir.Constant(
                _I64, 6))), _VF), align=4)
            if amx:
                cb = _add(builder, cb0, 1024 * slot)

                def c_of(m):
                    return builder.load(_ptr(builder, _add(builder, cb, 64 * m), _VI), align=64)
            else:
                wj = _add(builder, wb, builder.mul(j, ir.Constant(_I64, 16 * g)))
                xj = _add(builder, xa, builder.mul(j, ir.Constant(_I64, g)))
                c_of = _c_vnni512(builder, g, wj, xj, xstride)
            return _post(builder, accs, c_of, dxa, sva, j, s_j, z_j, nsub)

        one = ir.Constant(_I64, 1)
        # AMX (nsub even): one product ahead of the read-back, on alternating tile sets and
        # buffers; pairs 0 .. P-2 in the loop, the last pair after it. Else a sub-block a turn
        if amx:
            product(ir.Constant(_I64, 0), 0)
            turns = builder.sub(builder.udiv(nsub, ir.Constant(_I64, 2)), one)
        else:
            turns = nsub
        pre = builder.block
        loop, done = fn.append_basic_block("qtile.loop"), fn.append_basic_block("qtile.done")
        builder.cbranch(builder.icmp_unsigned(">", turns, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        i.add_incoming(ir.Constant(_I64, 0), pre)
        phis = [builder.phi(_VF) for _ in range(16)]
        for p in phis:
            p.add_incoming(ir.Constant(_VF, None), pre)
        accs = list(phis)
        if amx:
            j0 = builder.shl(i, one)
            j1 = builder.add(j0, one)
            product(j1, 1)
            accs = sub(accs, j0, 0)
            product(builder.add(j1, one), 0)
            accs = sub(accs, j1, 1)
        else:
            accs = sub(accs, i, 0)
        nxt = builder.add(i, one)
        end = builder.block
        i.add_incoming(nxt, end)
        for p, a in zip(phis, accs, strict=True):
            p.add_incoming(a, end)
        builder.cbranch(builder.icmp_unsigned("<", nxt, turns), loop, done)
        builder.position_at_end(done)
        res = [builder.phi(_VF) for _ in range(16)]
        for r, a in zip(res, accs, strict=True):
            r.add_incoming(ir.Constant(_VF, None), pre)
            r.add_incoming(a, end)
        if amx:  # the last pair (its first product already made)
            j1 = builder.sub(nsub, one)
            j0 = builder.sub(j1, one)
            product(j1, 1)
            res = sub(res, j0, 0)
            res = sub(res, j1, 1)
            _call(builder, "llvm.x86.tilerelease", ir.VoidType(), [])
        for m, a in enumerate(res):
            dst = _add(builder, out, builder.mul(ir.Constant(_I64, m), ostride))
            builder.store(a, _ptr(builder, dst, _VF), align=4)
        return context.get_dummy_value()
    return codegen


def _make(g, kind):
    def tile(typingctx, xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride):
        if not all(isinstance(a, types.Integer) for a in
                   (xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride)):
            return None
        return types.none(types.int64, types.int64, types.int64, types.int64, types.int64,
                          types.int64, types.int64, types.int64, types.int64,
                          types.int64), _codegen(g, kind)
    tile.__name__ = f"qtile_{kind}_{g}"
    return intrinsic(tile)


# (xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride): token 0's codes at xa (a token every
# xstride bytes), its dx and sv tables at dxa, sva ([16, nsub] f32), the weight block at wb
# ([nsub, g / 4, 16, 4] u8), its s and z at sa, za ([nsub, 16] f32, 64-byte aligned); y of token
# m at out + m * ostride (16 f32)
amx32, amx16 = _make(32, "amx"), _make(16, "amx")
vnni32, vnni16 = _make(32, "vnni512"), _make(16, "vnni512")
avxvnni32, avxvnni16 = _make(32, "vnni"), _make(16, "vnni")
# AVX2, by the codes' range (x's codes within +-127): 4-bit codes 8 products summed in int16,
# 5-bit 4, Q6_K's 6-bit 2 (its 16-channel sub-blocks: 4 groups); Q8_0's signed codes one
avx2_4bit, avx2_5bit, avx2_6bit, avx2_q8 = (_make(32, 8), _make(32, 4), _make(16, 2),
                                            _make(32, "sign"))


# --- peak micro-benchmarks: the dot-product instructions alone, in registers -------------------
PEAK_OPS = {"vnni": 12 * 64 * 2, "amx-int8": 4 * 16 * 16 * 64 * 2,
            "amx-bf16": 4 * 16 * 16 * 32 * 2, "avx2": 12 * 32 * 2}
# ^ operations (a multiply and an add each) of one turn of each loop


def _peak_codegen(kind):
    def codegen(context, builder, sig, args):
        (n,) = args
        fn = builder.function
        if kind.startswith("amx"):
            cfg = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
            cfg.align = 64
            base = builder.bitcast(cfg, _PTR)
            builder.store(ir.Constant(ir.ArrayType(_I8, 64), None), cfg)
            builder.store(_b(1), base)
            for t in range(8):
                builder.store(ir.Constant(_I16, 64), builder.bitcast(
                    builder.gep(base, [ir.Constant(_I32, 16 + 2 * t)]), _I16.as_pointer()))
                builder.store(_b(16), builder.gep(base, [ir.Constant(_I32, 48 + t)]))
            _call(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [base])
            for t in range(8):
                _call(builder, "llvm.x86.tilezero", ir.VoidType(), [_b(t)])
        src = builder.trunc(n, _I32)  # inputs LLVM cannot fold away
        u = _splat(builder, src, _VI)
        s = _splat(builder, builder.add(src, ir.Constant(_I32, 1)), _VI)
        ub = builder.bitcast(builder.shuffle_vector(u, u, ir.Constant(_D8, list(range(8)))), _B32)
        pre = builder.block
        loop, done = fn.append_basic_block("peak.loop"), fn.append_basic_block("peak.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        i.add_incoming(ir.Constant(_I64, 0), pre)
        accs, phis = [], []
        if kind == "vnni":
            phis = [builder.phi(_VI) for _ in range(12)]
            for p in phis:
                p.add_incoming(ir.Constant(_VI, None), pre)
            accs = [_call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, [p, u, s]) for p in phis]
        elif kind == "avx2":  # int16 sums fed back as the signed bytes: nothing to hoist
            phis = [builder.phi(_W16) for _ in range(12)]
            for p in phis:
                p.add_incoming(ir.Constant(_W16, None), pre)
            accs = [builder.add(p, _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16,
                                         [ub, builder.bitcast(p, _B32)])) for p in phis]
        else:
            op = "llvm.x86.tdpbusd" if kind == "amx-int8" else "llvm.x86.tdpbf16ps"
            for c, a, b in ((0, 4, 5), (1, 4, 6), (2, 7, 5), (3, 7, 6)):
                _call(builder, op, ir.VoidType(), [_b(c), _b(a), _b(b)])
        nxt = builder.add(i, ir.Constant(_I64, 1))
        i.add_incoming(nxt, builder.block)
        for p, a in zip(phis, accs, strict=True):
            p.add_incoming(a, builder.block)
        builder.cbranch(builder.icmp_unsigned("<", nxt, n), loop, done)
        builder.position_at_end(done)
        if accs:
            tot = accs[0]
            for a in accs[1:]:
                tot = builder.add(tot, a)
            r = _call(builder, f"llvm.vector.reduce.add.v16i{32 if kind == 'vnni' else 16}",
                      tot.type.element, [tot])
            return builder.sext(r, _I64)
        _call(builder, "llvm.x86.tilerelease", ir.VoidType(), [])
        return ir.Constant(_I64, 0)
    return codegen


def _make_peak(kind):
    def peak(typingctx, n):
        if not isinstance(n, types.Integer):
            return None
        return types.int64(types.int64), _peak_codegen(kind)
    peak.__name__ = f"peak_{kind.replace('-', '_')}"
    return intrinsic(peak)


peak_vnni, peak_amx_int8, peak_amx_bf16, peak_avx2 = (_make_peak(k) for k in PEAK_OPS)
AMX_BF16 = AMX and "+amx-bf16" in _FEATURES
