"""Integer GEMM for int8 models on x86 CPUs with AVX2 or AVX-512 VNNI: out = x @ (q * scale)^T without
dequantizing.

Why: prefill and batched decode are compute-bound, and a float32 GEMM on AVX2 does 8 multiply-adds
per FMA instruction. `vpmaddwd` multiplies 16 pairs of int16 and adds neighbours into 8 int32 lanes:
16 multiply-adds per instruction (plus one `vpaddd` to accumulate, on a port FMAs do not use). It
gains most over OpenBLAS's float32 GEMM at batched decode's few dozen rows, where OpenBLAS re-packs
the whole weight for little work (measured rates: docs/kernels.md).

Numbers:
    W: the model's int8 rows q[N, K] (per-row scales sw[N]), repacked once at load into blocks of
       16 output columns, k in pairs:           wp[N/16, K/2, 16, 2]  int8
    x: quantized per row at every call to int16 with its own scale sx[m] = max|x[m]| / qmax,
       packed in panels of 6 rows, k in pairs:  xp[ceil(M/6), K/2, 6, 2]  int16 (padding rows 0)
    out[m, n] = sx[m] * sw[n] * sum_k xp[m, k] * wp[n, k]   (exact integer sum in int32)

qmax = min(32767, (2^31 - 1) // (128 K)) keeps every int32 sum exact (|w| <= 127): 29k levels for
K = 576, 10.9k for K = 1536. Activations keep ~13-15 bits per token, which leaves the int8 model's
golden agreement where it was (tests/backend/test_quant.py); 8-bit activations per token (127
levels, most of them taken by an outlier channel) do not (docs/kernels.md). The quantizer finds each
row's max |x| with llvm.abs_max (8 lanes at a time: the plain max loop stays scalar) and writes the
panels as int32 k pairs, one store per pair.

The microkernel (llvm.int_gemm_tiles) is a 6 x 16 tile of int32 accumulators in 12 ymm
registers; per k pair it broadcasts one int32 (two int16) of each of the 6 x rows, sign-extends 16
pairs of int8 weights to two ymm of int16, and issues 12 vpmaddwd + 12 vpaddd. The loop is bound by
the vector pipes, not by loads, so layouts that trade pipe work for loads (int16 weights, x rows
stored pre-broadcast) gain nothing, and x rows read in place through 6 row pointers instead of
packed panels cost the GEMM more time than the packing does (docs/kernels.md).

Two paths, chosen once from the features of the CPU Numba compiles for (isa.py, `path_for`):
AVX-512 with VNNI runs vnni.py's tiles (6 rows x two 16-column blocks, one vpdpwssd per zmm per k
pair, work items of two blocks: gemm_packed_512, gemm_packed_silu_512), AVX2 the 6 x 16 tiles above.
Both read the same packed operands and give the same bits (exact int32 sums, the same float32
epilogue), so a model's output does not depend on which machine type ran it. Each path has its own
compiled entry points (PATHS), and `int8_matmul` / `int8_matmul_silu` name this machine's.
Any other CPU (isa.PORTABLE) runs the AVX2 path's code built for it: llvm.int_gemm_tiles' vpmaddwd is then
generic vector IR with the same exact sums (SSE2's pmaddwd on x86-64), so int8 models get the same
bits there too (the silu epilogue's exp differs: no FMA).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawinfer.backend.cpu.llvm import GEMM_COLS as BLOCK_COLS
from rawinfer.backend.cpu.llvm import GEMM_ROWS as PANEL_ROWS
from rawinfer.backend.cpu.kernels import Kernel
from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.llvm import abs_max, int_gemm_tiles, keep_alive
from rawinfer.backend.cpu.vmath import silu_tile
from rawinfer.backend.cpu.vnni import int_gemm_tiles_512

_tile2, _tile4, _tile6 = int_gemm_tiles[2], int_gemm_tiles[4], int_gemm_tiles[PANEL_ROWS]
_z1c1, _z2c1, _z4c1, _z6c1 = (int_gemm_tiles_512[R, 1] for R in (1, 2, 4, PANEL_ROWS))
_z1c2, _z2c2, _z4c2, _z6c2 = (int_gemm_tiles_512[R, 2] for R in (1, 2, 4, PANEL_ROWS))

PANELS_PER_ITEM = 16   # x panels one work item walks for its 16 columns (96 rows: ~110-300 KiB, in L2)


def supports(shape: tuple[int, int]) -> bool:
    """Whether a [N, K] weight fits the packed layout (whole 16-column blocks, whole k pairs). Every CPU
    runs the GEMM (PATHS has a build for each isa.py path): only the shape decides."""
    N, K = shape
    return N % BLOCK_COLS == 0 and K % 2 == 0 and K > 0


@nb.njit(cache=True)
def act_qmax(K):
    """The largest activation level that keeps K products with |w| <= 127 (128 for safety) in int32."""
    return min(32767, (2 ** 31 - 1) // (128 * K))


def pack_weights(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] -> wp int8 [N/16, K/2, 16, 2]: one 32-byte row per (column block, k pair)."""
    N, K = q.shape
    if not (N % BLOCK_COLS == 0 and K % 2 == 0):
        raise ValueError(f"pack_weights: shape {q.shape} needs N % {BLOCK_COLS} == 0 and even K")
    # k pairs moved as one int16 each: NumPy's transpose of 2-byte elements, not of bytes (several times faster
    # on an LM head of a large vocabulary, which every start packs)
    w = np.ascontiguousarray(q, np.int8).view(np.int16).reshape(N // BLOCK_COLS, BLOCK_COLS, K // 2)
    return np.ascontiguousarray(w.transpose(0, 2, 1)).view(np.int8).reshape(N // BLOCK_COLS, K // 2, BLOCK_COLS, 2)


@nb.njit(cache=True)
def packed_x_shape(M, K):
    return ((M + PANEL_ROWS - 1) // PANEL_ROWS, K // 2, PANEL_ROWS, 2)


# ---- drivers ----------------------------------------------------------------------------------------
@nb.njit(cache=True, inline="always")
def _quantize_row(x, qmax, q, r, xpanel):
    # x[K] float32 (contiguous) -> row r of an int16 panel [kpairs, 6, 2]; returns the row's max |x|
    # (its scale is that / qmax). q: int16 scratch [K]. The panel is written as int32 k pairs: one
    # store per pair.
    amax = abs_max(np.int64(x.ctypes.data), x.shape[0])
    pairs = xpanel.reshape(xpanel.shape[0] * PANEL_ROWS * 2).view(np.int32)   # [kpairs * 6]
    if not amax > np.float32(0.0):     # zero row (or all NaN)
        for kp in range(xpanel.shape[0]):
            pairs[kp * PANEL_ROWS + r] = 0
        return amax
    inv = np.float32(qmax) / amax
    for k in range(x.shape[0]):
        v = np.rint(x[k] * inv)
        v = v if v < np.float32(qmax) else np.float32(qmax)
        v = v if v > -np.float32(qmax) else -np.float32(qmax)
        q[k] = np.int16(np.int32(v))
    q32 = q.view(np.int32)
    for kp in range(xpanel.shape[0]):
        pairs[kp * PANEL_ROWS + r] = q32[kp]
    return amax


def _quantize_rows(x, qmax, xp, sx):
    """x float32 [M, K] (rows contiguous) -> xp int16 [ceil(M/6), K/2, 6, 2] and sx float32
    [>= ceil(M/6) * 6] with x[m] ~= xp row m * sx[m]; rows past M are zero."""
    M, K = x.shape
    panels, kpairs = xp.shape[0], xp.shape[1]
    for t in nb.prange(panels):
        q = np.empty(K, np.int16)
        for r in range(PANEL_ROWS):
            m = t * PANEL_ROWS + r
            if m < M:
                sx[m] = _quantize_row(x[m], qmax, q, r, xp[t]) / np.float32(qmax)   # zero / NaN rows too
            else:
                sx[m] = np.float32(0.0)
                for kp in range(kpairs):
                    xp[t, kp, r, 0] = 0
                    xp[t, kp, r, 1] = 0


# One panel (a decode step of up to 6 rows) is quantized serially: waking the pool for it costs more
# than the work. Both builds compute every row the same way.
quantize_rows = Kernel(_quantize_rows, min_parallel_rows=2)     # rows: panels


@nb.njit(inline="always")
def _tile(rows, xp, wp, kpairs, op, ldo, sxp, swp):
    # The build that computes the fewest rows covering `rows` (a last panel of M % 6 rows).
    if rows > 4:
        _tile6(xp, wp, kpairs, op, ldo, rows, sxp, swp)
    elif rows > 2:
        _tile4(xp, wp, kpairs, op, ldo, rows, sxp, swp)
    else:
        _tile2(xp, wp, kpairs, op, ldo, rows, sxp, swp)


@nb.njit(parallel=True, cache=True)
def gemm_packed(xp, sx, wp, sw, out, M):
    """out[M, N] = (xp * sx) @ (wp * sw)^T over packed operands (see the module docstring). Work items
    are (group of x panels, 16 columns), consecutive items sharing their x panels. The groups hold at
    most PANELS_PER_ITEM panels and are of equal size (+-1), so that every thread gets the same work:
    84 panels as 6 x 14, not 5 x 16 + 4."""
    panels, kpairs = xp.shape[0], xp.shape[1]
    nblocks = wp.shape[0]
    ldo = np.int64(out.shape[1])
    x0, w0, o0 = np.int64(xp.ctypes.data), np.int64(wp.ctypes.data), np.int64(out.ctypes.data)
    sx0, sw0 = np.int64(sx.ctypes.data), np.int64(sw.ctypes.data)
    xstride, wstride = _strides(kpairs)
    mgroups = _panel_groups(panels)
    for it in nb.prange(mgroups * nblocks):
        g, nbk = it // nblocks, it % nblocks
        for t in range(g * panels // mgroups, (g + 1) * panels // mgroups):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            _tile(rows, x0 + t * xstride, w0 + nbk * wstride, kpairs, o0 + (m0 * ldo + nbk * BLOCK_COLS) * 4,
                  ldo, sx0 + m0 * 4, sw0 + nbk * BLOCK_COLS * 4)


@nb.njit(inline="always")
def _panel_groups(panels):
    return (panels + PANELS_PER_ITEM - 1) // PANELS_PER_ITEM


@nb.njit(inline="always")
def _strides(kpairs):
    # bytes per x panel (int16 [kpairs, 6, 2]) and per weight block (int8 [kpairs, 16, 2])
    return np.int64(kpairs * PANEL_ROWS * 2 * 2), np.int64(kpairs * BLOCK_COLS * 2)


@nb.njit(inline="always")
def silu_rows(gu, out, m0, rows, j):
    # out[m0 + r, 16 j .. 16 j + 15] = silu(gate) * up for a tile's gate and up blocks gu[0], gu[1]: the
    # int8, q4 and 8-bit-activation GEMMs' silu epilogue (all pack 16 columns per block), vmath.silu_tile.
    # gu is named after the call, so that the caller's scratch lives until the tile has read it.
    silu_tile(np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data),
              np.int64(out.ctypes.data) + m0 * out.strides[0] + j * BLOCK_COLS * 4, np.int64(out.strides[0] // 4), rows)
    keep_alive(gu)


@nb.njit(parallel=True, cache=True)
def gemm_packed_silu(xp, sx, wp, sw, out, M):
    """out[M, F] = silu(g) * u for [g | u] = (xp * sx) @ (wp * sw)^T, wp packing a gate_up weight [2F, K]
    (gate rows, then up rows). Each work item computes the tiles of gate block j and up block j into
    a small scratch and writes only their product: the [M, 2F] gate_up array is never stored and read
    back (the memory traffic a separate silu_mul pass costs)."""
    panels, kpairs = xp.shape[0], xp.shape[1]
    half = wp.shape[0] // 2
    x0, w0, sx0, sw0 = np.int64(xp.ctypes.data), np.int64(wp.ctypes.data), np.int64(sx.ctypes.data), \
        np.int64(sw.ctypes.data)
    xstride, wstride = _strides(kpairs)
    mgroups = _panel_groups(panels)
    for it in nb.prange(mgroups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        for t in range(g * panels // mgroups, (g + 1) * panels // mgroups):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            _tile(rows, x0 + t * xstride, w0 + j * wstride, kpairs, ga, BLOCK_COLS, sx0 + m0 * 4,
                  sw0 + j * BLOCK_COLS * 4)
            _tile(rows, x0 + t * xstride, w0 + (j + half) * wstride, kpairs, ua, BLOCK_COLS, sx0 + m0 * 4,
                  sw0 + (j + half) * BLOCK_COLS * 4)
            silu_rows(gu, out, m0, rows, j)


# ---- AVX-512 VNNI drivers (vnni.py's tiles): two 16-column blocks per tile ---------------------------
@nb.njit(inline="always")
def _tile512(rows, xp, kpairs, sxp, ldo, w0, s0, o0, w1, s1, o1, pf):
    # The build that computes the fewest rows covering `rows`, on blocks 0 and 1; pf = (pf0, pf1, pfn):
    # the next weight blocks' slice to prefetch (vnni.py).
    if rows > 4:
        _z6c2(xp, kpairs, rows, sxp, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
    elif rows > 2:
        _z4c2(xp, kpairs, rows, sxp, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
    elif rows > 1:
        _z2c2(xp, kpairs, rows, sxp, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
    else:
        _z1c2(xp, kpairs, rows, sxp, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])


@nb.njit(inline="always")
def _tile512_one(rows, xp, kpairs, sxp, ldo, w0, s0, o0):
    # The same on one block (the last of an odd count), nothing prefetched.
    z = np.int64(0)
    if rows > 4:
        _z6c1(xp, kpairs, rows, sxp, ldo, w0, s0, o0, z, z, z)
    elif rows > 2:
        _z4c1(xp, kpairs, rows, sxp, ldo, w0, s0, o0, z, z, z)
    elif rows > 1:
        _z2c1(xp, kpairs, rows, sxp, ldo, w0, s0, o0, z, z, z)
    else:
        _z1c1(xp, kpairs, rows, sxp, ldo, w0, s0, o0, z, z, z)


@nb.njit(inline="always")
def _next_blocks(a, b, wstride, i, panels, ok):
    """(pf0, pf1, pfn) for the i-th of a work item's `panels` tile calls: the i-th slice of the next
    item's weight blocks a and b (wstride bytes each, at these addresses), nothing where not ok."""
    lines = wstride // 64
    per = (lines + panels - 1) // panels
    n = min(per, lines - i * per)
    if not ok or n <= 0:
        return np.int64(0), np.int64(0), np.int64(0)
    return a + i * per * 64, b + i * per * 64, np.int64(n)


@nb.njit(parallel=True, cache=True)
def gemm_packed_512(xp, sx, wp, sw, out, M):
    """gemm_packed on AVX-512 VNNI: work items are (group of x panels, pair of 16-column blocks); each
    tile call also prefetches a slice of the next pair's weights (the next item of this thread)."""
    panels, kpairs = xp.shape[0], xp.shape[1]
    nblocks = wp.shape[0]
    npairs = (nblocks + 1) // 2
    ldo = np.int64(out.shape[1])
    x0, w0, o0 = np.int64(xp.ctypes.data), np.int64(wp.ctypes.data), np.int64(out.ctypes.data)
    sx0, sw0 = np.int64(sx.ctypes.data), np.int64(sw.ctypes.data)
    xstride, wstride = _strides(kpairs)
    mgroups = _panel_groups(panels)
    for it in nb.prange(mgroups * npairs):
        g, b = it // npairs, 2 * (it % npairs)
        t0, t1 = g * panels // mgroups, (g + 1) * panels // mgroups
        for t in range(t0, t1):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            xt, st, ot = x0 + t * xstride, sx0 + m0 * 4, o0 + m0 * ldo * 4
            if b + 1 < nblocks:
                nxt = w0 + (b + 2) * wstride
                _tile512(rows, xt, kpairs, st, ldo, w0 + b * wstride, sw0 + b * BLOCK_COLS * 4,
                         ot + b * BLOCK_COLS * 4, w0 + (b + 1) * wstride, sw0 + (b + 1) * BLOCK_COLS * 4,
                         ot + (b + 1) * BLOCK_COLS * 4,
                         _next_blocks(nxt, nxt + wstride, wstride, t - t0, t1 - t0, b + 3 < nblocks))
            else:
                _tile512_one(rows, xt, kpairs, st, ldo, w0 + b * wstride, sw0 + b * BLOCK_COLS * 4,
                             ot + b * BLOCK_COLS * 4)


@nb.njit(parallel=True, cache=True)
def gemm_packed_silu_512(xp, sx, wp, sw, out, M):
    """gemm_packed_silu on AVX-512 VNNI: one tile computes gate block j and up block j together."""
    panels, kpairs = xp.shape[0], xp.shape[1]
    half = wp.shape[0] // 2
    x0, w0, sx0, sw0 = np.int64(xp.ctypes.data), np.int64(wp.ctypes.data), np.int64(sx.ctypes.data), \
        np.int64(sw.ctypes.data)
    xstride, wstride = _strides(kpairs)
    mgroups = _panel_groups(panels)
    for it in nb.prange(mgroups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        t0, t1 = g * panels // mgroups, (g + 1) * panels // mgroups
        for t in range(t0, t1):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            _tile512(rows, x0 + t * xstride, kpairs, sx0 + m0 * 4, BLOCK_COLS,
                     w0 + j * wstride, sw0 + j * BLOCK_COLS * 4, ga,
                     w0 + (j + half) * wstride, sw0 + (j + half) * BLOCK_COLS * 4, ua,
                     _next_blocks(w0 + (j + 1) * wstride, w0 + (j + 1 + half) * wstride, wstride, t - t0, t1 - t0,
                                  j + 1 < half))
            silu_rows(gu, out, m0, rows, j)


_quantize_parallel, _quantize_serial = quantize_rows.parallel, quantize_rows.serial


@nb.njit(cache=True)
def quantized_x(x, xbuf, sx):
    """x [M, K] quantized into xbuf's packed panels (returned as a view) and sx."""
    M, K = x.shape
    shape = packed_x_shape(M, K)
    xp = xbuf[:shape[0] * shape[1] * shape[2] * shape[3]].reshape(shape)
    if shape[0] > 1:
        _quantize_parallel(x, act_qmax(K), xp, sx)
    else:
        _quantize_serial(x, act_qmax(K), xp, sx)
    return xp


@nb.njit(cache=True)
def int8_matmul_avx2(x, wp, sw, out, xbuf, sx):
    """out[M, N] = x[M, K] @ (q * sw[:, None])^T for a weight packed by pack_weights. xbuf (int16) and
    sx (float32): buffers of at least x_buffer_sizes(M, K) elements, reused across calls (fresh pages
    would fault in on every call). Compiled, so that compiled code (fused.py) calls it too."""
    gemm_packed(quantized_x(x, xbuf, sx), sx, wp, sw, out, x.shape[0])


@nb.njit(cache=True)
def int8_matmul_silu_avx2(x, wp, sw, out, xbuf, sx):
    """out[M, F] = silu(x @ Wg^T) * (x @ Wu^T) for a gate_up weight [Wg; Wu] ([2F, K], F % 16 == 0)
    packed by pack_weights (buffers as for int8_matmul)."""
    gemm_packed_silu(quantized_x(x, xbuf, sx), sx, wp, sw, out, x.shape[0])


@nb.njit(cache=True)
def int8_matmul_avx512(x, wp, sw, out, xbuf, sx):
    """int8_matmul_avx2 on AVX-512 VNNI: the same bits."""
    gemm_packed_512(quantized_x(x, xbuf, sx), sx, wp, sw, out, x.shape[0])


@nb.njit(cache=True)
def int8_matmul_silu_avx512(x, wp, sw, out, xbuf, sx):
    """int8_matmul_silu_avx2 on AVX-512 VNNI: the same bits."""
    gemm_packed_silu_512(quantized_x(x, xbuf, sx), sx, wp, sw, out, x.shape[0])


# The entry points per path (isa.py's names); each is its own compiled function, so a cached build
# of one path is never taken for another.
PATHS = {isa.AVX512_VNNI: (int8_matmul_avx512, int8_matmul_silu_avx512),
         isa.AVX2: (int8_matmul_avx2, int8_matmul_silu_avx2),
         isa.PORTABLE: (int8_matmul_avx2, int8_matmul_silu_avx2)}     # the AVX2 drivers, built for that CPU


def path_for(features) -> str:
    """The integer GEMM's path on a CPU with `features` (isa.py)."""
    return isa.select(set(features))


PATH = path_for(isa.FEATURES)
int8_matmul, int8_matmul_silu = PATHS[PATH]      # the entry points of this machine's path


def x_buffer_sizes(M: int, K: int) -> tuple[int, int]:
    """Elements of the int16 activation buffer and the float32 scale buffer int8_matmul needs."""
    panels = (M + PANEL_ROWS - 1) // PANEL_ROWS
    return panels * PANEL_ROWS * (K + K % 2), panels * PANEL_ROWS
