"""Backend selection: `get_backend("auto" | "cpu" | "cuda")` returns the op implementation to run on.

The one module that knows both backends; each backend knows only the interface (base.py, shapes.py)."""

from __future__ import annotations

from rawinfer.backend.base import Backend


class DeviceUnavailableError(RuntimeError):
    """The device asked for (--device cuda) is not usable on this machine: for the command line, bad usage."""


def _cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads: without it no GPU can be used, and learning that through CuPy
    means importing it (seconds of a CPU-only command's start)."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_usable() -> bool:
    """True when CuPy imports and sees at least one GPU. Never raises."""
    if not _cuda_driver_present():
        return False
    try:
        from rawinfer.backend.cuda.backend import cuda_available
    except Exception:
        return False
    try:
        return bool(cuda_available())
    except Exception:
        return False


def get_backend(device: str = "auto", num_threads: int | None = None, cpu_int_gemm: bool = True,
                cache_dir: str | None = None, batch_invariant: bool = False, int8_activations: bool = False) -> Backend:
    """The backend for `device` (EngineConfig.device); num_threads, cpu_int_gemm, cache_dir (where
    compiled kernels are kept), batch_invariant (one attention kernel for every query count) and
    int8_activations (int8 models' products on 8-bit activations) configure the CPU one (CPU only)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" or (device == "auto" and cuda_usable()):
        if device == "cuda" and not cuda_usable():
            raise DeviceUnavailableError("--device cuda was asked for but no usable GPU was found (CuPy missing or "
                                         "no device); install rawinfer[cuda12] or rawinfer[cuda13], or use "
                                         "--device cpu")
        for name, on in (("batch_invariant", batch_invariant), ("int8_activations", int8_activations)):
            if on:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) is built for the CPU backend only; use "
                                 "--device cpu, or leave it off on a GPU")
        from rawinfer.backend.cuda.backend import CUDABackend
        return CUDABackend()
    from rawinfer.backend.cpu.backend import CPUBackend
    return CPUBackend(num_threads=num_threads, int_gemm=cpu_int_gemm, cache_dir=cache_dir,
                      one_attention=batch_invariant, int8_activations=int8_activations)
