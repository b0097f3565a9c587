"""A float32 GEMM whose every output element is computed the same way whatever the number of rows, the
tile that holds it, the thread split or the machine's vector width: the float32 products of the
batch-invariant mode (`--batch-invariant`).

Why: OpenBLAS rounds by call shape. A row of x multiplied alone (sgemv), with a few other rows or with
many (sgemm, either orientation) gets different last bits (docs/kernels.md), so a float32 request's
logits depended on its batch, and a near-tie could change its tokens. The int8 and q4 GEMMs are
row-invariant by construction (exact integer sums); this is the float32 counterpart.

The arithmetic of out[m, n] = x[m] . w[n] over K, in 16 lanes:

    a[l] = 0 for l < 16
    for each chunk j of 16 (the last one zero-padded past K):   a[l] = fma(x[m, 16 j + l], w[n, 16 j + l], a[l])
    out  = ((a[0:8] + a[8:16])[0:4] + ...[4:8])[0:2] + ...   a fixed tree: 8, 4, 2, 1 lanes

written in LLVM IR on <16 x float> vectors with no fast-math flags: each lane's fma chain and the tree
are exact IEEE operations in a fixed order, so AVX-512 (one zmm per vector) and AVX2 (LLVM splits each
vector into two ymm) give the same bits. A tile computes R rows x C weight rows (R x C accumulators);
tiles of other shapes compute the same per-element sequence, so the driver picks the shape by the
number of rows (one row: streaming C weight rows at once; more: a register block that reuses loads).

It reads x and w in their natural layouts (row-major, K contiguous): nothing is packed at load.
A tile's weight rows come from memory (DRAM, for a model's weights) at its first row tile and from L1
at the others; every tile call also prefetches a slice of the next tile's rows, spread over the
16-float chunks of its loop (vnni.paced_prefetch) rather than all at once (requests spread out arrived
sooner than the same lines in one burst: docs/kernels.md), so that read overlaps the arithmetic instead
of stalling the first row tile (it does not change what is computed).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.llvm import F32, I32, _fma, _ptr, _vload, _vstore, counted_loop, i64, keep_alive
from rawinfer.backend.cpu.vnni import lines_per_step, paced_prefetch

LANES = 16
_VF = ir.VectorType(F32, LANES)
_VI = ir.VectorType(I32, LANES)
_M_BLOCK = 96          # rows of x a thread walks per pass over its weight rows (their panel stays in L2)
_K_SPLIT = 1024        # longer rows (K) are walked in slices of _K_SLICE (a multiple of LANES), so that a
_K_SLICE = 768         # tile's weight rows and x rows fit L1 together
DEFAULT_MAX_ROWS = 96  # the backend's float32 products of up to this many rows take this GEMM by default
                       # (faster than OpenBLAS's there, slower on prompts); --batch-invariant: all of them


def _reduce_packed(builder, accs):
    """Every accumulator of `accs` through the fixed tree, several per instruction: two vectors holding P
    accumulators of L lanes each (accumulator i in lanes i*L .. i*L+L-1) become one holding 2P of L/2
    lanes, lane l of each segment the sum of its lanes l and l + L/2, which is the tree's next level for
    each accumulator (the module docstring's adds in the same order, so the same bits). After four
    levels a vector holds 16 finished sums. Returns the scalars in the order of `accs`."""
    vecs = [(a, [i]) for i, a in enumerate(accs)]           # (vector, accumulator index per segment)
    L = LANES
    while L > 1:
        half = L // 2
        if len(vecs) % 2:
            vecs.append((ir.Constant(_VF, [0.0] * LANES), []))   # a partner whose lanes are never read
        nxt = []
        for (a, ia), (b, ib) in zip(vecs[0::2], vecs[1::2]):
            P = LANES // L
            lo = [s * L + l for s in range(P) for l in range(half)] + \
                 [LANES + s * L + l for s in range(P) for l in range(half)]
            hi = [i + half for i in lo]
            v = builder.fadd(builder.shuffle_vector(a, b, ir.Constant(_VI, lo)),
                             builder.shuffle_vector(a, b, ir.Constant(_VI, hi)))
            nxt.append((v, ia + [None] * (P - len(ia)) + ib))
        vecs, L = nxt, half
    out = [None] * len(accs)
    for v, idx in vecs:
        for lane, i in enumerate(idx):
            if i is not None:
                out[i] = builder.extract_element(v, ir.Constant(I32, lane))
    return out


def _tile_code(builder, R, C, args, carried=False):
    """out[r, c] for r < rows, c < cols (the module docstring's arithmetic). Rows and weight rows past
    the valid ones read the last valid one (never out of bounds) and are not stored.

    carried: the tile runs over one slice of K (a multiple of 16 unless it is the last) and two more
    arguments say where its R x C accumulators live between slices (accp, zeros before the first) and
    whether this slice is the last (finish: then the tail, the tree and the stores; else the
    accumulators go back to accp). Each lane's fma chain goes on where it stopped, so the bits are
    those of one pass over all of K."""
    if carried:
        xp, ldx, wp, ldw, op, ldo, K, rows, cols, accp, finish, pfp, pfn = args
    else:
        xp, ldx, wp, ldw, op, ldo, K, rows, cols, pfp, pfn = args
    xb, wb, ob = _ptr(builder, xp, F32), _ptr(builder, wp, F32), _ptr(builder, op, F32)
    fma = _fma(builder, _VF)

    def clamp(i, n):
        last = builder.sub(n, i64(1))
        return builder.select(builder.icmp_signed("<", i64(i), n), i64(i), last)

    xr = [builder.gep(xb, [builder.mul(clamp(r, rows), ldx)]) for r in range(R)]
    wc = [builder.gep(wb, [builder.mul(clamp(c, cols), ldw)]) for c in range(C)]
    zero = ir.Constant(_VF, [0.0] * LANES)

    def chunk(xv, wv, acc):
        return [builder.call(fma, [xv[r], wv[c], acc[r * C + c]]) for r in range(R) for c in range(C)]

    nfull = builder.sdiv(K, i64(LANES))

    per = lines_per_step(builder, pfn, nfull)

    def body(j, acc):
        paced_prefetch(builder, j, per, pfn, (pfp,))                 # pfn lines spread over the chunks
        at = builder.mul(j, i64(LANES))
        xv = [_vload(builder, p, at, _VF) for p in xr]
        wv = [_vload(builder, p, at, _VF) for p in wc]
        return chunk(xv, wv, acc)

    if carried:
        ab = _ptr(builder, accp, F32)
        init = [_vload(builder, ab, i64(i * LANES), _VF) for i in range(R * C)]
    else:
        init = [zero] * (R * C)
    acc = counted_loop(builder, nfull, init, body)
    if not carried:
        _finish(builder, R, C, acc, xr, wc, chunk, K, nfull, rows, cols, ob, ldo)
        return
    with builder.if_else(builder.icmp_signed("!=", finish, i64(0))) as (last_slice, more):
        with last_slice:
            _finish(builder, R, C, acc, xr, wc, chunk, K, nfull, rows, cols, ob, ldo)
        with more:
            for i, a in enumerate(acc):
                _vstore(builder, a, ab, i64(i * LANES))


def _finish(builder, R, C, acc, xr, wc, chunk, K, nfull, rows, cols, ob, ldo):
    """The tile's end: the K % 16 tail, the tree, the stores of the valid elements."""
    zero = ir.Constant(_VF, [0.0] * LANES)
    # the last K % 16 elements, zeros past K (fma(0, 0, a) leaves a as it is, but -0 -> +0): each lane
    # loaded from a clamped index and selected, once per tile
    tail = builder.sub(K, builder.mul(nfull, i64(LANES)))
    pre = builder.block
    with builder.if_then(builder.icmp_signed(">", tail, i64(0))):
        at = builder.mul(nfull, i64(LANES))
        last = builder.sub(tail, i64(1))

        def padded(p):
            v = zero
            for lane in range(LANES):
                inside = builder.icmp_signed("<", i64(lane), tail)
                idx = builder.add(at, builder.select(inside, i64(lane), last))
                e = builder.select(inside, builder.load(builder.gep(p, [idx]), align=4), ir.Constant(F32, 0.0))
                v = builder.insert_element(v, e, ir.Constant(I32, lane))
            return v
        tacc = chunk([padded(p) for p in xr], [padded(p) for p in wc], acc)
        tblock = builder.block
    acc = [_phi(builder, a, pre, t, tblock) for a, t in zip(acc, tacc)]
    sums = _reduce_packed(builder, acc)
    for r in range(R):
        for c in range(C):
            ok = builder.and_(builder.icmp_signed("<", i64(r), rows), builder.icmp_signed("<", i64(c), cols))
            with builder.if_then(ok):
                builder.store(sums[r * C + c], builder.gep(ob, [builder.add(builder.mul(i64(r), ldo), i64(c))]))


def _phi(builder, a, a_block, b, b_block):
    p = builder.phi(a.type)
    p.add_incoming(a, a_block)
    p.add_incoming(b, b_block)
    return p


def _make_tile(R: int, C: int):
    @intrinsic
    def f32_dot_tile(typingctx, xp, ldx, wp, ldw, op, ldo, K, rows, cols, pfp, pfn):
        def codegen(context, builder, signature, args):
            _tile_code(builder, R, C, args)
            return context.get_dummy_value()
        return types.void(*([types.int64] * 11)), codegen
    return f32_dot_tile


def _make_carried_tile(R: int, C: int):
    @intrinsic
    def f32_dot_tile_carried(typingctx, xp, ldx, wp, ldw, op, ldo, K, rows, cols, accp, finish, pfp, pfn):
        def codegen(context, builder, signature, args):
            _tile_code(builder, R, C, args, carried=True)
            return context.get_dummy_value()
        return types.void(*([types.int64] * 13)), codegen
    return f32_dot_tile_carried


# (rows, weight rows) per tile: one x row streams C weight rows at once (C independent fma chains);
# more rows take an R x C register block. AVX2 holds a 16-lane vector in two ymm of its 16, AVX-512 in
# one zmm of its 32. On AVX2 the 2 x 3 block keeps 12 ymm of sums and 4 for loads: per half-vector it
# loads 2 x and 3 w ymm for 6 fmas (a 2 x 2 block: 4 loads for 4), and the x rows, which a pass over
# M rows reads from L2 for every weight tile, cost a third of a load per fma instead of half.
if {"avx512f"} <= isa.FEATURES:
    SHAPES = {"one": (1, 8), "many": (4, 6)}
else:
    SHAPES = {"one": (1, 4), "many": (2, 3)}
_one = _make_tile(*SHAPES["one"])
_many = _make_tile(*SHAPES["many"])
_many_carried = _make_carried_tile(*SHAPES["many"])
_C1, _R, _C = SHAPES["one"][1], SHAPES["many"][0], SHAPES["many"][1]


def available() -> bool:
    """The tiles need FMA (without it LLVM would call a libm fma a JIT-compiled kernel cannot count on):
    AVX2 and FMA, as llvm.py's blocks."""
    return cpu_llvm.available()


@nb.njit(inline="always")
def _prefetch_step(K, row_tiles, slices):
    """Bytes of the next weight tile (_C rows of K floats) to prefetch with each of the row_tiles x
    slices tile calls on the current one, whole cache lines. A single row tile (2 to _R rows: a few
    decode rows, a sequence verifying drafts) prefetches too: its _C weight row streams at once are
    more than the hardware prefetcher keeps ahead of (docs/kernels.md)."""
    return (_C * K * 4 // (row_tiles * slices) + 63) // 64 * 64


@nb.njit(inline="always")
def _prefetch_next(w0, K, n, n_hi, i, step):
    """(address, lines): the i-th `step` bytes of the next tile's rows (contiguous: rows are K floats
    apart), none past this thread's last row n_hi, for the i-th tile call on weight rows n .. n + _C to
    prefetch into L2, spread over its 16-float chunks (L1 holds the rows the tile calls are reusing)."""
    a = w0 + ((n + _C) * K * 4 + i * step)
    end = w0 + min(n + 2 * _C, n_hi) * K * 4
    if step > 0 and a < end:
        return a, (min(step, end - a) + 63) // 64
    return np.int64(0), np.int64(0)


@nb.njit(parallel=True, cache=True)
def matmul_nt(x, w, out, parts):
    """out[M, N] = x[M, K] @ w[N, K]^T (all C-contiguous float32), the N weight rows split into `parts`
    contiguous slices over the thread pool; every element by the module docstring's arithmetic."""
    M, K = x.shape
    N = w.shape[0]
    ldo = np.int64(out.shape[1])
    x0, w0, o0 = np.int64(x.ctypes.data), np.int64(w.ctypes.data), np.int64(out.ctypes.data)
    Kl = np.int64(K)
    for p in nb.prange(parts):
        n_lo, n_hi = N * p // parts, N * (p + 1) // parts
        if M == 1:
            for n in range(n_lo, n_hi, _C1):
                _one(x0, Kl, w0 + n * Kl * 4, Kl, o0 + n * 4, ldo, Kl, np.int64(1), np.int64(min(_C1, n_hi - n)),
                     np.int64(0), np.int64(0))
        elif K <= _K_SPLIT:
            for mb in range(0, M, _M_BLOCK):
                me = min(M, mb + _M_BLOCK)
                step = _prefetch_step(Kl, (me - mb + _R - 1) // _R, 1)
                for n in range(n_lo, n_hi, _C):
                    cols = np.int64(min(_C, n_hi - n))
                    i = 0
                    for m in range(mb, me, _R):
                        pa, pn = _prefetch_next(w0, Kl, n, n_hi, i, step)
                        i += 1
                        _many(x0 + m * Kl * 4, Kl, w0 + n * Kl * 4, Kl, o0 + (m * ldo + n) * 4, ldo, Kl,
                              np.int64(min(_R, me - m)), cols, pa, pn)
        else:
            # K in slices of _K_SLICE, all of a block's row tiles per slice, the accumulators kept in
            # `acc` between slices: the weight rows' slice stays in L1 across the row tiles
            acc = np.empty(((_M_BLOCK + _R - 1) // _R) * _R * _C * LANES, np.float32)
            a0 = np.int64(acc.ctypes.data)
            for mb in range(0, M, _M_BLOCK):
                me = min(M, mb + _M_BLOCK)
                step = _prefetch_step(Kl, (me - mb + _R - 1) // _R, (K + _K_SLICE - 1) // _K_SLICE)
                for n in range(n_lo, n_hi, _C):
                    cols = np.int64(min(_C, n_hi - n))
                    acc[:] = np.float32(0.0)
                    i = 0
                    for k0 in range(0, K, _K_SLICE):
                        kc = np.int64(min(_K_SLICE, K - k0))
                        finish = np.int64(k0 + _K_SLICE >= K)
                        for m in range(mb, me, _R):
                            pa, pn = _prefetch_next(w0, Kl, n, n_hi, i, step)
                            i += 1
                            _many_carried(x0 + (m * Kl + k0) * 4, Kl, w0 + (n * Kl + k0) * 4, Kl,
                                          o0 + (m * ldo + n) * 4, ldo, kc, np.int64(min(_R, me - m)), cols,
                                          a0 + (m - mb) // _R * (_R * _C * LANES * 4), finish, pa, pn)
            keep_alive(acc)
    keep_alive(x)                      # read through x0, w0, o0 up to here
    keep_alive(w)
    keep_alive(out)
