"""The host execution shim for rawinfer's CUDA kernels: cuda_shim.h, its build harness, NumPy references."""
