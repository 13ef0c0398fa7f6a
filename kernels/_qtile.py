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


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _ptr(builder, addr, ty=_I8):
    return builder.inttoptr(addr, ty.as_pointer())


def _add(builder, a, off):
    return builder.add(a, ir.Constant(a.type, off)) if isinstance(off, int) else builder.add(a, off)


def _splat(builder, x, vty):
    one = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, 16), None))


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


def _codegen(g, amx):
    def codegen(context, builder, sig, args):
        xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride = args
        fn = builder.function
        cbuf = cgutils.alloca_once(builder, ir.ArrayType(_VI, 32))  # AMX: C of two sub-blocks
        cbuf.align = 64
        cb0 = builder.ptrtoint(cbuf, _I64)
        if amx:
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
                wv = [builder.load(_ptr(builder, _add(builder, wj, 64 * k), _VI), align=4)
                      for k in range(g // 4)]

                def c_of(m):
                    c = ir.Constant(_VI, None)
                    row = _add(builder, xj, builder.mul(ir.Constant(_I64, m), xstride))
                    for k in range(g // 4):
                        x4 = builder.load(_ptr(builder, _add(builder, row, 4 * k), _I32),
                                          align=1)
                        c = _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI,
                                  [c, wv[k], _splat(builder, x4, _VI)])
                    return c
            return _post(builder, accs, c_of, dxa, sva, j, s_j, z_j, nsub)

        one = ir.Constant(_I64, 1)
        # AMX (nsub even): one product ahead of the read-back, on alternating tile sets and
        # buffers; pairs 0 .. P-2 in the loop, the last pair after it. VNNI: a sub-block a turn
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


def _make(g, amx):
    def tile(typingctx, xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride):
        if not all(isinstance(a, types.Integer) for a in
                   (xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride)):
            return None
        return types.none(types.int64, types.int64, types.int64, types.int64, types.int64,
                          types.int64, types.int64, types.int64, types.int64,
                          types.int64), _codegen(g, amx)
    tile.__name__ = f"qtile_{'amx' if amx else 'vnni'}{g}"
    return intrinsic(tile)


# (xa, xstride, dxa, sva, wb, sa, za, nsub, out, ostride): token 0's codes at xa (a token every
# xstride bytes), its dx and sv tables at dxa, sva ([16, nsub] f32), the weight block at wb
# ([nsub, g / 4, 16, 4] u8), its s and z at sa, za ([nsub, 16] f32, 64-byte aligned); y of token
# m at out + m * ostride (16 f32)
amx32, amx16 = _make(32, True), _make(16, True)
vnni32, vnni16 = _make(32, False), _make(16, False)


# --- peak micro-benchmarks: the dot-product instructions alone, in registers -------------------
PEAK_OPS = {"vnni": 12 * 64 * 2, "amx-int8": 4 * 16 * 16 * 64 * 2, "amx-bf16": 4 * 16 * 16 * 32 * 2}
# ^ operations (a multiply and an add each) of one turn of each loop


def _peak_codegen(kind):
    def codegen(context, builder, sig, args):
        (n,) = args
        fn = builder.function
        if kind != "vnni":
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
        pre = builder.block
        loop, done = fn.append_basic_block("peak.loop"), fn.append_basic_block("peak.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        i.add_incoming(ir.Constant(_I64, 0), pre)
        accs = []
        if kind == "vnni":
            phis = [builder.phi(_VI) for _ in range(12)]
            for p in phis:
                p.add_incoming(ir.Constant(_VI, None), pre)
            accs = [_call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, [p, u, s]) for p in phis]
        else:
            op = "llvm.x86.tdpbusd" if kind == "amx-int8" else "llvm.x86.tdpbf16ps"
            for c, a, b in ((0, 4, 5), (1, 4, 6), (2, 7, 5), (3, 7, 6)):
                _call(builder, op, ir.VoidType(), [_b(c), _b(a), _b(b)])
        nxt = builder.add(i, ir.Constant(_I64, 1))
        i.add_incoming(nxt, builder.block)
        for p, a in zip(phis if kind == "vnni" else [], accs, strict=True):
            p.add_incoming(a, builder.block)
        builder.cbranch(builder.icmp_unsigned("<", nxt, n), loop, done)
        builder.position_at_end(done)
        if kind == "vnni":
            tot = accs[0]
            for a in accs[1:]:
                tot = builder.add(tot, a)
            r = _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [tot])
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


peak_vnni, peak_amx_int8, peak_amx_bf16 = (_make_peak(k) for k in PEAK_OPS)
AMX_BF16 = AMX and "+amx-bf16" in _FEATURES
