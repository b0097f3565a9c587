"""How an op method becomes a kernel launch: thread counts, the shared-memory limit, argument packing.

CUDABackend makes one `Launches` and hands it to each part it owns (attention.py, sampling.py, weight_only.py);
its own layer ops launch through it too.  `Launches.launch` checks the arguments against the kernel's
signature (kernel_specs.pack_args) and hands them to the launcher, which is the GPU's CuPyLauncher
(runtime.py) or the host launcher of the test harness (tests/cuda_shim).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rawinfer.backend.cuda import kernel_specs as ks

MAX_SHARED_BYTES = 48 * 1024   # dynamic shared memory any launch may use without an opt-in


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def row_threads(n: int) -> int:
    """Threads for a block that walks one row of n elements: about 4 elements each, 32..1024."""
    return min(1024, max(32, round_up(-(-n // 4), 32)))


def address(a: Any) -> int:
    """The device (CuPy) or host (NumPy, under the test launcher) address of an array's first element."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


class Launches:
    """The one way CUDABackend and its parts (attention.py, sampling.py, weight_only.py) put work on the device:
    `launch` checks a kernel's arguments and shared memory and hands them to the launcher; `gemm` is the
    launcher's cuBLAS GEMM (the call backend.py's module docstring states)."""

    def __init__(self, launcher: Any):
        """launcher: CuPyLauncher, or a test launcher with the same launch()/gemm() (and capture())."""
        self.launcher = launcher

    def launch(self, kernel: str, targs: tuple[str, ...], grid, block, shared_mem: int, *args) -> None:
        """Launch kernel<targs> (a name of kernel_specs.SPECS) on grid x block with shared_mem bytes of
        dynamic shared memory; args in the order of the kernel's C++ signature."""
        spec = ks.SPECS[kernel]
        packed = ks.pack_args(spec, targs, args)
        if shared_mem > MAX_SHARED_BYTES:
            raise ValueError(f"{kernel} would need {shared_mem} bytes of shared memory (limit {MAX_SHARED_BYTES}); "
                             "use a smaller block size or head dimension")
        self.launcher.launch(spec, targs, grid, block, shared_mem, packed)

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, a, lda: int, b, ldb: int,
             c, ldc: int, beta: float) -> None:
        """cublasGemmEx through the launcher: C = op(A) op(B) + beta C, column-major, float32 accumulation."""
        self.launcher.gemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, beta)
