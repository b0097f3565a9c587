"""Speculative decoding on the CUDA backend, run on the host shim (tests/cuda_shim, no GPU): a sequence's
drafts are verified as decode rows, so a step of drafts is a pure decode step that replays a captured decode
graph; the greedy tokens equal plain decoding on the same backend, for a model with full attention and one
whose every layer slides.
"""

from __future__ import annotations

import pytest

from rawinfer import LLMEngine
from rawinfer.config import EngineConfig

harness = pytest.importorskip("cuda_shim.harness")
if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from conftest import _convert_tiny  # noqa: E402
from tests.engine.test_speculative import _Oracle, _stepwise  # noqa: E402
from tests.exec.test_graphs import device_reporting_backend  # noqa: E402


def shim_engine(monkeypatch, model_dir, libraries, **options) -> LLMEngine:
    """The CUDA engine on the shim, with decode graphs (recorded launches replayed, as tests/exec/test_graphs.py);
    its launcher as engine.launcher."""
    launcher = harness.CapturingShimLauncher(libraries)
    backend = device_reporting_backend(launcher)
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
    engine = LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * 1024**2, max_num_batched_tokens=16,
                                             max_num_seqs=8, max_model_len=128, itl_target_ms=0, warmup=False,
                                             block_size=4, **options))
    engine.launcher = launcher
    return engine


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-swa"])
def test_drafts_verified_in_decode_graphs_keep_the_greedy_tokens(monkeypatch, tmp_path_factory, shim_libraries, name):
    from rawinfer import SamplingParams
    model_dir = _convert_tiny(tmp_path_factory, name)
    prompts = [[5, 6, 7, 8], list(range(20, 47))]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = shim_engine(monkeypatch, model_dir, shim_libraries)
    expected = _stepwise(plain, prompts, params)
    eng = shim_engine(monkeypatch, model_dir, shim_libraries, speculative_method="ngram", num_speculative_tokens=3)
    eng.speculator.proposer = _Oracle({tuple(p): e + [1] * 4 for p, e in zip(prompts, expected)}, wrong=5, vocab=512)
    eng.speculator.choose_k = lambda *_: 3
    buckets, run = [], eng.runner.run

    def recording_run(plan):
        if plan.num_seqs > 2:                       # more rows than sequences: drafts
            buckets.append(plan.graph_bucket)
        return run(plan)
    eng.runner.run = recording_run
    assert _stepwise(eng, prompts, params) == expected
    s = eng.stats()["speculative"]
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    assert eng.runner.use_graphs and buckets and any(b is not None for b in buckets)
    assert eng.launcher.replays > 0


def test_a_draft_model_in_the_targets_pool_drafts_through_its_own_decode_graphs(monkeypatch, tmp_path_factory,
                                                                                shim_libraries):
    """tiny-llama drafting for itself on the CUDA backend: the draft's weights, KV and graph inputs are carved
    from the target's one arena, its decode passes replay its own graphs, every draft is kept and the greedy
    tokens equal plain decoding."""
    from rawinfer import SamplingParams
    model_dir = _convert_tiny(tmp_path_factory, "tiny-llama")
    prompts = [[5, 6, 7, 8], list(range(20, 47))]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = _stepwise(shim_engine(monkeypatch, model_dir, shim_libraries), prompts, params)
    draft_launcher = harness.CapturingShimLauncher(shim_libraries)
    draft_backend = device_reporting_backend(draft_launcher)
    monkeypatch.setattr("rawinfer.engine.draft.get_backend", lambda *args, **kwargs: draft_backend)
    eng = shim_engine(monkeypatch, model_dir, shim_libraries, speculative_model=model_dir, num_speculative_tokens=3)
    eng.speculator.choose_k = lambda *_: 3
    draft = eng.speculator.proposer
    assert draft.backend is draft_backend and draft.pool.arena is eng.pool.arena and draft.runner.use_graphs
    assert draft.block_manager.num_blocks == eng.block_manager.num_blocks
    assert _stepwise(eng, prompts, params) == expected
    s = eng.stats()["speculative"]
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 0
    assert draft_launcher.replays > 0 and eng.launcher.replays > 0
