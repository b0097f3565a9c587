"""The tiles of the 8-bit-activation integer GEMM (a8gemm.py), written in LLVM IR (llvmlite) as Numba
intrinsics, one build per instruction set.

Operands (a8gemm.py makes them): a weight block is 16 output columns of uint8 w + 128 (the int8 weight
made unsigned), k in quads, [K/4, 16, 4]; an x panel is 6 rows of int8 activations, k in quads,
[K/4, 6, 4], with per row and block of KBLOCK k one float32 scale and one int32 correction -128 * (sum
of the block's int8 x), which removes the +128 from the weights: sum (w + 128) x - 128 sum x = sum w x.

    tiles[isa][R, C]   R rows of a panel against C weight blocks (given by separate addresses; every
                       build takes two blocks' addresses, of which a one-block build reads the first). Per
                       block of KBLOCK k: the int32 sums start at the rows' corrections (0 on AVX2
                       without AVX-VNNI, which sums w x itself), gather the block's 8 k quads exactly,
                       then fold into float32 sums as
                       acc = fma(float(block sum), row block scale, acc); at the end
                       out = acc * column scale.
        avx512_vnni    R = 1, 2, 4, 6; C = 1, 2: one zmm of 16 int32 per (row, block); per k quad and
                       block one 64-byte weight load, per row one broadcast int32 (4 x) and one
                       vpdpbusd (64 products: 4 u8 x s8 per int32 lane, added in); R <= 2
                       prefetches the weights PREFETCH_AHEAD quads on into L2
        avx2           R = 1, 2; C = 1: two ymm halves of 8 columns per (row, block); the quad's
                       weights made signed again (xor 0x80) and their magnitudes |w| (vpsignb w, w:
                       -128 comes out as 128 unsigned), then per row the broadcast x given w's signs
                       (vpsignb), vpmaddubsw |w| x sign(w) x into int16 pairs (at most 2 x 128 x 127:
                       no saturation), vpmaddwd against ones into int32 and vpaddd: llama.cpp's sign
                       trick, 32 products per half. Sums, float sums and both halves' w and |w| fill
                       the 16 ymm at R = 2 (3 rows spill and run slower).
                       Where the CPU has AVX-VNNI (isa.avx_vnni()): avx512_vnni's steps on ymm halves
                       (its 256-bit vpdpbusd, 32 products), R = 1, 2, 3

The integer block sums are exact on both paths and the float32 steps are the same fused
multiply-adds in the same order, so both give the same bits. Every address is a raw int64 (see
llvm.py); out rows at or past `rows` are neither computed into memory nor written.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.vnni import lines_per_step, paced_prefetch
from rawinfer.backend.cpu.llvm import F32, GEMM_COLS, GEMM_ROWS, I32, _fma, _ptr, _vload, _vstore, \
    counted_loop, i64, prefetch_line, splat

KBLOCK = 32                  # k per activation scale
QUADS = KBLOCK // 4          # k quads per block (one int32 lane sums 4 products)
ROWS = {isa.AVX512_VNNI: (1, 2, 4, GEMM_ROWS), isa.AVX2: (1, 2, 3) if isa.avx_vnni() else (1, 2)}
BLOCKS = {isa.AVX512_VNNI: (1, 2), isa.AVX2: (1,)}
_LANES = {isa.AVX512_VNNI: 16, isa.AVX2: 8}
# k quads ahead that the AVX-512 builds of one or two rows (decode) prefetch each block's weights, into
# L2 (prefetcht1), as vnni.py's tile does: one row streams every weight from memory once.
PREFETCH_AHEAD = 640


def make_tile(tile_code, path: str, R: int, C: int):
    """A Numba intrinsic of a8gemm's tile arguments whose IR tile_code(builder, path, R, C, args) emits
    (this file's tiles and a8q4tile.py's). Every build takes two blocks' addresses; a one-block build
    ignores the second three."""
    def codegen(context, builder, signature, args):
        tile_code(builder, path, R, C, args)
        return context.get_dummy_value()

    @intrinsic
    def a8_tile(typingctx, xp, kblocks, rows, xsp, xcp, ldo, wp0, swp0, op0, wp1, swp1, op1, pf0, pf1, pfn):
        return types.void(*([types.int64] * 15)), codegen
    return a8_tile


def _tile_code(builder, path, R, C, args):
    """out_c[r, 0:16] = sw_c[0:16] * sum over blocks b of xs[b, r] * (x panel row r . w block c over
    block b) for r < min(rows, R), c < C. xp -> int8 panel [kblocks * 8, 6, 4]; xsp -> float32 [kblocks,
    6] scales; xcp -> int32 [kblocks, 6] corrections; ldo: the row stride of every out_c (floats); per
    block c: wp_c -> uint8 block [kblocks * 8, 16, 4], swp_c -> float32 [16], op_c -> float32 out_c.
    Last, pf0, pf1, pfn: the AVX-512 builds of more than 2 rows prefetch pfn lines from each of pf0 and
    pf1 into L2 (the driver's next weight blocks), spread evenly over the k-blocks."""
    xp, kblocks, rows, xsp, xcp, ldo = args[:6]
    blocks = [args[6 + 3 * c:9 + 3 * c] for c in range(C)]
    pf0, pf1, pfn = args[12:15]
    lanes = _LANES[path]
    H = GEMM_COLS // lanes                               # vectors per (row, block)
    VI, VF = ir.VectorType(I32, lanes), ir.VectorType(F32, lanes)
    vnni = path == isa.AVX512_VNNI
    dots = vnni or isa.avx_vnni()
    weights, madd = _quad_products(builder, dots, lanes)
    fma = _fma(builder, VF)
    xb, xsb, xcb = _ptr(builder, xp, I32), _ptr(builder, xsp, F32), _ptr(builder, xcp, I32)
    wbs = [_ptr(builder, w, VI) for w, _, _ in blocks]
    per = lines_per_step(builder, pfn, kblocks)

    def kblock(kb, sums):
        if vnni and R > 2:
            paced_prefetch(builder, kb, per, pfn, (pf0, pf1))
        row0 = builder.mul(kb, i64(GEMM_ROWS))           # this block's entry of row 0 in xs, xc
        accs = []
        for r in range(R):                               # AVX2 without vpdpbusd sums w x itself: from 0
            start = splat(builder, builder.load(builder.gep(xcb, [builder.add(row0, i64(r))]), align=4), VI) \
                if dots else ir.Constant(VI, [0] * lanes)
            accs += [start] * (C * H)
        for qd in range(QUADS):
            kq = builder.add(builder.mul(kb, i64(QUADS)), i64(qd))
            xrow = builder.gep(xb, [builder.mul(kq, i64(GEMM_ROWS))])
            xq = [builder.load(builder.gep(xrow, [i64(r)]), align=4) for r in range(R)]
            xv = [splat(builder, q, VI) for q in xq]
            for c in range(C):
                if vnni and R <= 2:                      # past the end: a hint, never a fault
                    prefetch_line(builder, builder.gep(wbs[c], [builder.add(kq, i64(PREFETCH_AHEAD))]), locality=2)
                for h in range(H):
                    w = weights(builder.load(builder.gep(wbs[c], [builder.add(builder.mul(kq, i64(H)), i64(h))]),
                                             align=4))
                    for r in range(R):
                        j = (r * C + c) * H + h
                        accs[j] = madd(accs[j], w, xv[r])
        new = []
        for r in range(R):
            s = splat(builder, builder.load(builder.gep(xsb, [builder.add(row0, i64(r))]), align=4), VF)
            for j in range(r * C * H, (r + 1) * C * H):
                new.append(builder.call(fma, [builder.sitofp(accs[j], VF), s, sums[j]]))
        return new

    fin = counted_loop(builder, kblocks, [ir.Constant(VF, [0.0] * lanes)] * (R * C * H), kblock)
    swv = [[_vload(builder, _ptr(builder, sw, F32), i64(lanes * h), VF) for h in range(H)] for _, sw, _ in blocks]
    obs = [_ptr(builder, o, F32) for _, _, o in blocks]
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", i64(r), rows), likely=True):
            for c in range(C):
                for h in range(H):
                    f = builder.fmul(fin[(r * C + c) * H + h], swv[c][h])
                    _vstore(builder, f, obs[c], builder.add(builder.mul(i64(r), ldo), i64(lanes * h)))


def _quad_products(builder, dots: bool, lanes: int):
    """(weights, madd) for one k quad: weights(wv) turns a loaded vector of uint8 w + 128 into what madd
    takes; madd(acc, w, xv) adds the products of w and xv (a broadcast int32 of 4 int8 x) to acc's int32
    lanes. With vpdpbusd (dots) the unsigned weights go in as they are (the corrections remove the +128)."""
    VI = ir.VectorType(I32, lanes)
    if dots:
        # declared with LLVM's original int32 operand types, as vnni.py's vpdpwssd
        dot = builder.module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", (),
                                               ir.FunctionType(VI, [VI] * 3))
        return (lambda wv: wv), (lambda acc, wv, xv: builder.call(dot, [acc, wv, xv]))
    V16I16, V32I8 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(8), 32)
    pmaddwd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                               ir.FunctionType(VI, [V16I16, V16I16]))
    ubsw = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (),
                                            ir.FunctionType(V16I16, [V32I8, V32I8]))
    psign = builder.module.declare_intrinsic("llvm.x86.avx2.psign.b", (), ir.FunctionType(V32I8, [V32I8] * 2))
    bias, ones = ir.Constant(VI, [0x80808080] * lanes), ir.Constant(V16I16, [1] * 16)

    def weights(wv):                                     # the signed weights w and |w| (-128 -> 128 as unsigned)
        ws = builder.bitcast(builder.xor(wv, bias), V32I8)
        return ws, builder.call(psign, [ws, ws])

    def madd(acc, w, xv):                                # |w| x sign(w) x: pairs <= 2 x 128 x 127, no saturation
        ws, wa = w
        sx = builder.call(psign, [builder.bitcast(xv, V32I8), ws])
        pairs = builder.call(ubsw, [wa, sx])
        return builder.add(acc, builder.call(pmaddwd, [pairs, ones]))
    return weights, madd


assert GEMM_COLS == 16 and KBLOCK % 4 == 0
# tiles[path][R, C]: every path's builds (a path's are only called where isa.py selects it)
tiles = {path: {(R, C): make_tile(_tile_code, path, R, C) for R in ROWS[path] for C in BLOCKS[path]} for path in ROWS}
