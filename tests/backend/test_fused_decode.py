"""Decode steps in one call (fused.decoder_stack_batched_kernel) give the per-op path's bits: the same
tokens and the same logprobs, alone and in batches. float32 models (fgemm) of every family: Llama, QKV
bias (Qwen2), a sliding window (Mistral), q/k norms (Qwen3), Gemma 3's sandwich norms, GeGLU, local
RoPE and window, in the default and the batch-invariant mode; int8 and q4 models of the families
beyond Llama (tests/backend/test_quant.py holds Llama's); int8 models on 8-bit activations."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import fused_vs_per_op
from rawinfer import SamplingParams
from rawinfer.backend.cpu import a8gemm as cpu_a8gemm
from rawinfer.backend.cpu import fgemm
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.fgemm import DEFAULT_MAX_ROWS
from rawinfer.engine.llm import LLM

pytestmark = pytest.mark.skipif(not (fgemm.available() and cpu_llvm.available()),
                                reason="the fused paths run on fgemm and the integer GEMMs (AVX2, FMA)")
FAMILIES = {"llama": "tiny-llama", "qwen2": "tiny-qwen2", "swa": "tiny-mistral-swa", "qwen3": "tiny-qwen3",
            "gemma3": "tiny-gemma3"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import _convert_tiny
    made = {}

    def get(family, quant=None):
        if (family, quant) not in made:
            made[family, quant] = _convert_tiny(tmp_path_factory, FAMILIES[family], quant=quant)
        return made[family, quant]
    return get


def _tokens_and_logprobs(results):
    return ([r.outputs[0].token_ids for r in results],
            [np.array(r.outputs[0].logprobs.logprobs + sum(r.outputs[0].logprobs.top_logprobs, []), np.float64)
             for r in results])


def _prompts(llm, lengths, seed=4):
    rng = np.random.default_rng(seed)
    V = llm.engine.model_config.vocab_size
    return [[int(t) for t in rng.integers(3, V, n)] for n in lengths]


def _compare(llm, prompts):
    """Tokens and logprobs through the fused path and op by op, and the token counts of the fused calls
    in each run."""
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    fused, per_op, rows, none = fused_vs_per_op(llm, prompts, sp)
    return (*_tokens_and_logprobs(fused), rows), (*_tokens_and_logprobs(per_op), none)


def _same(llm, lengths_list):
    for lengths in lengths_list:
        (f_toks, f_lps, rows), (p_toks, p_lps, none) = _compare(llm, _prompts(llm, lengths))
        assert max(rows) == len(lengths) and none == []
        assert f_toks == p_toks
        for a, b in zip(f_lps, p_lps):
            np.testing.assert_array_equal(a, b)


# Every engine here takes the fixed prefill budget (itl_target_ms 0): prefill steps past the fused kernels'
# rows run on BLAS (float32, or dequantized int8/q4 weights), whose bits follow the call's shape, so the
# fused and the per-op run must chunk the prompts alike; a budget fitted to measured step times may chunk
# them differently from one run to the next.
FIXED_BUDGET = {"itl_target_ms": 0}
# 1 row (serial elementwise builds), 20 rows (parallel builds); prompts past the windows
LENGTHS = ((7,), (64, 3, 17, 30, 5) + tuple(range(1, 31, 2)))


@pytest.mark.parametrize("family,batch_invariant,kv", [(f, False, "auto") for f in FAMILIES] +
                         [("llama", True, "auto"), ("gemma3", True, "auto"), ("llama", False, "float16"),
                          ("gemma3", False, "int8")])
def test_fused_float32_decode_is_the_per_op_path(family, batch_invariant, kv, tiny_dir):
    llm = LLM(tiny_dir(family), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256,
              enable_prefix_caching=False, batch_invariant=batch_invariant, kv_cache_dtype=kv, **FIXED_BUDGET)
    model = llm.engine.model
    assert model.fused_plan is not None and model.fused_plan["float"]
    assert model.fused_decode_max == ((1 << 30) if batch_invariant else DEFAULT_MAX_ROWS)
    _same(llm, LENGTHS)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_fused_quantized_decode_of_other_families_is_the_per_op_path(family, quant, tiny_dir):
    llm = LLM(tiny_dir(family, quant), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256,
              enable_prefix_caching=False, **FIXED_BUDGET)
    model = llm.engine.model
    assert model.fused_plan["packed"] and not model.fused_plan["llama"]
    assert model.fused_max_tokens == 0            # the few-row kernel runs the Llama layer only
    _same(llm, LENGTHS)


@pytest.mark.skipif(not cpu_a8gemm.available(), reason="8-bit activations need AVX2")
@pytest.mark.parametrize("family,quant", [("llama", "int8"), ("qwen2", "int8"), ("qwen3", "int8"), ("gemma3", "int8"),
                                         ("llama", "q4"), ("gemma3", "q4")])
def test_fused_decode_on_8_bit_activations_is_the_per_op_path(family, quant, tiny_dir):
    """int8 and q4 models with int8_activations: every decode batch in one call on a8gemm.py (silu in its
    epilogue, GeGLU apart), the per-op path's bits; the few-row kernel (int16-activation products) never runs."""
    llm = LLM(tiny_dir(family, quant), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256,
              enable_prefix_caching=False, int8_activations=True, **FIXED_BUDGET)
    model = llm.engine.model
    assert model.fused_plan["packed"] and model.fused_plan["a8"]
    assert model.fused_max_tokens == 0 and model.fused_decode_max == 1 << 30
    _same(llm, LENGTHS)


def test_smollm2_fused_float32_decode_is_the_per_op_path(smollm2_dir):
    """SmolLM2's shapes (head_dim 64: the AVX2 attention; 576 x 1536 down: fgemm's K slices)."""
    llm = LLM(smollm2_dir, device="cpu", kv_cache_memory="256MiB", max_num_batched_tokens=512,
              enable_prefix_caching=False, **FIXED_BUDGET)
    (f_toks, f_lps, rows), (p_toks, p_lps, _) = _compare(llm, _prompts(llm, (3, 17, 30, 5, 64, 9)))
    assert max(rows) == 6 and f_toks == p_toks
    for a, b in zip(f_lps, p_lps):
        np.testing.assert_array_equal(a, b)


def test_decode_batches_past_fgemm_rows_stay_per_op(tiny_dir):
    """The default mode multiplies more than DEFAULT_MAX_ROWS rows on BLAS: such decode batches keep the
    per-op path, whose products are those of the same rows in any other step."""
    llm = LLM(tiny_dir("llama"), device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=256, max_num_seqs=128,
              enable_prefix_caching=False, **FIXED_BUDGET)
    n = DEFAULT_MAX_ROWS + 4
    (_, _, rows), _ = _compare(llm, _prompts(llm, [2 + i % 5 for i in range(n)]))
    assert rows and max(rows) <= DEFAULT_MAX_ROWS      # the steps of all n rows did not take it


def test_the_batched_kernel_is_built_for_the_model_and_machine_only(tiny_dir):
    """The batched kernel's choices (decode attention kernel, GeGLU, q/k head norms) come as True or None,
    and overloads on that type pick what it calls, so a model compiles only the kernels it runs (a False
    would compile the other side too: seconds of a cold start, docs/CHANGELOG.md)."""
    from numba import types

    from rawinfer.backend.cpu import fused
    plans = {f: LLM(tiny_dir(f), device="cpu", kv_cache_memory="8MiB", warmup=False).engine.model.fused_plan
             for f in ("llama", "qwen3", "gemma3")}
    assert plans["llama"]["q_norms"] is None and plans["llama"]["k_norms"] is None
    assert plans["llama"]["gelu"] is None and plans["qwen3"]["gelu"] is None and plans["gemma3"]["gelu"] is True
    assert len(plans["qwen3"]["q_norms"]) == len(plans["qwen3"]["in_norms"]) == len(plans["qwen3"]["k_norms"])
    assert plans["llama"]["avx2_attention"] is None             # head dim 16: the portable kernel

    called = (lambda f: set(f.__code__.co_names))
    arr = types.Array(types.float32, 2, "C")
    rest = (arr,) * 9
    assert called(fused._decode_attention_of(types.none, *rest)) == {"_decode_attention"}
    assert called(fused._decode_attention_of(types.boolean, *rest)) == {"_decode_attention_avx2"}
    kernels = (lambda f: {c.cell_contents for c in f.__closure__})
    assert kernels(fused._act_after(arr, arr, types.boolean, types.none)) == {fused._silu_mul, fused._silu_mul_p}
    assert kernels(fused._act_after(arr, arr, types.boolean, types.boolean)) == {fused._gelu_mul, fused._gelu_mul_p}
    norms = types.ListType(types.Array(types.float32, 1, "C"))
    assert fused._head_norms(types.none, types.none, *rest[:6])(*[None] * 8) is None
    assert fused._head_norms(norms, norms, *rest[:6]).__name__ == "norms"
    packed = types.Array(types.int8, 4, "C")
    args = (arr, packed) + (arr,) * 8
    assert fused._gate_up_act(*args, types.none).__name__ == "fused_if_paired"
    assert called(fused._gate_up_act(*args, types.boolean)) == {"_gate_up_then_act"}
