"""float16 <-> float32 of one value held as its uint16 bits, for compiled code (Numba has no float16 on the
CPU): the q4 weights' block scales (q4.py) and the float16 KV cache (kernels.py).

    half_to_float(bits)   exact
    float_to_half(x)      rounded to nearest even; beyond the largest half (65504, ties included): +-inf;
                          NaN: a quiet NaN of the same sign

Where the CPU Numba compiles for (isa.py) has F16C, they are LLVM's fpext / fptrunc, which loops
vectorize to vcvtph2ps / vcvtps2ph. Without F16C, LLVM would lower those to calls of runtime helpers
(__extendhfsf2, __truncsfhf2) that a JIT-compiled kernel does not link reliably: a build for such a CPU
crashed or read wrong scales (a q4 model printed garbage). There the conversions are written out in
integer and float32 operations instead (`*_soft`), which give the same values, every bit, as the
hardware (tests/backend/test_half.py checks every half and the rounding cases against NumPy); only a
NaN's payload may differ.

half -> float, h = sign | e (5 bits) | m (10 bits):
    e == 0     m * 2^-24 (zero or subnormal: exact in float32), then the sign
    e == 31    infinity or NaN: float32's all-ones exponent, m shifted up
    otherwise  exponent rebased by 127 - 15, m shifted up by 13
float -> half, a = |x| as bits:
    a >= 2^16            inf (or, past float32's infinity, a quiet NaN)
    a < 2^-14            float32(|x|) + 0.5: the sum's last bits are |x| rounded (to nearest even, by the
                         float32 addition) in steps of 2^-24, the half subnormal step; 0.5's bits off
    otherwise            exponent rebased, then + 0xfff + (bit 13 of a): a carry past bit 13 rounds up,
                         ties to even; the result's exponent may carry into inf (65520 and up)
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.isa import FEATURES as _FEATURES

F16C = "f16c" in _FEATURES
_I16, _I32, _F32, _F16 = ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.HalfType()


def _c(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


def _h2f_soft(builder, bits):
    # bits: i16, or a vector of them (every value converted alike, lane by lane)
    n = bits.type.count if isinstance(bits.type, ir.VectorType) else 0
    i32, f32 = (ir.VectorType(_I32, n), ir.VectorType(_F32, n)) if n else (_I32, _F32)

    def c(ty, v):
        return ir.Constant(ty, [v] * n if n else v)
    h = builder.zext(bits, i32)
    sign = builder.shl(builder.and_(h, c(i32, 0x8000)), c(i32, 16))
    ax = builder.and_(h, c(i32, 0x7FFF))
    e = builder.lshr(ax, c(i32, 10))
    up = builder.shl(ax, c(i32, 13))
    normal = builder.add(up, c(i32, 112 << 23))
    special = builder.or_(up, c(i32, 0x7F800000))
    tiny = builder.bitcast(builder.fmul(builder.sitofp(ax, f32), c(f32, 2.0 ** -24)), i32)
    mag = builder.select(builder.icmp_unsigned("==", e, c(i32, 0)), tiny,
                         builder.select(builder.icmp_unsigned("==", e, c(i32, 31)), special, normal))
    return builder.bitcast(builder.or_(mag, sign), f32)


def _f2h_soft(builder, x):
    u = builder.bitcast(x, _I32)
    sign = builder.and_(u, _c(-0x80000000))
    a = builder.xor(u, sign)
    big = builder.select(builder.icmp_unsigned(">", a, _c(0x7F800000)), _c(0x7E00), _c(0x7C00))
    half_bits = _c(126 << 23)                                  # 0.5
    summed = builder.fadd(builder.bitcast(a, _F32), builder.bitcast(half_bits, _F32))
    small = builder.sub(builder.bitcast(summed, _I32), half_bits)
    odd = builder.and_(builder.lshr(a, _c(13)), _c(1))
    rounded = builder.add(builder.add(a, _c(((15 - 127) << 23) + 0xFFF)), odd)
    normal = builder.lshr(rounded, _c(13))
    mag = builder.select(builder.icmp_unsigned(">=", a, _c(143 << 23)), big,
                         builder.select(builder.icmp_unsigned("<", a, _c(113 << 23)), small, normal))
    return builder.trunc(builder.or_(mag, builder.lshr(sign, _c(16))), _I16)


def _h2f_hw(builder, bits):
    if isinstance(bits.type, ir.VectorType):
        n = bits.type.count
        return builder.fpext(builder.bitcast(bits, ir.VectorType(_F16, n)), ir.VectorType(_F32, n))
    return builder.fpext(builder.bitcast(bits, _F16), _F32)


def _f2h_hw(builder, x):
    return builder.bitcast(builder.fptrunc(x, _F16), _I16)


def _make(code, to_float: bool):
    @intrinsic
    def conversion(typingctx, v):
        def codegen(context, builder, signature, args):
            return code(builder, args[0])
        return (types.float32(types.uint16) if to_float else types.uint16(types.float32)), codegen
    return conversion


half_to_float_ir = _h2f_hw if F16C else _h2f_soft     # the IR of half_to_float (i16 or a vector of i16)
half_to_float = _make(half_to_float_ir, True)
float_to_half = _make(_f2h_hw if F16C else _f2h_soft, False)
half_to_float_soft = _make(_h2f_soft, True)         # for the tests: the build a CPU without F16C takes
float_to_half_soft = _make(_f2h_soft, False)
