"""fp8 (float8 e4m3fn) weight-only products on CUDA: the e4m3 instances of cuda/weight_only_linear.cu and
cuda/weight_only_embedding.cu through backend/cuda/weight_only.py, on the host shim (no GPU), against
NumPy references (ml_dtypes decodes e4m3 as the reference).

The int8 instances of the same kernels are tested in test_cuda_int8.py; here the weight bytes read as
e4m3 (common.cuh's weight_value): every one of the 256 byte values decoded exactly, then the GEMV at every
decode row count and the dequantized tiles + GEMM for more rows, on ragged shapes (the embedding of both
formats: test_cuda_int8.py).
"""

from __future__ import annotations

import numpy as np
import pytest

harness = pytest.importorskip("cuda_shim.harness")
if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16, float8_e4m3fn  # noqa: E402

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from rawinfer.backend.cuda.kernel_specs import weight_type  # noqa: E402
from rawinfer.backend.cuda.weight_only import WO_GEMV_MAX_ROWS  # noqa: E402
from rawinfer.quant import Fp8Weight  # noqa: E402
from reference_ops import (assert_close, int8_linear_ref, linear_ref, rand, random_weight_only,  # noqa: E402
                           weight_only_values)

ACT_DTYPES = [np.float16, bfloat16, np.float32]
ACT_IDS = ["f16", "bf16", "f32"]
SHAPES = [(13, 48), (70, 528), (37, 100), (5, 7)]     # as test_cuda_int8.py: N % 4 != 0, K off the 16-byte chunk


@pytest.fixture
def backend(shim_libraries):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries))


def fp8_matrix(rng, n, k, dtype=np.uint8) -> Fp8Weight:
    """Random finite e4m3 codes (reference_ops.random_weight_only), viewed as dtype, and per-row scales."""
    q, scale = random_weight_only(rng, n, k, "fp8")
    return Fp8Weight(q.view(dtype), scale)


def ct(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float16): "f16", np.dtype(bfloat16): "bf16"}[np.dtype(dtype)]


def test_every_byte_decodes_exactly(backend):
    """wo_dequant_kernel with scale 1 into float32: each of the 256 bytes is ml_dtypes' value (NaN for S.1111.111)."""
    q = np.arange(256, dtype=np.uint8).reshape(2, 128)
    out = np.full((2, 128), 7.0, np.float32)
    backend._launch("wo_dequant_kernel", ("e4m3", "float"), (2,), (32,), 0, out, q, np.ones(2, np.float32), 128)
    want = weight_only_values(q)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(out[finite], want[finite])
    assert np.signbit(out[0, 0]) == 0 and np.signbit(out[1, 0]) == 1       # +0 and -0 keep their sign


def test_both_storage_dtypes_name_the_e4m3_kernels():
    q = np.zeros((2, 16), np.uint8)
    assert weight_type(q.dtype) == weight_type(q.view(float8_e4m3fn).dtype) == "e4m3"
    assert weight_type(np.int8) == "signed char"
    with pytest.raises(ValueError, match="int8 or float8 e4m3fn"):
        weight_type(np.float16)


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_IDS)
@pytest.mark.parametrize("n_out,k", SHAPES)
def test_gemv_decode_rows(backend, dtype, n_out, k):
    """Every row count of the GEMV, out in x's dtype and float32, with and without bias: the float32 sums of
    decoded weights times x, scaled once, within two units in the last place of the output dtype."""
    rng = np.random.default_rng(n_out * 1000 + k)
    w = fp8_matrix(rng, n_out, k, float8_e4m3fn if k % 2 else np.uint8)
    for rows in range(1, WO_GEMV_MAX_ROWS + 1):
        x = rand(rng, (rows, k), dtype)
        for out_dtype in {np.dtype(dtype), np.dtype(np.float32)}:
            bias = rand(rng, (n_out,), out_dtype) if rows % 2 else None
            out = np.full((rows, n_out), np.nan, out_dtype)
            backend._launcher.launches.clear()
            backend.linear(x, w, out, bias=bias)
            assert [name for name, *_ in backend._launcher.launches] == [
                f"wo_gemv_kernel<e4m3, {ct(dtype)}, {ct(out_dtype)}>"]
            assert_close(out, int8_linear_ref(x, weight_only_values(w.q), w.scale, bias), out_dtype,
                         f"fp8 gemv rows={rows} out={out_dtype} bias={bias is not None}")


@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=ACT_IDS)
@pytest.mark.parametrize("n_out,k", SHAPES[:3])
@pytest.mark.parametrize("rows", [9, 23])
def test_prefill_rows_take_dequantized_tiles(backend, dtype, n_out, k, rows):
    """More rows: tiles of decoded weights times their scales, rounded once to x's dtype, through the GEMM;
    equal to the GEMM of that dequantized matrix."""
    rng = np.random.default_rng(rows * 7 + k)
    w = fp8_matrix(rng, n_out, k)
    x = rand(rng, (rows, k), dtype)
    scratch = np.zeros(5 * k, np.float32)
    tile_rows = 5 * 4 // np.dtype(dtype).itemsize
    tile = (weight_only_values(w.q) * w.scale[:, None]).astype(dtype)
    for bias in (None, rand(rng, (n_out,), np.float32)):
        out = np.full((rows, n_out), np.nan, np.float32)
        backend._launcher.launches.clear()
        backend.linear(x, w, out, bias=bias, scratch=scratch)
        launched = [name for name, *_ in backend._launcher.launches]
        assert launched.count(f"wo_dequant_kernel<e4m3, {ct(dtype)}>") == -(-n_out // tile_rows)
        assert_close(out, linear_ref(x, tile, bias), np.float32, "tiled fp8 GEMM")


def test_a_float16_matrix_is_no_weight_only_matrix(backend):
    w = Fp8Weight(np.zeros((4, 16), np.float16), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="int8 or float8 e4m3fn"):
        backend.linear(np.zeros((1, 16), np.float32), w, np.zeros((1, 4), np.float32))
