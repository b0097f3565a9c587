"""Fixed-order reductions of float32 rows for the attention kernels (and of float32 x int8 rows for the
int8 matrix-vector kernels): dot products, sums and maxima whose every add is in this code's order, not
an optimizer's.

Why: the kernels that call them carry no fastmath reassociation. A parallel build's loop body exists
twice, as compiled and run in the process that compiled it and as linked again (and optimized again)
into the code Numba caches for the next process, and with reassoc + nsz LLVM vectorized the attention
kernels' sums differently in the two copies: the first process and every later one got different
last bits (docs/kernels.md, tests/backend/test_determinism.py). Written as vector IR, the order is
fixed and the loops are still vectorized.

The order: RED_LANES running values over the elements j = lane (mod RED_LANES), then the lanes folded
in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1), then the n % RED_LANES tail element by element. The int8 dot
product (row_dot_i8) keeps I8_LANES = 64 running values the same way (four vectors, so that four
independent fma chains hide the fma's latency in a product that streams one byte per multiply-add). Products are
fused (fma) where the CPU has FMA, else a multiply then an add: each machine has one order and one
rounding for them.
"""

from __future__ import annotations

import numba as nb
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.llvm import _AVX2, F32, I8, I32, _fma, _ptr, _vload, counted_loop, i64, keep_alive, splat

RED_LANES = 16
I8_LANES = 64


def _fold(builder, v, op):
    n = v.type.count
    while n > 1:
        half = n // 2
        idx = ir.VectorType(I32, half)
        lo = builder.shuffle_vector(v, v, ir.Constant(idx, list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(idx, list(range(half, n))))
        v = op(lo, hi)
        n = half
    return builder.extract_element(v, ir.Constant(I32, 0))


def _mul_add(builder, a, b, c):
    """a * b + c: one fma where the CPU has FMA, else a rounded product then a rounded sum."""
    if _AVX2:
        return builder.call(_fma(builder, a.type), [a, b, c])
    return builder.fadd(builder.fmul(a, b), c)


def _as_f32(builder, v):
    """Loaded values as float32: int8 ones (scalar or vector) converted, exactly."""
    if isinstance(v.type, ir.VectorType):
        return v if v.type.element == F32 else builder.sitofp(v, ir.VectorType(F32, v.type.count))
    return v if v.type == F32 else builder.sitofp(v, F32)


def _row_reduction(builder, n, ptrs, step, fold, init, lanes=RED_LANES):
    """The shared loop of the blocks below: vectors, fold, tail (the module docstring's order). step(acc,
    values) takes the running value(s) and the loaded element(s) of each pointer (float32 or int8, as
    float32), as vectors in the main loop and as scalars in the tail; fold(lo, hi) combines lanes."""
    chunks = builder.sdiv(n, i64(lanes))
    vinit = splat(builder, init, ir.VectorType(F32, lanes))

    def vec(p, c):
        return _as_f32(builder, _vload(builder, p, builder.mul(c, i64(lanes)), ir.VectorType(p.type.pointee, lanes),
                                       align=1 if p.type.pointee == I8 else 4))
    acc, = counted_loop(builder, chunks, [vinit], lambda c, accs: [step(accs[0], [vec(p, c) for p in ptrs])])
    total = _fold(builder, acc, fold)
    start = builder.mul(chunks, i64(lanes))
    total, = counted_loop(builder, builder.sub(n, start), [total], lambda j, accs: [
        step(accs[0], [_as_f32(builder, builder.load(builder.gep(p, [builder.add(start, j)]))) for p in ptrs])])
    return total


@intrinsic
def row_dot(typingctx, ap, bp, n):
    """sum of a[j] * b[j] for j < n (a, b: float32 addresses) in the module docstring's order."""
    def codegen(context, builder, signature, args):
        ap, bp, n = args
        ptrs = [_ptr(builder, ap, F32), _ptr(builder, bp, F32)]
        return _row_reduction(builder, n, ptrs, lambda acc, v: _mul_add(builder, v[0], v[1], acc), builder.fadd,
                              ir.Constant(F32, 0.0))
    return types.float32(types.int64, types.int64, types.int64), codegen


@intrinsic
def row_dot_i8(typingctx, ap, bp, n):
    """sum of a[j] * float(b[j]) for j < n (a: a float32 address, b: an int8 one), with I8_LANES running
    values (the module docstring's order)."""
    def codegen(context, builder, signature, args):
        ap, bp, n = args
        ptrs = [_ptr(builder, ap, F32), _ptr(builder, bp, I8)]
        return _row_reduction(builder, n, ptrs, lambda acc, v: _mul_add(builder, v[0], v[1], acc), builder.fadd,
                              ir.Constant(F32, 0.0), I8_LANES)
    return types.float32(types.int64, types.int64, types.int64), codegen


@intrinsic
def row_total(typingctx, ap, n):
    """sum of a[j] for j < n (a: a float32 address) in the module docstring's order."""
    def codegen(context, builder, signature, args):
        ap, n = args
        return _row_reduction(builder, n, [_ptr(builder, ap, F32)], lambda acc, v: builder.fadd(acc, v[0]),
                              builder.fadd, ir.Constant(F32, 0.0))
    return types.float32(types.int64, types.int64), codegen


@intrinsic
def row_max_of(typingctx, ap, n):
    """max of a[j] for j < n (a: a float32 address; -inf when n == 0; NaNs are passed over). Exact in
    any order; the vectors only make it fast."""
    def codegen(context, builder, signature, args):
        ap, n = args

        def bigger(x, y):
            return builder.select(builder.fcmp_ordered(">", y, x), y, x)
        return _row_reduction(builder, n, [_ptr(builder, ap, F32)], lambda acc, v: bigger(acc, v[0]), bigger,
                              ir.Constant(F32, float("-inf")))
    return types.float32(types.int64, types.int64), codegen


# ---- on arrays: contiguous float32 rows, kept alive across the read ----------------------------------
@nb.njit(inline="always")
def dot(a, b):
    """sum(a[c] * b[c]) over two contiguous float32 rows of equal length, in row_dot's fixed
    order (vector lanes, a fixed fold, the tail): the attention kernels carry no fastmath
    reassociation, so that every copy of their code rounds alike (the module docstring says why)."""
    s = row_dot(a.ctypes.data, b.ctypes.data, a.shape[0])
    keep_alive(a)                        # read through their addresses up to here
    keep_alive(b)
    return s


@nb.njit(inline="always")
def dot_i8(a, b):
    """sum(a[c] * float32(b[c])) over a contiguous float32 row and a contiguous int8 row of equal length,
    in row_dot_i8's fixed order."""
    s = row_dot_i8(a.ctypes.data, b.ctypes.data, a.shape[0])
    keep_alive(a)
    keep_alive(b)
    return s


@nb.njit(inline="always")
def row_sum(x, n):
    """sum(x[:n]) of a contiguous float32 row in row_total's fixed order."""
    s = row_total(x.ctypes.data, n)
    keep_alive(x)
    return s


@nb.njit(inline="always")
def row_max(x, n):
    """max(x[:n]) of a contiguous float32 row (-inf for n == 0), vectorized (row_max_of)."""
    m = row_max_of(x.ctypes.data, n)
    keep_alive(x)
    return m
