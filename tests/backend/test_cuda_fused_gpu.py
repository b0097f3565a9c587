"""GPU suite (marker `gpu`) for the fused ops and the decode graphs: fused_rope_kv_write (with and without
the q/k norm) and norm_add_rmsnorm on the device against the NumPy references and against the separate
ops' kernels, at the supported families' head shapes; and an engine whose first decode step captures every
bucket and measures the graphs' device memory. The same kernels on the host shim: test_cuda_fused.py.

Skipped wherever no usable GPU is present. tools/gpu_check.sh runs it with the rest of the GPU suite.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.base import Backend
from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from conftest import _convert_tiny, _staggered_generation, dev, host  # noqa: E402
from reference_ops import (DTYPE_IDS, DTYPES, add_rmsnorm_ref, assert_close, cos_sin_table, head_rmsnorm_ref,  # noqa: E402
                           kv_write_ref, rand, rmsnorm_ref, rope_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (4, 1, 256), (16, 8, 128)])
def test_fused_rope_kv_write(gpu, dtype, qk_norm, heads, kv_heads, head_dim):
    rng = np.random.default_rng(head_dim + heads)
    n, nb, bs = 77, 8, 16
    qkv = rand(rng, (n, (heads + 2 * kv_heads) * head_dim), dtype, 3.0)
    positions = rng.integers(0, 8192, n).astype(np.int32)
    cos_sin = cos_sin_table(8192, head_dim, theta=500000.0)
    k_cache, v_cache = rand(rng, (nb, kv_heads, bs, head_dim), dtype), rand(rng, (nb, kv_heads, bs, head_dim), dtype)
    slots = rng.permutation(nb * bs)[:n].astype(np.int32)
    norms = tuple((1.0 + rand(rng, (head_dim,), dtype, 0.3)).astype(dtype) for _ in range(2)) if qk_norm else (None, None)
    ref = qkv
    if qk_norm:
        ref = head_rmsnorm_ref(ref, *norms, 1e-6, heads, kv_heads).astype(np.float32).astype(dtype)
    ref = rope_ref(ref, positions, cos_sin, heads, kv_heads).astype(np.float32).astype(dtype)
    ref_k, ref_v = kv_write_ref(ref, k_cache, v_cache, slots, heads)
    args = (dev(gpu, positions), dev(gpu, cos_sin))
    d_norms = tuple(None if w is None else dev(gpu, w) for w in norms)
    outs = []
    for fn in (gpu.fused_rope_kv_write, lambda *a: Backend.fused_rope_kv_write(gpu, *a)):
        d_qkv, dk, dv = dev(gpu, qkv), dev(gpu, k_cache), dev(gpu, v_cache)
        fn(d_qkv, *args, dk, dv, dev(gpu, slots), heads, kv_heads, *d_norms, 1e-6)
        outs.append([host(gpu, a) for a in (d_qkv, dk, dv)])
    for got, sep in zip(*outs):
        assert_close(got, sep, dtype, "fused vs separate")
    assert_close(outs[0][0], ref, dtype, "qkv")
    assert_close(outs[0][1], ref_k, dtype, "k_cache")
    np.testing.assert_array_equal(outs[0][2].astype(np.float64), ref_v.astype(np.float64))


@pytest.mark.parametrize("dtype,res_dtype", [(np.float32, np.float32), (bfloat16, np.float32), (np.float16, np.float32),
                                             (bfloat16, bfloat16)], ids=["f32", "bf16-res32", "f16-res32", "bf16"])
@pytest.mark.parametrize("n,hidden", [(1, 640), (64, 4096), (33, 1152)])
def test_norm_add_rmsnorm(gpu, dtype, res_dtype, n, hidden):
    rng = np.random.default_rng(hidden)
    x, residual = rand(rng, (n, hidden), dtype, 4.0), rand(rng, (n, hidden), res_dtype, 2.0)
    x_weight, weight = ((1.0 + rand(rng, (hidden,), dtype, 0.3)).astype(dtype) for _ in range(2))
    normed = rmsnorm_ref(x, x_weight, 1e-6).astype(np.float32).astype(dtype)
    ref_out, ref_residual = add_rmsnorm_ref(normed, residual, weight, 1e-6)
    d_res, out = dev(gpu, residual), gpu.empty((n, hidden), dtype)
    gpu.norm_add_rmsnorm(dev(gpu, x), dev(gpu, x_weight), d_res, dev(gpu, weight), 1e-6, out)
    assert_close(host(gpu, d_res), ref_residual, res_dtype if res_dtype is not np.float32 else dtype, "residual")
    assert_close(host(gpu, out), ref_out, dtype, "norm_add_rmsnorm")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_first_decode_step_captures_every_bucket_on_the_device(tmp_path_factory, caplog, name):
    """Every bucket captured at the first decode step, its device memory measured, and the graph-decoded
    tokens what eager decoding (teacher-forced logits) calls best."""
    import logging

    from rawinfer import LLMEngine
    model = _convert_tiny(tmp_path_factory, name, "float32")
    opts = dict(device="cuda", kv_cache_memory="64MiB", max_num_batched_tokens=256, max_num_seqs=12, warmup=False)
    engine = LLMEngine(model, **opts)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4, 8, 12) and graphs.captured == ()
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(3, 500, n).tolist() for i, n in enumerate([3, 40, 17, 5])}
    with caplog.at_level(logging.INFO, logger="rawinfer"):
        generated = _staggered_generation(engine, prompts, 8)
    assert graphs.captured == graphs.buckets and graphs.device_bytes is not None
    assert any(r.getMessage().startswith("decode graphs: batch sizes 1, 2, 4, 8, 12 captured") for r in caplog.records)
    eager = LLMEngine(model, **opts, use_cuda_graphs=False)
    for rid, prompt in prompts.items():
        logits = eager.score(prompt + generated[rid])[len(prompt) - 1:-1]
        chosen = logits[np.arange(8), generated[rid]]
        assert np.all(chosen >= logits.max(-1) - 1e-4 * max(1.0, np.abs(logits).max())), rid
