"""The step-cost model without a model: its fit to measured steps (exact, noisy, with outliers, through long
runs of one kind of step), the shape of a real step plan, and the prefill chunk it allows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rawinfer.core.step_cost import Coefficients, PrefillAllowance, StepCost, StepShape
from rawinfer.core.step_plan import PlanLayout, ScheduledSeq, build_step_plan
from rawinfer.core.sequence import Sequence
from rawinfer.sampling import SamplingParams

TRUE = Coefficients(intercept=0.020, prefill_token=0.0015, decode_row=0.002, key=2e-7)


def seconds(shape: StepShape, c: Coefficients = TRUE) -> float:
    return c.intercept + c.prefill_token * shape.prefill_tokens + c.decode_row * shape.decode_rows + c.key * shape.keys


def traffic(rng: random.Random, n: int) -> list[StepShape]:
    """Steps as a server runs them: decode batches at growing contexts, some with a prompt's chunk."""
    shapes = []
    for _ in range(n):
        d = rng.randrange(1, 64)
        keys = d * rng.randrange(10, 600)
        if rng.random() < 0.4:
            p, start = rng.randrange(16, 1024), rng.randrange(0, 1500)
            shapes.append(StepShape(p, d, keys + StepShape.chunk_keys(p, start)))
        else:
            shapes.append(StepShape(0, d, keys))
    return shapes


def close(a: Coefficients, b: Coefficients, rel: float) -> bool:
    """a within rel of b; the key cost, the least determined (and a small ridge pulls it to 0), within 10 %."""
    tolerances = (rel, rel, rel, max(rel, 0.1))
    return all(abs(x - y) <= r * y for x, y, r in zip(
        (a.intercept, a.prefill_token, a.decode_row, a.key), (b.intercept, b.prefill_token, b.decode_row, b.key),
        tolerances))


def test_no_estimate_until_both_kinds_of_step_were_seen():
    cost = StepCost()
    for d in range(1, 10):
        cost.observe(StepShape(0, d, d * 50), seconds(StepShape(0, d, d * 50)))
    assert cost.coefficients is None and not cost.usable() and cost.predict(StepShape(0, 1, 1)) is None
    cost.observe(StepShape(100, 0, 5050), seconds(StepShape(100, 0, 5050)))
    assert cost.coefficients is not None and cost.usable()
    cost.forget()
    assert cost.coefficients is None and cost.num_observed == 0


def test_fit_recovers_the_coefficients_exactly_noisy_and_through_outliers():
    rng = random.Random(0)
    exact = StepCost()
    for s in traffic(rng, 100):
        exact.observe(s, seconds(s))
    assert close(exact.coefficients, TRUE, 0.02)

    noisy, nprng = StepCost(), np.random.default_rng(1)
    for s in traffic(rng, 200):
        t = seconds(s) * float(nprng.normal(1.0, 0.03))
        if nprng.random() < 0.15:                      # another process took the cores for this step
            t *= float(nprng.uniform(2, 10))
        noisy.observe(s, t)
    assert close(noisy.coefficients, TRUE, 0.15)
    check = StepShape(512, 32, 32 * 300 + StepShape.chunk_keys(512, 1000))
    assert noisy.predict(check) == pytest.approx(seconds(check), rel=0.1)
    # the plan leaves room for a step as slow as steps usually are: about 3 % here, none for exact steps
    assert 0.02 < noisy.spread < 0.04 and exact.spread < 0.002
    decodes = StepShape(0, 8, 800)
    assert noisy.prefill_budget(0.5, decodes) == pytest.approx(0.5 / (1 + noisy.spread) - noisy.predict(decodes))


def test_a_long_run_of_decode_steps_keeps_what_a_prefill_token_costs():
    """The two windows: 500 pure decode steps after the mixed ones leave the prefill steps in the fit; a
    machine that got slower shows in the estimate within a window."""
    rng = random.Random(2)
    cost = StepCost()
    for s in traffic(rng, 80):
        cost.observe(s, seconds(s))
    for _ in range(500):
        s = StepShape(0, rng.randrange(1, 64), rng.randrange(100, 5000))
        cost.observe(s, seconds(s))
    assert close(cost.coefficients, TRUE, 0.02)
    slower = Coefficients(*(2 * v for v in (TRUE.intercept, TRUE.prefill_token, TRUE.decode_row, TRUE.key)))
    for s in traffic(rng, 400):
        cost.observe(s, seconds(s, slower))
    assert close(cost.coefficients, slower, 0.02)


def test_the_fit_is_a_function_of_what_it_observed():
    rng = random.Random(3)
    shapes = traffic(rng, 90)
    times = [seconds(s) * rng.uniform(0.9, 1.3) for s in shapes]
    fits = []
    for _ in range(2):
        cost = StepCost()
        for s, t in zip(shapes, times):
            cost.observe(s, t)
        fits.append(cost.coefficients)
    assert fits[0] == fits[1]
    cost.observe(StepShape(0, 1, 1), float("nan"))     # not a measurement: ignored
    cost.observe(StepShape(0, 1, 1), -1.0)
    assert cost.num_observed == 90


def test_shape_of_a_step_plan():
    """Decode rows read their whole context; a chunk's rows read start + 1 ... start + n keys."""
    def seq(sid, n_prompt, computed):
        s = Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=list(range(n_prompt)),
                     params=SamplingParams())
        s.num_computed_tokens = computed
        return s
    a, b, c = seq("a", 10, 9), seq("b", 40, 16), seq("c", 30, 0)
    sched = [ScheduledSeq(a, 1, True), ScheduledSeq(b, 8, False), ScheduledSeq(c, 30, True)]
    plan = build_step_plan(sched, [[0, 1, 2], [3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]], [],
                           PlanLayout(block_size=4))
    shape = StepShape.of_plan(plan)
    assert shape == StepShape(prefill_tokens=38, decode_rows=1,
                              keys=10 + sum(range(17, 25)) + sum(range(1, 31)))
    assert StepShape.chunk_keys(8, 16) == sum(range(17, 25))


@pytest.mark.parametrize("key", [0.0, 3e-7])
def test_prefill_tokens_within_is_the_longest_chunk_that_fits(key):
    cost = StepCost(Coefficients(0.01, 0.001, 0.002, key))
    rng = random.Random(4)
    for _ in range(300):
        budget, start = rng.uniform(-0.01, 2.0), rng.randrange(0, 4000)
        n = cost.prefill_tokens_within(budget, start)
        assert n == 0 if budget <= 0 else cost.prefill_seconds(n, start) <= budget
        assert cost.prefill_seconds(n + 1, start) > budget


def test_a_prefill_token_with_no_cost_of_its_own_costs_a_decode_row():
    cost = StepCost(Coefficients(0.01, 0.0, 0.002, 0.0))
    assert cost.usable() and cost.prefill_tokens_within(0.1, 0) == 50
    assert not StepCost(Coefficients(0.01, 0.0, 0.0, 0.0)).usable()


def test_allowance_spends_its_seconds_and_gives_the_first_chunk_a_minimum():
    cost = StepCost(Coefficients(0.01, 0.001, 0.002, 0.0))
    spent = PrefillAllowance(cost, -0.5, min_tokens=16)          # decodes alone are over the target
    assert spent.tokens(0) == 16 and spent.fits(500, 0)           # the step's first prefill
    spent.take(16, 0)
    assert spent.tokens(0) == 0 and not spent.fits(2, 0)
    left = PrefillAllowance(cost, 0.1, min_tokens=16)
    assert left.tokens(0) == 100
    left.take(60, 0)
    assert left.tokens(500) == 40 and left.fits(40, 0) and not left.fits(41, 0)
