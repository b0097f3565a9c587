"""Weight-only quantized products on CUDA: rawinfer/quant.py's "int8" (q[N, K] int8 rows) and "fp8" (q[N, K]
float8 e4m3fn bytes), each with scale[N] float32; a weight is q * scale.

CUDABackend owns one `WeightOnlyProducts`; its `linear` and `embedding` hand such a weight here.  The two
formats share every kernel: both are one byte a weight, read by common.cuh's weight_value, so the
kernels are templates over the weight type W (kernel_specs.weight_type names it from q's dtype):

- decode rows (T <= WO_GEMV_MAX_ROWS): wo_gemv_kernel (cuda/weight_only_linear.cu) reads every weight
  row once for all T rows, scale and bias applied to the float32 sums;
- more rows (prefill, large decode batches): wo_dequant_kernel writes a tile of weight rows as
  q * scale in the activation dtype into `scratch` (the pool's dequantization workspace, the float32
  buffer the CPU backend's int8 path uses too, viewed as the activation dtype), and the backend's one
  cuBLAS GEMM (backend.py's module docstring) multiplies x with the tile into out's columns of that tile;
- embedding lookups: wo_embedding_kernel (cuda/weight_only_embedding.cu) dequantizes the gathered rows.

Tiles of weight rows for the GEMM path:

    q [N, K]          tile j = rows [j * R, (j + 1) * R)  ->  scratch [R, K] (x's dtype)
    out [T, N]        columns [j * R, (j + 1) * R) of every row = x @ tile^T (ldc = N)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.launch import Launches, row_threads

WO_GEMV_MAX_ROWS = 8      # WO_GEMV_MAX_ROWS in cuda/weight_only_linear.cu: rows one GEMV launch serves
WO_GEMV_WARPS = 4         # WO_GEMV_WARPS there: output rows (one warp each) per block
OWN_TILE_ROWS = 8192      # rows of the tile buffer a call without scratch allocates


class WeightOnlyProducts:
    """CUDABackend's linear and embedding with an int8 or fp8 weight (anything with q [N, K] and scale [N])."""

    def __init__(self, launches: Launches, xp: Any):
        """launches: the backend's (launch.py); xp: numpy or cupy, for a tile buffer of its own."""
        self.launches, self.xp = launches, xp

    def linear(self, x, w, out, bias, scratch) -> None:
        """out[T, N] = x[T, K] @ (w.q * w.scale[:, None])^T (+ bias[N]); see the module docstring."""
        n, k, n_out = shapes.linear(x, tuple(w.shape), out, bias)
        wt = ks.weight_type(w.q.dtype)
        if w.scale.dtype != np.float32 or tuple(w.scale.shape) != (n_out,):
            raise ValueError(f"linear: a weight-only matrix's scale is [N] float32, got {w.scale.dtype} "
                             f"{tuple(w.scale.shape)}")
        if out.dtype not in (x.dtype, np.dtype(np.float32)):
            raise ValueError(f"linear: out ({out.dtype}) must have x's dtype ({x.dtype}) or be float32")
        if bias is not None and bias.dtype != out.dtype:
            raise ValueError(f"linear: bias ({bias.dtype}) must have out's dtype ({out.dtype})")
        if n == 0:
            return
        if n <= WO_GEMV_MAX_ROWS:
            self.launches.launch("wo_gemv_kernel", (wt, ks.element_type(x.dtype), ks.element_type(out.dtype)),
                                 (-(-n_out // WO_GEMV_WARPS),), (32 * WO_GEMV_WARPS,), 0,
                                 out, x, w.q, w.scale, out if bias is None else bias, n, n_out, k,
                                 int(bias is not None))
            return
        tiles = self._dequant_tiles(x.dtype, n_out, k, scratch)
        beta = 0.0
        if bias is not None:
            out[...] = bias[None, :]   # a plain copy of bits: exact for uint16-stored bf16 too
            beta = 1.0
        flat_out = out.reshape(-1)
        for n0 in range(0, n_out, tiles.shape[0]):
            rows = min(tiles.shape[0], n_out - n0)
            tile = tiles[:rows]
            self.launches.launch("wo_dequant_kernel", (wt, ks.element_type(x.dtype)), (rows,), (row_threads(k),), 0,
                                 tile, w.q[n0:n0 + rows], w.scale[n0:n0 + rows], k)
            # columns n0 .. n0 + rows of every row of out: out^T's rows n0.., leading dimension N
            self.launches.gemm(True, False, rows, n, k, tile, k, x, k, flat_out[n0:], n_out, beta)

    def _dequant_tiles(self, dtype, n_out: int, k: int, scratch):
        """A [R, K] buffer of x's dtype for the dequantized tiles: a view of scratch (the pool's float32
        dequantization workspace) where one is given, else a fresh array (tests; the engine always
        passes its workspace, so nothing is allocated while it serves)."""
        if scratch is None:
            return self.xp.empty((min(n_out, OWN_TILE_ROWS), k), dtype)
        if scratch.dtype != np.float32 or scratch.ndim != 1:
            raise ValueError(f"linear: scratch must be a flat float32 buffer, got {scratch.dtype} {scratch.shape}")
        elems = scratch.size * 4 // np.dtype(dtype).itemsize
        rows = min(n_out, elems // k)
        if rows < 1:
            raise ValueError(f"linear: scratch holds {scratch.size} floats, less than one weight row of {k}; "
                             "size it with exec/memory.py's dequant_scratch_size")
        return scratch.view(dtype)[:rows * k].reshape(rows, k)

    def embedding(self, ids, table, out, scale: float) -> None:
        """out[T, C] = (table.q[ids] * table.scale[ids, None]) * scale, in float32, rounded once to out's dtype."""
        n, hidden = shapes.embedding(ids, table.shape, out)
        if n:
            targs = (ks.weight_type(table.q.dtype), ks.element_type(out.dtype))
            self.launches.launch("wo_embedding_kernel", targs, (n,), (row_threads(hidden),), 0,
                                 out, ids, table.q, table.scale, hidden, scale)
