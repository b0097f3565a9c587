"""Elementwise math on 16 float32 lanes in LLVM IR, for the kernels written as IR (tileattn.py, the silu
epilogue of the int8, q4 and 8-bit-activation GEMMs), and the constants kernels.fast_exp shares with it.

    exp16        exp by kernels.fast_exp's steps: clamp to [EXP_MIN, EXP_MAX], x = n ln2 + r with
                 |r| <= ln2 / 2 (ln2 split in a high and a low part), exp(r) by its Taylor polynomial
                 to r^6, times 2^n built from its exponent bits; every multiply-add one fma
    silu_tile    out = silu(g) * u = g / (1 + exp(-g)) * u over a tile of up to 6 rows of 16 columns

Why here and not in Numba: a Numba loop vectorizes only where LLVM decides it may (aliasing, index
checks), and the GEMMs' silu epilogue, 16 columns at a time, stayed partly scalar. The IR is generic
vector IR: AVX-512 runs a 16-lane vector in one register, AVX2 in two halves, and both give the same
bits, since every lane takes the same IEEE operations in the same order.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.llvm import F32, I32, _ptr, _vload, _vstore, available, counted_loop, i64, mul_add

# fast_exp's constants (kernels.py uses them too)
EXP_MIN, EXP_MAX = -87.0, 88.0            # exp(-87) = 1.6e-38 still a normal float32; exp(88) < float32 max
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06     # ln 2 = hi + lo, hi exact in few bits
EXP_TAYLOR = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)   # r^6 ... r^0, Horner order

V16F32, V16I32 = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


def const16(v, ty=V16F32):
    """A 16-lane constant vector of v."""
    return ir.Constant(ty, [v] * ty.count)


def exp16(builder, x):
    """exp of the 16 float32 lanes of x (kernels.fast_exp's steps; every p * r + c one fma). Where the CPU
    has no FMA (or no AVX2: the portable builds) each is llvm.fmuladd, a product and a sum there, and
    the floor is taken through int32 (exact for the clamped range), since LLVM would make both calls
    to libm per lane."""
    fma_fn = mul_add(builder, V16F32)
    if available():
        floor_fn = builder.module.declare_intrinsic("llvm.floor.v16f32", (), ir.FunctionType(V16F32, [V16F32]))

        def floor(v):
            return builder.call(floor_fn, [v])
    else:
        def floor(v):
            t = builder.sitofp(builder.fptosi(v, V16I32), V16F32)            # toward zero
            return builder.fsub(t, builder.uitofp(builder.fcmp_ordered(">", t, v), V16F32))

    def fma(args):
        return builder.call(fma_fn, args)
    x = builder.select(builder.fcmp_ordered(">", x, const16(EXP_MIN)), x, const16(EXP_MIN))
    x = builder.select(builder.fcmp_ordered("<", x, const16(EXP_MAX)), x, const16(EXP_MAX))
    n = floor(fma([x, const16(LOG2E), const16(0.5)]))
    r = fma([n, const16(-LN2_HI), x])
    r = fma([n, const16(-LN2_LO), r])
    p = const16(EXP_TAYLOR[0])
    for coef in EXP_TAYLOR[1:]:
        p = fma([p, r, const16(coef)])
    two_n = builder.shl(builder.add(builder.fptosi(n, V16I32), const16(127, V16I32)), const16(23, V16I32))
    return builder.fmul(p, builder.bitcast(two_n, V16F32))


@intrinsic
def silu_tile(typingctx, gp, up, op, ldo, rows):
    """op[r * ldo + c] = silu(g) * u with g = gp[16 r + c], u = up[16 r + c] for c < 16, r < rows (float32
    raw addresses; ldo in floats). A kernel calling it must not be compiled with fast-math flags, which
    would fuse 1 + exp(-g) into the exp's last multiply differently on different builds."""
    def codegen(context, builder, signature, args):
        gp, up, op, ldo, rows = args
        gb, ub, ob = _ptr(builder, gp, F32), _ptr(builder, up, F32), _ptr(builder, op, F32)

        def row(r, _):
            g = _vload(builder, gb, builder.mul(r, i64(16)), V16F32)
            u = _vload(builder, ub, builder.mul(r, i64(16)), V16F32)
            e = exp16(builder, builder.fsub(const16(0.0), g))
            _vstore(builder, builder.fmul(builder.fdiv(g, builder.fadd(const16(1.0), e)), u), ob,
                    builder.mul(r, ldo))
            return []
        counted_loop(builder, rows, [], row)
        return context.get_dummy_value()
    return types.void(*([types.int64] * 5)), codegen
