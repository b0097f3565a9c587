"""GPU suite (marker `gpu`), the kernels: every CUDA kernel on the device against its NumPy reference
(the layer ops, the Gemma 3 / Qwen3 ops: scaled embedding, per-head RMSNorm, GeGLU, and sliding-window
attention), the cuBLAS GEMM convention, the pool's bf16 round trip, and the replay of a hand-written
step captured as a CUDA graph.  The whole model on the GPU is test_gpu_model.py.

Skipped, module-wide, wherever no usable GPU is present (see rawinfer.backend.cuda.runtime.cuda_status).
tools/gpu_check.sh runs it on a GPU machine:  python -m pytest -m gpu tests/backend/test_gpu*.py
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from conftest import dev, host  # noqa: E402
from reference_ops import (DTYPE_IDS, DTYPES, add_rmsnorm_ref, argmax_ref, assert_close, copy_blocks_ref,  # noqa: E402
                           cos_sin_table, embedding_ref, f64, gelu_tanh_mul_ref, head_rmsnorm_ref, kv_write_ref,
                           linear_ref, make_paged_batch, paged_attention_ref, rand, rmsnorm_ref, rope_ref,
                           sample_ref, silu_mul_ref, take_rows_ref)


RESIDUAL_CASES = [(np.float32, np.float32), (np.float16, np.float16), (bfloat16, bfloat16),
                  (np.float16, np.float32), (bfloat16, np.float32)]
RESIDUAL_IDS = ["f32", "f16", "bf16", "f16-res32", "bf16-res32"]


# ---- kernels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
def test_embedding(gpu, dtype, res_dtype):
    rng = np.random.default_rng(1)
    table = rand(rng, (8000, 4096), dtype)
    ids = rng.integers(0, 8000, 37).astype(np.int32)
    out = gpu.empty((37, 4096), res_dtype)
    d_ids, d_table = dev(gpu, ids), dev(gpu, table)
    gpu.embedding(d_ids, d_table, out)
    np.testing.assert_array_equal(f64(host(gpu, out)), f64(embedding_ref(ids, table)))
    gpu.embedding(d_ids, d_table, out, 64.0)        # Gemma's sqrt(hidden)
    assert_close(host(gpu, out), embedding_ref(ids, table, 64.0), res_dtype, "scaled embedding")


@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("shape", [(67, 4096), (3, 5120), (1, 896)])
def test_rmsnorm_and_add_rmsnorm(gpu, dtype, res_dtype, shape):
    rng = np.random.default_rng(2)
    x, w = rand(rng, shape, res_dtype, 3.0), rand(rng, shape[1:], dtype)
    out = gpu.empty(shape, dtype)
    gpu.rmsnorm(dev(gpu, x), dev(gpu, w), 1e-5, out)
    assert_close(host(gpu, out), rmsnorm_ref(x, w, 1e-5), dtype, "rmsnorm")
    h, residual = rand(rng, shape, dtype), rand(rng, shape, res_dtype, 2.0)
    ref_out, ref_residual = add_rmsnorm_ref(h, residual, w, 1e-6)
    d_residual = dev(gpu, residual)
    gpu.add_rmsnorm(dev(gpu, h), d_residual, dev(gpu, w), 1e-6, out)
    np.testing.assert_array_equal(f64(host(gpu, d_residual)), f64(ref_residual))
    assert_close(host(gpu, out), ref_out, dtype, "add_rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [
    (100, 32, 8, 128),      # Qwen3-8B-like
    (37, 4, 1, 256),        # Gemma 3 270M
    (1, 16, 8, 128),
    (3, 5, 1, 64),
])
def test_head_rmsnorm(gpu, dtype, n, heads, kv_heads, head_dim):
    rng = np.random.default_rng(15)
    qkv = rand(rng, (n, (heads + 2 * kv_heads) * head_dim), dtype, 3.0)
    q_weight, k_weight = rand(rng, (head_dim,), dtype), rand(rng, (head_dim,), dtype)
    d = dev(gpu, qkv)
    gpu.head_rmsnorm(d, dev(gpu, q_weight), dev(gpu, k_weight), 1e-6, heads, kv_heads)
    got = host(gpu, d)
    assert_close(got, head_rmsnorm_ref(qkv, q_weight, k_weight, 1e-6, heads, kv_heads), dtype, "head_rmsnorm")
    v = slice((heads + kv_heads) * head_dim, None)
    np.testing.assert_array_equal(f64(got[:, v]), f64(qkv[:, v]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (14, 2, 64), (8, 8, 256)])
def test_rope(gpu, dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(3)
    qkv = rand(rng, (100, (heads + 2 * kv_heads) * head_dim), dtype)
    positions = rng.integers(0, 8192, 100).astype(np.int32)
    cos_sin = cos_sin_table(8192, head_dim, theta=500000.0)
    ref = rope_ref(qkv, positions, cos_sin, heads, kv_heads)
    d = dev(gpu, qkv)
    gpu.rope(d, dev(gpu, positions), dev(gpu, cos_sin), heads, kv_heads)
    assert_close(host(gpu, d), ref, dtype, "rope")


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_activations(gpu, op, dtype):
    rng = np.random.default_rng(4)
    gate_up = rand(rng, (33, 2 * 14336), dtype, 3.0)
    gate_up[0, :6] = [-30.0, -9.0, -0.5, 0.0, 9.0, 30.0]   # both tails and zero
    out = gpu.empty((33, 14336), dtype)
    getattr(gpu, op)(dev(gpu, gate_up), out)
    ref = {"silu_mul": silu_mul_ref, "gelu_tanh_mul": gelu_tanh_mul_ref}[op](gate_up)
    assert_close(host(gpu, out), ref, dtype, op)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kv_write(gpu, dtype):
    rng = np.random.default_rng(5)
    nb, hkv, bs, d, heads, n = 64, 8, 16, 128, 32, 100
    k_cache, v_cache = rand(rng, (nb, hkv, bs, d), dtype), rand(rng, (nb, hkv, bs, d), dtype)
    qkv = rand(rng, (n, (heads + 2 * hkv) * d), dtype)
    slots = rng.permutation(nb * bs)[:n].astype(np.int32)
    ref_k, ref_v = kv_write_ref(qkv, k_cache, v_cache, slots, heads)
    dk, dv = dev(gpu, k_cache), dev(gpu, v_cache)
    gpu.kv_write(dev(gpu, qkv), dk, dv, dev(gpu, slots), heads)
    np.testing.assert_array_equal(f64(host(gpu, dk)), f64(ref_k))
    np.testing.assert_array_equal(f64(host(gpu, dv)), f64(ref_v))


def _attention(gpu, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, max_context_len=None, seed=6,
               window=0):
    """paged_attention against its reference.  With a window, every block wholly before the window of its
    sequence's first query is then filled with NaN: the scheduler may have freed it, so the kernels must
    not read it, and one read would make the output NaN."""
    rng = np.random.default_rng(seed)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    _, k_cache, v_cache, block_tables, context_lens, _ = paged
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        first = max(0, ctx - q_len - window + 1) if window else 0
        k_cache[block_tables[b, :first // block_size]] = np.nan
        v_cache[block_tables[b, :first // block_size]] = np.nan
    out = gpu.empty((paged[0].shape[0], heads * head_dim), dtype)
    gpu.paged_attention(*[dev(gpu, a) for a in paged], scale, out, max(q_lens),
                        max_context_len or max(ctx_lens), window)
    assert_close(host(gpu, out), ref, dtype, "attention")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", [
    (32, 8, 128, 16, [1, 100, 513, 4097]),     # Llama-3-8B heads, up to 9 splits
    (14, 2, 64, 16, [2000, 37, 1]),            # Qwen2.5-0.5B-like, G = 7
    (32, 32, 128, 16, [300, 1200]),            # no grouping
    (8, 1, 256, 32, [777]),                    # MQA, D = 256 (smaller partition)
    (32, 8, 128, 16, [20000]),                 # one long sequence: 40 splits fill the GPU
], ids=["llama3", "g7", "mha", "mqa-d256", "long"])
def test_paged_attention_decode(gpu, dtype, case):
    heads, kv_heads, head_dim, block_size, ctx = case
    _attention(gpu, dtype, [1] * len(ctx), ctx, heads, kv_heads, head_dim, block_size)


def test_paged_attention_decode_fixed_bound(gpu):
    """The grid sized for the model length (what a captured graph uses) gives the same result."""
    _attention(gpu, np.float16, [1, 1], [700, 33], 32, 8, 128, 16, max_context_len=8192)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", [
    (32, 8, 128, 16, [100, 1, 37], [100, 300, 2000]),    # prompt, decode row, chunk after a long past
    (14, 2, 64, 16, [513], [513]),
    (8, 8, 256, 16, [40, 9], [40, 90]),
], ids=["mixed", "g7-long", "d256"])
def test_paged_attention_prefill(gpu, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx = case
    _attention(gpu, dtype, q_lens, ctx, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths, window
    (4, 1, 256, 16, [1, 1, 1, 1], [1, 100, 513, 4097], 512),          # Gemma 3 270M's local layers, decode
    (4, 1, 256, 16, [300, 17, 1], [300, 2000, 700], 512),            # the same in prefill chunks
    (32, 8, 128, 32, [1, 1, 1], [4096, 4097, 9000], 4096),           # Mistral-7B-v0.1's window, decode
    (32, 8, 128, 32, [100, 513], [5000, 513], 4096),                 # and prefill, past longer than the window
    (16, 8, 128, 16, [1, 1, 37], [5, 40, 60], 24),                   # Qwen3-like heads, a small window
    (8, 2, 64, 16, [1, 1, 20], [1, 33, 33], 1),                      # W = 1: each query sees itself
], ids=["gemma-decode", "gemma-prefill", "mistral-decode", "mistral-prefill", "w24", "w1"])
def test_paged_attention_window(gpu, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx, window = case
    _attention(gpu, dtype, q_lens, ctx, heads, kv_heads, head_dim, block_size, window=window)


def test_paged_attention_window_fixed_bound(gpu):
    """A windowed decode step with the grid sized for the model length (what a captured graph uses)."""
    _attention(gpu, np.float16, [1, 1, 1], [700, 33, 5000], 4, 1, 256, 16, max_context_len=32768, window=512)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_blocks_and_take_rows(gpu, dtype):
    rng = np.random.default_rng(7)
    ks_host = [rand(rng, (20, 8, 16, 128), dtype) for _ in range(4)]
    vs_host = [rand(rng, (20, 8, 16, 128), dtype) for _ in range(4)]
    pairs = [(3, 7), (19, 0), (3, 11)]
    kd, vd = [dev(gpu, a) for a in ks_host], [dev(gpu, a) for a in vs_host]
    gpu.copy_blocks(kd, vd, pairs)
    for got, ref in zip(kd + vd, copy_blocks_ref(ks_host, pairs) + copy_blocks_ref(vs_host, pairs)):
        np.testing.assert_array_equal(f64(host(gpu, got)), f64(ref))
    x = rand(rng, (300, 4096), dtype)
    idx = np.array([299, 0, 17, 17], np.int32)
    out = gpu.empty((4, 4096), dtype)
    gpu.take_rows(dev(gpu, x), dev(gpu, idx), out)
    np.testing.assert_array_equal(f64(host(gpu, out)), f64(take_rows_ref(x, idx)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_argmax_and_sample(gpu, dtype):
    rng = np.random.default_rng(8)
    logits = rand(rng, (6, 128256), dtype, 4.0)
    logits[1, [5, 90000]] = 60.0
    np.testing.assert_array_equal(gpu.argmax(dev(gpu, logits)), argmax_ref(logits))
    rows = 10
    logits = rand(rng, (rows, 32000), dtype, 3.0)
    temperature = np.array([0, 1, 0.7, 1, 1.3, 0.5, 1, 1, 2, 0.9], np.float32)
    top_k = np.array([0, 0, 50, 1, 20, 0, 0, 3, 0, 40], np.int32)
    top_p = np.array([1, 1, 1, 1, 1, 0.9, 0.5, 0.3, 1, 0.8], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0.1, 0.05], np.float32)
    uniform = rng.random(rows).astype(np.float32)
    got = gpu.sample(dev(gpu, logits), temperature, top_k, top_p, min_p, uniform)
    ref, ambiguous = sample_ref(logits, temperature, top_k, top_p, min_p, uniform)
    assert ambiguous.sum() <= 1
    np.testing.assert_array_equal(got[~ambiguous], ref[~ambiguous])


@pytest.mark.parametrize("dtype,out_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                             (bfloat16, bfloat16), (bfloat16, np.float32), (np.float16, np.float32)])
def test_linear(gpu, dtype, out_dtype):
    """cuBLAS through the documented row-major convention, with and without bias."""
    rng = np.random.default_rng(9)
    x, w, bias = rand(rng, (37, 4096), dtype), rand(rng, (1000, 4096), dtype, 0.02), rand(rng, (1000,), out_dtype)
    out = gpu.empty((37, 1000), out_dtype)
    for b in (None, bias):
        gpu.linear(dev(gpu, x), dev(gpu, w), out, bias=None if b is None else dev(gpu, b))
        want = linear_ref(x, w, b)
        err = np.abs(f64(host(gpu, out)) - want).max() / np.abs(want).max()
        assert err < {np.dtype(np.float32): 1e-5}.get(np.dtype(out_dtype), 1e-2), err


def test_arena_carve_upload_roundtrip(gpu):
    arena = gpu.alloc_arena(1 << 20)
    view = gpu.carve(arena, 4096, (64, 100), bfloat16)
    values = np.random.default_rng(10).standard_normal((64, 100)).astype(np.float32)
    gpu.upload(view, values)
    back = gpu.to_host(view)
    assert back.dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(back, values.astype(bfloat16))
    free, total = gpu.device_memory_info()
    assert 0 < free <= total


def test_cuda_graph_replay_matches_eager(gpu):
    """A decode-like sequence of launches captured once and replayed gives the eager result bit for
    bit, and a replay reads whatever the input buffers hold at that moment."""
    rng = np.random.default_rng(11)
    dtype, heads, kv_heads, head_dim, bs = bfloat16, 32, 8, 128, 16
    paged = make_paged_batch(rng, dtype, [1] * 8, [1, 40, 300, 17, 999, 64, 2, 513], heads, kv_heads, head_dim, bs)
    qkv, k_cache, v_cache, block_tables, context_lens, qsl = [dev(gpu, a) for a in paged]
    hidden = 4096
    x = dev(gpu, rand(rng, (8, hidden), dtype))
    w_norm = dev(gpu, rand(rng, (hidden,), dtype))
    w_qkv = dev(gpu, rand(rng, (qkv.shape[1], hidden), dtype, 0.02))
    cos_sin = dev(gpu, cos_sin_table(1024, head_dim))
    positions = dev(gpu, (paged[4] - 1).astype(np.int32))
    w_out = dev(gpu, rand(rng, (hidden, heads * head_dim), dtype, 0.02))
    normed, attn = gpu.empty((8, hidden), dtype), gpu.empty((8, heads * head_dim), dtype)
    out = gpu.empty((8, hidden), np.float32)
    workspace = gpu.alloc_arena(gpu.attention_workspace_bytes(8, heads, head_dim, bs, 1024, 2, kv_heads))
    gpu.bind_attention_workspace(workspace)
    slots = dev(gpu, np.array([block_tables_host_slot(paged, b, bs) for b in range(8)], np.int32))

    def step():
        gpu.rmsnorm(x, w_norm, 1e-5, normed)
        gpu.linear(normed, w_qkv, qkv)
        gpu.rope(qkv, positions, cos_sin, heads, kv_heads)
        gpu.kv_write(qkv, k_cache, v_cache, slots, heads)
        gpu.paged_attention(qkv, k_cache, v_cache, block_tables, context_lens, qsl, head_dim ** -0.5, attn, 1, 1024)
        gpu.linear(attn, w_out, out)

    try:
        graph = gpu.capture_graph(step)           # runs step() once eagerly first
        for trial in range(2):
            gpu.upload(x, rand(np.random.default_rng(100 + trial), (8, hidden), dtype))
            step()
            eager = host(gpu, out).copy()
            gpu.upload(out, np.zeros((8, hidden), np.float32))
            graph.replay()
            np.testing.assert_array_equal(host(gpu, out), eager)
    finally:
        gpu.bind_attention_workspace(None)


def block_tables_host_slot(paged, b, bs):
    """The slot of the last position of sequence b (where this step's K/V go)."""
    block_tables, context_lens = paged[3], paged[4]
    pos = int(context_lens[b]) - 1
    return int(block_tables[b, pos // bs]) * bs + pos % bs
