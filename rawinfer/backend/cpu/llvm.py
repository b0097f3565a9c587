"""AVX2 building blocks of the CPU backend, written in LLVM IR (llvmlite) as Numba intrinsics.

Numba compiles loops well when LLVM can vectorize them by itself; the inner loops it cannot shape
the way the hardware wants are written here instead, each one a straight-line block over registers:

    int_gemm_tiles[R]    R x 16 int32 tile of an integer GEMM (R = 2, 4, 6 rows of a 6-row panel): per k
                         pair, 2R vpmaddwd + 2R vpaddd (qgemm.py has the layout and the drivers); built for
                         any CPU: madd_pairs is vpmaddwd with AVX2, else the same sums in generic IR
    dot_rows4            scores of 4 K rows against up to 3 query heads at once: one float32
                         accumulator register per (head, row), each K row loaded (and converted from
                         float16) once for all heads, reduced by a transposing horizontal add (a loop
                         over rows with a reduction each pays a horizontal sum per row)
    axpy_rows32          o[g, 0:32] += sum_r p[g, r] * v[r, 0:32] for up to 3 heads, o held in registers
                         across the rows (a vectorized loop over d would load and store o for every row)
    prefetch[_l2]        prefetcht0 over a byte range (the next KV block while this one is scored); prefetcht1,
                         not into L1 (fgemm's next weight tile, while L1 holds this one)
    abs_max              max |x| over a float32 row, 8 lanes at a time (the activation quantizer's scale)
    keep_alive           nothing at run time: keeps an array read through its raw address alive

dot_rows4 and axpy_rows32 come in builds per head count (1..HEADS_MAX) and row type (ELEMS): float32
rows, float16 rows (the float16 KV cache) and int8 rows (the int8 KV cache) converted as they are
loaded; the int8 builds also take the rows' scales and apply them to the 4 scores / to the weights
p[g, r], one multiply per row instead of one per element. Arguments are raw addresses
(int64) and element counts: Numba releases an array after its last use by name, which for
`np.int64(a.ctypes.data)` comes before the block reads it, so a kernel that allocates an array and
hands a block its address calls keep_alive(a) after the block's last read (arguments of the kernel
are kept alive by its caller). `available()` is False where the CPU Numba compiles for (isa.py)
lacks AVX2 or FMA (or is not x86-64): callers then take their plain Numba loops (the integer GEMM's tile
and q4.py's kernel excepted: they are built for any CPU through madd_pairs). Prefill attention
stays on OpenBLAS (blas.py): these blocks are shaped for decode's few query rows, and variants built
on them for prefill's long query runs lost to sgemm (docs/kernels.md).

NOTE: compiled kernels that call these carry their own copy, and Numba's disk cache only checks the
caller's file: cache.refresh() (called once by the CPU backend when it starts) drops cached kernels
built from older sources of any file in rawinfer/backend/cpu/.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.isa import FEATURES as _FEATURES
from rawinfer.backend.cpu.half import F16C as _F16C

_AVX2 = {"avx2", "fma"} <= _FEATURES


def available() -> bool:
    """AVX2 and FMA on the CPU Numba compiles for (isa.py): these blocks may be used."""
    return _AVX2


def has_f16c() -> bool:
    """Hardware float16 <-> float32 conversion (vcvtph2ps / vcvtps2ph), which the q4 GEMM's block scales
    use; scalar conversions elsewhere work without it (half.py)."""
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


def _fma(builder, ty=V8F32):
    """LLVM's fma intrinsic for float32 `ty`: a vector type (default <8 x float>) or F32."""
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    return builder.module.declare_intrinsic(name, (), ir.FunctionType(ty, [ty] * 3))


def mul_add(builder, ty):
    """The a * b + c of the blocks built for any CPU (float32 `ty`, a vector type): one fma where the CPU
    has AVX2 + FMA, else llvm.fmuladd, a product and a sum there (llvm.fma would be a libm call per lane)."""
    if _AVX2:
        return _fma(builder, ty)
    return builder.module.declare_intrinsic(f"llvm.fmuladd.v{ty.count}f32", (), ir.FunctionType(ty, [ty] * 3))


@intrinsic
def keep_alive(typingctx, a):
    """Nothing, at run time: a use of `a` by name, so that Numba releases it no earlier than here."""
    def codegen(context, builder, signature, args):
        return context.get_dummy_value()
    return types.none(a), codegen


ELEMS = ("f32", "f16", "i8")   # row element types of the attention blocks (KV cache dtypes)
_ELEM_IR = {"f32": F32, "f16": F16, "i8": I8}


def _load_f32x8(builder, base, index, elem: str):
    """8 floats from element `index` of `base`, a row of `elem` (ELEMS): float32 as they are, float16
    converted (vcvtph2ps), int8 sign-extended and converted (vpmovsxbd + vcvtdq2ps; the row's scale is
    the caller's to apply)."""
    if elem == "f16":
        return builder.fpext(_vload(builder, base, index, V8F16, align=2), V8F32)
    if elem == "i8":
        return builder.sitofp(_vload(builder, base, index, ir.VectorType(I8, 8), align=1), V8F32)
    return _vload(builder, base, index, V8F32)


# ---- integer GEMM tile ------------------------------------------------------------------------------
GEMM_ROWS, GEMM_COLS = 6, 16


def madd_pairs(builder):
    """(a, b) -> vpmaddwd of two <16 x i16> (int32 lane j = a[2j] b[2j] + a[2j + 1] b[2j + 1]): AVX2's
    instruction where the CPU has it, else the same sums in generic vector IR (products in int32, then
    even lanes plus odd ones), which LLVM compiles for any CPU (SSE2's pmaddwd on x86-64)."""
    if _AVX2:
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", (), ir.FunctionType(V8I32, [V16I16, V16I16]))
        return lambda a, b: builder.call(fn, [a, b])
    v16i32, idx = ir.VectorType(I32, 16), ir.VectorType(I32, 8)

    def madd(a, b):
        p = builder.mul(builder.sext(a, v16i32), builder.sext(b, v16i32))
        return builder.add(builder.shuffle_vector(p, p, ir.Constant(idx, list(range(0, 16, 2)))),
                           builder.shuffle_vector(p, p, ir.Constant(idx, list(range(1, 16, 2)))))
    return madd


def _make_int_gemm_tile(R: int):
    """The tile below computing only the first R rows of the 6-row panel (R accumulator rows)."""
    @intrinsic
    def int_gemm_tile(typingctx, xp, wp, kpairs, op, ldo, rows, sxp, swp):
        sig = types.void(*([types.int64] * 8))

        def codegen(context, builder, signature, args):
            _int_gemm_tile_code(builder, R, args)
            return context.get_dummy_value()
        return sig, codegen
    return int_gemm_tile


def _int_gemm_tile_code(builder, R, args):
    """out[r, 0:16] = sx[r] * sw[0:16] * (x panel row r . w block) for r < min(rows, R). xp -> int16
    panel [kpairs, 6, 2]; wp -> int8 block [kpairs, 16, 2]; op -> float32 out (row stride ldo floats);
    sxp -> float32 [6] row scales; swp -> float32 [16] column scales."""
    xp, wp, kpairs, op, ldo, rows, sxp, swp = args
    C = GEMM_COLS // 8
    madd = madd_pairs(builder)
    xb = _ptr(builder, xp, I32)                    # one int32 = the k pair of one row
    wb = _ptr(builder, wp, V16I8)                  # one <16 x i8> = 8 columns x one k pair

    def step(kp, accs):
        wrow = builder.gep(wb, [builder.mul(kp, i64(C))])
        wv = [builder.sext(builder.load(builder.gep(wrow, [i64(c)]), align=1), V16I16) for c in range(C)]
        xrow = builder.gep(xb, [builder.mul(kp, i64(GEMM_ROWS))])
        new = []
        for r in range(R):
            xv = builder.bitcast(splat(builder, builder.load(builder.gep(xrow, [i64(r)]), align=2), V8I32),
                                 V16I16)
            for c in range(C):
                new.append(builder.add(accs[r * C + c], madd(xv, wv[c])))
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


# int_gemm_tiles[R] for R = 2, 4, 6: a panel's last rows (M % 6) cost only the rows computed: with 64
# sequences the 11th panel holds 4 rows, a third of its vpmaddwd spent on zeros with one 6-row build.
int_gemm_tiles = {R: _make_int_gemm_tile(R) for R in (2, 4, GEMM_ROWS)}


# ---- attention blocks -------------------------------------------------------------------------------
HEADS_MAX = 3   # query heads one block call serves: 3 x 4 accumulators + operands fit the 16 ymm registers


def _hadd(builder, a, b):
    hadd = builder.module.declare_intrinsic("llvm.x86.avx.hadd.ps.256", (),
                                            ir.FunctionType(V8F32, [V8F32, V8F32]))
    return builder.call(hadd, [a, b])


def _hsum4(builder, vs):
    """4 vectors <8 x float> -> <4 x float> whose lane j is the sum of vs[j]'s lanes."""
    h = _hadd(builder, _hadd(builder, vs[0], vs[1]), _hadd(builder, vs[2], vs[3]))
    # h: lane j (j < 4) sums vs[j]'s low half, lane 4 + j its high half
    idx = ir.VectorType(I32, 4)
    lo = builder.shuffle_vector(h, h, ir.Constant(idx, [0, 1, 2, 3]))
    hi = builder.shuffle_vector(h, h, ir.Constant(idx, [4, 5, 6, 7]))
    return builder.fadd(lo, hi)


def _row_ptrs(builder, base, n, stride):
    """Pointers to rows 0..n-1 of a matrix at `base` with a stride of `stride` elements."""
    return [builder.gep(base, [builder.mul(i64(i), stride)]) for i in range(n)]


def _make_dot_rows4(heads: int, elem: str):
    @intrinsic
    def dot_rows4(typingctx, qp, qld, kp, ld, chunks, sp, sld, scp):
        """s[g, r] = q[g] . k[r] for r < 4, g < heads: each k row is loaded (and converted) once for
        all heads. qp -> float32 q rows [heads, >= 8 * chunks] with a stride of qld elements; kp -> k rows
        (of the build's element type, ELEMS) with a stride of ld elements; sp -> float32 s [heads,
        >= 4] with a stride of sld elements; scp -> the 4 rows' float32 scales (int8 builds: s[g, r]
        is times scale[r]; the others ignore it)."""
        sig = types.void(*([types.int64] * 8))

        def codegen(context, builder, signature, args):
            qp, qld, kp, ld, chunks, sp, sld, scp = args
            fma = _fma(builder)
            qb, kb, sb = _ptr(builder, qp, F32), _ptr(builder, kp, _ELEM_IR[elem]), _ptr(builder, sp, F32)
            qrows, krows = _row_ptrs(builder, qb, heads, qld), _row_ptrs(builder, kb, 4, ld)

            def step(c, accs):
                off = builder.mul(c, i64(8))
                new = list(accs)
                for r in range(4):
                    kv = _load_f32x8(builder, krows[r], off, elem)
                    for g in range(heads):
                        new[g * 4 + r] = builder.call(fma, [_vload(builder, qrows[g], off, V8F32), kv,
                                                            accs[g * 4 + r]])
                return new

            fin = counted_loop(builder, chunks, [ir.Constant(V8F32, [0.0] * 8)] * (4 * heads), step)
            scales = _vload(builder, _ptr(builder, scp, F32), i64(0), ir.VectorType(F32, 4)) if elem == "i8" else None
            for g in range(heads):
                sums = _hsum4(builder, fin[4 * g:4 * g + 4])
                _vstore(builder, sums if scales is None else builder.fmul(sums, scales), sb, builder.mul(i64(g), sld))
            return context.get_dummy_value()

        return sig, codegen
    return dot_rows4


def _make_axpy_rows32(heads: int, elem: str):
    @intrinsic
    def axpy_rows32(typingctx, pp, pld, vp, rows, ld, op, old, scp):
        """o[g, 0:32] += sum_{r < rows} p[g, r] * v[r, 0:32] for g < heads, with o held in registers
        across the rows and each v row loaded (and converted) once for all heads. pp -> float32 p [heads,
        >= rows] with a stride of pld elements; vp -> v rows (of the build's element type, ELEMS) with
        a stride of ld elements; op -> float32 o [heads, >= 32] with a stride of old elements; scp -> the
        rows' float32 scales (int8 builds: p[g, r] is taken times scale[r]; the others ignore it)."""
        sig = types.void(*([types.int64] * 8))

        def codegen(context, builder, signature, args):
            pp, pld, vp, rows, ld, op, old, scp = args
            fma = _fma(builder)
            pb, vb, ob = _ptr(builder, pp, F32), _ptr(builder, vp, _ELEM_IR[elem]), _ptr(builder, op, F32)
            prows, orows = _row_ptrs(builder, pb, heads, pld), _row_ptrs(builder, ob, heads, old)
            init = [_vload(builder, orows[g], i64(8 * u), V8F32) for g in range(heads) for u in range(4)]

            scb = _ptr(builder, scp, F32)

            def step(r, accs):
                row = builder.gep(vb, [builder.mul(r, ld)])
                ps = [builder.load(builder.gep(prows[g], [r]), align=4) for g in range(heads)]
                if elem == "i8":
                    sc = builder.load(builder.gep(scb, [r]), align=4)
                    ps = [builder.fmul(p, sc) for p in ps]
                ps = [splat(builder, p, V8F32) for p in ps]
                new = list(accs)
                for u in range(4):
                    v = _load_f32x8(builder, row, i64(8 * u), elem)
                    for g in range(heads):
                        new[g * 4 + u] = builder.call(fma, [ps[g], v, accs[g * 4 + u]])
                return new

            fin = counted_loop(builder, rows, init, step)
            for g in range(heads):
                for u in range(4):
                    _vstore(builder, fin[g * 4 + u], orows[g], i64(8 * u))
            return context.get_dummy_value()

        return sig, codegen
    return axpy_rows32


def prefetch_line(builder, ptr, locality: int = 3) -> None:
    """Emit one read prefetch of the cache line holding `ptr` (any pointer type), LLVM's locality hint
    `locality` (3: into every cache level, prefetcht0; 2: not L1, prefetcht1). A hint: never a fault."""
    i8p = ir.IntType(8).as_pointer()
    fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]))
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])


def _make_prefetch(locality: int):
    @intrinsic
    def prefetch(typingctx, addr, nbytes):
        def codegen(context, builder, signature, args):     # prefetch_line over each 64-byte line
            addr, nbytes = args
            i8p = ir.IntType(8).as_pointer()

            def step(i, _):
                prefetch_line(builder, builder.inttoptr(builder.add(addr, builder.mul(i, i64(64))), i8p), locality)
                return []

            counted_loop(builder, builder.sdiv(builder.add(nbytes, i64(63)), i64(64)), [], step)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen
    return prefetch


# Ask the CPU to bring [addr, addr + nbytes) into its caches: prefetch into L1 (and the levels below),
# prefetch_l2 not into L1. Hints: they never fault, whatever the address.
prefetch = _make_prefetch(3)
prefetch_l2 = _make_prefetch(2)


# dot_rows4[elem][heads] and axpy_rows32[elem][heads] for elem in ELEMS, 1 <= heads <= HEADS_MAX (index 0
# unused)
dot_rows4 = {e: [None] + [_make_dot_rows4(h, e) for h in range(1, HEADS_MAX + 1)] for e in ELEMS}
axpy_rows32 = {e: [None] + [_make_axpy_rows32(h, e) for h in range(1, HEADS_MAX + 1)] for e in ELEMS}


# ---- reductions ---------------------------------------------------------------------------------------
@intrinsic
def abs_max(typingctx, addr, n):
    """max |x[j]| over the n float32 values at addr (0 when n == 0; NaNs are skipped, as by
    `m = a if a > m else m`). Eight lanes at a time in generic vector IR: the plain Numba loop stays
    scalar (LLVM vectorizes a select-based max only under no-NaN math)."""
    sig = types.float32(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        addr, n = args
        base = _ptr(builder, addr, F32)
        fabs8 = builder.module.declare_intrinsic("llvm.fabs.v8f32", (), ir.FunctionType(V8F32, [V8F32]))
        fabs1 = builder.module.declare_intrinsic("llvm.fabs.f32", (), ir.FunctionType(F32, [F32]))

        def bigger(m, v):
            return builder.select(builder.fcmp_ordered(">", v, m), v, m)

        chunks = builder.sdiv(n, i64(8))
        vmax, = counted_loop(builder, chunks, [ir.Constant(V8F32, [0.0] * 8)], lambda c, m: [
            bigger(m[0], builder.call(fabs8, [_vload(builder, base, builder.mul(c, i64(8)), V8F32)]))])
        m = builder.extract_element(vmax, ir.Constant(I32, 0))
        for lane in range(1, 8):
            m = bigger(m, builder.extract_element(vmax, ir.Constant(I32, lane)))
        tail0 = builder.mul(chunks, i64(8))
        m, = counted_loop(builder, builder.sub(n, tail0), [m], lambda j, a: [
            bigger(a[0], builder.call(fabs1, [builder.load(builder.gep(base, [builder.add(tail0, j)]), align=4)]))])
        return m

    return sig, codegen
