"""GEMMs of the CPU backend on one thread pool: Numba's threads split the output columns and each calls
NumPy's own OpenBLAS, single-threaded, on its slice.

Why: a step alternates Numba kernels (norms, RoPE, attention) with GEMMs. Run through `np.matmul`,
the GEMMs use OpenBLAS's private thread pool, and on a machine with few cores the two pools steal the
cores from each other: a worker of one pool spins (waiting for its next parallel region) on the core
a worker of the other pool needs, and a small GEMM right after a Numba kernel takes several times
its own cost (docs/kernels.md). With every parallel region on Numba's pool, spinning workers are
what the next region wants.

How: NumPy (>= 2 wheels) ships OpenBLAS as `scipy_openblas64_` (64-bit integers, `scipy_` symbol
prefix). We find that library among the ones the process has loaded, make its symbols visible to
LLVM, and call `cblas_sgemm` / `cblas_sgemv` from nopython code as external functions, so the kernels
stay cacheable on disk (the symbol is linked by name when a cached kernel loads, not by address).

Every call inside a parallel region must run single-threaded: OpenBLAS splits a GEMM over its own
threads differently from one thread, which rounds differently, so a call that ran threaded would make
the result depend on timing. NumPy's OpenBLAS is a pthreads build, where
`openblas_set_num_threads_local` sets the process-wide count (it is per thread only in OpenMP builds):
set and restored by each worker, one worker restores the count while another is still between calls,
whose next GEMM then runs threaded, and the count ends as whichever worker restored last left it. So
the calling thread sets the count to 1 once before the parallel region and restores it after.

Pointers: each argument goes to BLAS as `a.ctypes` (typed void*), never as `a.ctypes.data` (an int):
the ctypes object holds a reference to the array until the call returns, whereas Numba may release
an array after its last use by name, which for `a.ctypes.data` comes before the call.

Where NumPy's BLAS is something else (MKL, Accelerate, an older OpenBLAS), `available()` is False and
the backend falls back to `np.matmul`.
"""

from __future__ import annotations

import ctypes
import functools

import numba as nb
import numpy as np
from numba import types

# inlined into the kernels below: see the cache NOTE in fused.py
from rawinfer.backend.cpu.attention import (attention_work_item, query_heads_into, softmax_numerators, window_start,
                                            write_heads)
from rawinfer.backend.cpu.kernels import kv_dims, kv_row_into, kv_scale_table
from rawinfer.backend.cpu.q4 import dequantize_tile

_SYMBOLS = ("scipy_cblas_sgemm64_", "scipy_cblas_sgemv64_", "openblas_set_num_threads_local")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_GEMV_MAX_ROWS = 2     # up to this many rows of x, one GEMV per row streams the weights faster than a
                       # GEMM (OpenBLAS's small-M GEMM reads the matrix far below the copy bandwidth)
_SWAP_MAX_ROWS = 96    # above _GEMV_MAX_ROWS and up to this, the product is taken the other way round:
                       # W x^T, where W's rows are the GEMM's long dimension (docs/kernels.md, blas.py)
_SWAP_TILE = 2048      # rows of W per such GEMM: its [tile, M] result stays in cache for the transpose


def _find_library() -> str | None:
    """Path of the loaded OpenBLAS that exports every symbol we call, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if all(hasattr(lib, s) for s in _SYMBOLS):
            return path
    return None


def describe() -> str:
    """The BLAS NumPy runs and the kernel it picked for this CPU ("OpenBLAS 0.3.31 ... kernel SkylakeX"),
    and the OPENBLAS_CORETYPE pin when one is set, for benchmark reports; "" where it cannot tell."""
    import os
    path = _find_library()
    if path is None:
        return ""
    lib = ctypes.CDLL(path)
    text = []
    for names in (("scipy_openblas_get_config64_", "openblas_get_config"),
                  ("scipy_openblas_get_corename64_", "openblas_get_corename")):
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            text.append(fn().decode(errors="replace"))
    out = " ".join(text[:1]) + (f", kernel {text[1]}" if len(text) > 1 else "")
    pin = os.environ.get("OPENBLAS_CORETYPE")
    return out + (f" (pinned by OPENBLAS_CORETYPE={pin}: unset it to measure as a user's machine runs)"
                  if pin else "")


@functools.cache
def available() -> bool:
    """Whether NumPy's OpenBLAS can be called from the kernels below. The first call (the CPU backend's,
    when it starts) finds the library and makes its symbols visible to LLVM, which the kernels below
    need before they are compiled or loaded from the disk cache."""
    path = _find_library()
    if path is not None:
        import llvmlite.binding as llvm
        llvm.load_library_permanently(path)
    return path is not None


_i32, _i64, _f32, _ptr = types.int32, types.int64, types.float32, types.voidptr
_sgemm = types.ExternalFunction(_SYMBOLS[0], types.void(
    _i32, _i32, _i32, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64))
_sgemv = types.ExternalFunction(_SYMBOLS[1], types.void(
    _i32, _i32, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64))
_set_threads = types.ExternalFunction(_SYMBOLS[2], _i32(_i32))   # process-wide here: see the docstring


@nb.njit(cache=True, inline="always")
def _matmul_slice(x, w, out, n0, n1):
    # out[:, n0:n1] = x @ w[n0:n1].T on the calling thread; x[M, K], w[N, K], out[M, N], all C-contiguous
    M, K = x.shape
    N = out.shape[1]
    one, zero = np.float32(1.0), np.float32(0.0)
    if M <= _GEMV_MAX_ROWS:
        for m in range(M):
            _sgemv(_ROW_MAJOR, _NO_TRANS, n1 - n0, K, one, w[n0:].ctypes, K, x[m].ctypes, 1, zero,
                   out[m, n0:].ctypes, 1)
    elif M <= _SWAP_MAX_ROWS:
        # out^T = W x^T tile by tile: OpenBLAS runs a GEMM with a long M well; one with M of a few rows
        # to a few dozen and a long N (x W^T) it runs far slower, as it re-packs all of W (its B) into a
        # buffer larger than the caches on every call. OpenBLAS rounds each call shape its own way (the
        # last bits differ from x W^T and from GEMV): fgemm.py is the row-invariant path.
        tmp = np.empty((_SWAP_TILE, M), np.float32)
        for t0 in range(n0, n1, _SWAP_TILE):
            rows = min(_SWAP_TILE, n1 - t0)
            _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, rows, M, K, one, w[t0:].ctypes, K, x.ctypes, K, zero,
                   tmp.ctypes, M)
            # transposed 16 rows at a time: out's rows lie N floats apart, and walking all M of them
            # per element of tmp would land (N a multiple of 1024: every row) in one L1 set
            for i0 in range(0, rows, 16):
                i1 = min(rows, i0 + 16)
                for m in range(M):
                    for i in range(i0, i1):
                        out[m, t0 + i] = tmp[i, m]
    else:
        _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, M, n1 - n0, K, one, x.ctypes, K, w[n0:].ctypes, K, zero,
               out[:, n0:].ctypes, N)


@nb.njit(parallel=True, cache=True)
def matmul_nt(x, w, out, parts):
    """out[M, N] = x[M, K] @ w[N, K]^T, the N columns split into `parts` slices over the thread pool."""
    N = w.shape[0]
    prev = _set_threads(1)                               # on the calling thread, around the region
    for p in nb.prange(parts):
        _matmul_slice(x, w, out, N * p // parts, N * (p + 1) // parts)
    _set_threads(prev)


@nb.njit(parallel=True, cache=True)
def quant_matmul_nt(x, a, b, out, scratch, tile_rows, parts):
    """out[M, N] = x[M, K] @ W^T for a quantized W[N, K] given as (a, b) (q4.dequantize_tile: int8 q
    and scales, or q4 lanes and block scales): each thread dequantizes tiles of `tile_rows` weight rows
    into its own part of `scratch` (float32, >= parts * tile_rows * K), still in its cache when the
    GEMM on that tile reads them."""
    M, K = x.shape
    N = a.shape[0]
    prev = _set_threads(1)
    for p in nb.prange(parts):
        wt = scratch[p * tile_rows * K:(p + 1) * tile_rows * K].reshape(tile_rows, K)
        n_end = N * (p + 1) // parts
        for n0 in range(N * p // parts, n_end, tile_rows):
            rows = min(tile_rows, n_end - n0)
            dequantize_tile(a, b, n0, wt[:rows])
            _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, M, rows, K, np.float32(1.0), x.ctypes, K, wt.ctypes, K,
                   np.float32(0.0), out[:, n0:].ctypes, N)
    _set_threads(prev)


# fastmath: no reassociation, as the attention kernels (attention.py's NOTE at its entry points)
@nb.njit(parallel=True, cache=True, fastmath={"contract", "nsz"})
def prefill_attention(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, work_seq, work_q0,
                      work_q1, scale, num_heads, window, out, parts):
    """Causal paged attention with the two matrix products on BLAS, for batches with long query runs
    (prefill chunks). One work item = (query tile of one sequence, kv head):
        K, V of the visible positions gathered from the item's blocks into [n, D] buffers
        S = Q K^T          [G * tile, n]   (the G query heads sharing the kv head stacked as rows)
        P = softmax(S)     per row, keys after the query's position (and, window W > 0, at or
                           before its position - W) masked out
        O = P V / sum(P)   [G * tile, D]
    Items are dealt to threads round-robin: later tiles see more keys, and contiguous halves would
    leave one thread with most of the work."""
    Hkv, BS, D = kv_dims(k_cache)
    G = num_heads // Hkv
    W = work_seq.shape[0] * Hkv
    one, zero = np.float32(1.0), np.float32(0.0)
    k_table, v_table = kv_scale_table(k_cache), kv_scale_table(v_cache)
    prev = _set_threads(1)
    for p in nb.prange(parts):
        for w in range(p, W, parts):
            b, kvh, q0, nq, first = attention_work_item(w, Hkv, work_seq, work_q0, work_q1, query_start_loc,
                                                        context_lens)
            lo = window_start(first, window)              # keys lo .. lo + n - 1: those any query sees
            n = first + nq - lo
            kc = np.empty((n, D), np.float32)
            vc = np.empty((n, D), np.float32)
            for j in range(n):
                blk = block_tables[b, (lo + j) // BS]
                kv_row_into(k_cache, k_table, blk, kvh, (lo + j) % BS, kc[j])
                kv_row_into(v_cache, v_table, blk, kvh, (lo + j) % BS, vc[j])
            q = np.empty((G * nq, D), np.float32)            # row g * nq + i: head g of query i
            for i in range(nq):
                query_heads_into(qkv, q0 + i, kvh, scale, q.reshape((G, nq, D))[:, i])
            s = np.empty((G * nq, n), np.float32)
            _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, G * nq, n, D, one, q.ctypes, D, kc.ctypes, D, zero, s.ctypes,
                   n)
            inv = np.empty(G * nq, np.float32)
            for row in range(G * nq):
                pos = first + row % nq
                a = window_start(pos, window) - lo        # the query's keys: columns a .. e - 1
                e = pos + 1 - lo
                inv[row] = softmax_numerators(s[row, a:], e - a)
                for j in range(a):
                    s[row, j] = zero
                for j in range(e, n):
                    s[row, j] = zero
            o = np.empty((G * nq, D), np.float32)
            _sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, G * nq, D, n, one, s.ctypes, n, vc.ctypes, D, zero, o.ctypes,
                   D)
            for i in range(nq):
                write_heads(o.reshape((G, nq, D))[:, i], inv.reshape((G, nq))[:, i], q0 + i, kvh, out)
    _set_threads(prev)
