"""Warm-up at engine start: afterwards no request compiles anything, and nothing of the warm-up is left."""

from __future__ import annotations

import pytest

from conftest import _convert_tiny
from rawinfer import LLMEngine, SamplingParams
from rawinfer.backend.cpu import cache as cpu_cache


def compiled() -> dict[str, int]:
    """Compiled signatures of every CPU kernel dispatcher loaded so far."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}": len(d.signatures) for d in cpu_cache._dispatchers()}


def workload(engine) -> None:
    """Every kind of traffic: short and long prompts, one and many sequences decoding, a mixed step,
    n > 1 samples, seeded sampling, a repetition penalty, scoring."""
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    engine.add_request("long", list(range(3, 80)), SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("longer", list(range(3, 130)), SamplingParams(max_tokens=2, temperature=0))
    for i in range(9):
        engine.add_request(f"b{i}", [9, i + 3], SamplingParams(max_tokens=5, temperature=0.8, seed=i,
                                                               repetition_penalty=1.1))
    engine.add_request("n", [4, 4, 4], SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1))
    while engine.has_unfinished():
        engine.step()
    engine.score(list(range(3, 30)), [20, 1, 1, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("quant,a8", [(None, False), ("int8", False), ("int8", True), ("q4", False)])
def test_after_warm_up_no_request_compiles_a_kernel(tmp_path_factory, quant, a8):
    from rawinfer.backend.cpu import a8gemm
    if a8 and not a8gemm.available():
        pytest.skip("8-bit activations need AVX2 and FMA")
    model = _convert_tiny(tmp_path_factory, "tiny-llama", quant=quant)
    engine = LLMEngine(model, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256, max_num_seqs=16,
                       int8_activations=a8)
    before = compiled()
    workload(engine)
    after = compiled()
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, f"kernels compiled during requests after the warm-up: {grew}"


def test_warm_up_leaves_nothing_behind(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64)
    stats = engine.stats()
    assert stats["steps"] == 0 and stats["tokens_generated"] == 0 and stats["requests_finished"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_preemptions"] == 0 and stats["waiting"] == 0
    bm = engine.block_manager
    assert bm.num_cached_blocks == 0 and bm.stats.queries == 0 and bm.free_block_ids() == list(range(bm.num_blocks))
    assert engine._seed_counter == 0 and engine.num_requests == 0
    cold = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64, warmup=False)
    params = SamplingParams(max_tokens=12, temperature=0.9)          # unseeded: the engine's own seed sequence
    for e in (engine, cold):
        e.add_request("r", [3, 4, 5], params)
    outs = [[t for _ in range(20) for o in e.step() for t in o.new_token_ids] for e in (engine, cold)]
    assert outs[0] == outs[1]


def test_warm_up_fits_tiny_engines(tiny_llama_dir):
    """An engine whose pool, context or budget is too small for some warm-up requests still starts."""
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="64KiB", max_num_batched_tokens=8,
                       max_num_seqs=1, max_model_len=24, block_size=4)
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
