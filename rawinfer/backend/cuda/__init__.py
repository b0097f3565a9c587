"""The CUDA backend: CUDABackend (backend.py) launching the RawKernels of cuda/*.cu and cuBLAS GEMMs
through CuPy (runtime.py), with one declarative signature per kernel (kernel_specs.py)."""
