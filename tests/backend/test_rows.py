"""The row-invariant fallback float32 product (rawinfer/backend/cpu/rows.py) against NumPy over several shapes,
ragged ones included, and the property it exists for: a row's bits do not depend on the rows beside
it or on the thread split. tools/test_portable.sh runs the engine on them (a CPU without AVX2)."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import rows as R

RNG = np.random.default_rng(17)
SHAPES = [(1, 16, 64), (3, 50, 64), (7, 33, 192), (40, 129, 576), (97, 64, 128)]    # (T, N, K)


@pytest.mark.parametrize("T,N,K", SHAPES)
def test_float32_rows_match_numpy(T, N, K):
    x = RNG.standard_normal((T, K)).astype(np.float32)
    w = RNG.standard_normal((N, K)).astype(np.float32)
    out = np.empty((T, N), np.float32)
    R.rows_matmul_f32(x, w, out, 2)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_split():
    T, N, K = 37, 80, 320
    x = RNG.standard_normal((T, K)).astype(np.float32)
    w = RNG.standard_normal((N, K)).astype(np.float32)
    run = (lambda xs, out, parts: R.rows_matmul_f32(xs, w, out, parts))
    batch = np.empty((T, N), np.float32)
    run(x, batch, 2)
    for t in (0, 5, T - 1):
        for parts in (1, 2, 7):
            alone = np.empty((1, N), np.float32)
            run(np.ascontiguousarray(x[t:t + 1]), alone, parts)
            assert np.array_equal(alone[0], batch[t]), (t, parts)
    for lo, hi in ((0, 1), (3, 9), (10, T)):
        part = np.empty((hi - lo, N), np.float32)
        run(np.ascontiguousarray(x[lo:hi]), part, 2)
        assert np.array_equal(part, batch[lo:hi])
