"""int8 weight-only quantization: the math, the CPU kernels against NumPy, and model-level agreement."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rawinfer import LLMEngine
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.backend import INT8_GEMV_MAX_ROWS, CPUBackend
from rawinfer.quant import Int8Weight, dequantize_int8, quantize_int8

be = CPUBackend()
RNG = np.random.default_rng(5)
from conftest import DATA  # noqa: E402
from reference_ops import int8_linear_ref  # noqa: E402


def test_quantize_roundtrip_error_is_half_a_step():
    w = RNG.standard_normal((37, 100)).astype(np.float32)
    w[3] = 0.0                                            # an all-zero row keeps a usable scale
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.shape == (37,) and np.abs(q).max() <= 127
    err = np.abs(dequantize_int8(q, scale) - w)
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert (dequantize_int8(q, scale)[3] == 0).all()


@pytest.mark.parametrize("T,K,N", [(1, 64, 3), (INT8_GEMV_MAX_ROWS, 576, 960), (INT8_GEMV_MAX_ROWS + 1, 33, 70),
                                   (40, 576, 1000)])
@pytest.mark.parametrize("scratch_rows", [None, 7, 100000])   # no scratch, tiled, whole matrix at once
@pytest.mark.parametrize("numba_pool", [True, False])          # dequantize + GEMM per thread, or np.matmul
def test_int8_linear(T, K, N, scratch_rows, numba_pool, monkeypatch):
    if numba_pool and not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    monkeypatch.setattr(be, "blas_on_numba_pool", numba_pool)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    q, scale = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    out = np.empty((T, N), np.float32)
    scratch = None if scratch_rows is None else np.empty(scratch_rows * K, np.float32)
    bias = RNG.standard_normal(N).astype(np.float32)
    be.linear(x, Int8Weight(q, scale), out, bias=bias, scratch=scratch)
    np.testing.assert_allclose(out, int8_linear_ref(x, q, scale) + bias, rtol=1e-4, atol=1e-4)


def test_int8_embedding():
    q, scale = quantize_int8(RNG.standard_normal((50, 12)).astype(np.float32))
    ids = np.array([0, 49, 7, 7], np.int32)
    out = np.empty((4, 12), np.float32)
    be.embedding(ids, Int8Weight(q, scale), out)
    np.testing.assert_allclose(out, dequantize_int8(q, scale)[ids], rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_int8_dir(tmp_path_factory):
    from conftest import _convert_tiny
    return _convert_tiny(tmp_path_factory, "tiny-llama", quant="int8")


def test_tiny_int8_model_tracks_the_float_reference(tiny_int8_dir):
    with open(os.path.join(tiny_int8_dir, "config.json")) as f:
        assert json.load(f)["quant"] == "int8"
    size = os.path.getsize(os.path.join(tiny_int8_dir, "model.safetensors"))
    assert size < 0.3 * os.path.getsize(os.path.join(DATA, "tiny-llama", "model.safetensors"))
    ref = np.load(os.path.join(DATA, "tiny-llama", "reference.npz"))
    # float16 K/V (auto would take int8): the two paths' tiny differences in K and V would otherwise
    # flip int8 roundings, a step of max|row| / 127, and drown the GEMM-vs-GEMV comparison below
    engine = LLMEngine(tiny_int8_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256,
                       kv_cache_dtype="float16")
    logits = engine.score(ref["seq_ids"].tolist())
    want = ref["seq_logits"]
    # per-row int8 scales on random Gaussian weights: a few percent of relative error, measured 3.5 %
    assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 0.06
    top2 = np.sort(want, -1)[:, -2:]
    sure = top2[:, 1] - top2[:, 0] > 0.3
    assert sure.sum() > 30
    np.testing.assert_array_equal(logits.argmax(-1)[sure], want.argmax(-1)[sure])
    # the decode path (int8 GEMV on float activations) and the prefill path (integer GEMM on activations
    # quantized to int16 per token; dequantize + BLAS where that is unavailable) agree: measured 1.3e-3
    # on logits of magnitude ~2 with the integer GEMM, < 1e-4 without where the CPU has FMA and 1.3e-4
    # with every kernel built for a CPU without (tools/test_portable.sh: no fma in the dot products)
    tol = 5e-3 if engine.backend.int_gemm else 1e-4 if cpu_llvm.available() else 3e-4
    np.testing.assert_allclose(engine.score(ref["seq_ids"].tolist(), [20] + [1] * 130), logits, atol=tol)


@pytest.mark.parametrize("kv_dtype,a8", [("auto", False), ("float16", False), ("auto", True)])
def test_smollm2_int8_agrees_with_golden(smollm2_int8_dir, kv_dtype, a8):
    """Teacher-forced argmax agreement on every golden step with margin > 0.5, with the int8 KV cache
    auto picks for int8 models and with a float16 one, and with 8-bit activations (int8_activations:
    a8gemm.py); the prompt prefilled, then the continuation decoded against the cache token by token."""
    from conftest import golden_decode_agreement
    from rawinfer.backend.cpu import a8gemm
    if a8 and not a8gemm.available():
        pytest.skip("8-bit activations need AVX2 and FMA")
    engine = LLMEngine(smollm2_int8_dir, device="cpu", kv_cache_memory="256MiB", max_num_batched_tokens=1024,
                       kv_cache_dtype=kv_dtype, int8_activations=a8)
    assert engine.pool.kv.k[0].dtype == (np.int8 if kv_dtype == "auto" else np.float16)
    checked, agreed, _ = golden_decode_agreement(engine)
    assert checked > 50
    assert agreed == checked, f"{agreed}/{checked} confident steps agree"


def _fused_vs_per_op(model_dir, kv_cache_memory):
    """Greedy tokens of 9 requests decoded together, through decoder_stack_batched_kernel (one call per
    step) and through the per-op path; returns both and how many tokens the fused call decoded."""
    from conftest import fused_vs_per_op
    from rawinfer import SamplingParams
    from rawinfer.engine.llm import LLM
    llm = LLM(model_dir, device="cpu", kv_cache_memory=kv_cache_memory, max_num_batched_tokens=512,
              enable_prefix_caching=False, itl_target_ms=0)   # both runs chunk prompts alike (BLAS prefill)
    model = llm.engine.model
    assert model.fused_plan["packed"] and model.fused_decode_max > 64
    rng = np.random.default_rng(4)
    V = llm.engine.model_config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, V, n)] for n in (3, 17, 30, 5, 64, 9, 1, 40, 22)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fused, per_op, fused_rows, _ = fused_vs_per_op(llm, prompts, sp)
    return [r.token_ids for r in fused], [r.token_ids for r in per_op], max(fused_rows)


@pytest.mark.skipif(not be.int_gemm, reason="the batched fused kernel runs on the integer GEMM (off here)")
def test_batched_decode_in_one_call_matches_the_per_op_path(tiny_int8_dir, smollm2_int8_dir):
    for model_dir, mem in ((tiny_int8_dir, "8MiB"), (smollm2_int8_dir, "256MiB")):   # head_dim 16 and 64
        fused, per_op, rows = _fused_vs_per_op(model_dir, mem)
        assert rows == 9                                 # every request decoding in one fused call
        assert fused == per_op, model_dir


def test_decoder_layers_refuses_what_it_cannot_run(tiny_int8_dir):
    from rawinfer.backend.base import FlatBatch
    engine = LLMEngine(tiny_int8_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256)
    model = engine.model
    z = np.zeros(8, np.int32)
    batch = FlatBatch(z, z, z, np.zeros((1, 1), np.int32), np.ones(1, np.int32), np.array([0, 8], np.int32), z[:1],
                      8, 8, 8)                        # one sequence's 8-token prefill chunk: not a decode batch
    with pytest.raises(ValueError, match="pure decode"):
        engine.backend.decoder_layers(model.fused_plan, engine.pool.workspace.acts, 8, batch, model.cos_sin, 1e-6,
                                      0.25, 4, 2)


