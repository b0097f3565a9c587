"""GPU suite (marker `gpu`) for the weight-only products, int8 and fp8 e4m3: the GEMV kernel (decode rows),
the dequantized tiles + cuBLAS (prefill rows) and the embedding on the device, at Llama-3-8B's matrix
shapes, against NumPy; and tiny int8 and fp8 models through the engine on the device against the CPU
backend. The same kernels on the host shim: test_cuda_int8.py, test_cuda_fp8.py.

Skipped wherever no usable GPU is present. tools/gpu_check.sh runs it with the rest of the GPU suite.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from conftest import _convert_tiny, _staggered_generation, dev, host  # noqa: E402
from rawinfer.quant import Fp8Weight, Int8Weight  # noqa: E402
from reference_ops import (assert_close, int8_linear_ref, linear_ref, rand, random_weight_only,  # noqa: E402
                           weight_only_values)


WEIGHT_CLASSES = {"int8": Int8Weight, "fp8": Fp8Weight}


def weight(rng, n, k, fmt):
    return WEIGHT_CLASSES[fmt](*random_weight_only(rng, n, k, fmt))


@pytest.mark.parametrize("fmt", list(WEIGHT_CLASSES))
@pytest.mark.parametrize("dtype", [bfloat16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n_out,k", [(6144, 4096), (4096, 14336), (1000, 136)])
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_int8_linear_on_the_device(gpu, dtype, n_out, k, rows, fmt):
    rng = np.random.default_rng(rows + k)
    w = weight(rng, n_out, k, fmt)
    x = rand(rng, (rows, k), dtype)
    d_w = type(w)(dev(gpu, w.q), dev(gpu, w.scale))
    scratch = gpu.empty((2048 * k // 2,), np.float32)   # tiles of 2,048 rows of 16-bit weights
    for out_dtype in (dtype, np.float32):
        out = gpu.empty((rows, n_out), out_dtype)
        bias = rand(rng, (n_out,), out_dtype)
        gpu.linear(dev(gpu, x), d_w, out, bias=dev(gpu, bias), scratch=scratch)
        got = host(gpu, out)
        if rows <= 8:
            assert_close(got, int8_linear_ref(x, weight_only_values(w.q), w.scale, bias), out_dtype, "gemv")
        else:
            deq = (weight_only_values(w.q) * w.scale[:, None]).astype(dtype)
            ref = linear_ref(x, deq, bias)
            err = np.abs(got.astype(np.float64) - ref) / np.maximum(1.0, np.abs(ref))
            assert err.max() < 4 * 2.0**-7, f"tiled GEMM: worst relative error {err.max()}"


@pytest.mark.parametrize("fmt", list(WEIGHT_CLASSES))
def test_int8_embedding_on_the_device(gpu, fmt):
    rng = np.random.default_rng(1)
    table = weight(rng, 32000, 4096, fmt)
    ids = rng.integers(0, 32000, 77).astype(np.int32)
    out = gpu.empty((77, 4096), np.float32)
    gpu.embedding(dev(gpu, ids), type(table)(dev(gpu, table.q), dev(gpu, table.scale)), out)
    np.testing.assert_array_equal(host(gpu, out), weight_only_values(table.q[ids]) * table.scale[ids, None])


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_int8_model_on_the_device_gives_the_cpu_backends_tokens(tmp_path_factory, name, quant):
    from rawinfer import LLMEngine
    model = _convert_tiny(tmp_path_factory, name, quant=quant)
    prompts = {"a": [5, 6, 7], "b": list(range(20, 47)), "c": [300, 301, 9, 11, 40, 41]}
    opts = dict(kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, itl_target_ms=0)
    got = _staggered_generation(LLMEngine(model, device="cuda", **opts), prompts, 8)
    # the CPU with what CUDA does: float32 K/V (not an int8 model's int8 cache), float activations in the products
    cpu = LLMEngine(model, device="cpu", kv_cache_dtype="float32", cpu_int_gemm=False, **opts)
    assert _staggered_generation(cpu, prompts, 8) == got
