"""The CUDA layer kernels, run on the CPU under tests/cuda_shim, against a NumPy <op>_ref.

The kernels are the real cuda/*.cu sources compiled by g++ with the execution shim, launched through
the real `CUDABackend` op methods (shape checks, launch geometry, kernel_specs argument packing) with a
host launcher in place of CuPy.  Shapes are small (the shim runs one OS thread per CUDA thread) but
ragged, not multiples of tiles or warps.  Tolerances: about two units in the last place of the storage
dtype.  The paged attention kernels are in test_cuda_shim_attention.py, the shim's own tests in
test_cuda_shim_selftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda import kernel_specs as ks

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from reference_ops import (DTYPE_IDS, DTYPES, add_rmsnorm_ref, argmax_ref, assert_close, copy_blocks_ref,  # noqa: E402
                           cos_sin_table, embedding_ref, f64, gelu_tanh_mul_ref, head_rmsnorm_ref, kv_write_ref,
                           linear_ref, rand, rmsnorm_ref, rope_ref, sample_ref, silu_mul_ref, take_rows_ref)


@pytest.fixture
def backend(shim_libraries):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries))


# ---- argument packing -----------------------------------------------------------------------------
def test_pack_args_checks_dtype_layout_and_ranges():
    spec = ks.SPECS["take_rows_kernel"]
    x, idx, out = np.zeros((4, 3), np.float16), np.zeros(2, np.int32), np.zeros((2, 3), np.float16)
    packed = ks.pack_args(spec, ("f16",), [out, x, idx, 3])
    assert isinstance(packed[3], np.int32)
    with pytest.raises(ks.KernelArgumentError, match="dtype float16"):
        ks.pack_args(spec, ("f16",), [out.astype(np.float32), x, idx, 3])
    with pytest.raises(ks.KernelArgumentError, match="C-contiguous"):
        ks.pack_args(spec, ("f16",), [out, np.zeros((3, 4), np.float16).T, idx, 3])
    with pytest.raises(ks.KernelArgumentError, match="integer"):
        ks.pack_args(spec, ("f16",), [out, x, idx, 2**31])
    with pytest.raises(ks.KernelArgumentError, match="takes 4 arguments"):
        ks.pack_args(spec, ("f16",), [out, x, idx])
    with pytest.raises(ks.KernelArgumentError, match="no instance"):
        ks.pack_args(spec, ("double",), [out, x, idx, 3])
    assert ks.pack_args(spec, ("bf16",), [out.view(np.uint16), x.view(bfloat16), idx, 3])


def test_spec_mismatch_fails_the_build(monkeypatch, tmp_path):
    """kernel_specs must match the .cu signature: a wrong entry stops the host build (and nvcc's)."""
    wrong = ks.KernelSpec("take_rows_kernel", "take_rows.cu", ks.signature("T* out, const T* x, const int* indices, float cols"),
                          ("T",), (("float",),))
    monkeypatch.setenv("RAWINFER_SHIM_CACHE", str(tmp_path))
    with pytest.raises(harness.ShimBuildError, match="disagrees with the signature"):
        harness.build("take_rows.cu", [wrong])


# ---- layer kernels --------------------------------------------------------------------------------
# (storage dtype, residual dtype): the engine's pool keeps the residual stream in float32.
RESIDUAL_CASES = [(np.float32, np.float32), (np.float16, np.float16), (bfloat16, bfloat16),
                  (np.float16, np.float32), (bfloat16, np.float32)]
RESIDUAL_IDS = ["f32", "f16", "bf16", "f16-res32", "bf16-res32"]


@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("n,hidden", [(9, 70), (1, 16), (17, 640)])
def test_embedding(backend, dtype, res_dtype, n, hidden):
    rng = np.random.default_rng(1)
    table = rand(rng, (50, hidden), dtype)
    ids = rng.integers(0, 50, n).astype(np.int32)
    out = np.zeros((n, hidden), res_dtype)
    backend.embedding(ids, table, out)
    np.testing.assert_array_equal(f64(out), f64(embedding_ref(ids, table)))   # scale 1: the exact rows
    scale = float(np.sqrt(hidden))   # Gemma's embedding scale
    backend.embedding(ids, table, out, scale)
    assert_close(out, embedding_ref(ids, table, scale), res_dtype, "scaled embedding")


@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("shape", [(5, 64), (3, 130), (2, 1000)])
def test_rmsnorm(backend, dtype, res_dtype, shape):
    rng = np.random.default_rng(2)
    x, w = rand(rng, shape, res_dtype, 3.0), rand(rng, shape[1:], dtype)
    out = np.zeros(shape, dtype)
    backend.rmsnorm(x, w, 1e-5, out)
    assert_close(out, rmsnorm_ref(x, w, 1e-5), dtype, "rmsnorm")
    if res_dtype is dtype:
        backend.rmsnorm(x, w, 1e-5, x)  # in place
        assert_close(x, out, dtype, "in place")


@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("shape", [(4, 96), (3, 300)])
def test_add_rmsnorm(backend, dtype, res_dtype, shape):
    rng = np.random.default_rng(3)
    x, residual, w = rand(rng, shape, dtype), rand(rng, shape, res_dtype, 2.0), rand(rng, shape[1:], dtype)
    ref_out, ref_residual = add_rmsnorm_ref(x, residual, w, 1e-6)
    out = np.zeros(shape, dtype)
    backend.add_rmsnorm(x, residual, w, 1e-6, out)
    np.testing.assert_array_equal(f64(residual), f64(ref_residual))
    assert_close(out, ref_out, dtype, "add_rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 64), (2, 2, 6)])
def test_rope(backend, dtype, heads, kv_heads, head_dim):
    rng = np.random.default_rng(4)
    n = 7
    qkv = rand(rng, (n, (heads + 2 * kv_heads) * head_dim), dtype)
    positions = rng.integers(0, 40, n).astype(np.int32)
    cos_sin = cos_sin_table(40, head_dim, theta=500000.0)
    ref = rope_ref(qkv, positions, cos_sin, heads, kv_heads)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].copy()
    backend.rope(qkv, positions, cos_sin, heads, kv_heads)
    assert_close(qkv, ref, dtype, "rope")
    np.testing.assert_array_equal(f64(qkv[:, (heads + kv_heads) * head_dim:]), f64(v_before))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [
    (3, 4, 1, 256),     # Gemma 3 270M: 4 q heads and 1 kv head of 256
    (1, 2, 2, 16),
    (17, 6, 2, 64),     # 8 normalised heads: two blocks of 4 warps
    (3, 5, 1, 128),     # 6 heads: the second block has 2 idle warps
    (2, 1, 1, 40),      # D not a multiple of the warp
])
def test_head_rmsnorm(backend, dtype, n, heads, kv_heads, head_dim):
    rng = np.random.default_rng(16)
    qkv = rand(rng, (n, (heads + 2 * kv_heads) * head_dim), dtype, 3.0)
    q_weight, k_weight = rand(rng, (head_dim,), dtype), rand(rng, (head_dim,), dtype)
    ref = head_rmsnorm_ref(qkv, q_weight, k_weight, 1e-6, heads, kv_heads)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].copy()
    backend.head_rmsnorm(qkv, q_weight, k_weight, 1e-6, heads, kv_heads)
    assert_close(qkv, ref, dtype, "head_rmsnorm")
    np.testing.assert_array_equal(f64(qkv[:, (heads + kv_heads) * head_dim:]), f64(v_before))


def test_head_rmsnorm_checks_shapes(backend):
    qkv = np.zeros((2, 6 * 16), np.float32)
    with pytest.raises(ValueError, match="head_rmsnorm: k_weight"):
        backend.head_rmsnorm(qkv, np.ones(16, np.float32), np.ones(8, np.float32), 1e-6, 4, 1)
    with pytest.raises(ValueError, match="head_rmsnorm: qkv"):
        backend.head_rmsnorm(qkv, np.ones(16, np.float32), np.ones(16, np.float32), 1e-6, 2, 1)
    with pytest.raises(ks.KernelArgumentError, match="dtype"):
        backend.head_rmsnorm(qkv, np.ones(16, np.float16), np.ones(16, np.float16), 1e-6, 4, 1)


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 300), (2, 40), (1, 16), (17, 97)])
def test_gated_activations(backend, op, dtype, shape):
    rng = np.random.default_rng(5)
    n, f = shape
    gate_up = rand(rng, (n, 2 * f), dtype, 3.0)
    gate_up[0, :6] = [-30.0, -9.0, -0.5, 0.0, 9.0, 30.0]   # both tails and zero
    out = np.zeros((n, f), dtype)
    getattr(backend, op)(gate_up, out)
    ref = {"silu_mul": silu_mul_ref, "gelu_tanh_mul": gelu_tanh_mul_ref}[op](gate_up)
    assert_close(out, ref, dtype, op)
    with pytest.raises(ValueError, match=f"{op}: out"):
        getattr(backend, op)(gate_up, np.zeros((n, f + 1), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kv_write(backend, dtype):
    rng = np.random.default_rng(6)
    nb, hkv, bs, d, heads, n = 6, 2, 4, 16, 4, 9
    k_cache, v_cache = rand(rng, (nb, hkv, bs, d), dtype), rand(rng, (nb, hkv, bs, d), dtype)
    qkv = rand(rng, (n, (heads + 2 * hkv) * d), dtype)
    slots = rng.permutation(nb * bs)[:n].astype(np.int32)
    ref_k, ref_v = kv_write_ref(qkv, k_cache, v_cache, slots, heads)
    backend.kv_write(qkv, k_cache, v_cache, slots, heads)
    np.testing.assert_array_equal(f64(k_cache), f64(ref_k))
    np.testing.assert_array_equal(f64(v_cache), f64(ref_v))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_blocks(backend, dtype):
    rng = np.random.default_rng(10)
    k_caches = [rand(rng, (7, 2, 4, 8), dtype) for _ in range(3)]
    v_caches = [rand(rng, (7, 2, 4, 8), dtype) for _ in range(3)]
    pairs = [(1, 4), (6, 0), (1, 2)]
    ref_k, ref_v = copy_blocks_ref(k_caches, pairs), copy_blocks_ref(v_caches, pairs)
    backend.copy_blocks(k_caches, v_caches, pairs)
    for got, ref in zip(k_caches + v_caches, ref_k + ref_v):
        np.testing.assert_array_equal(f64(got), f64(ref))
    with pytest.raises(ValueError, match="destination"):
        backend.copy_blocks(k_caches, v_caches, [(1, 2), (2, 3)])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_take_rows(backend, dtype):
    rng = np.random.default_rng(11)
    x = rand(rng, (10, 77), dtype)
    idx = np.array([9, 0, 4, 4], np.int32)
    out = np.zeros((4, 77), dtype)
    backend.take_rows(x, idx, out)
    np.testing.assert_array_equal(f64(out), f64(take_rows_ref(x, idx)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_argmax(backend, dtype):
    rng = np.random.default_rng(12)
    logits = rand(rng, (5, 1000), dtype, 4.0)
    logits[1, [17, 400, 999]] = 50.0  # ties: the first index wins
    logits[2, :] = -3.0
    np.testing.assert_array_equal(backend.argmax(logits), argmax_ref(logits))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sample(backend, dtype):
    rng = np.random.default_rng(13)
    rows, vocab = 12, 300
    base = rand(rng, (1, vocab), np.float32, 3.0)
    logits = np.repeat(base, rows, 0).astype(dtype)
    logits[3] = rand(rng, (vocab,), dtype, 3.0)
    temperature = np.array([0, 1, 0.7, 1, 1, 1.3, 0.5, 1, 1, 2, 1, 0.9], np.float32)
    top_k = np.array([0, 0, 0, 5, 1, 20, 0, 0, 3, 0, 300, 50], np.int32)
    top_p = np.array([1, 1, 1, 1, 1, 1, 0.9, 0.5, 0.3, 1, 1, 0.8], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0.1, 0, 0.05], np.float32)
    uniform = rng.random(rows).astype(np.float32)
    uniform[4] = 0.999999
    got = backend.sample(logits, temperature, top_k, top_p, min_p, uniform)
    ref, ambiguous = sample_ref(logits, temperature, top_k, top_p, min_p, uniform)
    assert ambiguous.sum() <= 1, "the test's random draws sit on decision boundaries; change the seed"
    np.testing.assert_array_equal(got[~ambiguous], ref[~ambiguous])
    assert got[0] == np.argmax(logits[0].astype(np.float32)) and got[4] == got[0]


def test_sample_distribution_matches_probabilities(backend):
    """Many draws of one row at evenly spread u reproduce the filtered distribution (inverse CDF)."""
    rng = np.random.default_rng(14)
    vocab, rows = 40, 24
    logits = np.repeat(rand(rng, (1, vocab), np.float32, 2.0), rows, 0)
    uniform = ((np.arange(rows) + 0.5) / rows).astype(np.float32)
    ones = np.ones(rows, np.float32)
    got = backend.sample(logits, ones, np.full(rows, 6, np.int32), ones * 0.95, np.zeros(rows, np.float32), uniform)
    ref, _ = sample_ref(logits, ones, np.full(rows, 6, np.int32), ones * 0.95, np.zeros(rows, np.float32), uniform)
    np.testing.assert_array_equal(got, ref)
    assert len(set(got.tolist())) <= 6


# ---- the GEMM convention (cuBLAS's column-major call, emulated) -----------------------------------
@pytest.mark.parametrize("dtype,out_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                             (bfloat16, bfloat16), (bfloat16, np.float32)])
def test_linear_row_major_convention(backend, dtype, out_dtype):
    rng = np.random.default_rng(15)
    x, w = rand(rng, (5, 24), dtype), rand(rng, (11, 24), dtype)
    bias = rand(rng, (11,), out_dtype)
    out = np.zeros((5, 11), out_dtype)
    backend.linear(x, w, out)
    assert_close(out, linear_ref(x, w), out_dtype, "linear")
    backend.linear(x, w, out, bias=bias)
    assert_close(out, linear_ref(x, w, bias), out_dtype, "linear + bias")


def test_shape_errors_name_the_argument(backend):
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="rmsnorm: weight"):
        backend.rmsnorm(x, np.zeros(7, np.float32), 1e-5, x)
    with pytest.raises(ValueError, match="linear"):
        backend.linear(x, np.zeros((4, 9), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(ks.KernelArgumentError, match="dtype"):
        backend.rmsnorm(x, np.zeros(8, np.float16), 1e-5, x)


def test_sample_agrees_with_the_cpu_sampler(backend):
    """Same logits, same parameters, same draw from the request's generator: same token as
    rawinfer.sampler (the host path), except where float32 rounding decides a boundary."""
    from rawinfer.engine.sampler import make_generator, sample_row
    from rawinfer.sampling import SamplingParams

    rng = np.random.default_rng(16)
    settings = [dict(temperature=0.8), dict(temperature=1.0, top_k=7), dict(temperature=1.2, top_p=0.6),
                dict(temperature=0.7, min_p=0.2), dict(temperature=1.0, top_k=30, top_p=0.9, min_p=0.05),
                dict(temperature=0.0), dict(temperature=2.0, top_p=0.3)]
    params = [SamplingParams(**s) for s in settings]
    logits = rand(rng, (len(params), 200), np.float32, 2.5)
    uniform = np.array([make_generator(5, i).random() for i in range(len(params))], np.float32)
    got = backend.sample(logits, [p.temperature for p in params], [p.top_k for p in params],
                         [p.top_p for p in params], [p.min_p for p in params], uniform)
    want = [sample_row(row, p, [], make_generator(5, i)) for i, (row, p) in enumerate(zip(logits, params))]
    _, ambiguous = sample_ref(logits, np.array([p.temperature for p in params]), np.array([p.top_k for p in params]),
                              np.array([p.top_p for p in params]), np.array([p.min_p for p in params]), uniform)
    assert ambiguous.sum() <= 1
    np.testing.assert_array_equal(got[~ambiguous], np.array(want)[~ambiguous])


def test_q4_embedding_table_is_refused(backend):
    """int8 tables run here (test_cuda_int8.py); q4 matrices are refused by name."""
    from rawinfer.quant import Q4Weight
    table = Q4Weight(np.zeros((50, 32), np.uint8), np.zeros((50, 2, 2), np.float16))
    with pytest.raises(ValueError, match="q4 weight-only models run on the CPU backend"):
        backend.embedding(np.zeros(2, np.int32), table, np.zeros((2, 64), np.float32))


def test_kv_cache_dtype_int8_is_refused_on_cuda(backend):
    """The int8 KV cache is the CPU backend's; CUDA keeps K/V in the model's dtype and says so."""
    assert backend.kv_dtype("float16", "auto") == np.float16
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*--kv-cache-dtype auto"):
        backend.kv_dtype("float16", "int8", "int8")
