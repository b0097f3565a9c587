"""Integer GEMM for q4 weights (quant.py's Q4_1 blocks), for any number of rows: one token's decode, a
batch, a prompt. Paths (isa.py): AVX-512 VNNI, AVX2, and on any other CPU the AVX2 path's code built
for it (q4tile.py's generic IR; the float steps without FMA there, so its bits are its own).

Why one kernel for every row count: the q4 matrix-vector kernel (q4.py) and BLAS on dequantized tiles
(prefill) round differently, so a request's tokens depended on its batch; and prefill on BLAS ran at
the float32 model's pace. Here every output element is computed by the same arithmetic, whatever the
batch, the tile that holds it or the machine's path:

    x row m quantized to int16: sx[m] = max|x[m]| / 32767, xq = rint(x / sx)   (qgemm's quantizer)
    bs[m, b] = (sum of x[m] over k-block b, in order) / sx[m]
    acc = 0; for each k-block b of 32 in order:
        s   = sum_k xq[m, k] q[n, k]                    exact int32 (|s| <= 32 * 15 * 32767)
        acc = fma(float(s), d[n, b], acc)
        acc = fma(m[n, b], bs[m, b], acc)
    out[m, n] = acc * sx[m]

Layout: the weight is repacked once at load into blocks of 16 output columns, and within a column
block per k-block of 32 one record of 320 bytes:

    wp[N/16, K/32, 320] uint8:  4 k octets x 64 bytes of nibbles, then d[16], m[16] float16
    a k octet (k0 .. k0 + 7 of 16 columns) is 32 little-endian uint16 lanes, lane 2c + h (column c,
    h = 0, 1) holding q[c, k0 + 2e + h] in its nibble e (bits 4e .. 4e + 3), e = 0 .. 3

so that one load of 32 bytes (8 columns, AVX2) or 64 bytes (16 columns, AVX-512) is already in pmaddwd's
int16 order: `& 15` gives the k pair (k0, k0 + 1) of every column, `>> 4 & 15` the pair (k0 + 2, k0 + 3),
`>> 8 & 15` and `>> 12` the next two; no byte-widening shuffle. (An earlier layout of 4-k quads widened
each with `vpmovzxbw`: 22 vector operations per 64 weights on AVX2 against 17; docs/CHANGELOG.md.)
x is quantized into qgemm's 6-row panels of int32 k pairs, broadcast one row at a time. A tile (q4tile.py,
in LLVM IR for both paths) keeps R x 16 (AVX2) or R x 32 (AVX-512, two column blocks) int32 sums per
k-block and as many float32 accumulators across k-blocks.

The AVX2 and AVX-512 paths give the same bits (exact int32 sums, the same float32 fma sequence per element).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.kernels import Kernel
from rawinfer.backend.cpu.llvm import GEMM_ROWS as PANEL_ROWS
from rawinfer.backend.cpu.q4tile import BLOCK_COLS, D_AT, M_AT, OCTETS, RECORD, TILE_ROWS, q4_gemm_tiles  # noqa: F401
from rawinfer.backend.cpu.qgemm import (PANELS_PER_ITEM, _next_blocks, _panel_groups, _quantize_row, packed_x_shape,
                                        silu_rows)
from rawinfer.quant import Q4_BLOCK, Q4_SPAN

assert BLOCK_COLS == 16          # qgemm.silu_rows, the shared epilogue, writes 16-column blocks
X_LEVELS = 32767


def supports(shape: tuple[int, int]) -> bool:
    """Whether a q4 weight [N, K] fits the packed layout (whole 16-column blocks, whole spans). Every CPU
    runs the GEMM (PATHS has a build for each isa.py path): only the shape decides."""
    N, K = shape
    return N % BLOCK_COLS == 0 and K % Q4_SPAN == 0 and K > 0


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [N, K/2] in quant.py's span layout -> q [N, K] uint8 (0..15): weight 16 i + l of a span of 64
    is nibble i of its 16-bit lane l."""
    N = qs.shape[0]
    lanes = np.ascontiguousarray(qs).view("<u2").reshape(N, -1, 1, 16)           # [row, span, 1, lane]
    shifts = (4 * np.arange(4, dtype=np.uint16)).reshape(1, 1, 4, 1)
    return ((lanes >> shifts) & 15).astype(np.uint8).reshape(N, -1)


def pack_weights(qs: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """A q4 pair (qs [N, K/2] uint8, dm [N, K/32, 2] float16) -> wp uint8 [N/16, K/32, RECORD]."""
    N, K = qs.shape[0], 2 * qs.shape[1]
    if N % BLOCK_COLS or K % Q4_SPAN or dm.shape != (N, K // Q4_BLOCK, 2):
        raise ValueError(f"q4 pack_weights: shape {(N, K)} needs N % {BLOCK_COLS} == 0, K % {Q4_SPAN} == 0 and "
                         f"dm [N, K/{Q4_BLOCK}, 2], got dm {dm.shape}")
    wp = np.empty((N // BLOCK_COLS, K // Q4_BLOCK, RECORD), np.uint8)
    lanes = np.ascontiguousarray(qs).view("<u2").reshape(N, K // Q4_SPAN, 16)
    dmbits = np.ascontiguousarray(dm, np.float16).view("<u2")
    _pack_records(lanes, dmbits, wp.view("<u2"))
    return wp


@nb.njit(cache=True)
def _pack_records(lanes, dmbits, wp):
    """lanes uint16 [N, K/64, 16] (quant.py's span layout), dmbits uint16 [N, K/32, 2] (float16 bits) ->
    wp uint16 [N/16, K/32, RECORD/2]: a record's nibble lanes (module docstring), then d[16], m[16]. A
    loop at load time instead of NumPy's whole-matrix reshuffles, which took most of a start (one thread:
    a matrix is too little work to share).

    Weight r of a span (r < 64) is nibble r // 16 of its lane r % 16; the span holds k-blocks 2s and
    2s + 1, and the weight k0 + 2e + h of octet o of its block bl is r = 32 bl + 8 o + 2 e + h: lane
    8 (o % 2) + 2 e + h, nibble 2 bl + o // 2."""
    N, spans = lanes.shape[0], lanes.shape[1]
    for n in range(N):
        cb, c = n // BLOCK_COLS, n % BLOCK_COLS
        for s in range(spans):
            span = lanes[n, s]
            for bl in range(2):
                b = 2 * s + bl
                for octet in range(OCTETS):
                    shift = 4 * (2 * bl + octet // 2)
                    for h in range(2):
                        lane = np.uint16(0)
                        for e in range(4):
                            nib = (span[8 * (octet % 2) + 2 * e + h] >> np.uint16(shift)) & np.uint16(15)
                            lane |= nib << np.uint16(4 * e)
                        wp[cb, b, (octet * BLOCK_COLS + c) * 2 + h] = lane
                wp[cb, b, D_AT // 2 + c] = dmbits[n, b, 0]
                wp[cb, b, M_AT // 2 + c] = dmbits[n, b, 1]


_a1, _a2, _a4, _a6 = (q4_gemm_tiles[isa.AVX2, R, 1] for R in TILE_ROWS)
_z1c1, _z2c1, _z4c1, _z6c1 = (q4_gemm_tiles[isa.AVX512_VNNI, R, 1] for R in TILE_ROWS)
_z1c2, _z2c2, _z4c2, _z6c2 = (q4_gemm_tiles[isa.AVX512_VNNI, R, 2] for R in TILE_ROWS)


# ---- activations -------------------------------------------------------------------------------------
def _quantize_rows(x, xp, sx, bs):
    """x float32 [M, K] -> xp int16 panels [ceil(M/6), K/2, 6, 2] (qgemm's layout, 32767 levels), sx
    [>= panels * 6] and bs [>= panels * 6, K/32] (module docstring); rows past M are zero."""
    M, K = x.shape
    panels, kpairs, nkb = xp.shape[0], xp.shape[1], K // Q4_BLOCK
    for t in nb.prange(panels):
        q = np.empty(K, np.int16)
        for r in range(PANEL_ROWS):
            m = t * PANEL_ROWS + r
            if m < M:
                xm = x[m]
                amax = _quantize_row(xm, X_LEVELS, q, r, xp[t])
                sx[m] = amax / np.float32(X_LEVELS)
                inv = np.float32(X_LEVELS) / amax if amax > np.float32(0.0) else np.float32(0.0)
                for b in range(nkb):
                    s = np.float32(0.0)
                    for j in range(Q4_BLOCK):
                        s += xm[b * Q4_BLOCK + j]
                    bs[m, b] = s * inv
            else:
                sx[m] = np.float32(0.0)
                for kp in range(kpairs):
                    xp[t, kp, r, 0] = 0
                    xp[t, kp, r, 1] = 0
                for b in range(nkb):
                    bs[m, b] = np.float32(0.0)


# One panel (a decode step of up to 6 rows) is quantized serially: waking the pool costs more than it.
quantize_rows = Kernel(_quantize_rows, min_parallel_rows=2)     # rows: panels
_quantize_parallel, _quantize_serial = quantize_rows.parallel, quantize_rows.serial


@nb.njit(cache=True)
def quantized_x(x, xbuf, sx, bsbuf):
    """x [M, K] quantized into xbuf's panels and bsbuf's block sums (returned as views) and sx."""
    M, K = x.shape
    shape = packed_x_shape(M, K)
    xp = xbuf[:shape[0] * shape[1] * shape[2] * shape[3]].reshape(shape)
    bs = bsbuf[:shape[0] * PANEL_ROWS * (K // Q4_BLOCK)].reshape(shape[0] * PANEL_ROWS, K // Q4_BLOCK)
    if shape[0] > 1:
        _quantize_parallel(x, xp, sx, bs)
    else:
        _quantize_serial(x, xp, sx, bs)
    return xp, bs


def x_buffer_sizes(M: int, K: int) -> tuple[int, int, int]:
    """Elements of the int16 panel buffer, the float32 row-scale buffer and the float32 block-sum buffer."""
    rows = -(-M // PANEL_ROWS) * PANEL_ROWS
    return rows * K, rows, rows * (K // Q4_BLOCK)


# ---- drivers -------------------------------------------------------------------------------------------
@nb.njit(inline="always")
def _tile_avx2(rows, xp, bsp, sxp, nkb, ldo, w, o):
    # The build that computes the fewest rows covering `rows` (a last panel of M % 6 rows); nothing
    # prefetched (the AVX-512 drivers' next-block prefetch was not measured on an AVX2 machine).
    z = np.int64(0)
    if rows > 4:
        _a6(xp, bsp, sxp, nkb, rows, ldo, w, o, z, z, z)
    elif rows > 2:
        _a4(xp, bsp, sxp, nkb, rows, ldo, w, o, z, z, z)
    elif rows > 1:
        _a2(xp, bsp, sxp, nkb, rows, ldo, w, o, z, z, z)
    else:
        _a1(xp, bsp, sxp, nkb, rows, ldo, w, o, z, z, z)


@nb.njit(inline="always")
def _tile_512(rows, xp, bsp, sxp, nkb, ldo, w0, o0, w1, o1, pf):
    # pf = (pf0, pf1, pfn): the next weight blocks' slice to prefetch (q4tile.py; qgemm._next_blocks)
    if rows > 4:
        _z6c2(xp, bsp, sxp, nkb, rows, ldo, w0, o0, w1, o1, pf[0], pf[1], pf[2])
    elif rows > 2:
        _z4c2(xp, bsp, sxp, nkb, rows, ldo, w0, o0, w1, o1, pf[0], pf[1], pf[2])
    elif rows > 1:
        _z2c2(xp, bsp, sxp, nkb, rows, ldo, w0, o0, w1, o1, pf[0], pf[1], pf[2])
    else:
        _z1c2(xp, bsp, sxp, nkb, rows, ldo, w0, o0, w1, o1, pf[0], pf[1], pf[2])


@nb.njit(inline="always")
def _tile_512_one(rows, xp, bsp, sxp, nkb, ldo, w0, o0):
    z = np.int64(0)
    if rows > 4:
        _z6c1(xp, bsp, sxp, nkb, rows, ldo, w0, o0, z, z, z)
    elif rows > 2:
        _z4c1(xp, bsp, sxp, nkb, rows, ldo, w0, o0, z, z, z)
    elif rows > 1:
        _z2c1(xp, bsp, sxp, nkb, rows, ldo, w0, o0, z, z, z)
    else:
        _z1c1(xp, bsp, sxp, nkb, rows, ldo, w0, o0, z, z, z)


@nb.njit(inline="always")
def _geometry(xp, wp):
    # (panels, k-blocks, bytes per x panel, bytes per column block, panel groups)
    panels, nkb = xp.shape[0], wp.shape[1]
    return panels, nkb, np.int64(xp.shape[1] * PANEL_ROWS * 4), np.int64(nkb * RECORD), _panel_groups(panels)


@nb.njit(parallel=True, cache=True)
def gemm_avx2(xp, bs, sx, wp, out, M):
    """out[M, N] over packed operands: work items are (group of x panels, 16 columns), consecutive items
    sharing their x panels; groups of at most qgemm's PANELS_PER_ITEM panels, of equal size (+-1)."""
    panels, nkb, xstride, wstride, mgroups = _geometry(xp, wp)
    nblocks, ldo = wp.shape[0], np.int64(out.shape[1])
    x0, bs0, sx0 = np.int64(xp.ctypes.data), np.int64(bs.ctypes.data), np.int64(sx.ctypes.data)
    w0, o0 = np.int64(wp.ctypes.data), np.int64(out.ctypes.data)
    for it in nb.prange(mgroups * nblocks):
        g, c = it // nblocks, it % nblocks
        for t in range(g * panels // mgroups, (g + 1) * panels // mgroups):
            m0 = t * PANEL_ROWS
            _tile_avx2(min(PANEL_ROWS, M - m0), x0 + t * xstride, bs0 + m0 * nkb * 4, sx0 + m0 * 4, nkb, ldo,
                       w0 + c * wstride, o0 + (m0 * ldo + c * BLOCK_COLS) * 4)


@nb.njit(parallel=True, cache=True)
def gemm_silu_avx2(xp, bs, sx, wp, out, M):
    """out[M, F] = silu(g) * u for [g | u] = x @ W^T, W a gate_up weight [2F, K] (gate rows, then up
    rows): gate block j and up block j into a small scratch, only their product stored."""
    panels, nkb, xstride, wstride, mgroups = _geometry(xp, wp)
    half = wp.shape[0] // 2
    x0, bs0, sx0, w0 = np.int64(xp.ctypes.data), np.int64(bs.ctypes.data), np.int64(sx.ctypes.data), \
        np.int64(wp.ctypes.data)
    for it in nb.prange(mgroups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        for t in range(g * panels // mgroups, (g + 1) * panels // mgroups):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            xt, bt, st = x0 + t * xstride, bs0 + m0 * nkb * 4, sx0 + m0 * 4
            _tile_avx2(rows, xt, bt, st, nkb, BLOCK_COLS, w0 + j * wstride, ga)
            _tile_avx2(rows, xt, bt, st, nkb, BLOCK_COLS, w0 + (j + half) * wstride, ua)
            silu_rows(gu, out, m0, rows, j)


@nb.njit(parallel=True, cache=True)
def gemm_512(xp, bs, sx, wp, out, M):
    """gemm_avx2 on AVX-512 VNNI: work items are (group of x panels, pair of 16-column blocks)."""
    panels, nkb, xstride, wstride, mgroups = _geometry(xp, wp)
    nblocks, ldo = wp.shape[0], np.int64(out.shape[1])
    npairs = (nblocks + 1) // 2
    x0, bs0, sx0 = np.int64(xp.ctypes.data), np.int64(bs.ctypes.data), np.int64(sx.ctypes.data)
    w0, o0 = np.int64(wp.ctypes.data), np.int64(out.ctypes.data)
    for it in nb.prange(mgroups * npairs):
        g, c = it // npairs, 2 * (it % npairs)
        t0, t1 = g * panels // mgroups, (g + 1) * panels // mgroups
        for t in range(t0, t1):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            xt, bt, st, ot = x0 + t * xstride, bs0 + m0 * nkb * 4, sx0 + m0 * 4, o0 + m0 * ldo * 4
            if c + 1 < nblocks:
                nxt = w0 + (c + 2) * wstride
                _tile_512(rows, xt, bt, st, nkb, ldo, w0 + c * wstride, ot + c * BLOCK_COLS * 4,
                          w0 + (c + 1) * wstride, ot + (c + 1) * BLOCK_COLS * 4,
                          _next_blocks(nxt, nxt + wstride, wstride, t - t0, t1 - t0, c + 3 < nblocks))
            else:
                _tile_512_one(rows, xt, bt, st, nkb, ldo, w0 + c * wstride, ot + c * BLOCK_COLS * 4)


@nb.njit(parallel=True, cache=True)
def gemm_silu_512(xp, bs, sx, wp, out, M):
    """gemm_silu_avx2 on AVX-512 VNNI: one tile computes gate block j and up block j together."""
    panels, nkb, xstride, wstride, mgroups = _geometry(xp, wp)
    half = wp.shape[0] // 2
    x0, bs0, sx0, w0 = np.int64(xp.ctypes.data), np.int64(bs.ctypes.data), np.int64(sx.ctypes.data), \
        np.int64(wp.ctypes.data)
    for it in nb.prange(mgroups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        t0, t1 = g * panels // mgroups, (g + 1) * panels // mgroups
        for t in range(t0, t1):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            _tile_512(rows, x0 + t * xstride, bs0 + m0 * nkb * 4, sx0 + m0 * 4, nkb, BLOCK_COLS,
                      w0 + j * wstride, ga, w0 + (j + half) * wstride, ua,
                      _next_blocks(w0 + (j + 1) * wstride, w0 + (j + 1 + half) * wstride, wstride, t - t0, t1 - t0,
                                   j + 1 < half))
            silu_rows(gu, out, m0, rows, j)


@nb.njit(cache=True)
def q4_matmul_avx2(x, wp, out, xbuf, sx, bsbuf):
    """out[M, N] = x[M, K] @ W^T for a q4 weight packed by pack_weights. xbuf (int16), sx and bsbuf
    (float32): buffers of at least x_buffer_sizes(M, K) elements, reused across calls. Compiled, so
    that compiled code (fused.py) calls it too."""
    xp, bs = quantized_x(x, xbuf, sx, bsbuf)
    gemm_avx2(xp, bs, sx, wp, out, x.shape[0])


@nb.njit(cache=True)
def q4_matmul_silu_avx2(x, wp, out, xbuf, sx, bsbuf):
    """out[M, F] = silu(x @ Wg^T) * (x @ Wu^T) for a packed gate_up weight [Wg; Wu] ([2F, K], F % 16 == 0)."""
    xp, bs = quantized_x(x, xbuf, sx, bsbuf)
    gemm_silu_avx2(xp, bs, sx, wp, out, x.shape[0])


@nb.njit(cache=True)
def q4_matmul_avx512(x, wp, out, xbuf, sx, bsbuf):
    """q4_matmul_avx2 on AVX-512 VNNI: the same bits."""
    xp, bs = quantized_x(x, xbuf, sx, bsbuf)
    gemm_512(xp, bs, sx, wp, out, x.shape[0])


@nb.njit(cache=True)
def q4_matmul_silu_avx512(x, wp, out, xbuf, sx, bsbuf):
    """q4_matmul_silu_avx2 on AVX-512 VNNI: the same bits."""
    xp, bs = quantized_x(x, xbuf, sx, bsbuf)
    gemm_silu_512(xp, bs, sx, wp, out, x.shape[0])


# The entry points per path (isa.py's names): separate compiled functions, so a cached build of one
# path is never taken for another.
PATHS = {isa.AVX512_VNNI: (q4_matmul_avx512, q4_matmul_silu_avx512),
         isa.AVX2: (q4_matmul_avx2, q4_matmul_silu_avx2),
         isa.PORTABLE: (q4_matmul_avx2, q4_matmul_silu_avx2)}      # the AVX2 drivers, built for that CPU
PATH = isa.HOST
q4_matmul, q4_matmul_silu = PATHS[PATH]      # the entry points of this machine's path
