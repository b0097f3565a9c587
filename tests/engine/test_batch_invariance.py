"""A request's greedy tokens do not depend on what else the engine runs, on SmolLM2 in every weight
format (int8 and q4 also with 8-bit activations: int8a8, q4a8): alone vs inside a batch, and (batch_invariant) after
prefix-cache hits and preemption.

Why each holds (docs/kernels.md): int8 and q4 products of any number of rows run on integer GEMMs whose
per-row bits do not depend on the row count; float32 products of up to 96 rows run on the row-invariant
float32 GEMM (fgemm.py), longer ones on BLAS, which rounds by call shape; each sequence takes the
attention kernel its own query count picks. batch_invariant sends every query through one attention
kernel and every float32 product through fgemm.py, so a prefix-cache hit (a short query run instead of
the whole prompt), a recomputation after preemption or a prompt prefilled beside others rounds as the
first run did. On a CPU without AVX2 (tools/test_portable.sh builds every kernel for one) the int8 and
q4 products of every row count, and float32 ones of up to 96, run on rows.py's kind of row-invariant
dot products instead.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import a8gemm as cpu_a8gemm

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain KV caches.",
             "Who wrote Hamlet?", "Why is the sky blue?", "Translate hello to Spanish.", "Tell a joke.",
             "Count to five."]
_A8 = pytest.mark.skipif(not cpu_a8gemm.available(), reason="8-bit activations need AVX2 and FMA")
FORMATS = ["float32", "int8", pytest.param("int8a8", marks=_A8), "q4", pytest.param("q4a8", marks=_A8)]


@pytest.fixture
def model(request):
    """(the SmolLM2 conversion named by the test's parameter, the engine options it runs with)."""
    fixture = {"float32": "smollm2_dir", "int8": "smollm2_int8_dir", "int8a8": "smollm2_int8_dir",
               "q4": "smollm2_q4_dir", "q4a8": "smollm2_q4_dir"}[request.param]
    return request.getfixturevalue(fixture), {"int8_activations": request.param.endswith("a8")}


@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_greedy_tokens_alone_equal_batched(model):
    """8 chat prompts x 40 tokens, prefix caching off: the batch of 8 vs each alone (before the integer
    GEMMs took every row count, 9 of 16 int8 prompts changed within 48 tokens)."""
    from rawinfer import LLM, SamplingParams
    model_dir, opts = model
    llm = LLM(model_dir, device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False, **opts)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    batched = [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == batched


@pytest.mark.parametrize("model", FORMATS, indirect=True)
def test_batch_invariant_mode_survives_prefix_hits_and_preemption(model):
    """batch_invariant: the same greedy tokens and the same logprobs, to the bit, in a batch (cold
    prompts), alone after the batch (each prompt's full blocks now prefix-cache hits, its remainder a
    short query run) and in a pool so small that sequences are preempted and recomputed. Without it, a
    cache hit changed a request's tokens; float32 without the row-invariant GEMM kept its tokens here
    but changed the logprobs of all 16 requests."""
    from rawinfer import LLM, SamplingParams
    from rawinfer.config import ModelConfig
    model_dir, opts = model
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, 40000, int(rng.integers(5, 60)))] for _ in range(16)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)

    def run(llm, batch):
        return [(r.outputs[0].token_ids, r.outputs[0].logprobs.logprobs)
                for r in llm.generate(batch, params, use_tqdm=False)]
    llm = LLM(model_dir, device="cpu", kv_cache_memory="256MiB", batch_invariant=True, **opts)
    batched = run(llm, prompts)
    alone = [run(llm, [p])[0] for p in prompts]
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert alone == batched
    pool = "8MiB" if ModelConfig.from_dir(model_dir).quant is None else "4MiB"   # a float32 cache is 2x-4x larger
    small = LLM(model_dir, device="cpu", kv_cache_memory=pool, max_num_batched_tokens=256, batch_invariant=True,
                **opts)
    assert run(small, prompts) == batched
    assert small.engine.stats()["num_preemptions"] > 0
