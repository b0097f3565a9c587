"""The engine's gauges (issue 16, item 8): cached prefix blocks that nobody holds are free, but an operator
must see them: how many blocks hold a cached prefix, how many of those are free to be evicted, how many
were evicted, and the hit rate."""

from __future__ import annotations

import pytest

from rawinfer import LLMEngine, SamplingParams
from rawinfer.core.block_manager import BlockManager


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # 64 blocks of 16 tokens: small enough to force evictions
    return LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="512KiB", warmup=False)


def run(engine, rid: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_cached_free_blocks_evictions_and_hits_are_reported(engine):
    engine.reset_state()
    bm = engine.block_manager
    total = bm.num_blocks
    s = engine.stats()
    for key in ("kv_blocks_free", "prefix_cache_blocks", "prefix_cache_free_blocks", "prefix_cache_evictions",
                "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "prefix_cache_hit_rate"):
        assert key in s, key
    assert (s["kv_blocks_used"], s["kv_blocks_free"], s["prefix_cache_blocks"]) == (0, total, 0)

    prompt = list(range(3, 3 + 40))                 # 2 full blocks of prompt, the rest of it decoded
    run(engine, "a", prompt, 30)                     # 70 tokens: 4 full blocks registered
    s = engine.stats()
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == total
    assert s["prefix_cache_blocks"] == 4 and s["prefix_cache_free_blocks"] == 4
    assert s["prefix_cache_hit_tokens"] == 0 and s["prefix_cache_evictions"] == 0
    bm.check_invariants()

    run(engine, "b", prompt, 1)                      # the same prompt: its 2 full blocks are hits
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] == 32 and s["prefix_cache_query_tokens"] == 80
    assert s["prefix_cache_hit_rate"] == pytest.approx(32 / 80)

    # other prompts that need every block of the pool: the cached ones are evicted, and counted
    n = 0
    while engine.stats()["prefix_cache_evictions"] == 0 and n < 20:
        run(engine, f"fill{n}", [400 + n] * (16 * 12), 16 * 4)
        n += 1
    s = engine.stats()
    assert s["prefix_cache_evictions"] > 0
    assert 0 < s["prefix_cache_free_blocks"] <= s["prefix_cache_blocks"] and s["kv_blocks_free"] == total
    bm.check_invariants()


def test_the_cached_free_count_follows_every_path_of_the_block_manager():
    """Free cached blocks enter by free(), leave by a prefix hit, an eviction or reset_prefix_cache."""
    bm = BlockManager(num_blocks=6, block_size=4)
    toks = list(range(12))
    assert bm.allocate_slots("s", 0, 12) is not None
    bm.cache_full_blocks("s", toks, 12)
    bm.free("s")
    assert bm.stats.cached_free_blocks == 3
    hits = bm.find_cached_prefix(toks + [99])
    assert len(hits) == 3
    bm.allocate_slots("t", 12, 1, hits)              # the hits leave the free list
    assert bm.stats.cached_free_blocks == 0
    bm.check_invariants()
    bm.free("t")
    assert bm.stats.cached_free_blocks == 3
    bm.allocate_slots("u", 0, 4 * 5)                 # 3 plain blocks first, then 2 cached ones evicted
    assert bm.stats.cached_free_blocks == 1 and bm.stats.evicted_blocks == 2
    bm.check_invariants()
    bm.free("u")
    bm.reset_prefix_cache()
    assert bm.stats.cached_free_blocks == 0
    bm.check_invariants()
