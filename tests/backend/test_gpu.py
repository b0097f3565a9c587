"""GPU suite (marker `gpu`): every CUDA kernel on the device against its NumPy reference, the cuBLAS
GEMM convention, the pool's bf16 round trip and its sizing from free memory, CUDA graph replay (of
a hand-written step and of the model runner's decode graphs), the device sampler's batch-invariant
seeds, the refusal of int8 models, and the whole model on the GPU: the tiny checkpoints against their
reference logits and the CUDA backend against the CPU backend on a randomly initialised model of
about 250 million parameters.

Skipped, module-wide, wherever no usable GPU is present (see rawinfer.backend.cuda.runtime.cuda_status).
tools/gpu_check.sh runs it on a GPU machine:  python -m pytest -m gpu tests/backend/test_gpu.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]

from ml_dtypes import bfloat16  # noqa: E402

from reference_ops import (DTYPE_IDS, DTYPES, add_rmsnorm_ref, argmax_ref, assert_close, copy_blocks_ref,  # noqa: E402
                           cos_sin_table, embedding_ref, f64, kv_write_ref, linear_ref, make_paged_batch,
                           paged_attention_ref, rand, rmsnorm_ref, rope_ref, sample_ref, silu_mul_ref,
                           take_rows_ref)

from conftest import DATA  # noqa: E402
RESIDUAL_CASES = [(np.float32, np.float32), (np.float16, np.float16), (bfloat16, bfloat16),
                  (np.float16, np.float32), (bfloat16, np.float32)]
RESIDUAL_IDS = ["f32", "f16", "bf16", "f16-res32", "bf16-res32"]


@pytest.fixture(scope="module")
def gpu():
    from rawinfer.backend.cuda.backend import CUDABackend
    return CUDABackend()


def dev(gpu, a):
    """A device copy of host array a (bf16 travels as its bits)."""
    d = gpu.empty(a.shape, a.dtype)
    gpu.upload(d, a)
    return d


def host(gpu, d):
    gpu.synchronize()
    return gpu.to_host(d)


# ---- kernels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
def test_embedding(gpu, dtype, res_dtype):
    rng = np.random.default_rng(1)
    table = rand(rng, (8000, 4096), dtype)
    ids = rng.integers(0, 8000, 37).astype(np.int32)
    out = gpu.empty((37, 4096), res_dtype)
    gpu.embedding(dev(gpu, ids), dev(gpu, table), out)
    np.testing.assert_array_equal(f64(host(gpu, out)), f64(embedding_ref(ids, table)))


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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul(gpu, dtype):
    rng = np.random.default_rng(4)
    gate_up = rand(rng, (33, 2 * 14336), dtype, 3.0)
    out = gpu.empty((33, 14336), dtype)
    gpu.silu_mul(dev(gpu, gate_up), out)
    assert_close(host(gpu, out), silu_mul_ref(gate_up), dtype, "silu_mul")


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


def _attention(gpu, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, max_context_len=None, seed=6):
    rng = np.random.default_rng(seed)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    qkv, k_cache, v_cache, block_tables, context_lens, qsl = paged
    out = gpu.empty((qkv.shape[0], heads * head_dim), dtype)
    scale = head_dim ** -0.5
    gpu.paged_attention(*[dev(gpu, a) for a in paged], scale, out, max(q_lens),
                        max_context_len or max(ctx_lens))
    ref = paged_attention_ref(qkv, k_cache, v_cache, block_tables, context_lens, qsl, scale, heads)
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


# ---- the whole model ------------------------------------------------------------------------------
def _convert(tmp_path_factory, name, dtype):
    try:
        from rawinfer.convert import convert
    except ImportError as e:
        pytest.fail(f"rawinfer.convert cannot be imported on this machine ({e}); its gguf/tqdm imports must be "
                    "lazy so that safetensors checkpoints convert without them")
    dst = str(tmp_path_factory.mktemp("gpu-models") / f"{name}-{dtype}")
    convert(os.path.join(DATA, name), dst, dtype=dtype, progress=False)
    return dst


def _engine(path, device, **kw):
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig
    opts = dict(device=device, kv_cache_memory=64 * 1024**2, max_num_batched_tokens=256, max_num_seqs=16)
    opts.update(kw)
    return LLMEngine(path, EngineConfig(**opts))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_checkpoints_match_reference_logits(tmp_path_factory, name, dtype):
    """Teacher-forced logits at all 150 positions, as one prefill and as prefill + 129 decode steps."""
    engine = _engine(_convert(tmp_path_factory, name, dtype), "cuda")
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    ids, want = ref["seq_ids"].tolist(), ref["seq_logits"]
    for sizes in (150, [21] + [1] * 129):
        got = engine.score(ids, sizes)
        err = np.abs(got - want).max()
        if dtype == "float32":
            assert err < 1e-3, f"{name} {sizes if isinstance(sizes, int) else 'decode'}: max |err| {err}"
        else:  # bf16 weights and activations: compare what bf16 can promise
            assert err < 0.1 * np.abs(want).max(), err
            top2 = np.sort(want, -1)[:, -2:]
            sure = top2[:, 1] - top2[:, 0] > 0.1
            assert (got.argmax(-1) == want.argmax(-1))[sure].all()


def test_tiny_greedy_generation_matches_reference(tmp_path_factory):
    from rawinfer import SamplingParams
    engine = _engine(_convert(tmp_path_factory, "tiny-llama", "float32"), "cuda")
    ref = np.load(os.path.join(DATA, "tiny-llama", "reference.npz"))
    engine.add_request("r", ref["prompt_ids"].tolist(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    ties = np.nonzero(ref["step_margin"] < 1e-3)[0]
    upto = int(ties[0]) if len(ties) else 40
    assert tokens[:upto] == ref["greedy_ids"][:upto].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_replay_equals_eager(tmp_path_factory, dtype, staggered_generation):
    """The runner's decode graphs: a replay gives the bits of an eager run of the same padded batch,
    and graph-decoded tokens are what eager decoding (on teacher-forced logits) calls best."""
    path = _convert(tmp_path_factory, "tiny-llama", dtype)
    graphed = _engine(path, "cuda", max_num_seqs=8)
    runner = graphed.runner
    assert runner.graphs is not None and graphed.pool.kv.padding_block is not None
    checked = []
    real_run = runner.graphs.run

    def spy(plan):
        logits = real_run(plan)
        bucket = plan.graph_bucket
        if bucket > plan.num_seqs and not checked:       # a step with padding rows
            got = graphed.backend.to_host(logits).copy()
            want = graphed.backend.to_host(graphed.model.forward(runner.graphs.flat_batch(bucket))[:len(logits)])
            np.testing.assert_array_equal(got, want)
            checked.append(bucket)
        return logits

    runner.graphs.run = spy
    rng = np.random.default_rng(14)
    prompts = {f"r{i}": rng.integers(3, 512, n).tolist() for i, n in enumerate([3, 40, 17, 5, 90])}
    generated = staggered_generation(graphed, prompts, 12)
    assert checked and set(runner.graphs.captured) >= {1, 2, 4, 8}
    eager = _engine(path, "cuda", max_num_seqs=8, use_cuda_graphs=False)
    assert eager.runner.graphs is None
    noise = 1e-4 if dtype == "float32" else 0.05
    for rid, prompt in prompts.items():
        logits = eager.score(prompt + generated[rid])[len(prompt) - 1:-1]
        chosen = logits[np.arange(12), generated[rid]]
        assert np.all(chosen >= logits.max(-1) - noise * max(1.0, np.abs(logits).max())), rid


def test_seeded_sampling_is_batch_invariant_on_the_device_sampler(tmp_path_factory):
    from rawinfer import SamplingParams
    engine = _engine(_convert(tmp_path_factory, "tiny-llama", "float32"), "cuda")
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=7, ignore_eos=True)

    def run(prompts):
        out = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{len(prompts)}-{i}", prompt, p)
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"s{len(prompts)}-{i}"] for i in range(len(prompts))]

    alone = run([[1, 2, 3, 4]])[0]
    batched = run([[1, 2, 3, 4], [9, 9, 9], [100] * 30])
    assert batched[0] == alone and len(alone) == 16
    assert len(set(alone)) > 1


def test_pool_is_sized_from_free_device_memory(tmp_path_factory):
    import gc
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig
    path = _convert(tmp_path_factory, "tiny-llama", "float32")
    gc.collect()
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    engine = LLMEngine(path, EngineConfig(device="cuda", gpu_memory_utilization=0.2, max_num_batched_tokens=256,
                                          max_num_seqs=16))
    pool = engine.pool
    assert pool.kv_bytes == pool.total_bytes - pool.weight_bytes - pool.workspace_bytes
    assert 0.15 * free_before < pool.total_bytes <= 0.2 * free_before
    assert "gpu_memory_utilization" in pool.describe()
    assert pool.workspace.attention is not None
    del engine, pool
    gc.collect()


def test_int8_models_are_refused_at_start(tmp_path_factory):
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig
    from rawinfer.convert import convert
    dst = str(tmp_path_factory.mktemp("gpu-models") / "tiny-int8")
    convert(os.path.join(DATA, "tiny-llama"), dst, quant="int8", progress=False)
    with pytest.raises(ValueError, match="int8 weight-only models run on the CPU backend"):
        LLMEngine(dst, EngineConfig(device="cuda", kv_cache_memory=64 * 1024**2))


def _random_model_config(dtype):
    from rawinfer.config import ModelConfig, RopeConfig
    # about 250M parameters: 12 layers of C = 1024, F = 4096, 16 heads of 64, 4 KV heads, V = 32000
    return ModelConfig(architecture="llama", vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                       num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, dtype=dtype,
                       rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=1024))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gpu_and_cpu_engines(request):
    """The same random model on both backends; the CPU copy gets the GPU's (possibly bf16) weights."""
    from rawinfer import LLMEngine
    from rawinfer.config import EngineConfig
    common = dict(kv_cache_memory=256 * 1024**2, max_num_batched_tokens=512, max_num_seqs=16)
    gpu_engine = LLMEngine.random(_random_model_config(request.param), EngineConfig(device="cuda", **common), seed=3)
    cpu_engine = LLMEngine.random(_random_model_config("float32"), EngineConfig(device="cpu", **common), seed=3)
    for name, view in gpu_engine.pool.weights.items():
        cpu_engine.backend.upload(cpu_engine.pool.weights[name],
                                  gpu_engine.backend.to_host(view).astype(np.float32))
    return gpu_engine, cpu_engine, request.param


def test_random_model_cuda_matches_cpu_logits(gpu_and_cpu_engines):
    gpu_engine, cpu_engine, dtype = gpu_and_cpu_engines
    ids = np.random.default_rng(12).integers(0, 32000, 300).tolist()
    for sizes in (300, [100, 77] + [1] * 23 + [100]):   # prefill, chunked prefill, decode steps, a chunk again
        got, want = gpu_engine.score(ids, sizes), cpu_engine.score(ids, sizes)
        scale = np.abs(want).max()
        if dtype == "float32":
            np.testing.assert_allclose(got, want, atol=2e-4 * scale, rtol=0)
        else:
            assert np.abs(got - want).max() < 0.1 * scale
            assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


def test_random_model_cuda_generation_is_a_cpu_argmax(gpu_and_cpu_engines):
    """Continuous batching on the GPU (staggered prompts, decode and prefill mixed): every greedy token
    it picks is, on the CPU backend's teacher-forced logits, within noise of the best one."""
    from rawinfer import SamplingParams
    gpu_engine, cpu_engine, dtype = gpu_and_cpu_engines
    rng = np.random.default_rng(13)
    prompts = {f"r{i}": rng.integers(0, 32000, n).tolist() for i, n in enumerate([5, 130, 17, 64, 1, 300])}
    generated = {rid: [] for rid in prompts}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    pending = list(prompts.items())
    while pending or gpu_engine.has_unfinished():
        if pending:
            rid, prompt = pending.pop(0)
            gpu_engine.add_request(rid, prompt, params)
        for out in gpu_engine.step():
            generated[out.request_id] += out.new_token_ids
    noise = 1e-3 if dtype == "float32" else 0.15
    for rid, prompt in prompts.items():
        assert len(generated[rid]) == 24
        seq = prompt + generated[rid]
        logits = cpu_engine.score(seq)[len(prompt) - 1:-1]
        chosen = logits[np.arange(24), generated[rid]]
        assert np.all(chosen >= logits.max(-1) - noise * max(1.0, np.abs(logits).max())), rid
