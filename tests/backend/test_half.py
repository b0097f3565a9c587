"""float16 <-> float32 in compiled code (rawinfer/backend/cpu/half.py): the build this CPU takes and the
integer build a CPU without F16C takes, both against NumPy's conversions, every bit. A build for a CPU
without F16C once lowered these to runtime calls it could not make (a q4 model printed garbage);
tools/test_portable.sh runs the engine built that way."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest

from rawinfer.backend.cpu import half as H

BUILDS = {"this CPU's": (H.half_to_float, H.float_to_half), "without F16C": (H.half_to_float_soft,
                                                                             H.float_to_half_soft)}


def _kernels(to_float, to_half):
    @nb.njit(cache=False)
    def h2f(bits, out):
        for i in range(bits.size):
            out[i] = to_float(bits[i])

    @nb.njit(cache=False)
    def f2h(x, out):
        for i in range(x.size):
            out[i] = to_half(x[i])
    return h2f, f2h


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _floats() -> np.ndarray:
    """Random values over every magnitude a half holds (and past it), every half exactly, its neighbours
    one float32 step either side, the midpoints between halves (ties: to even), and the edges."""
    rng = np.random.default_rng(5)
    halves = ALL_HALVES.view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    finite.sort()
    parts = [rng.standard_normal(200_000).astype(np.float32) * np.float32(s)
             for s in (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4, 6e4, 1e6)]
    parts += [finite, np.nextafter(finite, np.float32(np.inf)), np.nextafter(finite, np.float32(-np.inf)),
              (finite[:-1] + finite[1:]) / np.float32(2)]
    parts.append(np.array([65504, 65519.996, 65520, 65536, 1e30, np.inf, -np.inf, 0.0, -0.0, 2.0 ** -25,
                           2.0 ** -24, 3 * 2.0 ** -26, 1.5 * 2.0 ** -24, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25,
                           3.4e38, -3.4e38, 1e-45], np.float32))
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_half_to_float_is_exact_for_every_half(build):
    h2f, _ = _kernels(*BUILDS[build])
    got = np.empty(ALL_HALVES.size, np.float32)
    h2f(ALL_HALVES, got)
    want = ALL_HALVES.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))    # signed zeros too
    assert np.isnan(got[nan]).all()
    assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_float_to_half_rounds_like_numpy(build):
    _, f2h = _kernels(*BUILDS[build])
    x = _floats()
    got = np.empty(x.size, np.uint16)
    f2h(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, e.g. {x[bad[:4]]}: {got[bad[:4]]} vs {want[bad[:4]]}"
    x_nan = np.array([np.nan, -np.nan, np.float32(np.nan) * np.float32(-1)], np.float32)
    out = np.empty(3, np.uint16)
    f2h(x_nan, out)
    assert np.isnan(out.view(np.float16)).all()
    assert np.array_equal(np.signbit(out.view(np.float16)), np.signbit(x_nan))


def test_this_cpu_takes_the_hardware_conversion_where_it_has_f16c():
    """fpext / fptrunc on half (vcvtph2ps / vcvtps2ph) only where the target has F16C; the integer
    build has neither."""
    from rawinfer.backend.cpu import isa
    assert H.F16C == ("f16c" in isa.FEATURES)
    for build, hardware in (("this CPU's", H.F16C), ("without F16C", False)):
        h2f, f2h = _kernels(*BUILDS[build])
        h2f(ALL_HALVES[:4], np.empty(4, np.float32))
        f2h(np.zeros(4, np.float32), np.empty(4, np.uint16))
        code = "".join(h2f.inspect_llvm().values()) + "".join(f2h.inspect_llvm().values())
        assert ("fpext half" in code) == hardware and ("fptrunc float" in code) == hardware, build


def _vector_h2f(code):
    """A kernel converting 4 halves per step with `code` on <4 x i16> (how q4.py converts block scales)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def four(typingctx, src, dst):
        def codegen(context, builder, signature, args):
            vty = ir.VectorType(ir.IntType(16), 4)
            bits = builder.load(builder.inttoptr(args[0], vty.as_pointer()), align=2)
            builder.store(code(builder, bits), builder.inttoptr(args[1], ir.VectorType(ir.FloatType(), 4).as_pointer()),
                          align=4)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen

    @nb.njit(cache=False)
    def h2f(bits, out):
        for i in range(0, bits.size, 4):
            four(bits.ctypes.data + 2 * i, out.ctypes.data + 4 * i)
    return h2f


@pytest.mark.parametrize("code", ["half_to_float_ir", "_h2f_soft"])
def test_half_to_float_on_vectors_matches_the_scalar_build(code):
    got = np.empty(ALL_HALVES.size, np.float32)
    _vector_h2f(getattr(H, code))(ALL_HALVES, got)
    want = ALL_HALVES.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
