"""A model whose every layer attends through a sliding window gives back a running sequence's KV blocks
that slid out of the window (BlockManager.release_before, called by Scheduler.advance)."""

from __future__ import annotations

import random

import pytest

from rawinfer.config import EngineConfig
from rawinfer.core.block_manager import DROPPED, BlockManager
from rawinfer.core.scheduler import Scheduler
from rawinfer.core.sequence import FinishReason, Sequence
from rawinfer.sampling import SamplingParams


def seq(sid, n_prompt, start=0) -> Sequence:
    return Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=list(range(start, start + n_prompt)),
                    params=SamplingParams())


def step(s: Scheduler, token=1) -> dict[str, int]:
    batch = s.schedule()
    for x, _ in s.update(batch).samples:
        x.append_token(token, 0.0)
    s.check_invariants()
    return {x.seq.seq_id: x.num_new_tokens for x in batch.seqs}


def test_release_before_gives_back_whole_blocks_only():
    bm = BlockManager(8, 4)
    bm.allocate_slots("a", 0, 14)                          # 4 blocks: positions 0..13
    table = bm.block_table("a")
    assert bm.release_before("a", 3) == 0                  # block 0 still holds position 3
    assert bm.release_before("a", 9) == 2                  # blocks 0 and 1 hold only positions < 8
    assert bm.block_table("a") == [DROPPED.block_id] * 2 + table[2:]
    assert bm.num_free_blocks == 6
    assert bm.release_before("a", 9) == 0 and bm.release_before("a", 2) == 0   # idempotent, never back
    bm.check_invariants()
    alloc = bm.allocate_slots("a", 14, 3)                  # growing goes on as before
    assert len(alloc.new_block_ids) == 1 and len(bm.block_table("a")) == 5
    bm.fork("a", "b")                                      # a fork shares only the live blocks
    assert bm.blocks[table[2]].ref_cnt == 2 and bm.block_table("b")[:2] == [0, 0]
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_released_prefix_blocks_stay_in_the_prefix_cache():
    bm = BlockManager(8, 4)
    tokens = list(range(12))
    bm.allocate_slots("a", 0, 12)
    bm.cache_full_blocks("a", tokens, 12)
    bm.release_before("a", 8)
    assert bm.num_cached_blocks == 3
    assert len(bm.find_cached_prefix(tokens + [99])) == 3  # a new request with that prompt still hits
    assert bm.allocate_slots("a", 12, 4) is not None
    bm.cache_full_blocks("a", tokens + [1, 2, 3, 4], 16)   # registers block 3, skips the given-back entries
    assert bm.num_cached_blocks == 4
    bm.check_invariants()


@pytest.mark.parametrize("window,block_size", [(24, 16), (8, 4), (5, 4), (1, 4)])
def test_a_long_generation_holds_a_window_of_blocks(window, block_size):
    ecfg = EngineConfig(block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(ecfg, BlockManager(64, block_size), sliding_window=window)
    a = seq("a", 40)
    s.add(a)
    most = 0
    while a.num_output_tokens < 150:
        step(s)
        live = len(s.bm.block_table("a")) - s.bm._seqs["a"].num_dropped
        most = max(most, live)
        # the next query at position n reads from n - W + 1: the live blocks cover that and no more
        n = a.num_computed_tokens
        assert s.bm._seqs["a"].num_dropped == max(0, n - window + 1) // block_size
    # a window of W tokens starting anywhere spans at most ceil((W - 1) / BS) + 1 blocks, and a prefill chunk
    # of up to 16 tokens past it while the prompt was being computed
    assert most <= -(-(window - 1 + 16) // block_size) + 1
    s.finish(a, FinishReason.LENGTH)
    assert s.bm.num_used_blocks == 0


def test_without_a_window_nothing_is_given_back():
    ecfg = EngineConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    s = Scheduler(ecfg, BlockManager(64, 4))
    a = seq("a", 10)
    s.add(a)
    for _ in range(20):
        step(s)
    assert s.bm._seqs["a"].num_dropped == 0 and s.bm.num_used_blocks == -(-a.num_computed_tokens // 4)


@pytest.mark.parametrize("seed", range(3))
def test_random_windowed_traffic_keeps_the_invariants(seed):
    """Admission, preemption (a released sequence recomputes from scratch), aborts and prefix hits with
    sequences that give blocks back."""
    rng = random.Random(seed)
    ecfg = EngineConfig(block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
    s = Scheduler(ecfg, BlockManager(14, 4), sliding_window=6)
    live, n = [], 0
    for _ in range(500):
        r = rng.random()
        if r < 0.15:
            x = seq(f"r{n}", rng.randrange(1, 30), start=rng.choice((0, 0, 100)))
            n += 1
            s.add(x)
            live.append(x)
        elif r < 0.2 and live:
            s.finish(live.pop(rng.randrange(len(live))), FinishReason.ABORT)
        else:
            step(s, token=rng.randrange(3))
            for x in list(live):
                if x.num_output_tokens >= 30:
                    s.finish(x, FinishReason.LENGTH)
                    live.remove(x)
    for x in live:
        s.finish(x, FinishReason.ABORT)
    assert s.bm.num_used_blocks == 0
    s.check_invariants()
