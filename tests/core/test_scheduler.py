"""The scheduler without a model: budgets, chunked prefill, preemption, forks, scoring chunks, invariants."""

from __future__ import annotations

import random

import pytest

from rawinfer.config import EngineConfig
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.scheduler import Scheduler
from rawinfer.core.sequence import FinishReason, Sequence
from rawinfer.sampling import SamplingParams


def make(num_blocks=64, block_size=4, **ecfg) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, **{"max_num_batched_tokens": 16, "max_num_seqs": 8, **ecfg})
    return Scheduler(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching))


def seq(sid, n_prompt, start=0, params=None, **kw) -> Sequence:
    return Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=list(range(start, start + n_prompt)),
                    params=params or SamplingParams(), **kw)


def step(s: Scheduler, token=1) -> dict[str, int]:
    """One step: schedule, 'run', update, append a token to every sample that draws one."""
    batch = s.schedule()
    for x, _ in s.update(batch).samples:
        x.append_token(token, 0.0)
    s.check_invariants()
    return {x.seq.seq_id: x.num_new_tokens for x in batch.seqs}


def test_budget_chunks_a_long_prompt_beside_decodes():
    s = make()
    a = seq("a", 3)
    s.add(a)
    assert step(s) == {"a": 3}
    s.add(seq("b", 40))
    got = [step(s) for _ in range(4)]
    assert got == [{"a": 1, "b": 15}, {"a": 1, "b": 15}, {"a": 1, "b": 10}, {"a": 1, "b": 1}]
    plan = s.schedule().plan
    assert plan.num_seqs == 2 and plan.logits_indices.tolist() == [0, 1]


def test_pool_exhaustion_preempts_the_newest_and_recomputes_it():
    s = make(num_blocks=4, block_size=4)
    a, b = seq("a", 6), seq("b", 6, start=100)
    s.add(a)
    s.add(b)
    assert step(s) == {"a": 6, "b": 6}                     # 2 blocks each: the pool is full
    for _ in range(2):
        step(s)                                            # both write into their second block
    batch = s.schedule()                                   # position 8 needs a third block for a: b goes
    assert [x.seq.seq_id for x in batch.seqs] == ["a"] and batch.preempted == [b]
    assert s.waiting == [b] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "b" not in s.bm and s.num_preemptions == 1
    s.update(batch)
    s.check_invariants()
    s.finish(a, FinishReason.LENGTH)
    # recomputed: its first block is still in the prefix cache (a took its second one), the rest of its
    # prompt and its two tokens are computed again
    assert step(s) == {"b": 5} and b.num_cached_prompt_tokens == 0 and b.num_computed_tokens == 9
    s.finish(b, FinishReason.LENGTH)
    assert s.bm.num_used_blocks == 0 and not s.has_unfinished


def test_forked_samples_share_blocks_and_respect_max_num_seqs():
    """n = 4: the step that computes the prompt schedules three forks; they join in update(), sharing its
    blocks, and draw from its logits row."""
    s = make(max_num_seqs=2)
    p = seq("p", 10, params=SamplingParams(n=4))
    s.add(p)
    batch = s.schedule()
    (sp,) = batch.seqs
    assert [(c.seq_id, c.index, c.token_ids) for c in sp.forks] == [(("p", i), i, p.token_ids) for i in (1, 2, 3)]
    assert not any(c.seq_id in s.bm for c in sp.forks)                 # nothing is forked before the pass
    upd = s.update(batch)
    assert [(x.seq_id, row) for x, row in upd.samples] == [("p", 0)] + [(("p", i), 0) for i in (1, 2, 3)]
    for x, _ in upd.samples:
        x.append_token(7, 0.0)
    assert all(s.bm.block_table(c.seq_id) == s.bm.block_table("p") for c in sp.forks)
    assert all(c.num_computed_tokens == 10 and c.timings.scheduled == p.timings.scheduled for c in sp.forks)
    s.check_invariants()
    first = step(s)
    assert len(first) == 2 and first == {"p": 1, ("p", 1): 1}          # oldest two of four
    batch = s.schedule()
    assert [x.seq.seq_id for x in batch.seqs] == ["p", ("p", 1)] and not any(x.forks for x in batch.seqs)
    assert batch.plan.copies == ()                     # the shared partial block was copied the step before


def test_a_prompt_only_request_and_a_scored_sequence_finish_in_update():
    """max_tokens 0 (prompt log-probabilities, a K/V export) and a scored sequence computed to its end: update()
    finishes them (length), forks none and draws nothing; their blocks go back."""
    s = make()
    p = seq("p", 6, params=SamplingParams(max_tokens=0, n=3))
    scored = seq("s", 5, start=50, chunk_sizes=(5,))
    s.add(p)
    s.add(scored)
    batch = s.schedule()
    assert [x.forks for x in batch.seqs] == [(), ()]
    upd = s.update(batch)
    assert upd.samples == [] and upd.finished == [p, scored]
    assert p.finish_reason == scored.finish_reason == FinishReason.LENGTH and s.bm.num_used_blocks == 0
    s.check_invariants()


def test_scoring_takes_exact_chunks_and_no_prefix_hits():
    s = make(max_num_batched_tokens=8)
    warm = seq("w", 12)                                    # puts the same prompt's blocks in the prefix cache
    s.add(warm)
    step(s)
    step(s)
    s.finish(warm, FinishReason.LENGTH)
    scored = seq("s", 12, chunk_sizes=(5, 1, 20))
    other = seq("o", 6, start=50)
    s.add(other)
    s.add(scored)
    assert step(s) == {"o": 6}                             # 5 > the 2 tokens left: s waits, unsplit
    assert step(s) == {"o": 1, "s": 5}                     # from position 0 (no prefix hit)
    assert step(s) == {"o": 1, "s": 1}
    batch = s.schedule()                                   # the 20-chunk: what is left of the sequence
    assert [(x.seq.seq_id, x.num_new_tokens, x.samples) for x in batch.seqs] == [("o", 1, True), ("s", 6, False)]
    assert batch.plan.score_rows.tolist() == list(range(1, 7)) and batch.plan.logits_indices.tolist() == [0]
    s.update(batch)
    assert scored.num_computed_tokens == 12 and scored.chunk_index == 3
    s.check_invariants()


def test_invariants_catch_a_waiting_sequence_with_blocks():
    s = make()
    a = seq("a", 5)
    s.add(a)
    s.bm.allocate_slots("a", 0, 5)
    with pytest.raises(AssertionError, match="owns KV blocks"):
        s.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_the_invariants_and_frees_everything(seed):
    rng = random.Random(seed)
    s = make(num_blocks=12, block_size=4, max_num_batched_tokens=12, max_num_seqs=4)
    live, n = [], 0
    for _ in range(400):
        r = rng.random()
        if r < 0.2:
            x = seq(f"r{n}", rng.randrange(1, 20), start=rng.choice((0, 0, 100)))
            n += 1
            s.add(x)
            live.append(x)
        elif r < 0.25 and live:
            x = live.pop(rng.randrange(len(live)))
            s.finish(x, FinishReason.ABORT)
        else:
            step(s, token=rng.randrange(3))
            for x in list(live):
                if x.num_output_tokens >= 8:
                    s.finish(x, FinishReason.LENGTH)
                    live.remove(x)
        s.check_invariants()
    while s.has_unfinished:
        step(s)
        for x in list(live):
            if x.num_output_tokens >= 8:
                s.finish(x, FinishReason.LENGTH)
                live.remove(x)
    assert s.bm.num_used_blocks == 0 and s.num_preemptions > 0


def test_long_prefill_threshold_lets_short_prompts_start_beside_a_long_one():
    """A long prompt's chunks stop at the threshold: prompts queued with it start in its first step and decode
    beside its next chunks, and one arriving later starts after one short step. Without the threshold they
    wait for its last chunk."""
    def run(threshold, steps=4):
        s = make(max_num_batched_tokens=16, long_prefill_token_threshold=threshold)
        for x in (seq("long", 40), seq("s1", 3, start=100), seq("s2", 4, start=200)):
            s.add(x)
        got = [step(s) for _ in range(steps)]
        s.add(seq("late", 5, start=300))
        return got + [step(s)]
    assert run(None) == [{"long": 16}, {"long": 16}, {"long": 8, "s1": 3, "s2": 4}, {"long": 1, "s1": 1, "s2": 1},
                         {"long": 1, "s1": 1, "s2": 1, "late": 5}]
    assert run(6, steps=1) == [{"long": 6, "s1": 3, "s2": 4}, {"long": 6, "s1": 1, "s2": 1, "late": 5}]
    assert run(6, steps=3)[1:] == [{"long": 6, "s1": 1, "s2": 1}] * 2 + [{"long": 6, "s1": 1, "s2": 1, "late": 5}]
    with pytest.raises(ValueError, match="long_prefill_token_threshold=0 is invalid"):
        EngineConfig(long_prefill_token_threshold=0).validate()


def test_remote_prefill_hooks():
    """can_reserve_remote: only a new waiting request that samples and wants no prompt log-probabilities, in a model
    that keeps its blocks; reserve_remote -> receiving with blocks for P - 1 tokens, complete_remote -> running
    with them computed, cancel_remote -> waiting again with none."""
    s = make()
    a, b = seq("a", 10), seq("b", 10, start=50)
    lp = seq("lp", 10, start=100, params=SamplingParams(prompt_logprobs=0))
    scored = seq("s", 10, start=150, chunk_sizes=(10,))
    for x in (a, b, lp, scored):
        s.add(x)
    assert [s.can_reserve_remote(x) for x in (a, b, lp, scored)] == [True, True, False, False]
    with pytest.raises(ValueError, match="cannot prefill remotely"):
        s.reserve_remote(lp)
    r = s.reserve_remote(a)
    assert r.start_block == 0 and len(r.block_ids) == 3 and r.num_tokens == 9 and s.receiving == {"a": a}
    assert not s.can_reserve_remote(a) and s.reserve_remote(b, min_tokens=10) is None
    s.check_invariants()
    s.complete_remote(a)
    assert a in s.running and a.num_computed_tokens == 9
    r = s.reserve_remote(b)
    s.cancel_remote(b)
    assert b in s.waiting and b.num_computed_tokens == 0 and "b" not in s.bm
    s.check_invariants()
    windowed = Scheduler(s.ecfg, BlockManager(64, 4), sliding_window=8)
    windowed.add(c := seq("c", 10))
    assert not windowed.can_reserve_remote(c)
