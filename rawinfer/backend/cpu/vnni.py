"""The integer GEMM's tile for AVX-512 with VNNI, written in LLVM IR (llvmlite) as Numba intrinsics.

The same packed operands as the AVX2 tile (llvm.int_gemm_tiles; qgemm.py has the layout): one k pair
of a 16-column weight block is 32 int8, which sign-extend to exactly one zmm of 32 int16, and
`vpdpwssd` multiplies its 16 int16 pairs by a broadcast x pair and adds them into 16 int32 lanes in
one instruction (AVX2 needs vpmaddwd + vpaddd for 8 lanes). The sums are exact int32, as on AVX2, and
the float32 epilogue is the same expression, so both paths give the same bits.

    int_gemm_tiles_512[R, C]   R x (16 C) int32 tile: R rows of a 6-row x panel (R = 1, 2, 4, 6)
                               against C weight blocks (C = 1, 2) given by separate addresses; per
                               k pair C sign extensions and R C vpdpwssd
                               (accumulators: R C zmm, 12 for the 6 x 2 build, which keeps enough
                               independent sums in flight to cover vpdpwssd's latency); the 1- and
                               2-row builds prefetch the weights PREFETCH_AHEAD k pairs on into L2,
                               the 4- and 6-row builds a slice of the driver's next blocks
                               (paced_prefetch, which q4tile.py and a8tile.py use too)

The blocks' addresses are separate arguments so that one build serves the plain GEMM (blocks j and
j + 1) and the gate/up GEMM with silu in its epilogue (gate block j and up block j + F/16).
Only compiled where the CPU Numba compiles for has AVX-512 F/BW and VNNI (isa.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.llvm import GEMM_COLS, GEMM_ROWS, F32, I8, I32, _ptr, _vload, _vstore, counted_loop, \
    i64, prefetch_line, splat

V16I32, V32I16, V32I8, V16F32 = (ir.VectorType(I32, 16), ir.VectorType(ir.IntType(16), 32),
                                 ir.VectorType(I8, 32), ir.VectorType(F32, 16))
I8P = I8.as_pointer()
TILE_ROWS = (1, 2, 4, GEMM_ROWS)
TILE_BLOCKS = (1, 2)
# k pairs ahead that the builds of one or two rows (decode) prefetch each block's weights, into L2
# (prefetcht1): they stream every weight from memory once, and the hardware prefetchers alone keep
# fewer lines in flight (docs/kernels.md); prefetches into L1 queue on its few miss buffers. More rows
# reuse each weight line from cache.
PREFETCH_AHEAD = 640


def lines_per_step(builder, lines, steps):
    """ceil(lines / steps) (steps <= 0 counts as 1): how many lines paced_prefetch takes per loop step."""
    steps = builder.select(builder.icmp_signed(">", steps, i64(0)), steps, i64(1))
    return builder.sdiv(builder.add(lines, builder.sub(steps, i64(1))), steps)


def paced_prefetch(builder, step, per, lines, bases):
    """In loop step `step` of a tile: prefetch into L2 (prefetcht1) lines step * per .. step * per + per
    - 1 of each region starting at an address of `bases`, those below `lines`. A driver hands a tile a
    slice of the weights it will read next; requested a few per step, spread over the arithmetic,
    they arrive sooner than the same lines in one burst (docs/kernels.md)."""
    first = builder.mul(step, per)
    left = builder.sub(lines, first)

    def line(i, _):
        at = builder.mul(builder.add(first, i), i64(64))
        for base in bases:
            prefetch_line(builder, builder.inttoptr(builder.add(base, at), I8P), 2)
        return []
    counted_loop(builder, builder.select(builder.icmp_signed("<", left, per), left, per), [], line)


def _make_tile(R: int, C: int):
    # Numba's intrinsics take no *args: one typer per block count.
    def codegen(context, builder, signature, args):
        _tile_code(builder, R, C, args)
        return context.get_dummy_value()

    if C == 1:
        @intrinsic
        def int_gemm_tile_512(typingctx, xp, kpairs, rows, sxp, ldo, wp0, swp0, op0, pf0, pf1, pfn):
            return types.void(*([types.int64] * 11)), codegen
    else:
        @intrinsic
        def int_gemm_tile_512(typingctx, xp, kpairs, rows, sxp, ldo, wp0, swp0, op0, wp1, swp1, op1, pf0, pf1,
                              pfn):
            return types.void(*([types.int64] * 14)), codegen
    return int_gemm_tile_512


def _tile_code(builder, R, C, args):
    """out_c[r, 0:16] = sx[r] * sw_c[0:16] * (x panel row r . w block c) for r < min(rows, R), c < C.
    xp -> int16 panel [kpairs, 6, 2]; sxp -> float32 [6] row scales; ldo: the row stride of every out_c
    (floats); then per block c: wp_c -> int8 block [kpairs, 16, 2], swp_c -> float32 [16] column
    scales, op_c -> float32 out_c. Last, pf0, pf1, pfn: builds of more than 2 rows prefetch pfn lines from
    each of pf0 and pf1 into L2, one from each per k pair (the driver's next weight blocks, paced so
    that the requests spread over the arithmetic; pfn <= kpairs)."""
    xp, kpairs, rows, sxp, ldo = args[:5]
    blocks = [args[5 + 3 * c:8 + 3 * c] for c in range(C)]
    pf0, pf1, pfn = args[-3:]
    # Declared with LLVM's original int32 operand types: older LLVMs know only these, newer ones
    # upgrade the call to their int16 form (the same instruction).
    dpwssd = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpwssd.512", (),
                                              ir.FunctionType(V16I32, [V16I32] * 3))
    xb = _ptr(builder, xp, I32)                              # one int32 = the k pair of one row
    wbs = [_ptr(builder, w, V32I8) for w, _, _ in blocks]    # one <32 x i8> = 16 columns x one k pair

    def step(kp, accs):
        if R <= 2:                                           # past the end: a hint, never a fault
            for wb in wbs:
                prefetch_line(builder, builder.gep(wb, [builder.add(kp, i64(PREFETCH_AHEAD))]), locality=2)
        else:
            paced_prefetch(builder, kp, i64(1), pfn, (pf0, pf1))
        wv = [builder.bitcast(builder.sext(builder.load(builder.gep(wb, [kp]), align=1), V32I16), V16I32)
              for wb in wbs]
        xrow = builder.gep(xb, [builder.mul(kp, i64(GEMM_ROWS))])
        new = []
        for r in range(R):
            xv = splat(builder, builder.load(builder.gep(xrow, [i64(r)]), align=2), V16I32)
            for c in range(C):
                new.append(builder.call(dpwssd, [accs[r * C + c], xv, wv[c]]))
        return new

    fin = counted_loop(builder, kpairs, [ir.Constant(V16I32, [0] * 16)] * (R * C), step)
    sxb = _ptr(builder, sxp, F32)
    swv = [_vload(builder, _ptr(builder, sw, F32), i64(0), V16F32) for _, sw, _ in blocks]
    obs = [_ptr(builder, o, F32) for _, _, o in blocks]
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", i64(r), rows), likely=True):
            sv = splat(builder, builder.load(builder.gep(sxb, [i64(r)]), align=4), V16F32)
            for c in range(C):
                # the AVX2 tile's expression, (acc * sx) * sw in float32: the same bits
                f = builder.fmul(builder.fmul(builder.sitofp(fin[r * C + c], V16F32), sv), swv[c])
                _vstore(builder, f, obs[c], builder.mul(i64(r), ldo))


assert GEMM_COLS == 16       # one zmm of int32 sums is one 16-column block
int_gemm_tiles_512 = {(R, C): _make_tile(R, C) for R in TILE_ROWS for C in TILE_BLOCKS}
