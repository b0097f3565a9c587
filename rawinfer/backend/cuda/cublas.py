"""cuBLAS GEMMs called through ctypes, so that CUDA graphs can capture them.

CuPy's cuBLAS wrappers set the handle's stream before every call and refuse to do that while a
stream is capturing ("calling cuBLAS API during stream capture is currently unsupported"), although
cuBLAS itself supports capture.  So the launcher calls the library's C functions directly, on a handle
of its own: the pointer mode is set once (alpha and beta are host floats) and the stream only when it
changes, which capture() does before it begins recording.  The handle gets a workspace of its own
(as PyTorch does) so that a captured GEMM never asks cuBLAS to allocate; cublasSetStream resets the
workspace to cuBLAS's default pool, so it is set again after every change of stream.

The library is the one CuPy already loaded into the process (found in /proc/self/maps), else the
first of its sonames that loads, so cupy-cuda12x and cupy-cuda13x both work.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

CUDA_R = {"float": 0, "f16": 2, "bf16": 14}   # cudaDataType: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
OP_N, OP_T = 0, 1
COMPUTE_32F = 68
GEMM_DEFAULT = -1
POINTER_MODE_HOST = 0
STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
          11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED"}


def _loaded_path() -> str | None:
    """The path of the libcublas this process has mapped (CuPy loads it with its first handle)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return path
    except OSError:
        pass
    return None


def load_library() -> ctypes.CDLL:
    names = [p for p in (_loaded_path(),) if p] + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise RuntimeError("cannot load cuBLAS (" + "; ".join(errors) + "); install the CuPy wheel for your CUDA "
                       "version (cupy-cuda12x or cupy-cuda13x) with its nvidia-cublas package")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


class Cublas:
    """One cuBLAS handle: gemm() is cublasGemmEx with float32 accumulation and host alpha/beta."""

    def __init__(self, workspace_ptr: int, workspace_bytes: int):
        self._workspace = (workspace_ptr, workspace_bytes)
        lib = self._lib = load_library()
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetPointerMode_v2.argtypes = [vp, i]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for fn in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasSetPointerMode_v2,
                   lib.cublasSetWorkspace_v2, lib.cublasGemmEx):
            fn.restype = i
        handle = vp()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self._handle = handle
        # The handle goes when its launcher does (tests and notebooks make many engines in one process),
        # but not at interpreter exit, when the CUDA context may already be gone.
        weakref.finalize(self, lib.cublasDestroy_v2, handle).atexit = False
        _check(lib.cublasSetPointerMode_v2(handle, POINTER_MODE_HOST), "cublasSetPointerMode")
        self._stream: int | None = None

    def set_stream(self, stream_ptr: int) -> None:
        """Point the handle at a stream (a no-op when it already is: allowed while capturing)."""
        if stream_ptr != self._stream:
            _check(self._lib.cublasSetStream_v2(self._handle, stream_ptr or None), "cublasSetStream")
            _check(self._lib.cublasSetWorkspace_v2(self._handle, *self._workspace), "cublasSetWorkspace")
            self._stream = stream_ptr

    def gemm(self, stream_ptr: int, trans_a: bool, trans_b: bool, m: int, n: int, k: int,
             alpha_ptr: int, a_ptr: int, a_type: int, lda: int, b_ptr: int, b_type: int, ldb: int,
             beta_ptr: int, c_ptr: int, c_type: int, ldc: int) -> None:
        self.set_stream(stream_ptr)
        _check(self._lib.cublasGemmEx(self._handle, OP_T if trans_a else OP_N, OP_T if trans_b else OP_N,
                                      m, n, k, alpha_ptr, a_ptr, a_type, lda, b_ptr, b_type, ldb,
                                      beta_ptr, c_ptr, c_type, ldc, COMPUTE_32F, GEMM_DEFAULT), "cublasGemmEx")
