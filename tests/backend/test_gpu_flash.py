"""GPU suite (marker `gpu`): both prefill kernels on the device for f16 / bf16, against paged_attention_ref.

test_gpu.py's prefill and window cases now run the tensor-core kernel for f16 / bf16 (CUDABackend picks
it); here the same kind of batches run once with each kernel (`flash_prefill` on and off), so the FMA
kernel keeps its device coverage for the half types, plus a 600-token Llama-3-8B-shaped prompt split
over several query and key tiles.  And the fragment-layout checks of test_cuda_shim_mma.py on the tensor
cores themselves (mma.sync, ldmatrix), so the host shim's layouts are pinned to the hardware's as well as
to the PTX ISA's tables.  Skipped wherever no usable GPU is present; tools/gpu_check.sh runs it.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from conftest import dev  # noqa: E402
from reference_ops import assert_close, make_paged_batch, paged_attention_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths, window
    (32, 8, 128, 16, [600], [600], 0),                     # Llama-3-8B heads, one prompt: 38 packed tiles
    (32, 8, 128, 16, [100, 1, 37], [100, 300, 2000], 0),   # a mixed step: prompt, decode row, chunk
    (14, 2, 64, 16, [513], [513], 0),                      # Qwen2.5-0.5B-like, G = 7
    (4, 1, 256, 16, [300, 17], [300, 2000], 512),          # Gemma 3's local layers in prefill chunks
    (32, 8, 128, 32, [100, 300], [1500, 300], 1024),       # a window, a past longer than it
], ids=["llama3-prompt", "mixed", "g7", "gemma-window", "long-past-window"])
def test_prefill_kernels_on_device(gpu, dtype, case):
    """Each kernel in turn on the same batch (one float64 reference for both)."""
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window = case
    rng = np.random.default_rng(11)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    args = [dev(gpu, a) for a in paged]
    try:
        for flash in (True, False):
            gpu.flash_prefill = flash
            out = gpu.empty((paged[0].shape[0], heads * head_dim), dtype)
            assert gpu.uses_flash_prefill(args[0], args[1], args[2], out, head_dim) == flash
            gpu.paged_attention_prefill(*args, scale, out, max(q_lens), window)
            gpu.synchronize()
            assert_close(gpu.to_host(out), ref, dtype, f"prefill attention ({'tensor cores' if flash else 'FMA'})")
    finally:
        gpu.flash_prefill = True


# ---- the tensor-core wrappers on the device: the shim's layouts are the hardware's ------------------
@pytest.fixture(scope="module")
def device_run():
    """Launches tests/cuda_shim/shim_mma_selftest.cu's kernels on the GPU with NumPy arguments copied in
    and back, in the calling convention of test_cuda_shim_mma.py's `run`."""
    import cupy as cp

    from cuda_shim import harness
    from rawinfer.backend.cuda import kernel_specs as ks
    import test_cuda_shim_mma as shim_mma

    common = (harness.CUDA_DIR / "common.cuh").read_text()
    text = (harness.SHIM_DIR / "shim_mma_selftest.cu").read_text().replace('#include "common.cuh"', common, 1)
    specs = {s.name: s for s in shim_mma.SPECS}
    exprs = [s.name_expression(t) for s in shim_mma.SPECS for t in (s.instances or [()])]
    module = cp.RawModule(code=text, name_expressions=exprs)

    def run(name, targs, smem, *args):
        packed = ks.pack_args(specs[name], targs, args)
        on_device = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in packed]
        module.get_function(specs[name].name_expression(targs))((1,), (32,), tuple(on_device), shared_mem=smem)
        cp.cuda.get_current_stream().synchronize()
        for host_array, dev_array in zip(packed, on_device):
            if isinstance(host_array, np.ndarray):
                host_array[...] = cp.asnumpy(dev_array)
    return run


@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
def test_device_mma_layouts_match_the_shim(device_run, dtype_name):
    """The layout checks of test_cuda_shim_mma.py, run on the tensor cores themselves."""
    import test_cuda_shim_mma as shim_mma
    shim_mma.test_mma_identity_and_selectors_show_where_each_element_came_from(device_run, dtype_name)
    shim_mma.test_mma_random_matches_numpy(device_run, dtype_name)


@pytest.mark.parametrize("trans", [0, 1])
def test_device_ldmatrix_layouts_match_the_shim(device_run, trans):
    import test_cuda_shim_mma as shim_mma
    shim_mma.test_ldmatrix_x4_layout(device_run, trans)
    if trans:
        shim_mma.test_ldmatrix_b_fragments_feed_mma(device_run)
