"""GPU suite (marker `gpu`): both prefill kernels on the device for f16 / bf16, against paged_attention_ref.

test_gpu.py's prefill and window cases now run the tensor-core kernel for f16 / bf16 (CUDABackend picks
it); here the same kind of batches run once with each kernel (`flash_prefill` on and off), so the FMA
kernel keeps its device coverage for the half types, plus a 600-token Llama-3-8B-shaped prompt split
over several query and key tiles.  Skipped wherever no usable GPU is present; tools/gpu_check.sh runs it.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from reference_ops import assert_close, make_paged_batch, paged_attention_ref  # noqa: E402


@pytest.fixture(scope="module")
def gpu():
    from rawinfer.backend.cuda.backend import CUDABackend
    return CUDABackend()


def dev(gpu, a):
    d = gpu.empty(a.shape, a.dtype)
    gpu.upload(d, a)
    return d


@pytest.mark.parametrize("flash", [True, False], ids=["tensor-cores", "fma"])
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths, window
    (32, 8, 128, 16, [600], [600], 0),                     # Llama-3-8B heads, one prompt: 10 query tiles
    (32, 8, 128, 16, [100, 1, 37], [100, 300, 2000], 0),   # a mixed step: prompt, decode row, chunk
    (14, 2, 64, 16, [513], [513], 0),                      # Qwen2.5-0.5B-like, G = 7
    (4, 1, 256, 16, [300, 17], [300, 2000], 512),          # Gemma 3's local layers in prefill chunks
    (32, 8, 128, 32, [100, 513], [5000, 513], 4096),       # Mistral's window, a past longer than it
], ids=["llama3-prompt", "mixed", "g7", "gemma-window", "mistral-window"])
def test_prefill_kernels_on_device(gpu, flash, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window = case
    rng = np.random.default_rng(11)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    gpu.flash_prefill = flash
    try:
        args = [dev(gpu, a) for a in paged]
        out = gpu.empty((paged[0].shape[0], heads * head_dim), dtype)
        assert gpu.uses_flash_prefill(args[0], args[1], args[2], out, head_dim) == flash
        gpu.paged_attention_prefill(*args, scale, out, max(q_lens), window)
        gpu.synchronize()
        assert_close(gpu.to_host(out), ref, dtype, "prefill attention")
    finally:
        gpu.flash_prefill = True
