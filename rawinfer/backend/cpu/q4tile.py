"""The q4 GEMM's tile (q4gemm.py has the arithmetic, the layout and the drivers), in LLVM IR as Numba
intrinsics, one source for both paths:

    q4_gemm_tiles[path, R, C]   R rows of a 6-row x panel (R = 1, 2, 4, 6) against C 16-column blocks;
                                AVX2: C = 1 as two ymm per row, vpmaddwd + vpaddd; AVX-512 VNNI: C = 1
                                or 2 (blocks given by separate addresses), one zmm per block, vpdpwssd.
                                The AVX2 build compiles for any CPU: llvm.madd_pairs and llvm.mul_add are
                                generic IR where AVX2 and FMA are missing, the scales' conversion
                                half.py's integer one where F16C is

Per k-block of 32: per k octet, one load of each vector's 4L bytes as 2L int16 lanes, each lane holding four
nibbles, one per k pair of its column (q4gemm.py's layout); `& 15`, `>> 4 & 15`, `>> 8 & 15` and `>> 12` give
the octet's four k pairs in pmaddwd's order (no widening shuffle); per pair one broadcast int32 x pair per row
and R x (vectors) multiply-adds into int32 sums that start from zero; then per sum, in this order, acc =
fma(float(s), d, acc) and acc = fma(m, bs, acc) (d and m converted from float16 with vcvtph2ps where the CPU
has F16C); at the end acc * sx is stored for the rows < rows. The float32 accumulators live across k-blocks
(the int32 ones within one), so the 6-row builds keep 12 int32 and 12 float32 vectors: AVX-512's 32 zmm hold
both, AVX2 spills the float ones once per k-block.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.llvm import GEMM_ROWS as PANEL_ROWS
from rawinfer.backend.cpu.half import half_to_float_ir
from rawinfer.backend.cpu.llvm import F32, I8, I16, I32, _ptr, _vload, _vstore, counted_loop, i64, splat
from rawinfer.backend.cpu.llvm import madd_pairs, mul_add, prefetch_line
from rawinfer.backend.cpu.vnni import lines_per_step, paced_prefetch
from rawinfer.quant import Q4_BLOCK

BLOCK_COLS = 16                 # output columns per packed column block
OCTETS = Q4_BLOCK // 8          # k octets per k-block
OCTET_BYTES = 4 * BLOCK_COLS    # one octet of 16 columns: 32 int16 lanes of 4 nibbles
RECORD = OCTETS * OCTET_BYTES + 2 * 2 * BLOCK_COLS    # bytes per (column block, k-block): nibbles, d, m
D_AT, M_AT = OCTETS * OCTET_BYTES, OCTETS * OCTET_BYTES + 2 * BLOCK_COLS
TILE_ROWS = (1, 2, 4, PANEL_ROWS)
CHAINS = {1: 4, 2: 2, 4: 1, PANEL_ROWS: 1}     # int32 sums per output vector, by rows (see kblock)
# k-blocks ahead that the few-row builds prefetch (0: none), into L2 (prefetcht1). Decode's one or two
# rows stream every weight from memory once, at a pace the hardware prefetchers alone did not keep up
# with (they stop at page boundaries); into L1 (prefetcht0) the prefetches queue on L1's few miss
# buffers and slow the stream down instead (docs/kernels.md). With more rows a record is reused by
# every panel and the tile is compute-bound.
PREFETCH_AHEAD = {1: 32, 2: 32, 4: 0, PANEL_ROWS: 0}


def _tile_code(builder, path, R, C, args):
    """out_c[r, 0:16] for r < min(rows, R), c < C (module docstring). xp -> int16 panel [kpairs, 6, 2];
    bsp -> float32 bs of the panel's rows [6, nkb]; sxp -> float32 [6] row scales; nkb: k-blocks; ldo:
    the row stride of every out_c (floats); per block c: wp_c -> its records [nkb, RECORD], op_c ->
    float32 out_c. Last, pf0, pf1, pfn: builds of more than 2 rows prefetch pfn lines from each of pf0
    and pf1 into L2 (the driver's next weight blocks), spread evenly over the k-blocks."""
    xp, bsp, sxp, nkb, rows, ldo = args[:6]
    blocks = [args[6 + 2 * c:8 + 2 * c] for c in range(C)]
    pf0, pf1, pfn = args[-3:]
    per = lines_per_step(builder, pfn, nkb)
    L = 16 if path == isa.AVX512_VNNI else 8                 # int32 lanes per vector
    vf32, vhalf = ir.VectorType(F32, L), ir.VectorType(I16, L)      # vhalf: float16 bits
    fma = mul_add(builder, vf32)
    madd = _multiply_add_pairs(builder, L)
    parts = BLOCK_COLS // L                                  # vectors per column block
    vecs = [(c, h) for c in range(C) for h in range(parts)]  # vector v: block c, columns h L .. h L + L - 1
    xb, bsb = _ptr(builder, xp, I32), _ptr(builder, bsp, F32)
    wbs = [_ptr(builder, w, I8) for w, _ in blocks]

    def kblock(b, faccs):
        rec = [builder.gep(wb, [builder.mul(b, i64(RECORD))]) for wb in wbs]
        if PREFETCH_AHEAD[R]:
            # prefetcht1 of the record PREFETCH_AHEAD k-blocks on (past the end: a hint, never a fault)
            for r0 in rec:
                for line in range(0, RECORD, 64):
                    prefetch_line(builder, builder.gep(r0, [i64(PREFETCH_AHEAD[R] * RECORD + line)]), locality=2)
        elif R > 2:
            paced_prefetch(builder, b, per, pfn, (pf0, pf1))
        accs = _kblock_sums(builder, R, L, vecs, rec, xb, b, madd)
        d = [half_to_float_ir(builder, _vload(builder, rec[c], i64(D_AT + h * 2 * L), vhalf, align=1))
             for c, h in vecs]
        m = [half_to_float_ir(builder, _vload(builder, rec[c], i64(M_AT + h * 2 * L), vhalf, align=1))
             for c, h in vecs]
        new = []
        for r in range(R):
            bs = splat(builder, builder.load(builder.gep(bsb, [builder.add(builder.mul(i64(r), nkb), b)])), vf32)
            for v in range(len(vecs)):
                f = builder.call(fma, [builder.sitofp(accs[r * len(vecs) + v], vf32), d[v], faccs[r * len(vecs) + v]])
                new.append(builder.call(fma, [m[v], bs, f]))
        return new

    fin = counted_loop(builder, nkb, [ir.Constant(vf32, [0.0] * L)] * (R * len(vecs)), kblock)
    sxb = _ptr(builder, sxp, F32)
    obs = [_ptr(builder, o, F32) for _, o in blocks]
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", i64(r), rows), likely=True):
            sv = splat(builder, builder.load(builder.gep(sxb, [i64(r)]), align=4), vf32)
            for v, (c, h) in enumerate(vecs):
                _vstore(builder, builder.fmul(fin[r * len(vecs) + v], sv), obs[c],
                        builder.add(builder.mul(i64(r), ldo), i64(h * L)))


def _multiply_add_pairs(builder, L):
    """madd(acc, xv, wv): acc + the int16 pair products of xv (int32 lanes of a broadcast x pair) and wv
    (2L int16 weights): vpdpwssd on AVX-512 VNNI (L = 16), else madd_pairs (vpmaddwd) and an add."""
    vi32, vi16 = ir.VectorType(I32, L), ir.VectorType(I16, 2 * L)
    if L == 16:
        dpwssd = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpwssd.512", (),
                                                  ir.FunctionType(vi32, [vi32] * 3))
        return lambda acc, xv, wv: builder.call(dpwssd, [acc, xv, builder.bitcast(wv, vi32)])
    pairs = madd_pairs(builder)
    return lambda acc, xv, wv: builder.add(acc, pairs(builder.bitcast(xv, vi16), wv))


def _kblock_sums(builder, R, L, vecs, rec, xb, b, madd):
    """The int32 sums of k-block b, row r and vector v at r * len(vecs) + v: the record's nibbles
    (rec[c]: block c's record) against the panel's k pairs (xb: the int32 view of the x panel)."""
    vi32, vi16 = ir.VectorType(I32, L), ir.VectorType(I16, 2 * L)

    def splat_i16(n):
        return ir.Constant(vi16, [n] * (2 * L))
    low = splat_i16(15)
    zero = ir.Constant(vi32, [0] * L)
    kp0 = builder.mul(b, i64(Q4_BLOCK // 2))
    # S independent int32 sums per output vector (k pair j into sum j % S), added at the end of the
    # k-block: exact, so any split gives the same bits. A few rows give few sums, each a chain of
    # dependent multiply-adds (vpdpwssd's latency) unless split.
    S = CHAINS[R]
    chains = [[zero] * (R * len(vecs)) for _ in range(S)]
    for octet in range(OCTETS):
        raw = [_vload(builder, rec[c], i64(octet * OCTET_BYTES + h * 4 * L), vi16, align=1) for c, h in vecs]
        for e in range(4):                      # k pair 4 octet + e: nibble e of every lane
            shifted = raw if e == 0 else [builder.lshr(v, splat_i16(4 * e)) for v in raw]
            w = shifted if e == 3 else [builder.and_(v, low) for v in shifted]
            j = 4 * octet + e
            xrow = builder.gep(xb, [builder.mul(builder.add(kp0, i64(j)), i64(PANEL_ROWS))])
            for r in range(R):
                xv = splat(builder, builder.load(builder.gep(xrow, [i64(r)]), align=2), vi32)
                for v in range(len(vecs)):
                    acc = chains[j % S]
                    acc[r * len(vecs) + v] = madd(acc[r * len(vecs) + v], xv, w[v])
    accs = chains[0]
    for more in chains[1:]:
        accs = [builder.add(a, c) for a, c in zip(accs, more)]
    return accs


def _make_tile(path: str, R: int, C: int):
    # Numba's intrinsics take no *args: one typer per block count.
    def codegen(context, builder, signature, args):
        _tile_code(builder, path, R, C, args)
        return context.get_dummy_value()

    if C == 1:
        @intrinsic
        def q4_gemm_tile(typingctx, xp, bsp, sxp, nkb, rows, ldo, wp0, op0, pf0, pf1, pfn):
            return types.void(*([types.int64] * 11)), codegen
    else:
        @intrinsic
        def q4_gemm_tile(typingctx, xp, bsp, sxp, nkb, rows, ldo, wp0, op0, wp1, op1, pf0, pf1, pfn):
            return types.void(*([types.int64] * 13)), codegen
    return q4_gemm_tile


q4_gemm_tiles = {(path, R, C): _make_tile(path, R, C) for R in TILE_ROWS
                 for path, C in ((isa.AVX2, 1), (isa.AVX512_VNNI, 1), (isa.AVX512_VNNI, 2))}
