"""The scheduler with a step-cost model and an inter-token target, without a model: a step carrying decodes
takes only the prefill that fits the target (one block at least), a step without decodes the whole budget;
target 0 or no estimate schedules as before; random traffic keeps every invariant and the target."""

from __future__ import annotations

import random

import pytest

from rawinfer.config import EngineConfig
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.scheduler import Scheduler
from rawinfer.core.sequence import FinishReason
from rawinfer.core.step_cost import AUTO_TARGET_STEPS, Coefficients, StepCost, StepShape, auto_target_rows
from tests.core.test_scheduler import seq, step

# 10 ms a step, 1 ms a prefill token, 2 ms a decode row, no attention term: easy to follow by hand
COST = Coefficients(intercept=0.010, prefill_token=0.001, decode_row=0.002, key=0.0)


def make(cost=COST, num_blocks=256, block_size=4, **ecfg) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, **{"max_num_batched_tokens": 64, "max_num_seqs": 8,
                                                 "itl_target_ms": 50, **ecfg}).validate()
    return Scheduler(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching),
                     step_cost=StepCost(cost) if cost is not None else None)


def decoding(s: Scheduler, *names: str) -> None:
    """Admit short prompts and run their prefill step: they decode from the next step on."""
    for i, name in enumerate(names):
        s.add(seq(name, 3, start=1000 * (i + 1)))
    step(s)


def test_prefill_beside_decodes_fits_the_target():
    """Two decodes: 10 + 2 * 2 = 14 ms, so 36 ms (36 tokens) are left of the 50 ms target for the long prompt,
    whose chunks are sized by it, step after step, while the decodes go on."""
    s = make()
    decoding(s, "a", "b")
    s.add(seq("long", 100))
    got = [step(s) for _ in range(3)]
    assert got == [{"a": 1, "b": 1, "long": 36}, {"a": 1, "b": 1, "long": 36}, {"a": 1, "b": 1, "long": 28}]


def test_without_decodes_prefill_takes_the_whole_budget():
    s = make()
    s.add(seq("long", 100))
    assert step(s) == {"long": 64}


def test_target_off_or_no_estimate_schedules_as_before():
    for s in (make(itl_target_ms=0), make(cost=None)):
        decoding(s, "a", "b")
        s.add(seq("long", 100))
        assert step(s) == {"a": 1, "b": 1, "long": 62}


def test_decodes_alone_over_the_target_leave_one_block_to_the_first_prefill():
    """Eight decodes: 10 + 8 * 2 = 26 ms > a 20 ms target. The long prompt still advances one block (4 tokens)
    a step; a second prompt waits for a step with time left."""
    s = make(itl_target_ms=20)
    decoding(s, *"abcdefg")
    s.add(seq("long", 40))
    s.add(seq("next", 10, start=500))
    assert step(s) == {**dict.fromkeys("abcdefg", 1), "long": 4}
    assert step(s) == {**dict.fromkeys("abcdefg", 1), "long": 4}
    assert [x.seq_id for x in s.waiting] == ["next"]


def test_later_chunks_get_what_the_first_left():
    """36 ms after two decodes: a 10-token prompt first (running), then 26 tokens of the next one; a third
    prompt waits."""
    s = make()
    decoding(s, "a", "b")
    for name, n, start in (("p1", 10, 100), ("p2", 50, 200), ("p3", 20, 300)):
        s.add(seq(name, n, start=start))
    assert step(s) == {"a": 1, "b": 1, "p1": 10, "p2": 26}
    assert [x.seq_id for x in s.waiting] == ["p3"]


def test_attention_term_shortens_chunks_deep_into_a_prompt():
    """With a cost per key read, each chunk is the longest that keeps the step within the target, and one
    deep into the prompt is shorter than the first."""
    s = make(cost=Coefficients(0.010, 0.001, 0.002, 1e-5), max_num_batched_tokens=512, itl_target_ms=100)
    decoding(s, "a")
    s.add(seq("long", 1200))
    chunks = []
    for _ in range(6):
        batch = s.schedule()
        shape = StepShape.of_plan(batch.plan)
        n = dict((x.seq.seq_id, x.num_new_tokens) for x in batch.seqs)["long"]
        longer = StepShape(shape.prefill_tokens + 1, shape.decode_rows, shape.keys + shape.prefill_tokens + 1 +
                           s.running[-1].num_computed_tokens)
        assert s.step_cost.predict(shape) <= 0.1 < s.step_cost.predict(longer)
        chunks.append(n)
        s.update(batch)
        s.running[0].append_token(1, 0.0)
    assert chunks[0] > chunks[-1] > 0


def test_scoring_chunk_goes_in_whole_or_waits():
    """An unsplittable 30-token scoring chunk: refused while a 10-token prompt took part of the 36 ms, taken
    as a step's first prefill even though it is over what the target leaves."""
    s = make()
    decoding(s, "a", "b")
    s.add(seq("p1", 30, start=100))
    s.add(seq("scored", 40, start=200, chunk_sizes=(40,)))
    assert step(s) == {"a": 1, "b": 1, "p1": 30}                 # 6 ms left: scored waits
    assert step(s) == {"a": 1, "b": 1, "p1": 1, "scored": 40}    # the first prefill of its step


def test_auto_target_is_twice_the_decode_step_of_the_batch_served():
    """None: AUTO_TARGET_STEPS x the estimated decode step of every sequence running or waiting, counted as
    at least half of max_num_seqs and at most all of it."""
    assert AUTO_TARGET_STEPS == 2.0
    assert [auto_target_rows(n, 16) for n in (0, 3, 8, 9, 16, 40)] == [8, 8, 8, 9, 16, 16]
    s = make(itl_target_ms=None)                       # two decode + one waiting, at least 4: 2 x (10 + 4 * 2) ms
    decoding(s, "a", "b")
    s.add(seq("long", 100))
    assert step(s)["long"] == 36 - 14
    s = make(itl_target_ms=None)                       # six decode + four waiting, 8 at most: 52 ms
    decoding(s, *"abcdef")
    for i in range(4):
        s.add(seq(f"w{i}", 100, start=100 * i))
    assert step(s) == {**dict.fromkeys("abcdef", 1), "w0": 52 - 22}
    s = make(itl_target_ms=None, max_num_seqs=16)      # one decode + one waiting, at least 8 rows: 52 ms
    decoding(s, "a")
    s.add(seq("long", 100))
    assert step(s)["long"] == 52 - 12


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_the_invariants_and_the_target(seed):
    """Every step with decode rows is estimated within the target, but for a single one-block chunk when the
    decodes alone are over it; the target cuts chunks short, a small pool preempts, and every block comes back."""
    rng = random.Random(seed)
    cost = Coefficients(0.004, 0.001, 0.001, 2e-6)        # a prefill token and a decode row alike: 1-token chunks
    s = make(cost=cost, num_blocks=20, block_size=4, max_num_batched_tokens=48, max_num_seqs=6,
             itl_target_ms=rng.choice([12, 20]), enable_prefix_caching=False)
    target = s.ecfg.itl_target_ms / 1e3
    live, n, within, cut = [], 0, 0, 0
    for _ in range(400):
        if rng.random() < 0.25:
            x = seq(f"r{n}", rng.randrange(1, 60), start=rng.randrange(0, 500))
            n += 1
            s.add(x)
            live.append(x)
        decodes = any(x.num_uncomputed_tokens == 1 for x in s.running)
        batch = s.schedule()
        if decodes and not batch.is_empty:
            prefill = [x.num_new_tokens for x in batch.seqs if x.num_new_tokens > 1]
            if s.step_cost.predict(StepShape.of_plan(batch.plan)) <= target + 1e-9:
                within += 1
            else:
                assert len(prefill) <= 1 and sum(prefill) <= 4
            cut += batch.plan.num_tokens < 48 and any(x.num_new_tokens < x.seq.num_uncomputed_tokens for x in batch.seqs)
        for x, _ in s.update(batch).samples:
            x.append_token(1, 0.0)
        for x in list(live):
            if x.num_output_tokens >= rng.randrange(4, 12):
                s.finish(x, FinishReason.LENGTH)
                live.remove(x)
        s.check_invariants()
    for x in live:
        s.finish(x, FinishReason.ABORT)
    assert s.bm.num_used_blocks == 0 and within > 250 and cut > 50 and s.num_preemptions > 0
