"""The CPU backend: CPUBackend (backend.py) over Numba kernels, LLVM IR building blocks and NumPy's
BLAS, all on one thread pool (docs/kernels.md)."""
