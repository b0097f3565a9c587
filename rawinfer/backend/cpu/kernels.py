"""Numba kernels of the CPU backend: the elementwise ops, KV cache access and the int8 GEMV;
float32 math throughout (attention: rawinfer/backend/cpu/attention.py).

Each kernel has a NumPy `<op>_ref` twin in tests/reference_ops.py. Kernels are compiled once and
cached on disk (`cache=True`); `parallel=True` kernels spread rows over the Numba thread pool.
docs/kernels.md has the dispatch rules and the measurements behind these kernels' shapes.

NOTE: the kernels of this package copy arrays element by element over 1-d rows, never `a[i] = b` or
`a[i] += b` with an array b: Numba builds such an assignment with a shape check whose error message it
formats with its string functions, and compiling those costs a cold start seconds (docs/CHANGELOG.md).
copy_row copies one; loops over 1-d rows vectorize, a loop indexing `a[i, j]` does not.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from rawinfer.backend.cpu.half import float_to_half, half_to_float
from rawinfer.backend.cpu.llvm import abs_max
from rawinfer.backend.cpu.reductions import dot_i8
from rawinfer.backend.cpu.vmath import EXP_MAX, EXP_MIN, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E

_JIT = dict(cache=True)
_T6, _T5, _T4, _T3, _T2, _T1, _T0 = EXP_TAYLOR       # fast_exp's polynomial, r^6 first


@intrinsic
def _bits_as_float32(typingctx, bits):
    """Reinterpret the bits of an int32 as a float32 (no conversion)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@nb.njit(inline="always")
def copy_row(dst, src):
    """dst[j] = src[j] over a 1-d row (the NOTE above: not dst[:] = src)."""
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@nb.njit(inline="always")
def fast_exp(x):
    """exp(x) for float32 in plain arithmetic, so that LLVM vectorizes loops that call it (a call to
    libm's expf keeps the loop scalar).
    x = n ln2 + r with |r| <= ln2/2; exp(r) by its Taylor polynomial to r^6 (relative error < 5e-7);
    2^n built from its exponent bits. Inputs are clamped to [-87, 88]: exp(-inf) gives 1.6e-38, which
    is 0 for every sum it enters (softmax weights, 1 + exp(-x))."""
    # NOTE: conditional expressions, not min/max: Numba's min/max branch on NaN and block vectorization
    x = x if x > np.float32(EXP_MIN) else np.float32(EXP_MIN)
    x = x if x < np.float32(EXP_MAX) else np.float32(EXP_MAX)
    n = np.floor(x * np.float32(LOG2E) + np.float32(0.5))
    r = x - n * np.float32(LN2_HI) - n * np.float32(LN2_LO)
    p = np.float32(_T6)
    p = p * r + np.float32(_T5)
    p = p * r + np.float32(_T4)
    p = p * r + np.float32(_T3)
    p = p * r + np.float32(_T2)
    p = p * r + np.float32(_T1)
    p = p * r + np.float32(_T0)
    return p * _bits_as_float32((np.int32(n) + np.int32(127)) << 23)


def _renamed(fn, name: str):
    """A copy of fn under another name. NOTE: Numba's disk cache names its files after the function's
    qualified name and line and does not key them on the compile options, so two builds of one
    function (serial and parallel) would overwrite and then load each other's machine code."""
    import types as pytypes
    g = pytypes.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    g.__qualname__ = name
    g.__doc__ = fn.__doc__
    return g


# ---- KV cache element access -------------------------------------------------------------------------
# A cache is float32, float16 held as its uint16 bits (Numba has no float16 type on the CPU; the backend
# passes such caches as uint16 views), or int8 with one float32 scale per row (token, kv head): an int8
# cache is [NB, Hkv, BS + E, D], each (block, kv head) tile holding its BS rows of D int8 values and then
# its BS scales in E = ceil(4 BS / D) more rows (kv_cache_shape in rawinfer/exec/memory.py), so that a
# tile stays one contiguous range (one prefetch, one block copy) and its rows 64-byte aligned. Kernels
# read and write through these helpers, which resolve per cache dtype at compile time.

@nb.njit(**_JIT)
def int8_kv_block_size(rows, D):
    """BS of an int8 cache whose tiles have `rows` rows of D values: rows = BS + ceil(4 BS / D) and
    BS = floor(rows D / (D + 4)) invert each other."""
    return rows * D // (D + 4)


def kv_dims(cache):
    """(Hkv, BS, D): kv heads, tokens per block and head size of a cache."""


@overload(kv_dims, inline="always")
def _kv_dims(cache):
    if cache.dtype == types.int8:
        return lambda cache: (cache.shape[1], int8_kv_block_size(cache.shape[2], cache.shape[3]), cache.shape[3])
    return lambda cache: (cache.shape[1], cache.shape[2], cache.shape[3])


def kv_scale_table(cache):
    """What the helpers below reach an int8 cache's row scales through: the whole cache as a flat
    float32 view, taken once per kernel outside its parallel loop (a view of the tile's scale rows
    taken per row inside a prange loop lost its stores once Numba inlined it, and was slow); an empty
    array for float caches."""


@overload(kv_scale_table, inline="always")
def _kv_scale_table(cache):
    if cache.dtype == types.int8:
        return lambda cache: cache.reshape(cache.size).view(np.float32)
    return lambda cache: np.empty(0, np.float32)


@nb.njit(inline="always")
def kv_scale_index(cache, blk, h, r):
    """Index in kv_scale_table(cache) of the scale of an int8 cache's row (blk, h, r): the tile's
    float32 values past its BS * D int8 ones."""
    Hkv, BS, D = kv_dims(cache)
    return ((np.int64(blk) * Hkv + h) * cache.shape[2] * D + BS * D) // 4 + r


def kv_store_row(cache, table, blk, h, r, src):
    """cache[blk, h, r] <- src (float32 [D]): copied, rounded to float16, or quantized to int8 with
    scale max|src| / 127 (to nearest; an all-zero row stores zeros and scale 0), the scale written
    through table = kv_scale_table(cache)."""


@overload(kv_store_row, inline="always")
def _kv_store_row(cache, table, blk, h, r, src):
    if cache.dtype == types.int8:
        def quantize(cache, table, blk, h, r, src):
            D = src.shape[0]
            dst = cache[blk, h, r]
            m = abs_max(np.int64(src.ctypes.data), D)    # (a running-max loop here tripped Numba's SSA pass)
            inv = np.float32(127.0) / max(m, np.float32(1e-30))
            for d in range(D):
                dst[d] = np.int8(np.rint(src[d] * inv))
            table[kv_scale_index(cache, blk, h, r)] = m / np.float32(127.0)
        return quantize
    if cache.dtype == types.uint16:
        def to_half(cache, table, blk, h, r, src):
            dst = cache[blk, h, r]
            for d in range(src.shape[0]):
                dst[d] = float_to_half(src[d])
        return to_half

    def copy(cache, table, blk, h, r, src):
        copy_row(cache[blk, h, r], src)
    return copy


def kv_tile(cache, table, blk, h, buf):
    """cache[blk, h] ([BS, D]) as float32: the view itself, or converted into buf (float32 [BS, D];
    int8: times the rows' scales, read through table = kv_scale_table(cache))."""


@overload(kv_tile, inline="always")
def _kv_tile(cache, table, blk, h, buf):
    if cache.dtype == types.int8:
        def dequantize(cache, table, blk, h, buf):
            i0 = kv_scale_index(cache, blk, h, 0)
            for r in range(buf.shape[0]):
                src, dst, s = cache[blk, h, r], buf[r], table[i0 + r]
                for d in range(buf.shape[1]):
                    dst[d] = np.float32(src[d]) * s
            return buf
        return dequantize
    if cache.dtype == types.uint16:
        def convert(cache, table, blk, h, buf):
            src = cache[blk, h]
            for r in range(src.shape[0]):
                for d in range(src.shape[1]):
                    buf[r, d] = half_to_float(src[r, d])
            return buf
        return convert
    return lambda cache, table, blk, h, buf: cache[blk, h]


def kv_row_into(cache, table, blk, h, r, dst):
    """dst[D] (float32) <- cache[blk, h, r] (int8: times its scale, read through table =
    kv_scale_table(cache))."""


@overload(kv_row_into, inline="always")
def _kv_row_into(cache, table, blk, h, r, dst):
    if cache.dtype == types.int8:
        def dequantize(cache, table, blk, h, r, dst):
            src, s = cache[blk, h, r], table[kv_scale_index(cache, blk, h, r)]
            for d in range(dst.shape[0]):
                dst[d] = np.float32(src[d]) * s
        return dequantize
    if cache.dtype == types.uint16:
        def convert(cache, table, blk, h, r, dst):
            for d in range(dst.shape[0]):
                dst[d] = half_to_float(cache[blk, h, r, d])
        return convert

    def copy(cache, table, blk, h, r, dst):
        copy_row(dst, cache[blk, h, r])
    return copy


class Kernel:
    """One kernel source compiled twice: serially for small batches (a decode step of a few tokens,
    where waking the thread pool costs more than the work) and with `parallel=True` for large ones."""

    def __init__(self, fn, min_parallel_rows: int = 16, **options):
        self.serial = nb.njit(**_JIT, **options)(fn)
        self.parallel = nb.njit(parallel=True, **_JIT, **options)(_renamed(fn, fn.__name__ + "_parallel"))
        self.min_parallel_rows = min_parallel_rows

    def __call__(self, rows: int, *args):
        (self.parallel if rows >= self.min_parallel_rows else self.serial)(*args)


# NOTE: the loops below index row views (x[t], qkv[t, a:b]) with the plain loop counter. Written as
# qkv[t, base + i], the index may be negative as far as Numba knows, and the wraparound select it adds
# keeps LLVM from vectorizing the loop.
@nb.njit(inline="always")
def sum_squares(x):
    """sum(x[c]^2) over a row in float32, in one fixed order: eight running sums over the columns
    c = j (mod 8), then (s0 + s1) + (s2 + s3) + ... in a fixed tree, then the tail. Without reassociation
    LLVM cannot reorder it, so every build (serial, parallel, inlined in the fused decode, AVX2 or
    AVX-512) gives the same bits; the eight independent sums still map onto one vector register."""
    C = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    n8 = C - C % 8
    for c in range(0, n8, 8):
        v0 = np.float32(x[c]); v1 = np.float32(x[c + 1]); v2 = np.float32(x[c + 2]); v3 = np.float32(x[c + 3])
        v4 = np.float32(x[c + 4]); v5 = np.float32(x[c + 5]); v6 = np.float32(x[c + 6]); v7 = np.float32(x[c + 7])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for c in range(n8, C):
        v = np.float32(x[c])
        s += v * v
    return s


def _rmsnorm_kernel(x, weight, eps, out):
    # x[T, C] any float, weight[C], out[T, C]; statistics in float32
    T, C = x.shape
    for t in nb.prange(T):
        xr, o = x[t], out[t]
        ss = sum_squares(xr)
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(C) + np.float32(eps))
        for c in range(C):
            o[c] = np.float32(xr[c]) * inv * weight[c]


def _add_rmsnorm_kernel(x, residual, weight, eps, out):
    # residual[T, C] += x[T, C]; out = rmsnorm(residual) * weight
    T, C = x.shape
    for t in nb.prange(T):
        xr, r, o = x[t], residual[t], out[t]
        for c in range(C):
            r[c] += np.float32(xr[c])
        ss = sum_squares(r)
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(C) + np.float32(eps))
        for c in range(C):
            o[c] = r[c] * inv * weight[c]


def _rope_kernel(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim):
    # qkv[T, (H+2Hkv)*D] in place; q heads 0..H-1 and k heads H..H+Hkv-1 are rotated
    T = qkv.shape[0]
    half = head_dim // 2
    nrot = num_heads + num_kv_heads
    for t in nb.prange(T):
        p = positions[t]
        cos, sin = cos_sin[p, :half], cos_sin[p, half:2 * half]
        for h in range(nrot):
            x1 = qkv[t, h * head_dim:h * head_dim + half]
            x2 = qkv[t, h * head_dim + half:(h + 1) * head_dim]
            for i in range(half):
                a, b = x1[i], x2[i]
                x1[i] = a * cos[i] - b * sin[i]
                x2[i] = b * cos[i] + a * sin[i]


def _silu_mul_kernel(gate_up, out):
    # out[T, F] = silu(gate_up[:, :F]) * gate_up[:, F:]
    T, F = out.shape
    for t in nb.prange(T):
        for f in range(F):
            g = gate_up[t, f]
            out[t, f] = g / (np.float32(1.0) + fast_exp(-g)) * gate_up[t, F + f]


def _kv_write_kernel(qkv, k_cache, v_cache, slot_mapping, num_heads):
    # k_cache/v_cache[NB, Hkv, BS, D] <- k/v heads of qkv[T, (H+2Hkv)*D] at slot_mapping[T]
    # NOTE: slots are distinct within a batch, so tokens can be written in parallel.
    T = qkv.shape[0]
    Hkv, BS, D = kv_dims(k_cache)
    k0 = num_heads * D
    v0 = k0 + Hkv * D
    k_table, v_table = kv_scale_table(k_cache), kv_scale_table(v_cache)
    for t in nb.prange(T):
        slot = slot_mapping[t]
        b = slot // BS
        r = slot % BS
        for h in range(Hkv):
            kv_store_row(k_cache, k_table, b, h, r, qkv[t, k0 + h * D:k0 + (h + 1) * D])
            kv_store_row(v_cache, v_table, b, h, r, qkv[t, v0 + h * D:v0 + (h + 1) * D])


@nb.njit(**_JIT)
def take_rows_kernel(x, indices, out):
    # out[B, C] = x[indices[B]]   (np.take with out= buffers through a slow path; this is a plain copy)
    for b in range(indices.shape[0]):
        copy_row(out[b], x[indices[b]])


@nb.njit(**_JIT)
def copy_blocks_kernel(cache, src, dst):
    # cache[NB, ...] (C-contiguous): block dst[i] <- block src[i] (an int8 cache's scales included)
    blocks = cache.reshape((cache.shape[0], -1))
    for i in range(src.shape[0]):
        copy_row(blocks[dst[i]], blocks[src[i]])


# ---- entry points: (rows, *args) -> serial or parallel build ----------------------------------
rmsnorm_kernel = Kernel(_rmsnorm_kernel)
add_rmsnorm_kernel = Kernel(_add_rmsnorm_kernel)
rope_kernel = Kernel(_rope_kernel)
kv_write_kernel = Kernel(_kv_write_kernel)
silu_mul_kernel = Kernel(_silu_mul_kernel, fastmath={"contract"})


# ---- int8 weight-only kernels (rawinfer/quant.py): float32 activations, dequantized on the fly ----
# fastmath: contract (fma) only. The dot products are reductions.py's fixed-order dot_i8, not loops
# LLVM may reassociate: with reassociation, the copy of a parallel build a process compiles and runs
# and the copy it caches for later processes may sum in different orders (attention.py's NOTE).
_OPTS = dict(cache=True, fastmath={"contract"})


@nb.njit(parallel=True, **_OPTS)
def rows_matmul_kernel(x, w, scale, out):
    # out[T, N] = (x[T, K] @ w[N, K]^T) * scale[N] for a few rows T (x, w C-contiguous): each thread
    # streams a contiguous range of rows of the int8 weights w once, for every row of x.
    T = x.shape[0]
    N = w.shape[0]
    for n in nb.prange(N):
        s = scale[n]
        for t in range(T):
            out[t, n] = dot_i8(x[t], w[n]) * s


@nb.njit(parallel=True, **_OPTS)
def rows_matmul_silu_kernel(x, w, scale, out):
    # out[T, F] = silu(x @ Wg^T * sg) * (x @ Wu^T * su) for a few rows T of a gate_up weight w = [Wg; Wu]
    # (int8 [2F, K], scales [2F]): each item streams gate row n and up row F + n and writes only their
    # product, one parallel region instead of two (rows_matmul_kernel, then silu_mul) and no [T, 2F]
    # store.
    T = x.shape[0]
    F = w.shape[0] // 2
    for n in nb.prange(F):
        sg, su = scale[n], scale[F + n]
        wg, wu = w[n], w[F + n]
        for t in range(T):
            g = dot_i8(x[t], wg) * sg
            u = dot_i8(x[t], wu)
            out[t, n] = g / (np.float32(1.0) + fast_exp(-g)) * (u * su)


@nb.njit(parallel=True, **_OPTS)
def int8_dequant_rows_kernel(q, scale, n0, out):
    # out[R, K] = q[n0:n0+R] * scale[n0:n0+R, None]   (a float32 tile for a BLAS GEMM)
    R, K = out.shape
    for r in nb.prange(R):
        s = scale[n0 + r]
        for k in range(K):
            out[r, k] = np.float32(q[n0 + r, k]) * s


@nb.njit(**_OPTS)
def int8_embedding_kernel(ids, q, scale, out):
    # out[T, C] = q[ids] * scale[ids, None]
    T, C = out.shape
    for t in range(T):
        i = ids[t]
        s = scale[i]
        for c in range(C):
            out[t, c] = np.float32(q[i, c]) * s
