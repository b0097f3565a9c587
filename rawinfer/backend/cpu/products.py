"""Products with quantized weights on the CPU (int8 rows, q4 blocks): which kernel computes x @ W^T for T
rows, and the buffers they share.

    int8 with a packed copy (made at load where the shape fits; on every CPU, qgemm.py builds for each):
         the integer GEMM (qgemm.py) for any number of rows, silu * up in its epilogue for the gate/up
         product. Every row is computed the same way whatever its batch: a request's tokens do not
         depend on what else runs.
    int8 and q4 with int8_activations (the engine's 8-bit-activation mode): the 8-bit-activation GEMM
         (a8gemm.py; q4 on a8q4tile.py's tiles) on its own packed copy for any number of rows, silu * up in
         its epilogue; the same invariance.
    int8 without one (RAWINFER_CPU_INT_GEMM=0, a shape the GEMM does not fit): the row-invariant kernels
         (kernels.rows_matmul_kernel) for up to rows.ROWS_MAX rows and, in the batch-invariant mode,
         for every row count; BLAS on dequantized row tiles above. On a CPU without AVX2 the
         row-invariant kernels for every row count.
    q4 with a packed copy (made at load where the shape fits): the q4 integer GEMM (q4gemm.py) for any
         number of rows, silu * up in its epilogue, so again a row's bits never depend on its batch.
    q4 without one: the matrix-vector kernel (q4.py: its AVX2 build, or without AVX2 its generic one) for
         the same rows as int8, BLAS on dequantized row tiles for the others.
    (float32 where fgemm.py cannot run, no AVX2 + FMA: rows.rows_matmul_f32 for up to ROWS_MAX rows or
         in the batch-invariant mode, BLAS above: backend.py.)

CPUBackend (backend.py) owns one `QuantizedProducts`, made with its settings, and hands it every product
with an int8 or q4 weight.
"""

from __future__ import annotations

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.cpu import a8gemm as cpu_a8gemm
from rawinfer.backend.cpu import a8q4tile as cpu_a8q4
from rawinfer.backend.cpu import blas as cpu_blas
from rawinfer.backend.cpu import kernels as K
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu import q4 as cpu_q4
from rawinfer.backend.cpu import q4gemm as cpu_q4gemm
from rawinfer.backend.cpu import qgemm as cpu_qgemm
from rawinfer.backend.cpu import rows as cpu_rows
from rawinfer.quant import Q4_BLOCK, Q4_SPAN as SPAN
from rawinfer.quant import Int8Weight, Q4Weight

INT8_GEMV_MAX_ROWS = 4  # int8 decode batches up to this many rows without a GEMM: the few-row fused kernel
INT8_TILE_ROWS = 128    # weight rows per dequantized tile (fits in L2)


def check_array(name: str, x, dtype=None, contiguous: bool = True) -> None:
    """What the kernels need of an argument beyond its shape (backend/shapes.py checks those): a NumPy
    array, of dtype where given, C-contiguous (kernels index raw rows). Cheap: it runs for every
    argument of every op of every step."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {x.dtype}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def q4_parts(w: Q4Weight) -> tuple[np.ndarray, np.ndarray]:
    """(nibbles, block scales as uint16 float16 bits): what the q4 kernels take, after checking that
    the pair is one quant.quantize_q4 makes (the kernels read it through raw addresses)."""
    N, Kd = w.shape
    if Kd % SPAN or w.dm.shape != (N, Kd // Q4_BLOCK, 2) or w.dm.dtype != np.float16:
        raise ValueError(f"a q4 weight of shape {w.shape} needs K % {SPAN} == 0 and float16 block scales "
                         f"[N, K/{Q4_BLOCK}, 2], got {w.dm.dtype} {w.dm.shape}; build it with quant.quantize_q4")
    return w.qs, w.dm.view(np.uint16)


class QuantizedProducts:
    """The int8 / q4 halves of CPUBackend's prepare_weight, linear and linear_silu_mul, and the integer
    GEMMs' activation buffers, which the backend's fused decode shares."""

    def __init__(self, *, int_gemm: bool, int8_activations: bool, one_attention: bool, blas_on_numba_pool: bool,
                 max_threads: int):
        """int_gemm, int8_activations, one_attention: CPUBackend's options of those names (packed copies for
        the integer GEMMs; 8-bit activations; the row-invariant kernels for every row count);
        blas_on_numba_pool: dequantized tiles on blas.py's Numba-pool BLAS, else np.matmul; max_threads:
        the parts blas.py splits a product into, whatever the current thread count."""
        self.int_gemm, self.int8_activations, self.one_attention = int_gemm, int8_activations, one_attention
        self.blas_on_numba_pool, self.max_threads = blas_on_numba_pool, max_threads
        self._qx = np.empty(0, np.int16)                   # activation buffers of the integer GEMM,
        self._qs = np.empty(0, np.float32)                 # grown to the largest batch seen
        self._qb = np.empty(0, np.float32)                 # (and the q4 GEMM's block sums)
        self._a8 = (np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.int32))   # a8gemm's

    def prepare_weight(self, w, head: bool = False):
        import dataclasses
        # 8-bit activations: every layer matrix on a8gemm (a step's fused decode call quantizes x one way
        # for all of them); an int8 LM head only where that is faster than qgemm (a8gemm.int8_gains():
        # vpdpbusd), for a third of a batched decode step on AVX2 without it is the head's product
        if isinstance(w, Int8Weight) and self.int8_activations and (cpu_a8gemm.int8_gains() or not head):
            if not cpu_a8gemm.supports(w.shape):
                raise ValueError(f"int8_activations needs int8 matrices [N, K] with N % {cpu_a8gemm.BLOCK_COLS} == 0 "
                                 f"and K % {cpu_a8gemm.KBLOCK} == 0; this model has one of {w.shape}: leave the "
                                 "option off for it")
            return dataclasses.replace(w, packed=cpu_a8gemm.pack_weights(w.q))
        if isinstance(w, Q4Weight) and self.int8_activations:
            if not cpu_a8q4.supports(w.shape):
                raise ValueError(f"int8_activations needs q4 matrices [N, K] with N % {cpu_a8q4.BLOCK_COLS} == 0 and "
                                 f"K % {SPAN} == 0; this model has one of {w.shape}: leave the option off for it")
            q4_parts(w)                              # checks the pair
            return dataclasses.replace(w, packed=cpu_a8q4.pack_q4(cpu_q4gemm.unpack_nibbles(w.qs), w.dm))
        if isinstance(w, Int8Weight) and self.int_gemm and cpu_qgemm.supports(w.shape):
            return dataclasses.replace(w, packed=cpu_qgemm.pack_weights(w.q))
        if isinstance(w, Q4Weight) and self.int_gemm and cpu_q4gemm.supports(w.shape):
            q4_parts(w)                              # checks the pair
            return dataclasses.replace(w, packed=cpu_q4gemm.pack_weights(w.qs, w.dm))
        return w

    def linear(self, x, w: Int8Weight | Q4Weight, out, scratch) -> None:
        """out = x @ W^T (shapes, x and out checked by CPUBackend.linear)."""
        if isinstance(w, Int8Weight):
            self._linear_int8(x, w, out, scratch)
        else:
            self._linear_q4(x, w, out, scratch)

    def linear_silu_mul(self, x, w, out, scratch=None) -> bool:
        """out = silu(x @ Wg^T) * (x @ Wu^T) in one kernel where one takes this weight and these rows;
        False where none does (a float32 weight too), for CPUBackend to run linear() and silu_mul()."""
        # int8 GEMMs on packed weights: silu * up in the GEMM's epilogue, gate_up never stored (the same
        # bits as the GEMM and silu_mul apart). Gate block j pairs with up block j + half: an even count
        # of 16-column blocks (the batched decode kernel's test too). Without a packed copy, a few rows:
        # silu * up in the int8 matrix-vector kernel the same way. 8-bit activations (every weight packed,
        # for their own GEMM): that GEMM's silu epilogue, or (odd block count) the product, then silu_mul.
        if isinstance(w, Int8Weight):
            gemm = self._on_packed_gemm(x, w, scratch) and w.packed.shape[0] % 2 == 0
            few = not self.int8_activations and self._on_rows(x, scratch)
            if gemm or few:
                shapes.linear_silu_mul(x, w.shape, out)
                check_array("x", x, np.float32)
                check_array("out", out)
                if gemm and w.packed.dtype == np.uint8:         # packed for a8gemm
                    cpu_a8gemm.a8_matmul_silu(x, w.packed, w.scale, out, *self.a8_buffers(*x.shape))
                elif gemm:
                    cpu_qgemm.int8_matmul_silu(x, w.packed, w.scale, out, *self._int_gemm_buffers(*x.shape))
                else:
                    K.rows_matmul_silu_kernel(x, w.q, w.scale, out)
                return True
        if isinstance(w, Q4Weight) and w.packed is not None and w.packed.shape[0] % 2 == 0:
            shapes.linear_silu_mul(x, w.shape, out)
            check_array("x", x, np.float32)
            check_array("out", out)
            if self.int8_activations:                   # dm: unread by the q4 tiles (_linear_q4)
                cpu_a8gemm.a8_matmul_silu(x, w.packed, w.dm.view(np.uint16), out, *self.a8_buffers(*x.shape))
            else:
                cpu_q4gemm.q4_matmul_silu(x, w.packed, out, *self.q4_gemm_buffers(*x.shape))
            return True
        if isinstance(w, Q4Weight) and w.packed is None and self._on_rows(x, scratch):
            shapes.linear_silu_mul(x, w.shape, out)
            check_array("x", x, np.float32)
            check_array("out", out)
            cpu_q4.q4_matvec_silu(x, *q4_parts(w), out)
            return True
        return False

    @staticmethod
    def _on_packed_gemm(x, w: Int8Weight, scratch) -> bool:
        """Whether an int8 product takes the integer GEMM: whenever the weight has a packed copy (made at
        load), whatever the number of rows, so that a row's bits never depend on its batch."""
        return w.packed is not None

    def _linear_int8(self, x, w: Int8Weight, out, scratch) -> None:
        T, Kd = x.shape[0], w.shape[1]
        if w.packed is not None and w.packed.dtype == np.uint8:     # a8gemm's layout: 8-bit activations
            cpu_a8gemm.a8_matmul(x, w.packed, w.scale, out, *self.a8_buffers(T, Kd))
            return
        if self._on_packed_gemm(x, w, scratch):
            cpu_qgemm.int8_matmul(x, w.packed, w.scale, out, *self._int_gemm_buffers(T, Kd))
            return
        if self._on_rows(x, scratch):
            K.rows_matmul_kernel(x, w.q, w.scale, out)
            return
        self._dequantized_matmul(x, w.q, w.scale, out, scratch)

    def _on_rows(self, x, scratch) -> bool:
        """Whether a quantized product without a GEMM of its own takes the row-invariant kernels rather
        than BLAS on dequantized tiles: up to ROWS_MAX rows (decode batches: a row's bits then never
        depend on its batch), every row count in the batch-invariant mode or where the CPU has no
        integer GEMM at all (no AVX2: these kernels take its place, so that int8 and q4 rows are
        batch-invariant by default on every CPU), or no workspace for the tiles."""
        return x.shape[0] <= cpu_rows.ROWS_MAX or self.one_attention or scratch is None or not cpu_llvm.available()

    def _linear_q4(self, x, w: Q4Weight, out, scratch) -> None:
        if w.packed is not None and self.int8_activations:         # a8q4tile.py's layout, for every row count
            # the tiles read d and m from the packed records; dm (checked at load) only fills a8gemm's
            # column-scale argument with the type the fused decode passes, so both share one build
            cpu_a8gemm.a8_matmul(x, w.packed, w.dm.view(np.uint16), out, *self.a8_buffers(*x.shape))
            return
        if w.packed is not None:
            cpu_q4gemm.q4_matmul(x, w.packed, out, *self.q4_gemm_buffers(*x.shape))
            return
        qs, dm = q4_parts(w)
        if self._on_rows(x, scratch):
            cpu_q4.q4_matvec(x, qs, dm, out)
            return
        self._dequantized_matmul(x, qs.view(np.uint16), dm, out, scratch)

    def _dequantized_matmul(self, x, a, b, out, scratch) -> None:
        """out = x @ W^T, W given as (a, b) (q4.dequantize_tile), on BLAS over float32 tiles of W
        dequantized into scratch."""
        N, Kd = out.shape[1], x.shape[1]
        tile = min(INT8_TILE_ROWS, scratch.size // (self.max_threads * Kd))
        if self.blas_on_numba_pool and tile >= 1:
            cpu_blas.quant_matmul_nt(x, a, b, out, scratch, tile, self.max_threads)
            return
        tile = max(1, min(N, scratch.size // Kd))        # rows of W dequantized per BLAS call
        for n0 in range(0, N, tile):
            n1 = min(N, n0 + tile)
            wt = scratch[:(n1 - n0) * Kd].reshape(n1 - n0, Kd)
            if a.dtype == np.int8:
                K.int8_dequant_rows_kernel(a, b, n0, wt)
            else:
                cpu_q4.dequantize_rows(a, b, n0, wt)
            if n0 == 0 and n1 == N:
                np.matmul(x, wt.T, out=out)
            else:
                out[:, n0:n1] = x @ wt.T

    def _int_gemm_buffers(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The integer GEMM's activation buffers (int16 panels, float32 scales) for up to rows x k,
        grown to the largest batch seen."""
        nx, ns = cpu_qgemm.x_buffer_sizes(rows, k)
        if self._qx.size < nx:
            self._qx = np.empty(nx, np.int16)
        if self._qs.size < ns:
            self._qs = np.empty(ns, np.float32)
        return self._qx, self._qs

    def a8_buffers(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """a8gemm's activation buffers (int8 panels, float32 block scales, int32 block corrections) for up
        to rows x k, grown to the largest batch seen."""
        nx, ns = cpu_a8gemm.x_buffer_sizes(rows, k)
        xb, sb, cb = self._a8
        if xb.size < nx or sb.size < ns:
            self._a8 = (np.empty(max(nx, xb.size), np.int8), np.empty(max(ns, sb.size), np.float32),
                        np.empty(max(ns, cb.size), np.int32))
        return self._a8

    def q4_gemm_buffers(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The q4 GEMM's activation buffers (int16 panels, row scales, block sums): the integer GEMM's
        two (the same panel layout and sizes) and one more, grown the same way."""
        _, _, nb = cpu_q4gemm.x_buffer_sizes(rows, k)
        self._int_gemm_buffers(rows, k)
        if self._qb.size < nb:
            self._qb = np.empty(nb, np.float32)
        return self._qx, self._qs, self._qb
