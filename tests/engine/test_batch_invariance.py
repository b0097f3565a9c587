"""A request's greedy tokens do not depend on what else the engine runs, on SmolLM2 in every weight
format: alone vs inside a batch, and (batch_invariant) after prefix-cache hits and preemption.

Why each holds (docs/kernels.md): int8 and q4 products of any number of rows run on integer GEMMs whose
per-row bits do not depend on the row count, and each sequence takes the attention kernel its own query
count picks; batch_invariant sends every query through one attention kernel, so a prefix-cache hit (a
short query run instead of the whole prompt) or a recomputation after preemption rounds as the first
run did. float32 products of 1-2 rows (GEMV) and of more (GEMM) round differently in the last bits:
its greedy tokens agree here, a near-tie could flip them (the int8 / q4 paths have no such gap).
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import q4gemm as cpu_q4gemm

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain KV caches.",
             "Who wrote Hamlet?", "Why is the sky blue?", "Translate hello to Spanish.", "Tell a joke.",
             "Count to five."]
FORMATS = ["float32", "int8", pytest.param("q4", marks=pytest.mark.skipif(
    not cpu_q4gemm.available(), reason="the q4 GEMM needs AVX2, FMA and F16C"))]


@pytest.fixture
def model_dir(request):
    """The SmolLM2 conversion named by the test's parameter."""
    fixture = {"float32": "smollm2_dir", "int8": "smollm2_int8_dir", "q4": "smollm2_q4_dir"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.mark.parametrize("model_dir", FORMATS, indirect=True)
def test_greedy_tokens_alone_equal_batched(model_dir):
    """8 chat prompts x 40 tokens, prefix caching off: the batch of 8 vs each alone (before the integer
    GEMMs took every row count, 9 of 16 int8 prompts changed within 48 tokens)."""
    from rawinfer import LLM, SamplingParams
    llm = LLM(model_dir, device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    batched = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == batched


@pytest.mark.parametrize("model_dir", FORMATS[1:], indirect=True)
def test_batch_invariant_mode_survives_prefix_hits_and_preemption(model_dir):
    """batch_invariant: the same greedy tokens in a batch (cold prompts), alone after the batch (each
    prompt's full blocks now prefix-cache hits, its remainder a short query run) and in a pool so small
    that sequences are preempted and recomputed. Without it, a cache hit changed a request's tokens."""
    from rawinfer import LLM, SamplingParams
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, 40000, int(rng.integers(5, 60)))] for _ in range(16)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm = LLM(model_dir, device="cpu", kv_cache_memory="256MiB", batch_invariant=True)
    batched = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert alone == batched
    small = LLM(model_dir, device="cpu", kv_cache_memory="4MiB", max_num_batched_tokens=256, batch_invariant=True)
    assert [r.token_ids for r in small.generate(prompts, params, use_tqdm=False)] == batched
    assert small.engine.stats()["num_preemptions"] > 0
