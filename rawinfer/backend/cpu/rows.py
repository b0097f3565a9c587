"""The row-invariant float32 product for a CPU where fgemm.py cannot run (no AVX2 + FMA). (int8 has
kernels.rows_matmul_kernel, the same shape, and q4 the matrix-vector kernel of q4.py, built for any CPU.)

Each output element is one dot product of an x row with a weight row in reductions.py's fixed order
(vector lanes, a fixed fold, the tail; fma where the CPU has it, else a rounded product and sum), so
a row's bits do not depend on how many rows come with it: the backend (backend.py's linear,
products.py) sends every product of up to ROWS_MAX rows here (decode batches), and every product in the
batch-invariant mode, as fgemm.py takes float32 products elsewhere. Longer products (prompts) go to
BLAS, which is faster there and rounds by call shape.

    rows_matmul_f32   out[t, n] = x[t] . w[n]

Each thread walks a contiguous range of weight rows, once, against every row of x; a weight row stays
in L1 across them.
"""

from __future__ import annotations

import numba as nb

from rawinfer.backend.cpu.fgemm import DEFAULT_MAX_ROWS as ROWS_MAX    # by default, up to fgemm's rows
from rawinfer.backend.cpu.reductions import dot


@nb.njit(parallel=True, cache=True)
def rows_matmul_f32(x, w, out, parts):
    """out[T, N] = x[T, K] @ w[N, K]^T (float32, C-contiguous), the N rows in `parts` contiguous ranges."""
    T = x.shape[0]
    N = w.shape[0]
    for p in nb.prange(parts):
        for n in range(N * p // parts, N * (p + 1) // parts):
            wn = w[n]
            for t in range(T):
                out[t, n] = dot(x[t], wn)
