"""The CUDA execution shim itself (tests/cuda_shim/cuda_shim.h): what every kernel test relies on.

fp16/bf16 conversions bit for bit as the GPU rounds, warp shuffles and their width rules, atomics,
dynamic shared memory and __syncwarp, and a hard failure (not a silent pass) when threads of a block
meet different barriers.  The kernels are tests/cuda_shim/shim_selftest.cu, built with their own
KernelSpecs; the real kernels' tests are tests/backend/test_cuda_shim.py and test_cuda_shim_attention.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rawinfer.backend.cuda import kernel_specs as ks

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402


# ---- the shim itself ------------------------------------------------------------------------------
SELFTEST_SPECS = [
    ks.KernelSpec("convert_kernel", "shim_selftest.cu",
                  ks.signature("f16* h, bf16* b, float* h_back, float* b_back, const float* x, int n")),
    ks.KernelSpec("shuffle_kernel", "shim_selftest.cu", ks.signature("int* out")),
    ks.KernelSpec("atomics_kernel", "shim_selftest.cu",
                  ks.signature("float* fsum, int* isum, int* imax, unsigned long long* usum")),
    ks.KernelSpec("smem_kernel", "shim_selftest.cu", ks.signature("float* out, int* warp_out")),
    ks.KernelSpec("divergent_kernel", "shim_selftest.cu", ks.signature("int* out")),
    ks.KernelSpec("early_return_kernel", "shim_selftest.cu", ks.signature("int* out")),
]


@pytest.fixture(scope="module")
def selftest():
    lib = harness.build("shim_selftest.cu", SELFTEST_SPECS, folder=harness.SHIM_DIR)
    launcher = harness.ShimLauncher({"shim_selftest.cu": lib})
    specs = {s.name: s for s in SELFTEST_SPECS}

    def run(name, grid, block, smem, *args):
        launcher.launch(specs[name], (), grid, block, smem, ks.pack_args(specs[name], (), args))
    return run


def test_shim_conversions_are_bit_exact(selftest):
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf,
                        2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 1e-30, 1.0 + 2.0**-11,
                        1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38], np.float32)
    scaled = (rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000)).astype(np.float32)
    bits = rng.integers(0, 2**32, 3000, dtype=np.uint32).view(np.float32)
    x = np.concatenate([special, scaled, bits])
    x = x[~np.isnan(x)]
    n = len(x)
    h, b = np.empty(n, np.float16), np.empty(n, bfloat16)
    hb, bb = np.empty(n, np.float32), np.empty(n, np.float32)
    selftest("convert_kernel", (4,), (64,), 0, h, b, hb, bb, x, n)
    with np.errstate(over="ignore"):  # values beyond fp16's range become inf, as on the GPU
        want_h, want_b = x.astype(np.float16), x.astype(bfloat16)
    np.testing.assert_array_equal(h.view(np.uint16), want_h.view(np.uint16))
    np.testing.assert_array_equal(b.view(np.uint16), want_b.view(np.uint16))
    np.testing.assert_array_equal(hb, want_h.astype(np.float32))
    np.testing.assert_array_equal(bb, want_b.astype(np.float32))


def test_shim_shuffles_follow_cuda_rules(selftest):
    blocks, threads = 2, 64
    out = np.zeros((blocks * threads, 6), np.int32)
    selftest("shuffle_kernel", (blocks,), (threads,), 0, out)
    tid = np.tile(np.arange(threads), blocks)
    lane, warp0 = tid % 32, tid - tid % 32
    v = lambda t: 3 * t + 1  # noqa: E731

    def within(width, src_lane):  # a source outside the lane's width-segment returns the lane's own value
        seg = lane - lane % width
        ok = (src_lane >= seg) & (src_lane < seg + width)
        return v(warp0 + np.where(ok, src_lane, lane))
    np.testing.assert_array_equal(out[:, 0], v(warp0 + (lane ^ 5)))
    np.testing.assert_array_equal(out[:, 1], within(32, lane + 3))
    np.testing.assert_array_equal(out[:, 2], within(32, lane - 2))
    np.testing.assert_array_equal(out[:, 3], v(warp0 + 7))
    # xor with a width may read an earlier segment; only a later one yields the lane's own value
    xor_src = lane ^ 9
    np.testing.assert_array_equal(out[:, 4], v(warp0 + np.where(xor_src < lane - lane % 8 + 8, xor_src, lane)))
    np.testing.assert_array_equal(out[:, 5], within(8, lane + 3))


def test_shim_atomics(selftest):
    fsum, isum = np.zeros(1, np.float32), np.zeros(1, np.int32)
    imax, usum = np.full(1, -5, np.int32), np.zeros(1, np.uint64)
    selftest("atomics_kernel", (3,), (96,), 0, fsum, isum, imax, usum)
    assert fsum[0] == 3 * 96 and isum[0] == 3 * sum(range(96)) and imax[0] == 2 * 1000 + 95
    assert int(usum[0]) == 3 * 96 * 2**33


def test_shim_shared_memory_and_syncwarp(selftest):
    blocks, threads = 3, 64
    out, warp_out = np.zeros(blocks * threads, np.float32), np.zeros(blocks * threads, np.int32)
    selftest("smem_kernel", (blocks,), (threads,), threads * 4, out, warp_out)
    tid = np.arange(threads)
    for b in range(blocks):
        np.testing.assert_array_equal(out[b * threads:(b + 1) * threads], (threads - 1 - tid) * (b + 1))
        neighbour = tid - tid % 32 + (tid % 32 + 1) % 32
        np.testing.assert_array_equal(warp_out[b * threads:(b + 1) * threads], neighbour * 10 + b)


@pytest.mark.parametrize("kernel", ["divergent_kernel", "early_return_kernel"])
def test_shim_rejects_divergent_barriers(kernel, selftest):
    """A barrier not reached by every thread is a bug on the GPU; the shim must abort, not pass."""
    # Reuse the library the fixture built (same specs -> same cache entry).
    lib = harness.build("shim_selftest.cu", SELFTEST_SPECS, folder=harness.SHIM_DIR)
    code = textwrap.dedent(f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(lib)!r})
        out = np.zeros(32, np.int32)
        ptr = ctypes.c_void_p(out.ctypes.data)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(ptr))
        fn = getattr(lib, "rawinfer_launch_{kernel}")
        fn(*[ctypes.c_uint(v) for v in (1, 1, 1, 32, 1, 1)], ctypes.c_ulonglong(0), args)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"RAWINFER_SHIM_DEADLOCK_S": "5", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "divergent synchronisation" in proc.stderr or "deadlock" in proc.stderr, proc.stderr
