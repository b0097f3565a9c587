"""The row-invariant float32 GEMM (backend/cpu/fgemm.py): exactly the arithmetic its docstring states
(16 lanes of fma chains, then a fixed tree), emulated here in NumPy, on shapes that are not multiples
of the lane count or the tile; a row's bits the same alone and in any batch, over any thread split."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import fgemm

pytestmark = pytest.mark.skipif(not fgemm.available(), reason="the float32 tiles need AVX2 and FMA")
RNG = np.random.default_rng(7)


def emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out[m, n] by the stated order: lane l accumulates fma(x[m, 16j + l], w[n, 16j + l], a[l]) over the
    chunks j (zeros past K), then (a[:8] + a[8:]), (.. [:4] + .. [4:]), ... in float32. An fma is the
    exact product plus the accumulator rounded once: the product of two float32 is exact in the
    64-bit significand of long double, and the sum rounds there before rounding to float32 (a double
    rounding that differs from a single one with probability ~2^-40 per operation)."""
    M, K = x.shape
    N = w.shape[0]
    Kp = -(-K // 16) * 16
    xp = np.zeros((M, Kp), np.float32)
    xp[:, :K] = x
    wp = np.zeros((N, Kp), np.float32)
    wp[:, :K] = w
    a = np.zeros((M, N, 16), np.float32)
    for j in range(Kp // 16):
        prod = xp[:, None, 16 * j:16 * j + 16].astype(np.longdouble) * wp[None, :, 16 * j:16 * j + 16].astype(np.longdouble)
        a = (prod + a.astype(np.longdouble)).astype(np.float32)
    n = 16
    while n > 1:
        a = a[..., :n // 2] + a[..., n // 2:n]
        n //= 2
    return a[..., 0]


@pytest.mark.parametrize("M,K,N", [(1, 64, 3), (1, 15, 7), (1, 576, 960), (2, 576, 130), (5, 100, 1000),
                                   (13, 33, 17), (64, 576, 96), (97, 150, 45), (200, 17, 9),
                                   # K past fgemm._K_SPLIT: slices of 768 with the accumulators carried
                                   (6, 1536, 20), (9, 1030, 13), (100, 2100, 7), (1, 1539, 9)])
def test_fgemm_is_the_stated_arithmetic(M, K, N):
    x = RNG.standard_normal((M, K), dtype=np.float32) * RNG.uniform(0.01, 100, (M, 1)).astype(np.float32)
    w = RNG.standard_normal((N, K), dtype=np.float32)
    want = emulate(x, w)
    for parts in (1, 2, 3):
        out = np.full((M, N), np.nan, np.float32)
        fgemm.matmul_nt(x, w, out, parts)
        assert np.array_equal(out, want), (parts, np.abs(out - want).max())
    np.testing.assert_allclose(want, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4,
                               atol=1e-4 * np.abs(x).max() * np.sqrt(K))


def test_a_row_has_the_same_bits_alone_and_in_any_batch():
    """Row 0 of x alone (the one-row tile), inside 2..130 rows (the register-block tile, rows in every
    position of a tile and of the 96-row passes), and the weight rows split over 1-4 threads."""
    K, N = 1536, 579
    x = RNG.standard_normal((130, K), dtype=np.float32)
    w = RNG.standard_normal((N, K), dtype=np.float32)
    alone = np.empty((1, N), np.float32)
    fgemm.matmul_nt(x[:1].copy(), w, alone, 1)
    for M in (2, 3, 4, 5, 7, 96, 97, 130):
        for parts in (1, 2, 4):
            for first in (0, M // 2, M - 1):                      # where the row sits in the batch
                xb = x[:M].copy()
                xb[[0, first]] = xb[[first, 0]]
                out = np.empty((M, N), np.float32)
                fgemm.matmul_nt(xb, w, out, parts)
                assert np.array_equal(out[first], alone[0]), (M, parts, first)


def test_zero_and_special_values():
    x = np.zeros((3, 40), np.float32)
    x[1, 5] = np.inf
    x[2, 7] = np.nan
    w = RNG.standard_normal((5, 40), dtype=np.float32)
    out = np.empty((3, 5), np.float32)
    fgemm.matmul_nt(x, w, out, 2)
    assert np.array_equal(out[0], np.zeros(5, np.float32))
    assert np.array_equal(np.isinf(out[1]), np.isinf(x[1] @ w.T)) and np.isnan(out[2]).all()
