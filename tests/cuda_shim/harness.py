"""Host execution of rawinfer's CUDA kernels: g++ builds cuda/<op>.cu under cuda_shim.h, ctypes launches.

`ShimLauncher` is a drop-in for the CuPy launcher of `rawinfer.backend.cuda.CUDABackend`: the backend's
op methods (shape checks, launch geometry, argument packing from kernel_specs) run unchanged on NumPy
arrays, and only the final launch goes to a host library instead of the GPU.  Per .cu file the harness
generates one C++ stub per template instance:

    extern "C" void rawinfer_launch_<kernel>__<T>(grid, block, smem, void** args)

which `static_assert`s that the kernel's real signature equals the one in kernel_specs, then runs it with
`shim::launch`.  `args` is an array of pointers to argument values, exactly as cuLaunchKernel takes them.
Libraries are cached by a hash of everything that goes into them (RAWINFER_SHIM_CACHE, default
<repo>/.cache/cuda_shim), so each .cu file is compiled once and reused until something changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rawinfer.backend.cuda import kernel_specs as ks

REPO = Path(__file__).resolve().parents[2]
CUDA_DIR = REPO / "cuda"
SHIM_DIR = Path(__file__).resolve().parent
CXX_FLAGS = ["-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-DRAWINFER_SHIM",
             "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-Wno-unknown-pragmas"]


class ShimBuildError(RuntimeError):
    """g++ rejected a kernel file (or the generated launch stubs)."""


def compiler() -> str | None:
    """The host C++ compiler, or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def cache_dir() -> Path:
    return Path(os.environ.get("RAWINFER_SHIM_CACHE", REPO / ".cache" / "cuda_shim"))


def symbol(spec: ks.KernelSpec, targs: tuple[str, ...]) -> str:
    """The C name of one instance's launcher: template arguments joined by "__", a space ("signed char")
    written as "_"."""
    return "rawinfer_launch_" + spec.name + "".join("__" + t.replace(" ", "_") for t in targs)


def stub_source(kernel_file: Path, specs: list[ks.KernelSpec]) -> str:
    """The C++ file compiled for one .cu file: shim, kernels, one extern "C" stub per instance."""
    out = ['#include "cuda_shim.h"', f'#include "{kernel_file}"', "#include <type_traits>", ""]
    for spec in specs:
        for targs in spec.instances or [()]:
            types = spec.c_types(targs)
            expr = spec.name_expression(targs)
            call = ", ".join(f"*reinterpret_cast<{t}*>(args[{i}])" for i, t in enumerate(types))
            out += [
                f'extern "C" void {symbol(spec, targs)}(unsigned gx, unsigned gy, unsigned gz, unsigned bx,',
                "    unsigned by, unsigned bz, unsigned long long smem, void** args) {",
                f"  using Signature = void (*)({', '.join(types)});",
                f"  static_assert(std::is_same_v<decltype(&{expr}), Signature>,",
                f'                "kernel_specs.py disagrees with the signature of {expr}");',
                "  shim::launch(dim3(gx, gy, gz), dim3(bx, by, bz), smem,",
                f"               [args] {{ {expr}({call}); }});",
                "}",
                "",
            ]
    return "\n".join(out)


def build(source: str, specs: list[ks.KernelSpec] | None = None, folder: Path = CUDA_DIR) -> Path:
    """Compile folder/<source> with launch stubs for `specs` (default: its kernels in kernel_specs)
    into a shared library (cached); return its path."""
    cxx = compiler()
    if cxx is None:
        raise ShimBuildError("no host C++ compiler (g++) found; install g++ 12 or newer or set CXX")
    kernel_file = folder / source
    if specs is None:
        specs = [s for s in ks.SPECS.values() if s.source == source]
    stub = stub_source(kernel_file, specs)
    digest = hashlib.sha256()
    headers = sorted(CUDA_DIR.glob("*.cuh")) + sorted(SHIM_DIR.glob("*.h"))  # everything a .cu may include
    for part in (stub, kernel_file.read_text(), *(h.read_text() for h in headers), " ".join([cxx] + CXX_FLAGS)):
        digest.update(part.encode())
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{Path(source).stem}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        stub_path = Path(tmp) / f"{Path(source).stem}_stubs.cpp"
        stub_path.write_text(stub)
        tmp_lib = Path(tmp) / lib.name
        cmd = [cxx, *CXX_FLAGS, f"-I{SHIM_DIR}", f"-I{CUDA_DIR}", f"-I{folder}", str(stub_path), "-o", str(tmp_lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ShimBuildError(f"g++ failed on {source}:\n{proc.stderr[-6000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent sessions never load a half-written library
    return lib


def build_all(sources: list[str] | None = None) -> dict[str, Path]:
    """Compile several .cu files in parallel (one g++ per core)."""
    sources = sources or ks.sources()
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(sources, pool.map(build, sources)))


def _c_value(value):
    """A ctypes object holding one packed kernel argument."""
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    raise TypeError(f"cannot pass {type(value).__name__} to a host kernel")


class ShimLauncher:
    """Launches kernels on the host; the same interface as the CuPy launcher of CUDABackend."""

    def __init__(self, libraries: dict[str, Path] | None = None):
        self._paths = dict(libraries or {})  # source name -> built library (others are built on first use)
        self._libs: dict[str, ctypes.CDLL] = {}
        self.launches: list[tuple[str, tuple, tuple, int]] = []  # (name expression, grid, block, smem)

    def _lib(self, source: str) -> ctypes.CDLL:
        if source not in self._libs:
            path = self._paths.get(source) or build(source)
            self._libs[source] = ctypes.CDLL(str(path))
        return self._libs[source]

    def launch(self, spec: ks.KernelSpec, targs: tuple[str, ...], grid, block, shared_mem: int, args) -> None:
        fn = getattr(self._lib(spec.source), symbol(spec, targs))
        fn.restype = None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        holders = [_c_value(v) for v in args]
        argv = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        self.launches.append((spec.name_expression(targs), grid, block, int(shared_mem)))
        fn(*[ctypes.c_uint(int(g)) for g in grid], *[ctypes.c_uint(int(b)) for b in block],
           ctypes.c_ulonglong(int(shared_mem)), argv)

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, a, lda: int, b, ldb: int,
             c, ldc: int, beta: float) -> None:
        """cublasGemmEx semantics on flat column-major buffers: C = op(A) op(B) + beta C (alpha = 1),
        accumulating in float32 (float64 here, rounded once to C's dtype)."""
        def col_major(buf, rows, cols, ld):
            flat = buf.reshape(-1)
            return np.lib.stride_tricks.as_strided(flat, (rows, cols), (flat.itemsize, flat.itemsize * ld))
        a_mat = col_major(a, k if trans_a else m, m if trans_a else k, lda).astype(np.float64)
        b_mat = col_major(b, n if trans_b else k, k if trans_b else n, ldb).astype(np.float64)
        c_view = col_major(c, m, n, ldc)
        result = (a_mat.T if trans_a else a_mat) @ (b_mat.T if trans_b else b_mat)
        if beta:
            result += beta * c_view.astype(np.float64)
        c_view[...] = result.astype(c.dtype)


class RecordedGraph:
    """What CapturingShimLauncher.capture returns: replay() runs the recorded launches and GEMMs again."""

    def __init__(self, calls, launcher):
        self.calls, self.launcher = calls, launcher

    def replay(self):
        self.launcher.replays += 1
        for method, args in self.calls:
            method(*args)


class CapturingShimLauncher(ShimLauncher):
    """The shim launcher plus capture(): while capturing, launches and GEMMs are recorded, not run, and the
    graph's replay runs them again, which is what a CUDA graph does. Counts captures and replays."""

    def __init__(self, libraries: dict[str, Path] | None = None):
        super().__init__(libraries)
        self._record = None
        self.captures = self.replays = 0

    def launch(self, *args):
        self._run_or_record(super().launch, args)

    def gemm(self, *args):
        self._run_or_record(super().gemm, args)

    def _run_or_record(self, run, args):
        if self._record is None:
            run(*args)
        else:
            self._record.append((run, args))

    def capture(self, fn):
        self._record = []
        try:
            fn()
        finally:
            calls, self._record = self._record, None
        self.captures += 1
        return RecordedGraph(calls, self)
