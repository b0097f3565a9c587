"""Integer GEMM for int8 and q4 models with 8-bit activations (the engine's `int8_activations` mode):
out = x @ W^T with x quantized to int8 per row and block of 32 k, as llama.cpp's q8_0; W int8 rows
(below) or q4 blocks (a8q4tile.py has their layout, arithmetic and tiles; the drivers here serve both).

Why: with int16 activations (qgemm.py) the integer GEMM multiplies 2 pairs of 16 bits per int32 lane
and instruction (vpdpwssd); with 8-bit ones `vpdpbusd` multiplies 4 pairs of bytes, twice the
products per instruction, for prefill and batched decode, which are compute-bound. The price is
precision: 127 levels per block of 32 activations instead of 11-29k per row (docs/kernels.md has
the golden agreement it keeps), which is why it is a mode and not the int8 default.

Numbers:
    W: the model's int8 rows q[N, K] (per-row scales sw[N]), repacked once at load as unsigned bytes
       q + 128 (vpdpbusd multiplies unsigned by signed bytes), blocks of 16 output columns, k in
       quads:                                        wq[N/16, K/4, 16, 4]  uint8
    x: quantized at every call per row m and block b of KBLOCK k to int8 with scale
       xs[m, b] = max |x[m, block b]| / 127, packed in panels of 6 rows, k in quads:
                                                     xq[ceil(M/6), K/4, 6, 4]  int8 (padding rows 0)
       with the block sums' correction               xc[ceil(M/6), K/32, 6]  int32 = -128 * sum xq
       (for q4 weights float32 xs * sum xq instead: what a8q4tile.py's tiles multiply the blocks' minima by)
    out[m, n] = sw[n] * fold_b(acc = fma(float(xc[m, b] + sum_{k in b} xq[m, k] wq[n, k]), xs[m, b], acc))

Each block's integer sum is exact, and every row is computed the same way whatever the number of
rows, so a request's tokens do not depend on its batch. Paths (isa.py): AVX-512 VNNI (vpdpbusd on 6 x
32 tiles) and AVX2 (int8: vpmaddubsw by the sign trick, 2 x 16 tiles, slower; q4: vpmaddubsw, 3 x 16; with
AVX-VNNI both on 256-bit vpdpbusd, 3 x 16), the same bits on all (a8tile.py, a8q4tile.py). `available()`
is False without AVX2; the engine then refuses the mode.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from rawinfer.backend.cpu import a8q4tile as q4tile
from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.a8tile import KBLOCK, QUADS, ROWS, tiles
from rawinfer.backend.cpu.kernels import Kernel
from rawinfer.backend.cpu.llvm import GEMM_COLS as BLOCK_COLS
from rawinfer.backend.cpu.llvm import GEMM_ROWS as PANEL_ROWS
from rawinfer.backend.cpu.llvm import abs_max
from rawinfer.backend.cpu.qgemm import _panel_groups as _groups   # qgemm.gemm_packed's equal panel groups
from rawinfer.backend.cpu.qgemm import _next_blocks, silu_rows



def supports(shape: tuple[int, int]) -> bool:
    """Whether a [N, K] weight fits the packed layout (whole 16-column blocks, whole blocks of k)."""
    N, K = shape
    return N % BLOCK_COLS == 0 and K % KBLOCK == 0 and K > 0


def pack_weights(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] -> wq uint8 [N/16, K/4, 16, 4] = q + 128: one 64-byte row per (column block, k quad)."""
    N, K = q.shape
    if not supports(q.shape):
        raise ValueError(f"a8gemm.pack_weights: shape {q.shape} needs N % {BLOCK_COLS} == 0 and K % {KBLOCK} == 0")
    w = (np.asarray(q, np.int8).view(np.uint8) ^ np.uint8(0x80)).reshape(N // BLOCK_COLS, BLOCK_COLS, K // 4, 4)
    return np.ascontiguousarray(w.transpose(0, 2, 1, 3))


def x_buffer_sizes(M: int, K: int) -> tuple[int, int]:
    """Elements of the int8 panel buffer and of the scale (float32) and correction (int32) buffers."""
    rows = (M + PANEL_ROWS - 1) // PANEL_ROWS * PANEL_ROWS
    return rows * K, rows * (K // KBLOCK)


# ---- the quantizer ------------------------------------------------------------------------------------
def _correction(xc, scale, total):
    """What the quantizer stores beside a block's scale for the tiles that read xc: -128 * sum xq (int32)
    for int8 weights, xs * sum xq (float32) for q4 ones."""


@overload(_correction)
def _correction_of(xc, scale, total):
    if xc.dtype == types.float32:
        return lambda xc, scale, total: scale * np.float32(total)
    return lambda xc, scale, total: -128 * total


def _corrections(cbuf, wq):
    """The int32 correction buffer as the tiles of wq's layout read it: itself (int8, 4-d), float32 (q4)."""


@overload(_corrections)
def _corrections_of(cbuf, wq):
    if wq.ndim == 2:
        return lambda cbuf, wq: cbuf.view(np.float32)
    return lambda cbuf, wq: cbuf


@nb.njit(cache=True, inline="always")
def _quantize_row(x, r, xpanel, xs, xc, q):
    # x[K] float32 (contiguous) -> row r of an int8 panel [K/4, 6, 4] (as int32 quads [K/4 * 6]) and of
    # the panel's scales and corrections [K/32, 6] (_correction); q: int8 scratch [KBLOCK]
    quads = q.view(np.int32)
    for b in range(x.shape[0] // KBLOCK):
        k0 = b * KBLOCK
        amax = abs_max(np.int64(x.ctypes.data) + k0 * 4, KBLOCK)
        total = 0
        scale = np.float32(0.0)
        if amax > np.float32(0.0):         # else (zeros, or all NaN) a zero block
            inv = np.float32(127.0) / amax
            for k in range(KBLOCK):
                v = np.rint(x[k0 + k] * inv)
                v = v if v < np.float32(127.0) else np.float32(127.0)
                v = v if v > np.float32(-127.0) else np.float32(-127.0)
                q[k] = np.int8(np.int32(v))
                total += np.int32(v)
            scale = amax / np.float32(127.0)
        else:
            q[:] = 0
        xs[b * PANEL_ROWS + r] = scale
        xc[b * PANEL_ROWS + r] = _correction(xc, scale, total)
        for j in range(QUADS):
            xpanel[(b * QUADS + j) * PANEL_ROWS + r] = quads[j]


def _quantize_rows(x, xq, xs, xc):
    """x float32 [M, K] (rows contiguous) -> xq as int32 quads [panels, K/4 * 6], xs float32 and xc int32
    [panels, K/32 * 6]; rows past M are zero."""
    M, K = x.shape
    for t in nb.prange(xq.shape[0]):
        q = np.empty(KBLOCK, np.int8)
        for r in range(PANEL_ROWS):
            m = t * PANEL_ROWS + r
            if m < M:
                _quantize_row(x[m], r, xq[t], xs[t], xc[t], q)
            else:
                for kq in range(K // 4):
                    xq[t, kq * PANEL_ROWS + r] = 0
                for b in range(K // KBLOCK):
                    xs[t, b * PANEL_ROWS + r] = np.float32(0.0)
                    xc[t, b * PANEL_ROWS + r] = 0


# A decode step of up to 6 rows is one panel, quantized serially (waking the pool costs more).
quantize_rows = Kernel(_quantize_rows, min_parallel_rows=2)     # rows: panels
_quantize_parallel, _quantize_serial = quantize_rows.parallel, quantize_rows.serial


@nb.njit(cache=True)
def quantized_x(x, xbuf, sbuf, cbuf):
    """x [M, K] quantized into views of the three buffers: (xq [panels, K/4 * 6] int32, xs, xc); xc holds
    what _correction stores for its dtype (int32: int8 weights; float32: q4)."""
    M, K = x.shape
    panels = (M + PANEL_ROWS - 1) // PANEL_ROWS
    xq = xbuf[:panels * PANEL_ROWS * K].view(np.int32).reshape(panels, K // 4 * PANEL_ROWS)
    xs = sbuf[:panels * PANEL_ROWS * (K // KBLOCK)].reshape(panels, K // KBLOCK * PANEL_ROWS)
    xc = cbuf[:panels * PANEL_ROWS * (K // KBLOCK)].reshape(panels, K // KBLOCK * PANEL_ROWS)
    if panels > 1:
        _quantize_parallel(x, xq, xs, xc)
    else:
        _quantize_serial(x, xq, xs, xc)
    return xq, xs, xc


# ---- drivers ------------------------------------------------------------------------------------------
# One source for both weight layouts: int8 rows (pack_weights, 4-d) and q4 (a8q4tile.pack_q4, 2-d). The
# overloads below pick a layout's tiles and strides while Numba types the driver, so each driver compiles
# once per layout; the tiles of both take the same arguments.
def _layout(wq):
    """(k-blocks, column blocks, bytes per column block) of a packed weight of either layout."""


@overload(_layout, inline="always")
def _layout_of(wq):
    if wq.ndim == 2:
        return lambda wq: (wq.shape[1] // q4tile.RECORD, wq.shape[0], np.int64(wq.shape[1]))
    return lambda wq: (wq.shape[1] // QUADS, wq.shape[0], np.int64(wq.shape[1] * 4 * BLOCK_COLS))


def _by_rows(t1, t2, t4, t6):
    """The body that runs the tile build (t1, t2, t4, t6: 1, 2, 4, 6 rows) computing the fewest rows
    covering `rows`; pf = (pf0, pf1, pfn): the next weight blocks' slice to prefetch (qgemm._next_blocks)."""
    def impl(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf):
        if rows > 4:
            t6(xt, kb, rows, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
        elif rows > 2:
            t4(xt, kb, rows, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
        elif rows > 1:
            t2(xt, kb, rows, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
        else:
            t1(xt, kb, rows, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf[0], pf[1], pf[2])
    return impl


def _vnni2(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf):
    """Blocks 0 and 1 on AVX-512 VNNI (_by_rows)."""


def _vnni1(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf):
    """Block 0 on AVX-512 VNNI (_by_rows; w1, s1, o1 and pf unused)."""


@overload(_vnni2, inline="always")
def _vnni2_of(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf):
    return _by_rows(*((q4tile.tiles if wq.ndim == 2 else tiles)[isa.AVX512_VNNI][R, 2] for R in (1, 2, 4, 6)))


@overload(_vnni1, inline="always")
def _vnni1_of(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0, w1, s1, o1, pf):
    return _by_rows(*((q4tile.tiles if wq.ndim == 2 else tiles)[isa.AVX512_VNNI][R, 1] for R in (1, 2, 4, 6)))


def _avx2(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0):
    """One block on AVX2: rows as many at a time as the layout's widest AVX2 tile computes (3; int8 weights
    without AVX-VNNI 2: a8tile.ROWS), x rows 4 bytes apart in a quad row, scales 4 bytes apart; the last
    group with the build that computes the fewest rows covering it."""


@overload(_avx2, inline="always")
def _avx2_of(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0):
    builds, rows_built = (q4tile.tiles, q4tile.ROWS) if wq.ndim == 2 else (tiles, ROWS)
    step = rows_built[isa.AVX2][-1]                      # the layout's widest AVX2 tile: 3 rows, or 2
    t1, t2, t3 = (builds[isa.AVX2][R, 1] for R in (1, 2, step))

    def impl(wq, rows, xt, kb, st, ct, ldo, w0, s0, o0):
        for r in range(0, rows, step):
            n = rows - r
            xr, sr, cr, orow = xt + 4 * r, st + 4 * r, ct + 4 * r, o0 + 4 * r * ldo
            if n > 2:
                t3(xr, kb, n, sr, cr, ldo, w0, s0, orow, 0, 0, 0, 0, 0, 0)
            elif n > 1:
                t2(xr, kb, n, sr, cr, ldo, w0, s0, orow, 0, 0, 0, 0, 0, 0)
            else:
                t1(xr, kb, n, sr, cr, ldo, w0, s0, orow, 0, 0, 0, 0, 0, 0)
    return impl


@nb.njit(inline="always")
def _addresses(xq, xs, xc, wq):
    # (base addresses of xq, xs, xc, wq; bytes per x panel, per scale panel, per weight block)
    kblocks, _, wst = _layout(wq)
    return (np.int64(xq.ctypes.data), np.int64(xs.ctypes.data), np.int64(xc.ctypes.data),
            np.int64(wq.ctypes.data), np.int64(kblocks * KBLOCK * PANEL_ROWS),
            np.int64(kblocks * PANEL_ROWS * 4), wst)


@nb.njit(parallel=True, cache=True)
def gemm_vnni(xq, xs, xc, wq, sw, out, M):
    """out[M, N] over packed operands on AVX-512 VNNI; work items (group of x panels, pair of blocks)."""
    panels = xq.shape[0]
    kblocks, nblocks, _ = _layout(wq)
    npairs = (nblocks + 1) // 2
    ldo, o0, sw0 = np.int64(out.shape[1]), np.int64(out.ctypes.data), np.int64(sw.ctypes.data)
    x0, s0, c0, w0, xst, sst, wst = _addresses(xq, xs, xc, wq)
    groups = _groups(panels)
    for it in nb.prange(groups * npairs):
        g, b = it // npairs, 2 * (it % npairs)
        t0, t1 = g * panels // groups, (g + 1) * panels // groups
        for t in range(t0, t1):
            m0 = t * PANEL_ROWS
            rows = min(PANEL_ROWS, M - m0)
            xt, st, ct, ot = x0 + t * xst, s0 + t * sst, c0 + t * sst, o0 + m0 * ldo * 4
            if b + 1 < nblocks:
                nxt = w0 + (b + 2) * wst
                _vnni2(wq, rows, xt, kblocks, st, ct, ldo,
                       w0 + b * wst, sw0 + b * BLOCK_COLS * 4, ot + b * BLOCK_COLS * 4,
                       w0 + (b + 1) * wst, sw0 + (b + 1) * BLOCK_COLS * 4, ot + (b + 1) * BLOCK_COLS * 4,
                       _next_blocks(nxt, nxt + wst, wst, t - t0, t1 - t0, b + 3 < nblocks))
            else:
                _vnni1(wq, rows, xt, kblocks, st, ct, ldo,
                       w0 + b * wst, sw0 + b * BLOCK_COLS * 4, ot + b * BLOCK_COLS * 4, 0, 0, 0, (0, 0, 0))


@nb.njit(parallel=True, cache=True)
def gemm_silu_vnni(xq, xs, xc, wq, sw, out, M):
    """out[M, F] = silu(g) * u for [g | u] = x @ W^T, W a gate_up weight [2F, K]: gate block j and up
    block j in one tile, into a small scratch (the [M, 2F] product is never stored)."""
    panels = xq.shape[0]
    kblocks, nblocks, _ = _layout(wq)
    half = nblocks // 2
    sw0 = np.int64(sw.ctypes.data)
    x0, s0, c0, w0, xst, sst, wst = _addresses(xq, xs, xc, wq)
    groups = _groups(panels)
    for it in nb.prange(groups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        t0, t1 = g * panels // groups, (g + 1) * panels // groups
        for t in range(t0, t1):
            rows = min(PANEL_ROWS, M - t * PANEL_ROWS)
            _vnni2(wq, rows, x0 + t * xst, kblocks, s0 + t * sst, c0 + t * sst, BLOCK_COLS,
                   w0 + j * wst, sw0 + j * BLOCK_COLS * 4, ga,
                   w0 + (j + half) * wst, sw0 + (j + half) * BLOCK_COLS * 4, ua,
                   _next_blocks(w0 + (j + 1) * wst, w0 + (j + 1 + half) * wst, wst, t - t0, t1 - t0, j + 1 < half))
            silu_rows(gu, out, t * PANEL_ROWS, rows, j)


@nb.njit(parallel=True, cache=True)
def gemm_avx2(xq, xs, xc, wq, sw, out, M):
    """gemm_vnni on AVX2: work items (group of x panels, block)."""
    panels = xq.shape[0]
    kblocks, nblocks, _ = _layout(wq)
    ldo, o0, sw0 = np.int64(out.shape[1]), np.int64(out.ctypes.data), np.int64(sw.ctypes.data)
    x0, s0, c0, w0, xst, sst, wst = _addresses(xq, xs, xc, wq)
    groups = _groups(panels)
    for it in nb.prange(groups * nblocks):
        g, b = it // nblocks, it % nblocks
        for t in range(g * panels // groups, (g + 1) * panels // groups):
            m0 = t * PANEL_ROWS
            _avx2(wq, min(PANEL_ROWS, M - m0), x0 + t * xst, kblocks, s0 + t * sst, c0 + t * sst, ldo,
                  w0 + b * wst, sw0 + b * BLOCK_COLS * 4, o0 + (m0 * ldo + b * BLOCK_COLS) * 4)


@nb.njit(parallel=True, cache=True)
def gemm_silu_avx2(xq, xs, xc, wq, sw, out, M):
    """gemm_silu_vnni on AVX2."""
    panels = xq.shape[0]
    kblocks, nblocks, _ = _layout(wq)
    half = nblocks // 2
    sw0 = np.int64(sw.ctypes.data)
    x0, s0, c0, w0, xst, sst, wst = _addresses(xq, xs, xc, wq)
    groups = _groups(panels)
    for it in nb.prange(groups * half):
        g, j = it // half, it % half
        gu = np.empty((2, PANEL_ROWS, BLOCK_COLS), np.float32)
        ga, ua = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        for t in range(g * panels // groups, (g + 1) * panels // groups):
            rows = min(PANEL_ROWS, M - t * PANEL_ROWS)
            xt, st, ct = x0 + t * xst, s0 + t * sst, c0 + t * sst
            _avx2(wq, rows, xt, kblocks, st, ct, BLOCK_COLS, w0 + j * wst, sw0 + j * BLOCK_COLS * 4, ga)
            _avx2(wq, rows, xt, kblocks, st, ct, BLOCK_COLS,
                  w0 + (j + half) * wst, sw0 + (j + half) * BLOCK_COLS * 4, ua)
            silu_rows(gu, out, t * PANEL_ROWS, rows, j)


# ---- entry points -------------------------------------------------------------------------------------
@nb.njit(cache=True)
def a8_matmul_vnni(x, wq, sw, out, xbuf, sbuf, cbuf):
    """out[M, N] = x[M, K] @ (q * sw[:, None])^T for a weight packed by pack_weights; the buffers (int8,
    float32, int32) of at least x_buffer_sizes(M, K) elements are reused across calls."""
    xq, xs, xc = quantized_x(x, xbuf, sbuf, _corrections(cbuf, wq))
    gemm_vnni(xq, xs, xc, wq, sw, out, x.shape[0])


@nb.njit(cache=True)
def a8_matmul_silu_vnni(x, wq, sw, out, xbuf, sbuf, cbuf):
    """out[M, F] = silu(x @ Wg^T) * (x @ Wu^T) for a gate_up weight [Wg; Wu] packed by pack_weights."""
    xq, xs, xc = quantized_x(x, xbuf, sbuf, _corrections(cbuf, wq))
    gemm_silu_vnni(xq, xs, xc, wq, sw, out, x.shape[0])


@nb.njit(cache=True)
def a8_matmul_avx2(x, wq, sw, out, xbuf, sbuf, cbuf):
    """a8_matmul_vnni on AVX2: the same bits."""
    xq, xs, xc = quantized_x(x, xbuf, sbuf, _corrections(cbuf, wq))
    gemm_avx2(xq, xs, xc, wq, sw, out, x.shape[0])


@nb.njit(cache=True)
def a8_matmul_silu_avx2(x, wq, sw, out, xbuf, sbuf, cbuf):
    """a8_matmul_silu_vnni on AVX2: the same bits."""
    xq, xs, xc = quantized_x(x, xbuf, sbuf, _corrections(cbuf, wq))
    gemm_silu_avx2(xq, xs, xc, wq, sw, out, x.shape[0])


# The entry points per path (isa.py's names); each is its own compiled function, so a cached build of
# one path is never taken for another.
PATHS = {isa.AVX512_VNNI: (a8_matmul_vnni, a8_matmul_silu_vnni), isa.AVX2: (a8_matmul_avx2, a8_matmul_silu_avx2)}
PATH = isa.HOST if isa.HOST in PATHS else None
a8_matmul, a8_matmul_silu = PATHS[PATH or isa.AVX2]


def available() -> bool:
    """Whether this machine (the CPU Numba compiles for) runs the 8-bit-activation GEMM."""
    return PATH is not None


def int8_gains() -> bool:
    """Whether int8 weights run faster here on 8-bit activations than on qgemm's 16-bit ones: with vpdpbusd
    (AVX-512 VNNI, or AVX-VNNI on the AVX2 path). AVX2's int8 tile without it (vpsignb, vpmaddubsw and a
    widening vpmaddwd per 32 products) runs slower than qgemm: docs/kernels.md."""
    return PATH == isa.AVX512_VNNI or (PATH == isa.AVX2 and isa.avx_vnni())
