"""The CUDA runtime under CUDABackend: device detection, kernel sources, the CuPy launcher, CUDA graphs.

Everything that touches CuPy lives here, and CuPy is imported inside functions only: importing this
module (or `rawinfer.backend.cuda`) never fails on a machine without CuPy or without a GPU, and
`cuda_status()` says why CUDA is not usable there.

A launcher is the one object that puts work on the device.  `CUDABackend` hands it (kernel spec,
template arguments, grid, block, shared memory, packed arguments) or a cuBLAS GEMM; `CuPyLauncher`
does that on the GPU, and tests/cuda_shim supplies a host launcher with the same methods, so the
backend's op methods run unchanged in CI.  A launcher that can also `capture(fn)` makes CUDA graphs
available to the model runner.

CUDA graphs.  `CuPyLauncher.capture(fn)` records every launch fn makes on a private non-blocking
stream (relaxed capture mode) and returns a `CUDAGraph`; `replay()` re-issues the recorded launches,
with the pointers and scalars they had at capture time, on the current stream.  So fn must read its
inputs from fixed buffers (the caller copies new values into them before each replay), must allocate
nothing, and must not copy between host and device.  cuBLAS calls are captured too: with CUDA 12.2 or
newer cuBLAS takes its workspace through stream-ordered allocation, which capture supports.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.cublas import CUDA_R, Cublas

MIN_COMPUTE_CAPABILITY = 80    # bf16 conversions (cvt.rn.bf16.f32) need sm_80
CUBLAS_WORKSPACE_BYTES = 32 << 20   # what cuBLAS's documentation recommends for Hopper (4 MiB before it)


# ---- device detection -------------------------------------------------------------------------------
def cuda_status() -> tuple[bool, str]:
    """(usable, why not): CuPy importable, a device of compute capability >= 8.0, cuBLAS loadable."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means "no CUDA here"
        return False, f"CuPy is not importable ({e.__class__.__name__}: {e}); install cupy-cuda12x or cupy-cuda13x"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no CUDA device is visible"
        cc = int(cupy.cuda.Device(0).compute_capability)
        if cc < MIN_COMPUTE_CAPABILITY:
            return False, f"the GPU has compute capability {cc / 10:.1f}; rawinfer's kernels need 8.0 or newer"
        from cupy_backends.cuda.libs import cublas  # noqa: F401 - loads libcublas
    except Exception as e:  # noqa: BLE001
        return False, f"CUDA is not usable ({e.__class__.__name__}: {e})"
    return True, ""


def cuda_available() -> bool:
    """True where a usable CUDA GPU and CuPy are present.  Never raises."""
    try:
        return cuda_status()[0]
    except Exception:  # noqa: BLE001
        return False


# ---- kernel sources ---------------------------------------------------------------------------------
def kernel_dir() -> Path:
    """The folder of the .cu sources: package data rawinfer.cuda when installed, cuda/ in a checkout.

    NOTE: cuda/ has no __init__.py on purpose.  NVIDIA's Python packages (cuda-pathfinder, which CuPy 14
    imports, and cuda-bindings) live in a namespace package named `cuda`; a regular package `cuda` at the
    root of a checkout on sys.path (PYTHONPATH=., pytest) would shadow it and break `import cupy`."""
    spec = importlib.util.find_spec("rawinfer.cuda") if importlib.util.find_spec("rawinfer") else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "common.cuh").is_file():
            return Path(location)
    return Path(__file__).resolve().parents[3] / "cuda"


def kernel_source(source: str) -> str:
    """A .cu file with `#include "common.cuh"` pasted in: one self-contained text for NVRTC (and a
    CuPy kernel-cache key that changes whenever the shared header does)."""
    folder = kernel_dir()
    common = (folder / "common.cuh").read_text()
    text = (folder / source).read_text()
    return re.sub(r'^#include "common\.cuh"\s*$', lambda _: common, text, count=1, flags=re.M)


# ---- the GPU launcher -------------------------------------------------------------------------------
@dataclass
class CUDAGraph:
    """A captured sequence of launches; replay() re-issues it on the current stream."""

    graph: Any
    cupy: Any

    def replay(self) -> None:
        self.graph.launch(stream=self.cupy.cuda.get_current_stream())


class CuPyLauncher:
    """Compiles every kernel once (NVRTC via CuPy RawModule, templates through name expressions) and
    launches them on the current CuPy stream; GEMMs through cuBLAS; captures CUDA graphs."""

    def __init__(self):
        import cupy

        self._cp = cupy
        self._functions: dict[str, Any] = {}
        for source in ks.sources():
            exprs = [s.name_expression(t) for s in ks.SPECS.values() if s.source == source
                     for t in (s.instances or [()])]
            # NVRTC's default dialect is C++17 (CUDA 12 and 13); CuPy adds -arch for the device.
            module = cupy.RawModule(code=kernel_source(source), name_expressions=exprs)
            for expr in exprs:
                self._functions[expr] = module.get_function(expr)  # compiles (or loads CuPy's cache) now
        cupy.cuda.device.get_cublas_handle()      # loads libcublas (CuPy's copy, which Cublas then uses)
        self._blas_workspace = cupy.empty(CUBLAS_WORKSPACE_BYTES, np.uint8)
        self._blas = Cublas(self._blas_workspace.data.ptr, CUBLAS_WORKSPACE_BYTES)
        # alpha = 1 and beta in {0, 1}: host scalars that live as long as the launcher, so a captured
        # GEMM never points at a temporary.
        self._alpha = np.ones(1, np.float32)
        self._betas = {0.0: np.zeros(1, np.float32), 1.0: np.ones(1, np.float32)}

    def launch(self, spec: ks.KernelSpec, targs: tuple[str, ...], grid, block, shared_mem: int, args) -> None:
        fn = self._functions[spec.name_expression(targs)]
        fn(tuple(int(g) for g in grid), tuple(int(b) for b in block), tuple(args), shared_mem=int(shared_mem))

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, a, lda: int, b, ldb: int,
             c, ldc: int, beta: float) -> None:
        """cublasGemmEx, C = op(A) op(B) + beta C, column-major, float32 accumulation (beta 0 or 1)."""
        self._blas.gemm(self._cp.cuda.get_current_stream().ptr, trans_a, trans_b, m, n, k,
                        self._alpha.ctypes.data, a.data.ptr, CUDA_R[ks.element_type(a.dtype)], lda,
                        b.data.ptr, CUDA_R[ks.element_type(b.dtype)], ldb,
                        self._betas[float(beta)].ctypes.data, c.data.ptr, CUDA_R[ks.element_type(c.dtype)], ldc)

    def capture(self, fn: Callable[[], None]) -> CUDAGraph:
        """Record fn's launches as a graph (fn does not run).  The caller has run fn eagerly before, so
        every kernel is compiled and cuBLAS has picked its algorithms."""
        cp = self._cp
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            self._blas.set_stream(stream.ptr)   # cuBLAS's stream is set before recording, not during it
            stream.begin_capture()
            try:
                fn()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - the original error is the one worth reporting
                    pass
                raise
            graph = stream.end_capture()
        return CUDAGraph(graph, cp)
