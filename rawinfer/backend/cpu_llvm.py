"""AVX2 building blocks of the CPU backend, written in LLVM IR (llvmlite) as Numba intrinsics.

Numba compiles loops well when LLVM can vectorize them by itself; three inner loops it cannot shape
the way the hardware wants are written here instead, each one a straight-line block over registers:

    int_gemm_tile_6x16   6 x 16 int32 tile of an integer GEMM: per k pair, 12 vpmaddwd + 12 vpaddd
                         (cpu_qgemm.py has the layout and the drivers)
    dot_rows8            8 dot products q . k[r] at once: one float32 accumulator register per row,
                         reduced together by a transposing horizontal add (a loop over rows with a
                         reduction each pays a horizontal sum per row)
    axpy_rows32          o[0:32] += sum_r p[r] * v[r, 0:32] with o held in 4 registers across the rows
                         (a vectorized loop over d would load and store o for every row)

    half_to_float,       float16 <-> float32 of one value held as its uint16 bits (Numba has no float16
    float_to_half        on the CPU); loops of them vectorize to vcvtph2ps / vcvtps2ph

dot_rows8 and axpy_rows32 come in two builds: float32 rows, and float16 rows (`_f16`, for the float16
KV cache) converted as they are loaded. Arguments are raw addresses (int64) and element counts.
`available()` is False where the host CPU lacks AVX2 or FMA (or is not x86-64): callers then take
their plain Numba loops.

Tried and dropped: prefill attention with S = Q K^T by dot_rows8 over each row's visible keys and
P V three query rows at a time: slower than OpenBLAS on the same shapes (4.6 vs 3.0 ms per layer for a
500-token prompt; dot_rows8 reaches ~42 GFLOP/s on one core, OpenBLAS's sgemm ~64 there).

NOTE: compiled kernels that call these carry their own copy, and Numba's disk cache only checks the
caller's file: cpu_cache.refresh() (run on import, below) drops cached kernels built from older
sources of any cpu*.py file.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import cpu_cache

cpu_cache.refresh()     # before any module that imports this one defines (and may load) a cached kernel


def _host_features() -> set[str]:
    try:
        import llvmlite.binding as llvm
        return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    except Exception:  # noqa: BLE001 - no feature query on this platform: take the portable paths
        return set()


_FEATURES = _host_features()
_AVX2 = {"avx2", "fma"} <= _FEATURES
_F16C = "f16c" in _FEATURES


def available() -> bool:
    return _AVX2


def has_f16c() -> bool:
    """Hardware float16 <-> float32 conversion (the float16 KV cache needs it: without it LLVM would
    call runtime helpers a JIT-compiled kernel cannot link)."""
    return _F16C


I8, I16, I32, I64, F32, F16 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType(),
                               ir.HalfType())
V8I32, V16I16, V16I8, V8F32, V8F16 = (ir.VectorType(I32, 8), ir.VectorType(I16, 16), ir.VectorType(I8, 16),
                                      ir.VectorType(F32, 8), ir.VectorType(F16, 8))


def i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), mask)


def counted_loop(builder, n, init: list, body) -> list:
    """for i in range(n): values = body(i, values); returns the final values (init when n <= 0)."""
    pre = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed(">", n, i64(0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    i.add_incoming(i64(0), pre)
    cur = []
    for v in init:
        p = builder.phi(v.type)
        p.add_incoming(v, pre)
        cur.append(p)
    new = body(i, cur)
    i_next = builder.add(i, i64(1))
    i.add_incoming(i_next, builder.block)
    for p, v in zip(cur, new):
        p.add_incoming(v, builder.block)
    end = builder.block
    builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
    builder.position_at_end(done)
    out = []
    for v0, v in zip(init, new):
        p = builder.phi(v0.type)
        p.add_incoming(v0, pre)
        p.add_incoming(v, end)
        out.append(p)
    return out


def _ptr(builder, addr, ty):
    return builder.inttoptr(addr, ty.as_pointer())


def _vload(builder, base, index, vty, align=4):
    """Load a vector of vty from element `index` of the scalar pointer `base` (unaligned)."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), vty.as_pointer()), align=align)


def _vstore(builder, value, base, index, align=4):
    builder.store(value, builder.bitcast(builder.gep(base, [index]), value.type.as_pointer()), align=align)


def _fma(builder):
    return builder.module.declare_intrinsic("llvm.fma.v8f32", (), ir.FunctionType(V8F32, [V8F32] * 3))


# ---- float16 ----------------------------------------------------------------------------------------
@intrinsic
def half_to_float(typingctx, bits):
    """float32 value of the float16 whose bits are the uint16 `bits` (exact)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], F16), F32)
    return types.float32(types.uint16), codegen


@intrinsic
def float_to_half(typingctx, x):
    """uint16 bits of float32 x rounded to float16 (to nearest even; beyond +-65504: +-inf)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], F16), I16)
    return types.uint16(types.float32), codegen


def _load_f32x8(builder, base, index, half: bool):
    """8 floats from element `index` of `base` (a float* or, for half, a half* converted on load)."""
    if half:
        return builder.fpext(_vload(builder, base, index, V8F16, align=2), V8F32)
    return _vload(builder, base, index, V8F32)


# ---- integer GEMM tile ------------------------------------------------------------------------------
GEMM_ROWS, GEMM_COLS = 6, 16


@intrinsic
def int_gemm_tile_6x16(typingctx, xp, wp, kpairs, op, ldo, rows, sxp, swp):
    """out[r, 0:16] = sx[r] * sw[0:16] * (x panel row r . w block) for r < rows. xp -> int16 panel
    [kpairs, 6, 2]; wp -> int8 block [kpairs, 16, 2]; op -> float32 out (row stride ldo floats);
    sxp -> float32 [6] row scales; swp -> float32 [16] column scales."""
    sig = types.void(*([types.int64] * 8))

    def codegen(context, builder, signature, args):
        xp, wp, kpairs, op, ldo, rows, sxp, swp = args
        R, C = GEMM_ROWS, GEMM_COLS // 8
        pmaddwd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (),
                                                   ir.FunctionType(V8I32, [V16I16, V16I16]))
        xb = _ptr(builder, xp, I32)                    # one int32 = the k pair of one row
        wb = _ptr(builder, wp, V16I8)                  # one <16 x i8> = 8 columns x one k pair

        def step(kp, accs):
            wrow = builder.gep(wb, [builder.mul(kp, i64(C))])
            wv = [builder.sext(builder.load(builder.gep(wrow, [i64(c)]), align=1), V16I16) for c in range(C)]
            xrow = builder.gep(xb, [builder.mul(kp, i64(R))])
            new = []
            for r in range(R):
                xv = builder.bitcast(splat(builder, builder.load(builder.gep(xrow, [i64(r)]), align=2), V8I32),
                                     V16I16)
                for c in range(C):
                    new.append(builder.add(accs[r * C + c], builder.call(pmaddwd, [xv, wv[c]])))
            return new

        fin = counted_loop(builder, kpairs, [ir.Constant(V8I32, [0] * 8)] * (R * C), step)
        ob, sxb = _ptr(builder, op, F32), _ptr(builder, sxp, F32)
        swb = _ptr(builder, swp, F32)
        swv = [_vload(builder, swb, i64(8 * c), V8F32) for c in range(C)]
        for r in range(R):
            with builder.if_then(builder.icmp_signed("<", i64(r), rows), likely=True):
                sv = splat(builder, builder.load(builder.gep(sxb, [i64(r)]), align=4), V8F32)
                for c in range(C):
                    f = builder.fmul(builder.fmul(builder.sitofp(fin[r * C + c], V8F32), sv), swv[c])
                    _vstore(builder, f, ob, builder.add(builder.mul(i64(r), ldo), i64(8 * c)))
        return context.get_dummy_value()

    return sig, codegen


# ---- attention blocks -------------------------------------------------------------------------------
def _hsum8(builder, vs):
    """8 vectors <8 x float> -> one vector whose lane j is the sum of vs[j]'s lanes."""
    hadd = builder.module.declare_intrinsic("llvm.x86.avx.hadd.ps.256", (),
                                            ir.FunctionType(V8F32, [V8F32, V8F32]))
    a = [builder.call(hadd, [vs[2 * i], vs[2 * i + 1]]) for i in range(4)]
    b0 = builder.call(hadd, [a[0], a[1]])     # lanes: sums of vs[0..3] over their low halves | high halves
    b1 = builder.call(hadd, [a[2], a[3]])     # the same for vs[4..7]
    idx = ir.VectorType(I32, 8)
    lo = builder.shuffle_vector(b0, b1, ir.Constant(idx, [0, 1, 2, 3, 8, 9, 10, 11]))
    hi = builder.shuffle_vector(b0, b1, ir.Constant(idx, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.fadd(lo, hi)


def _make_dot_rows8(half: bool):
    @intrinsic
    def dot_rows8(typingctx, qp, kp, ld, chunks, sp):
        """s[r] = q . k[r] for r in 0..7: qp -> float32 q[8 * chunks], kp -> rows (float32, or float16
        for the _f16 build) with a stride of ld elements, sp -> float32 s[8]."""
        sig = types.void(*([types.int64] * 5))

        def codegen(context, builder, signature, args):
            qp, kp, ld, chunks, sp = args
            fma = _fma(builder)
            qb, kb = _ptr(builder, qp, F32), _ptr(builder, kp, F16 if half else F32)
            rows = [builder.gep(kb, [builder.mul(i64(r), ld)]) for r in range(8)]

            def step(c, accs):
                off = builder.mul(c, i64(8))
                qv = _vload(builder, qb, off, V8F32)
                return [builder.call(fma, [qv, _load_f32x8(builder, rows[r], off, half), accs[r]])
                        for r in range(8)]

            fin = counted_loop(builder, chunks, [ir.Constant(V8F32, [0.0] * 8)] * 8, step)
            _vstore(builder, _hsum8(builder, fin), _ptr(builder, sp, F32), i64(0))
            return context.get_dummy_value()

        return sig, codegen
    return dot_rows8


def _make_axpy_rows32(half: bool):
    @intrinsic
    def axpy_rows32(typingctx, pp, vp, rows, ld, op):
        """o[0:32] += sum_{r < rows} p[r] * v[r, 0:32]: pp -> float32 p[rows], vp -> rows (float32, or
        float16 for the _f16 build) with a stride of ld elements, op -> float32 o[32]."""
        sig = types.void(*([types.int64] * 5))

        def codegen(context, builder, signature, args):
            pp, vp, rows, ld, op = args
            fma = _fma(builder)
            pb, vb = _ptr(builder, pp, F32), _ptr(builder, vp, F16 if half else F32)
            ob = _ptr(builder, op, F32)
            init = [_vload(builder, ob, i64(8 * u), V8F32) for u in range(4)]

            def step(r, accs):
                p = splat(builder, builder.load(builder.gep(pb, [r]), align=4), V8F32)
                row = builder.gep(vb, [builder.mul(r, ld)])
                return [builder.call(fma, [p, _load_f32x8(builder, row, i64(8 * u), half), accs[u]])
                        for u in range(4)]

            fin = counted_loop(builder, rows, init, step)
            for u in range(4):
                _vstore(builder, fin[u], ob, i64(8 * u))
            return context.get_dummy_value()

        return sig, codegen
    return axpy_rows32


dot_rows8, dot_rows8_f16 = _make_dot_rows8(False), _make_dot_rows8(True)
axpy_rows32, axpy_rows32_f16 = _make_axpy_rows32(False), _make_axpy_rows32(True)
