"""The shim's tensor-core wrappers (common.cuh: mma_m16n8k16, ldmatrix_x4, cp_async_16) against the PTX
ISA's documented fragment layouts, so a tensor-core kernel that passes under the shim lays out its
registers as the GPU does.

The layouts are written here from the PTX ISA's tables ("Matrix Fragments for mma.m16n8k16 with floating
point type", "ldmatrix"), independently of the shim's C++ code, and pinned to a few entries read off the
ISA's figures.  The kernels (tests/cuda_shim/shim_mma_selftest.cu) move registers between NumPy arrays
and one wrapper call unchanged: identity and selector matrices make every output element say which input
element it came from, random ones check the arithmetic.
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

SPECS = [
    ks.KernelSpec("mma_layout_kernel", "shim_mma_selftest.cu",
                  ks.signature("float* d, const unsigned* a, const unsigned* b, const float* c"),
                  ("T",), (("f16",), ("bf16",))),
    ks.KernelSpec("ldmatrix_layout_kernel", "shim_mma_selftest.cu",
                  ks.signature("unsigned* out, const unsigned* src, int trans")),
    ks.KernelSpec("cp_async_kernel", "shim_mma_selftest.cu", ks.signature("float* out, const float* src")),
    ks.KernelSpec("cp_async_unwaited_kernel", "shim_mma_selftest.cu", ks.signature("float* out, const float* src")),
]
TYPES = {"f16": np.float16, "bf16": bfloat16}


@pytest.fixture(scope="module")
def run():
    lib = harness.build("shim_mma_selftest.cu", SPECS, folder=harness.SHIM_DIR)
    launcher = harness.ShimLauncher({"shim_mma_selftest.cu": lib})
    specs = {s.name: s for s in SPECS}

    def launch(name, targs, smem, *args):
        launcher.launch(specs[name], targs, (1,), (32,), smem, ks.pack_args(specs[name], targs, args))
    return launch


# ---- the PTX ISA's tables, g = groupID = lane >> 2, c = threadID_in_group = lane % 4 -----------------
def a_coords(lane: int) -> list[tuple[int, int]]:
    """(row, col) of elements a0..a7 of m16n8k16's A fragment (.f16 / .bf16)."""
    g, c = lane >> 2, lane % 4
    return [(g if i < 2 or 4 <= i < 6 else g + 8, c * 2 + (i & 1) + (8 if i >= 4 else 0)) for i in range(8)]


def b_coords(lane: int) -> list[tuple[int, int]]:
    """(row, col) of elements b0..b3 of the B fragment (k x n)."""
    g, c = lane >> 2, lane % 4
    return [(c * 2 + (i & 1) + (8 if i >= 2 else 0), g) for i in range(4)]


def cd_coords(lane: int) -> list[tuple[int, int]]:
    """(row, col) of c0..c3 / d0..d3 of the float accumulators."""
    g, c = lane >> 2, lane % 4
    return [(g if i < 2 else g + 8, c * 2 + (i & 1)) for i in range(4)]


def test_tables_match_the_isa_figures():
    """Entries read off the ISA's figures for lanes 0, 5 and 31."""
    assert a_coords(0) == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]
    assert a_coords(5)[0] == (1, 2) and a_coords(5)[7] == (9, 11)
    assert a_coords(31) == [(7, 6), (7, 7), (15, 6), (15, 7), (7, 14), (7, 15), (15, 14), (15, 15)]
    assert b_coords(0) == [(0, 0), (1, 0), (8, 0), (9, 0)]
    assert b_coords(5) == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert b_coords(31) == [(6, 7), (7, 7), (14, 7), (15, 7)]
    assert cd_coords(0) == [(0, 0), (0, 1), (8, 0), (8, 1)]
    assert cd_coords(31) == [(7, 6), (7, 7), (15, 6), (15, 7)]
    for coords, shape in ((a_coords, (16, 16)), (b_coords, (16, 8)), (cd_coords, (16, 8))):
        covered = sorted(rc for lane in range(32) for rc in coords(lane))
        assert covered == [(r, col) for r in range(shape[0]) for col in range(shape[1])]  # each element once


def pack(matrix, coords, dtype) -> np.ndarray:
    """Each lane's registers (two 16-bit elements each, the first in the low half) for a matrix."""
    bits = np.asarray(matrix, np.float32).astype(dtype).view(np.uint16).astype(np.uint32)
    regs = np.zeros((32, len(coords(0)) // 2), np.uint32)
    for lane in range(32):
        for i, (r, c) in enumerate(coords(lane)):
            regs[lane, i // 2] |= bits[r, c] << (16 * (i & 1))
    return regs


def mma(run, dtype_name, A, B, C) -> np.ndarray:
    """D [16, 8] as the shim's mma hands it to the lanes, placed by the accumulator table."""
    dtype = TYPES[dtype_name]
    c = np.array([[C[r, col] for r, col in cd_coords(lane)] for lane in range(32)], np.float32)
    d = np.zeros((32, 4), np.float32)
    run("mma_layout_kernel", (dtype_name,), 0, d, pack(A, a_coords, dtype), pack(B, b_coords, dtype), c)
    D = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for i, (r, col) in enumerate(cd_coords(lane)):
            D[r, col] = d[lane, i]
    return D


@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
def test_mma_identity_and_selectors_show_where_each_element_came_from(run, dtype_name):
    code_a = np.arange(256, dtype=np.float32).reshape(16, 16)   # A[r, k] = 16 r + k: exact in f16 and bf16
    code_b = np.arange(128, dtype=np.float32).reshape(16, 8)    # B[k, n] = 8 k + n
    zero = np.zeros((16, 8), np.float32)
    # A = I: D = B, so each output element names the B element (and B register) it came from.
    np.testing.assert_array_equal(mma(run, dtype_name, np.eye(16), code_b, zero), code_b)
    for half in (0, 8):  # B selects column n (+ 8) of A: D[r, n] = A[r, n + half]
        select = np.zeros((16, 8), np.float32)
        select[np.arange(8) + half, np.arange(8)] = 1.0
        np.testing.assert_array_equal(mma(run, dtype_name, code_a, select, zero), code_a[:, half:half + 8])
    # C passes through unchanged where A B = 0, each accumulator in its documented place.
    np.testing.assert_array_equal(mma(run, dtype_name, np.zeros((16, 16)), code_b, code_b * 0.5), code_b * 0.5)


@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
def test_mma_random_matches_numpy(run, dtype_name):
    rng = np.random.default_rng(3)
    dtype = TYPES[dtype_name]
    A = rng.standard_normal((16, 16)).astype(dtype).astype(np.float64)
    B = rng.standard_normal((16, 8)).astype(dtype).astype(np.float64)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    np.testing.assert_allclose(mma(run, dtype_name, A, B, C), A @ B + C, rtol=1e-5, atol=1e-5)  # f32 sums


@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix_x4_layout(run, trans):
    """Four 8 x 8 matrices whose elements are their own (matrix, row, col) codes."""
    codes = np.arange(256, dtype=np.uint16).reshape(4, 8, 8)       # 64 m + 8 r + c
    src = codes.reshape(32, 8).view(np.uint32).copy()              # row l % 8 of matrix l / 8 at row l
    out = np.zeros((32, 4), np.uint32)
    run("ldmatrix_layout_kernel", (), 32 * 48, out, src, trans)
    for lane in range(32):
        g, c = lane >> 2, lane % 4
        for i in range(4):
            lo, hi = int(out[lane, i]) & 0xFFFF, int(out[lane, i]) >> 16
            if trans:   # column g, rows 2c and 2c + 1
                assert (lo, hi) == (codes[i, 2 * c, g], codes[i, 2 * c + 1, g]), (lane, i)
            else:       # row g, columns 2c and 2c + 1
                assert (lo, hi) == (codes[i, g, 2 * c], codes[i, g, 2 * c + 1]), (lane, i)
    # the ISA's figure: lane 0 holds row 0's first two elements; transposed, column 0's first two
    assert int(out[0, 0]) == (8 << 16 if trans else 1 << 16)


def test_ldmatrix_b_fragments_feed_mma(run):
    """A [k][n] tile read with ldmatrix.trans gives m16n8k16's B registers: ldmatrix's and mma's tables
    agree the way the flash-attention kernel relies on (V tiles) and so does the non-transposed load of a
    [n][k] tile (K tiles)."""
    codes = np.arange(256, dtype=np.uint16).reshape(4, 8, 8)
    src = codes.reshape(32, 8).view(np.uint32).copy()
    out = np.zeros((32, 4), np.uint32)
    run("ldmatrix_layout_kernel", (), 32 * 48, out, src, 1)
    B = np.concatenate([codes[0], codes[1]])   # matrices 0 and 1 stacked along k: a [16 k][8 n] tile
    for lane in range(32):
        for i, (r, col) in enumerate(b_coords(lane)):
            assert (int(out[lane, i // 2]) >> (16 * (i & 1))) & 0xFFFF == B[r, col]
    run("ldmatrix_layout_kernel", (), 32 * 48, out, src, 0)
    Kt = np.concatenate([codes[0], codes[1]], axis=1)  # matrices 0 and 1 side by side: a [8 n][16 k] tile
    for lane in range(32):
        for i, (r, col) in enumerate(b_coords(lane)):   # B[k][n] = Kt[n][k]
            assert (int(out[lane, i // 2]) >> (16 * (i & 1))) & 0xFFFF == Kt[col, r]


def test_cp_async_completes_at_its_wait(run):
    src = np.arange(256, dtype=np.float32) + 1.0
    out = np.zeros((5, 128), np.float32)
    run("cp_async_kernel", (), 3 * 128 * 4, out, src)
    assert np.isnan(out[0]).all()                       # before any wait: the shim's poison
    np.testing.assert_array_equal(out[1], src[:128])    # wait<1>: the older group is complete ...
    assert np.isnan(out[2]).all()                       # ... the newer one is not
    np.testing.assert_array_equal(out[3], src[128:])    # wait<0>: everything
    np.testing.assert_array_equal(out[4], 0.0)          # valid = false: zeros, nothing read


def test_cp_async_never_waited_for_aborts():
    lib = harness.build("shim_mma_selftest.cu", SPECS, folder=harness.SHIM_DIR)
    code = textwrap.dedent(f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(lib)!r})
        out, src = np.zeros(32, np.float32), np.zeros(128, np.float32)
        ptrs = [ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(src.ctypes.data)]
        args = (ctypes.c_void_p * 2)(*[ctypes.addressof(p) for p in ptrs])
        fn = lib.rawinfer_launch_cp_async_unwaited_kernel
        fn(*[ctypes.c_uint(v) for v in (1, 1, 1, 32, 1, 1)], ctypes.c_ulonglong(512), args)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"RAWINFER_SHIM_DEADLOCK_S": "5", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "never waited for" in proc.stderr, proc.stderr
