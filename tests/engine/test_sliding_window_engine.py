"""A model whose every layer slides (tiny-mistral-swa, window 24) through the whole engine: a generation
much longer than the window runs in a pool of a few blocks, holds at most the window's worth of blocks,
and gives the tokens of a run in a large pool, alone or next to other requests."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import _convert_tiny

from rawinfer import LLMEngine, SamplingParams
from rawinfer.engine.engine import RequestRejected

BS = 16


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory) -> str:
    return _convert_tiny(tmp_path_factory, "tiny-mistral-swa")


def _engine(path, num_blocks=None, **kw):
    from rawinfer.config import ModelConfig
    cfg = ModelConfig.from_dir(path)
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * BS * cfg.head_dim * 4     # float32 K and V
    memory = (num_blocks or 256) * block_bytes
    return LLMEngine(path, device="cpu", kv_cache_memory=memory, block_size=BS, **kw)


def _run(engine, prompts: dict, max_tokens: int, watch=None) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if watch is not None:
            watch(engine)
        engine.scheduler.check_invariants()
    return out


def test_a_long_generation_holds_window_many_blocks(swa_dir):
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 512, 40).tolist()
    big = _engine(swa_dir)
    assert big.model_config.kv_window == 24
    want = _run(big, {"r": prompt}, 300)["r"]

    small = _engine(swa_dir, num_blocks=8, max_num_batched_tokens=64)
    assert small.block_manager.num_blocks < -(-(40 + 300) // BS)        # the whole sequence would not fit
    held = []
    got = _run(small, {"r": prompt}, 300,
               watch=lambda e: held.append(e.block_manager.num_blocks - e.block_manager.num_free_blocks))
    assert got["r"] == want
    assert max(held) <= (24 - 1 + 1) // BS + 2          # window plus the decode token, whole blocks
    assert small.stats()["kv_blocks_free"] == small.block_manager.num_blocks


def test_sliding_requests_in_a_shared_small_pool_match_alone(swa_dir):
    rng = np.random.default_rng(4)
    prompts = {f"r{i}": rng.integers(3, 512, n).tolist() for i, n in enumerate([5, 70, 33, 120])}
    alone = {rid: _run(_engine(swa_dir), {rid: ids}, 150)[rid] for rid, ids in prompts.items()}
    together = _run(_engine(swa_dir, num_blocks=14, max_num_batched_tokens=48), prompts, 150)
    assert together == alone


def test_the_pool_check_counts_the_window(swa_dir):
    small = _engine(swa_dir, num_blocks=6, max_num_batched_tokens=32)
    small.add_request("long", [5] * 30, SamplingParams(max_tokens=900, ignore_eos=True))   # fits: window + chunk
    small.abort("long")
    with pytest.raises(RequestRejected, match="KV blocks"):
        _engine(swa_dir, num_blocks=3, max_num_batched_tokens=64).add_request(
            "x", [5] * 100, SamplingParams(max_tokens=10))
