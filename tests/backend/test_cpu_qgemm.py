"""The integer GEMM of int8 models on the CPU (rawinfer/backend/cpu/qgemm.py) against NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu import qgemm as Q
from rawinfer.backend.cpu.backend import INT8_GEMV_MAX_ROWS, CPUBackend
from rawinfer.quant import Int8Weight, quantize_int8
from reference_ops import int8_linear_ref, int8_matmul_ref, quantize_rows_ref, silu_mul_ref

RNG = np.random.default_rng(11)

# Every integer-GEMM path (isa.py) gets the same reference tests; a path this CPU cannot run skips. The
# portable path is the AVX2 drivers built for a CPU without AVX2: tested where the build is that
# (tools/test_portable.sh), since elsewhere it is the AVX2 build again.
PATHS = [pytest.param(p, marks=pytest.mark.skipif(not isa.supports(p), reason=f"this CPU has no {p}"))
         for p in (isa.AVX2, isa.AVX512_VNNI)] + ([isa.PORTABLE] if isa.HOST == isa.PORTABLE else [])
GEMMS = {isa.AVX2: Q.gemm_packed, isa.AVX512_VNNI: Q.gemm_packed_512, isa.PORTABLE: Q.gemm_packed}


def unpack_x(xp: np.ndarray, M: int) -> np.ndarray:
    panels, kpairs = xp.shape[:2]
    return xp.transpose(0, 2, 1, 3).reshape(panels * Q.PANEL_ROWS, kpairs * 2)[:M].astype(np.int64)


def test_pack_weights_layout():
    q = RNG.integers(-127, 128, (32, 10)).astype(np.int8)
    wp = Q.pack_weights(q)
    assert wp.shape == (2, 5, 16, 2)
    for n in range(32):
        for k in range(10):
            assert wp[n // 16, k // 2, n % 16, k % 2] == q[n, k]
    with pytest.raises(ValueError, match="N % 16"):
        Q.pack_weights(np.zeros((24, 10), np.int8))


@pytest.mark.parametrize("M,K", [(1, 2), (6, 64), (7, 576), (13, 1536), (40, 30)])
def test_quantize_rows_matches_reference(M, K):
    x = RNG.standard_normal((M, K)).astype(np.float32) * RNG.uniform(0.01, 100, (M, 1)).astype(np.float32)
    x[M // 2] = 0.0                                           # a zero row gets scale 0 and zeros
    qmax = Q.act_qmax(K)
    want_q, want_s = quantize_rows_ref(x, qmax)
    for build in (Q.quantize_rows.serial, Q.quantize_rows.parallel):   # one panel is quantized serially
        xp = np.full(Q.packed_x_shape(M, K), 777, np.int16)  # garbage: padding rows must be cleared
        sx = np.full(xp.shape[0] * Q.PANEL_ROWS, 7.0, np.float32)
        build(x, qmax, xp, sx)
        np.testing.assert_array_equal(unpack_x(xp, M), want_q)
        np.testing.assert_array_equal(sx[:M], want_s)
        assert (unpack_x(xp, xp.shape[0] * Q.PANEL_ROWS)[M:] == 0).all() and (sx[M:] == 0).all()


def test_act_qmax_keeps_int32_sums_exact():
    for K in (2, 64, 576, 1536, 8192, 100000):
        qmax = Q.act_qmax(K)
        assert qmax * 128 * K <= 2 ** 31 - 1 and 1 <= qmax <= 32767
    assert Q.act_qmax(576) > 16000 and Q.act_qmax(1536) > 8000     # SmolLM2: >= 13 bits per activation


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K", [576, 1536])
def test_gemm_at_the_overflow_bound_is_exact(K, path):
    """Every activation at +-qmax and every weight at +-127: the largest sums the bound allows."""
    M, N = 7, 48                                               # 3 blocks: the AVX-512 one-block tile too
    qmax = Q.act_qmax(K)
    xq = np.full((M, K), qmax, np.int64)
    xq[1] = -qmax
    xq[2, ::2] = -qmax
    wq = np.full((N, K), 127, np.int8)
    wq[3] = -127
    wq[5, 1::3] = -127
    xp = np.zeros(Q.packed_x_shape(M, K), np.int16)
    panels = xp.reshape(xp.shape[0], K // 2, Q.PANEL_ROWS, 2)
    for m in range(M):
        panels[m // Q.PANEL_ROWS, :, m % Q.PANEL_ROWS, :] = xq[m].reshape(K // 2, 2)
    ones_x = np.ones(xp.shape[0] * Q.PANEL_ROWS, np.float32)
    out = np.empty((M, N), np.float32)
    GEMMS[path](xp, ones_x, Q.pack_weights(wq), np.ones(N, np.float32), out, M)
    want = xq @ wq.astype(np.int64).T
    assert np.abs(want).max() > 2 ** 30                       # the test reaches the int32 range
    np.testing.assert_array_equal(out.astype(np.float64), want.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("M,K,N", [(1, 2, 16), (5, 6, 32), (6, 100, 48), (7, 576, 960), (13, 30, 16),
                                   (100, 576, 1536), (97, 1536, 576), (8, 64, 32), (9, 30, 16), (64, 576, 960),
                                   (3, 64, 80), (1, 576, 49152)])
@pytest.mark.parametrize("path", PATHS)
def test_int8_matmul_matches_integer_reference(M, K, N, path):
    """Every last-panel size (M % 6 = 0..5 takes the 6-, 2-, 2-, 4-, 4-, 6-row tile builds; AVX-512 has a
    1-row build too) and odd and even counts of 16-column blocks (AVX-512 tiles take two). The GEMM equals the exact integer product of the quantized operands, scaled (up to float32
    rounding of the scaling), and the float product up to the activations' quantization step."""
    x = RNG.standard_normal((M, K)).astype(np.float32)
    q, sw = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    nx, ns = Q.x_buffer_sizes(M, K)
    out = np.full((M, N), np.nan, np.float32)
    Q.PATHS[path][0](x, Q.pack_weights(q), sw, out, np.empty(nx, np.int16), np.empty(ns, np.float32))
    exact = int8_matmul_ref(x, q, sw, Q.act_qmax(K))
    np.testing.assert_allclose(out, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())
    flt = int8_linear_ref(x, q, sw)
    assert np.abs(out - flt).max() <= 2e-4 * np.abs(flt).max()


@pytest.mark.parametrize("M,K,F", [(1, 2, 16), (7, 576, 48), (64, 576, 1536), (100, 30, 32), (13, 1536, 16)])
@pytest.mark.parametrize("path", PATHS)
def test_int8_matmul_silu_is_silu_of_gate_times_up(M, K, F, path):
    """The gate/up GEMM with silu * up in its epilogue equals the plain GEMM into [T, 2F] followed by
    silu_mul bit for bit (the same tiles, the same float32 expression), and the float reference up to
    the activations' quantization."""
    from rawinfer.backend.cpu import kernels as K_
    x = RNG.standard_normal((M, K)).astype(np.float32)
    q, sw = quantize_int8(RNG.standard_normal((2 * F, K)).astype(np.float32))
    wp = Q.pack_weights(q)
    nx, ns = Q.x_buffer_sizes(M, K)
    xb, sb = np.empty(nx, np.int16), np.empty(ns, np.float32)
    matmul, matmul_silu = Q.PATHS[path]
    fused = np.full((M, F), np.nan, np.float32)
    matmul_silu(x, wp, sw, fused, xb, sb)
    gu = np.empty((M, 2 * F), np.float32)
    matmul(x, wp, sw, gu, xb, sb)
    apart = np.empty((M, F), np.float32)
    K_.silu_mul_kernel(M, gu, apart)
    np.testing.assert_array_equal(fused, apart)
    ref = silu_mul_ref(int8_linear_ref(x, q, sw))
    assert np.abs(fused - ref).max() <= 1e-3 * np.abs(ref).max()


def test_backend_linear_silu_mul_takes_the_fused_gemm(monkeypatch):
    be = CPUBackend()
    T, K, F = 40, 64, 48
    q, scale = quantize_int8(RNG.standard_normal((2 * F, K)).astype(np.float32))
    w = be.prepare_weight(Int8Weight(q, scale))
    x = RNG.standard_normal((T, K)).astype(np.float32)
    calls = []
    real = Q.int8_matmul_silu
    monkeypatch.setattr(Q, "int8_matmul_silu", lambda *a: (calls.append(1), real(*a)))
    out, gu = np.empty((T, F), np.float32), np.empty((T, 2 * F), np.float32)
    be.linear_silu_mul(x, w, gu, out, scratch=np.empty(128 * K, np.float32))
    assert calls
    ref = np.empty_like(out)
    be.linear(x, w, gu, scratch=np.empty(128 * K, np.float32))
    be.silu_mul(gu, ref)
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="out"):
        be.linear_silu_mul(x, w, gu, np.empty((T, F + 1), np.float32), scratch=np.empty(128 * K, np.float32))


@pytest.mark.parametrize("T,K,F", [(1, 576, 1536), (INT8_GEMV_MAX_ROWS, 37, 24), (2, 1, 5), (3, 1536, 7)])
def test_few_rows_linear_silu_mul(T, K, F):
    """A few rows (decode) of an int8 gate/up product. With a packed copy (F a multiple of 16): the
    integer GEMM with silu * up in its epilogue, the same bits as these rows inside any larger batch.
    Without: rows_matmul_silu_kernel, silu * up straight from the int8 rows, agreeing with the two-pass
    matrix-vector product + silu_mul to float32 rounding (its dot products reassociate). At any K and
    F (not multiples of the vector width), with or without a workspace."""
    be = CPUBackend()
    q, scale = quantize_int8(RNG.standard_normal((2 * F, K)).astype(np.float32))
    w = be.prepare_weight(Int8Weight(q, scale))
    x = RNG.standard_normal((T, K)).astype(np.float32)
    gu = np.empty((T, 2 * F), np.float32)
    ref = np.empty((T, F), np.float32)
    be.linear(x, w, gu)
    be.silu_mul(gu, ref)
    for scratch in (None, np.empty(128 * K, np.float32)):
        out = np.full((T, F), np.nan, np.float32)
        be.linear_silu_mul(x, w, np.full_like(gu, np.nan), out, scratch=scratch)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    tol = 2e-4 if w.packed is not None else 1e-4          # the GEMM's activations are rounded to int16
    np.testing.assert_allclose(out, silu_mul_ref(int8_linear_ref(x, q, scale)), rtol=tol,
                               atol=(2e-4 if w.packed is not None else 1e-5) * np.abs(ref).max())
    if w.packed is not None:                              # batch invariance: the rows inside a batch of 9
        big = np.concatenate([RNG.standard_normal((9 - T, K)).astype(np.float32), x])
        out_big = np.empty((9, F), np.float32)
        be.linear_silu_mul(big, w, np.empty((9, 2 * F), np.float32), out_big, scratch=np.empty(128 * K, np.float32))
        np.testing.assert_array_equal(out_big[9 - T:], out)
    with pytest.raises(ValueError, match="out"):
        be.linear_silu_mul(x, w, gu, np.empty((T, F + 1), np.float32))


@pytest.mark.parametrize("T,K,N", [(INT8_GEMV_MAX_ROWS + 1, 64, 48), (40, 576, 960), (200, 34, 64)])
def test_backend_linear_uses_the_packed_weight(T, K, N, monkeypatch):
    be = CPUBackend()
    assert be.int_gemm
    q, scale = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    w = be.prepare_weight(Int8Weight(q, scale))
    assert w.packed is not None and w.q is q
    x = RNG.standard_normal((T, K)).astype(np.float32)
    bias = RNG.standard_normal(N).astype(np.float32)
    calls = []
    real = Q.int8_matmul
    monkeypatch.setattr(Q, "int8_matmul", lambda *a: (calls.append(1), real(*a)))
    out = np.empty((T, N), np.float32)
    be.linear(x, w, out, bias=bias, scratch=np.empty(128 * K, np.float32))
    assert calls
    ref = int8_linear_ref(x, q, scale, bias)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_shapes_outside_the_layout_and_the_switch_keep_the_float_path(monkeypatch):
    be = CPUBackend()
    q, scale = quantize_int8(RNG.standard_normal((40, 64)).astype(np.float32))   # 40 % 16 != 0
    assert be.prepare_weight(Int8Weight(q, scale)).packed is None
    q, scale = quantize_int8(RNG.standard_normal((32, 63)).astype(np.float32))   # odd K
    assert be.prepare_weight(Int8Weight(q, scale)).packed is None
    monkeypatch.setenv("RAWINFER_CPU_INT_GEMM", "0")             # read once, as EngineConfig's default
    from rawinfer.config import EngineConfig
    assert EngineConfig().cpu_int_gemm is False
    off = CPUBackend(int_gemm=EngineConfig().cpu_int_gemm)
    q, scale = quantize_int8(RNG.standard_normal((32, 64)).astype(np.float32))
    assert not off.int_gemm and off.prepare_weight(Int8Weight(q, scale)).packed is None
