"""Row-invariant products for the weights no GEMM of this CPU takes: float32 where fgemm.py cannot run
(no AVX2 + FMA) and q4 where neither the q4 GEMM nor the AVX2 matrix-vector kernel can (no AVX2).
(int8 has kernels.rows_matmul_kernel, the same shape.)

Each output element is one dot product of an x row with a weight row in reductions.py's fixed order
(vector lanes, a fixed fold, the tail; fma where the CPU has it, else a rounded product and sum), so
a row's bits do not depend on how many rows come with it: the backend (backend.py's linear,
products.py) sends every product of up to ROWS_MAX rows here (decode batches), and every product in the
batch-invariant mode, as fgemm.py takes float32 products elsewhere. Longer products (prompts) go to
BLAS, which is faster there and rounds by call shape.

    rows_matmul_f32   out[t, n] = x[t] . w[n]
    q4_rows_matmul    out[t, n] = x[t] . (row n of W dequantized: d q + m, q4.dequantize_rows, the
                      values the BLAS path's tiles hold)

Each thread walks a contiguous range of weight rows, once, against every row of x; a weight row (a
q4 one dequantized into the thread's buffer) stays in L1 across them.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawinfer.backend.cpu.fgemm import DEFAULT_MAX_ROWS as ROWS_MAX    # by default, up to fgemm's rows
from rawinfer.backend.cpu.q4 import dequantize_rows
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


@nb.njit(parallel=True, cache=True)
def q4_rows_matmul(x, lanes, dm, out, parts):
    """out[T, N] = x[T, K] @ W^T for q4 W (lanes = qs.view(np.uint16) [N, K/4], dm [N, K/32, 2] as uint16
    float16 bits), the N rows in `parts` contiguous ranges."""
    T, K = x.shape
    N = lanes.shape[0]
    for p in nb.prange(parts):
        row = np.empty((1, K), np.float32)
        for n in range(N * p // parts, N * (p + 1) // parts):
            dequantize_rows(lanes, dm, n, row)
            for t in range(T):
                out[t, n] = dot(x[t], row[0])
