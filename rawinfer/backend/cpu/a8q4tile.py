"""q4 weights against 8-bit activations: the packed layout and the tiles (LLVM IR as Numba intrinsics) that
a8gemm.py's drivers run for q4 models in the engine's `int8_activations` mode.

Why: a q4 weight is an unsigned nibble q (0..15) with a scale and a minimum per block of 32 k (quant.py's
Q4_1: w = d q + m). Against int8 activations (a8gemm.py's quantizer: |xq| <= 127 per row and block of 32,
scale xs) the products need no +128 correction and stay small: a pair of them is at most 2 x 15 x 127 =
3,810, so AVX2's `vpmaddubsw` (unsigned x signed bytes, pairs summed into int16 lanes) can neither saturate
nor overflow even when a whole block's 16 pair sums per lane are added in int16. One `vpmaddwd` against
ones per block then widens them. That is one multiplying instruction per 32 products, where int8 weights
on AVX2 take two (a8tile.py) and the q4 GEMM on 16-bit activations (q4tile.py) two as well. AVX-512 VNNI
multiplies the same bytes with `vpdpbusd` (64 products, int32 lanes), and so does the AVX2 build where the
CPU has AVX-VNNI (isa.avx_vnni(): its 256-bit, VEX-encoded vpdpbusd adds the products into int32 lanes in
the same instruction, so neither the int16 stage nor its vpaddw remain). All sum exactly.

    sum_k w[n, k] x[m, k] over block b  ~  xs[m, b] (d[n, b] s + m[n, b] sum_k xq[m, k]),  s = sum_k q[n, k] xq[m, k]

For q4 weights a8gemm's quantizer stores xs * sum_k xq per row and block (in the slot where int8 weights
take their integer correction), so the minimum's term costs the tiles one load per row and block.

Layout (pack_q4): blocks of 16 output columns; per column block one row of records, one per k-block of 32:

    wp[N/16, K/32 * RECORD] uint8, RECORD = 320 bytes: 4 quad pairs x 64 bytes of nibbles, then d[16]
    and m[16] float16; in quad pair p, byte 4c + i holds q[c, 8p + i] (low nibble) and q[c, 8p + 4 + i]
    (high nibble) of column c

so `& 15` of one 64-byte load (32 bytes: 8 columns on AVX2) is a k quad of every column in vpdpbusd's /
vpmaddubsw's order and `>> 4 & 15` the next. (2-d, where a8gemm.pack_weights is 4-d: the drivers and fused.py
tell the two layouts apart by that.)

    tiles[path][R, C]   R rows of a 6-row x panel against C column blocks (separate addresses; the same
                        arguments as a8tile.py's tiles, whose column scales these ignore: d and m are in
                        the records). avx512_vnni: R = 1, 2, 4, 6, C = 1, 2, one zmm per (row, block).
                        avx2: R = 1, 2, 3, C = 1, two ymm halves of 8 columns, int16 sums per block
                        (int32 sums on vpdpbusd with AVX-VNNI).
                        Per (row, vector) and k-block, in this order on both paths:
                            t = float(s) * xs;  acc = fma(t, d, acc);  acc = fma(m, xs * sum xq, acc)
                        and out = acc at the end, so both paths give the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.a8tile import make_tile
from rawinfer.backend.cpu.half import half_to_float_ir
from rawinfer.backend.cpu.llvm import F32, GEMM_ROWS, I8, I16, I32, _fma, _ptr, _vload, _vstore, counted_loop, \
    i64, prefetch_line, splat
from rawinfer.backend.cpu.vnni import lines_per_step, paced_prefetch
from rawinfer.quant import Q4_BLOCK, Q4_SPAN

BLOCK_COLS = 16
PAIRS = Q4_BLOCK // 8                 # quad pairs per k-block
PAIR_BYTES = 4 * BLOCK_COLS           # one quad pair of 16 columns: 64 bytes, one cache line
D_AT = PAIRS * PAIR_BYTES             # d[16] float16, then m[16]
M_AT = D_AT + 2 * BLOCK_COLS
RECORD = M_AT + 2 * BLOCK_COLS        # 320 bytes per (column block, k-block)
ROWS = {isa.AVX512_VNNI: (1, 2, 4, GEMM_ROWS), isa.AVX2: (1, 2, 3)}
BLOCKS = {isa.AVX512_VNNI: (1, 2), isa.AVX2: (1,)}
# k-blocks ahead that the builds of one or two rows (decode) prefetch their records into L2, as
# q4tile.py's: one row streams every weight from memory once; more rows reuse each record from cache.
PREFETCH_AHEAD = 32


def supports(shape: tuple[int, int]) -> bool:
    """Whether a q4 weight [N, K] fits the layout (whole 16-column blocks, whole spans of the q4 format)."""
    N, K = shape
    return N % BLOCK_COLS == 0 and K % Q4_SPAN == 0 and K > 0


def pack_q4(q: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """q uint8 [N, K] (0..15; q4gemm.unpack_nibbles of a q4 weight) and dm float16 [N, K/32, 2] (d, m) ->
    wp uint8 [N/16, K/32 * RECORD]."""
    N, K = q.shape
    if not supports(q.shape) or dm.shape != (N, K // Q4_BLOCK, 2):
        raise ValueError(f"a8q4tile.pack_q4: shape {(N, K)} needs N % {BLOCK_COLS} == 0, K % {Q4_SPAN} == 0 "
                         f"and dm [N, K/{Q4_BLOCK}, 2], got dm {dm.shape}")
    nb, kb = N // BLOCK_COLS, K // Q4_BLOCK
    v = np.asarray(q, np.uint8).reshape(nb, BLOCK_COLS, kb, PAIRS, 2, 4)      # cb c b p half i
    nib = (v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)  # cb b p c i
    nib = nib.reshape(nb, kb, PAIRS * PAIR_BYTES)
    scales = np.asarray(dm, np.float16).reshape(nb, BLOCK_COLS, kb, 2).transpose(0, 2, 3, 1)   # cb b (d|m) c
    scales = np.ascontiguousarray(scales).view(np.uint8).reshape(nb, kb, 4 * BLOCK_COLS)
    return np.ascontiguousarray(np.concatenate([nib, scales], axis=2).reshape(nb, kb * RECORD))


def _tile_code(builder, path, R, C, args):
    """out_c[r, 0:16] for r < min(rows, R), c < C (module docstring). xp -> int8 panel [kblocks * 8, 6, 4];
    xsp -> float32 [kblocks, 6] scales; xcp -> float32 [kblocks, 6] xs * sum xq; ldo: the row stride of every
    out_c (floats); per block c: wp_c -> its records [kblocks, RECORD], op_c -> float32 out_c (swp_c unused).
    Last, pf0, pf1, pfn: the AVX-512 builds of more than 2 rows prefetch pfn lines from each of pf0 and pf1
    into L2 (the driver's next weight blocks), spread evenly over the k-blocks."""
    xp, kblocks, rows, xsp, xcp, ldo = args[:6]
    blocks = [(args[6 + 3 * c], args[8 + 3 * c]) for c in range(C)]
    pf0, pf1, pfn = args[12:15]
    vnni = path == isa.AVX512_VNNI
    L = 16 if vnni else 8
    dots = vnni or isa.avx_vnni()                        # vpdpbusd: int32 sums, no int16 stage
    H = BLOCK_COLS // L                                  # vectors per (row, block)
    vf32, vhalf = ir.VectorType(F32, L), ir.VectorType(I16, L)
    fma = _fma(builder, vf32)
    products = _QuadProducts(builder, dots, L)
    xb, xsb, xmb = _ptr(builder, xp, I32), _ptr(builder, xsp, F32), _ptr(builder, xcp, F32)
    wbs = [_ptr(builder, w, I8) for w, _ in blocks]
    vecs = [(c, h) for c in range(C) for h in range(H)]
    per = lines_per_step(builder, pfn, kblocks)

    def kblock(kb, faccs):
        rec = [builder.gep(wb, [builder.mul(kb, i64(RECORD))]) for wb in wbs]
        if R <= 2:                                       # past the end: a hint, never a fault
            for r0 in rec:
                for line in range(0, RECORD, 64):
                    prefetch_line(builder, builder.gep(r0, [i64(PREFETCH_AHEAD * RECORD + line)]), locality=2)
        elif vnni:
            paced_prefetch(builder, kb, per, pfn, (pf0, pf1))
        row0 = builder.mul(kb, i64(GEMM_ROWS))           # this block's entry of row 0 in xs and xs * sum xq
        sums = _kblock_sums(builder, R, L, vecs, rec, xb, kb, products)
        scales = [[half_to_float_ir(builder, _vload(builder, rec[c], i64(at + h * 2 * L), vhalf, align=1))
                   for at in (D_AT, M_AT)] for c, h in vecs]
        new = []
        for r in range(R):
            xsv = splat(builder, builder.load(builder.gep(xsb, [builder.add(row0, i64(r))]), align=4), vf32)
            msum = splat(builder, builder.load(builder.gep(xmb, [builder.add(row0, i64(r))]), align=4), vf32)
            for v, (d, m) in enumerate(scales):
                s32 = products.widen(sums[r, v])
                t = builder.fmul(builder.sitofp(s32, vf32), xsv)
                new.append(builder.call(fma, [m, msum, builder.call(fma, [t, d, faccs[r * len(vecs) + v]])]))
        return new

    fin = counted_loop(builder, kblocks, [ir.Constant(vf32, [0.0] * L)] * (R * len(vecs)), kblock)
    obs = [_ptr(builder, o, F32) for _, o in blocks]
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", i64(r), rows), likely=True):
            for v, (c, h) in enumerate(vecs):
                _vstore(builder, fin[r * len(vecs) + v], obs[c], builder.add(builder.mul(i64(r), ldo), i64(L * h)))


class _QuadProducts:
    """The products of one k quad of nibbles and one broadcast int32 of 4 int8 x, summed into `zero`'s
    lanes by madd: int32 with vpdpbusd (dots), else int16 pairs (vpmaddubsw) that widen() makes int32
    (vpmaddwd against ones) once per k-block."""

    def __init__(self, builder, dots: bool, L: int):
        self.builder, self.dots = builder, dots
        vi32, self.vi8, vi16 = ir.VectorType(I32, L), ir.VectorType(I8, 4 * L), ir.VectorType(I16, 2 * L)
        if dots:
            self.dot = builder.module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * L}", (),
                                                        ir.FunctionType(vi32, [vi32] * 3))
        else:
            self.ubsw = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", (),
                                                         ir.FunctionType(vi16, [self.vi8, self.vi8]))
            self.pmaddwd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                                            ir.FunctionType(vi32, [vi16, vi16]))
            self.ones = ir.Constant(vi16, [1] * (2 * L))
        self.zero = ir.Constant(vi32 if dots else vi16, [0] * (L if dots else 2 * L))

    def madd(self, acc, w, x):
        if self.dots:
            return self.builder.call(self.dot, [acc, w, x])
        b = self.builder
        return b.add(acc, b.call(self.ubsw, [b.bitcast(w, self.vi8), b.bitcast(x, self.vi8)]))

    def widen(self, s):
        return s if self.dots else self.builder.call(self.pmaddwd, [s, self.ones])


def _kblock_sums(builder, R, L, vecs, rec, xb, kb, products: _QuadProducts) -> dict:
    """{(row r, vector v): the sum of k-block kb} of the records' nibbles (rec[c]: block c's record)
    against the panel's k quads (xb: the int32 view of the x panel)."""
    vi32 = ir.VectorType(I32, L)
    nibble = ir.Constant(vi32, [0x0F0F0F0F] * L)
    four = ir.Constant(vi32, [4] * L)
    quad0 = builder.mul(kb, i64(Q4_BLOCK // 4))

    def x_quad(j, r):                                    # k quad j of the block, row r, broadcast
        xrow = builder.gep(xb, [builder.mul(builder.add(quad0, i64(j)), i64(GEMM_ROWS))])
        return splat(builder, builder.load(builder.gep(xrow, [i64(r)]), align=4), vi32)

    # Per quad pair and its two k quads e: the quad's weights of every vector (C blocks on AVX-512, two
    # halves on AVX2), then per row one broadcast x and a multiply-add per vector. Live: R x (vectors)
    # sums, the vectors' weights and one x: AVX2's 16 ymm allow 3 rows, AVX-512's 32 zmm 6 rows x 2 blocks.
    vs = range(len(vecs))
    sums = {(r, v): products.zero for r in range(R) for v in vs}
    for p in range(PAIRS):
        raws = [_vload(builder, rec[c], i64(p * PAIR_BYTES + h * 4 * L), vi32, align=1) for c, h in vecs]
        for e in (0, 1):
            w = [builder.and_(raw if e == 0 else builder.lshr(raw, four), nibble) for raw in raws]
            for r in range(R):
                x = x_quad(2 * p + e, r)
                for v in vs:
                    sums[r, v] = products.madd(sums[r, v], w[v], x)
    return sums


assert GEMM_ROWS == 6 and Q4_BLOCK == 32
# 16 int16 pair sums of at most 2 x 15 x 127 per lane and block: no int16 overflow on AVX2
assert 16 * 15 * 127 < 2 ** 15
tiles = {path: {(R, C): make_tile(_tile_code, path, R, C) for R in ROWS[path] for C in BLOCKS[path]}
         for path in BLOCKS}
