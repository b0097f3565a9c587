"""Backends: the op interface (base.py, with each op's shape contract in shapes.py), its CPU (cpu/:
NumPy + Numba) and CUDA (cuda/: CuPy RawKernels + cuBLAS) implementations, and the choice between them
(select.py)."""
