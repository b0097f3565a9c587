"""How an op method becomes a kernel launch: thread counts, the shared-memory limit, argument packing.

`KernelLaunches` is the part of CUDABackend that every op family (backend.py's layer ops, attention.py,
sampling.py) launches through: `_launch` checks the arguments against the kernel's signature
(kernel_specs.pack_args) and hands them to the launcher, which is the GPU's CuPyLauncher
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


class KernelLaunches:
    """Mixin of CUDABackend: `_launch`, the one way its op methods put a kernel on the device."""

    _launcher: Any   # CuPyLauncher, or a test launcher with the same launch()/gemm()

    def _launch(self, kernel: str, targs: tuple[str, ...], grid, block, shared_mem: int, *args) -> None:
        """Launch kernel<targs> (a name of kernel_specs.SPECS) on grid x block with shared_mem bytes of
        dynamic shared memory; args in the order of the kernel's C++ signature."""
        spec = ks.SPECS[kernel]
        packed = ks.pack_args(spec, targs, args)
        if shared_mem > MAX_SHARED_BYTES:
            raise ValueError(f"{kernel} would need {shared_mem} bytes of shared memory (limit {MAX_SHARED_BYTES}); "
                             "use a smaller block size or head dimension")
        self._launcher.launch(spec, targs, grid, block, shared_mem, packed)
