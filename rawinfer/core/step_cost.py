"""StepCost: what one step costs on this machine and model, fitted to measured steps, and how many prefill
tokens a step may still take under a latency target (PrefillAllowance).

The scheduler uses it for stall-free batching (Sarathi-Serve's idea): a step that carries decode rows
takes only as many prefill tokens as fit the inter-token target, so a running stream never waits behind a
whole prompt. The model of a step's wall time:

    seconds = a + b * P + c * D + d * K

    P   prefill tokens: rows of sequences that advance by more than one token this step
    D   decode rows: sequences that advance by one token
    K   key positions the attention reads, summed over every row (a row at position p reads p + 1 keys),
        the part of a long prompt's chunk that grows with how far into the prompt it is

The engine times each step (forward pass and sampling) and reports it (observe_plan); the warm-up's steps
seed the fit (engine/warmup.py) and real steps refine it. Two windows keep the latest steps of each kind
(decode only, and with prefill), so a long run of pure decode steps does not wash out what a prefill token
costs. The fit is a least-squares one of the relative error (a step's noise grows with its length), made
robust by reweighting (a step slowed by another program on the same cores counts little, then nothing), with
a small ridge toward 0 on d (where chunks at similar depths cannot tell a key's cost from a token's, d stays
near 0 and b takes both). The fit's robust spread (how far steps typically land from their estimate, as a
share) makes the scheduler's plan that much more cautious. The estimate is a pure function of the steps
held, so a scheduling decision is deterministic given the model's state.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

WINDOW = 64              # recent steps of each kind (decode only / with prefill) the fit reads
REFIT_EVERY = 8          # observations between refits (a fit is a few 4x4 solves over the window)
MIN_STEPS = 5            # no estimate before this many steps, with at least one of each kind
HUBER_K = 1.5            # Huber rounds: a residual r beyond HUBER_K robust spreads s counts with weight k s / |r|
TUKEY_C = 4.685          # biweight rounds: residuals beyond TUKEY_C spreads count nothing
IRLS_ROUNDS = 3          # reweighted solves of each kind per fit
RIDGE = 1e-6             # pull toward 0 per step held, on columns scaled to [0, 1]: keeps the solve regular
KEY_RIDGE = 1e-4         # ... and on d, a tiebreaker: a key read is cheap unless the steps show otherwise
MAX_SPREAD = 0.5         # the most a plan shrinks for the steps' spread (see prefill_budget)
AUTO_TARGET_STEPS = 2.0  # the automatic target: this many times the estimated decode step of the batch served,
AUTO_TARGET_MIN_SHARE = 0.5    # counted as at least this share of max_num_seqs rows (see auto_target_rows)


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the terms of the cost model."""

    prefill_tokens: int = 0        # P
    decode_rows: int = 0           # D
    keys: int = 0                  # K: key positions read by every row's attention

    @classmethod
    def of_plan(cls, plan) -> "StepShape":
        """The shape of a StepPlan: sequence b advances by q = query_start_loc[b+1] - query_start_loc[b]
        tokens and ends at context_lens[b]; its rows read context_lens[b] - q + 1 ... context_lens[b] keys."""
        q = np.diff(plan.query_start_loc).astype(np.int64)
        ctx = plan.context_lens.astype(np.int64)
        keys = int((q * ctx - q * (q - 1) // 2).sum())
        decode = q == 1
        return cls(int(q[~decode].sum()), int(decode.sum()), keys)

    @staticmethod
    def chunk_keys(n: int, start: int) -> int:
        """K of a chunk of n tokens from position start: rows read start + 1 ... start + n keys."""
        return n * start + n * (n + 1) // 2

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.prefill_tokens), float(self.decode_rows), float(self.keys)


@dataclass(frozen=True)
class Coefficients:
    """seconds = intercept + prefill_token * P + decode_row * D + key * K (each >= 0)."""

    intercept: float
    prefill_token: float
    decode_row: float
    key: float

    def describe(self) -> str:
        return (f"{self.intercept * 1e3:.2f} ms + {self.prefill_token * 1e3:.4f} ms per prefill token + "
                f"{self.decode_row * 1e3:.4f} ms per decode row + {self.key * 1e6:.5f} us per key read")


class StepCost:
    """The fitted step-time model of one engine (machine and model). Without enough steps observed it has
    no estimate (`coefficients` is None), and a scheduler then limits prefill by the token budget alone."""

    def __init__(self, coefficients: Coefficients | None = None, window: int = WINDOW, refit_every: int = REFIT_EVERY):
        """coefficients: a starting estimate (tests, or a model known in advance); observations refine it."""
        self._decode: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._prefill: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.coefficients = coefficients
        self.spread = 0.0             # robust relative spread of the steps around the fit (0: none measured)

    def forget(self) -> None:
        """Drop every observation and the estimate (the warm-up's compiling steps are no measurement)."""
        self._decode.clear()
        self._prefill.clear()
        self._since_fit = 0
        self.coefficients = None
        self.spread = 0.0

    @property
    def num_observed(self) -> int:
        return len(self._decode) + len(self._prefill)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step of `shape` took `seconds` of wall time; refits every refit_every observations."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        (self._prefill if shape.prefill_tokens else self._decode).append((shape.features(), seconds))
        self._since_fit += 1
        if self._decode and self._prefill and self.num_observed >= MIN_STEPS and (
                self.coefficients is None or self._since_fit >= self._refit_every):
            self.fit()

    def observe_plan(self, plan, seconds: float) -> None:
        """A step that ran `plan` (a StepPlan) took `seconds`."""
        self.observe(StepShape.of_plan(plan), seconds)

    def fit(self) -> None:
        """Refit the coefficients to the steps held: least squares of the relative error (a step's noise grows
        with its length), reweighted: Huber rounds from the plain fit, then Tukey's biweight, which gives a step
        slowed far beyond the others' spread (another program took the cores) no weight at all; a ridge
        toward 0, stronger on d, which prefill chunks at similar positions cannot tell apart from b."""
        rows = list(self._decode) + list(self._prefill)
        X = np.array([x for x, _ in rows], np.float64)                   # [N, 4]
        y = np.array([t for _, t in rows], np.float64)                   # [N]
        scale = X.max(axis=0)
        scale[scale <= 0] = 1.0
        Xs = X / scale[None, :] / y[:, None]                             # rows scaled to relative error
        lam = len(rows) * np.diag([RIDGE, RIDGE, RIDGE, KEY_RIDGE])
        w = np.ones(len(rows))
        for i in range(2 * IRLS_ROUNDS):
            theta = np.linalg.solve(Xs.T @ (w[:, None] * Xs) + lam, Xs.T @ w)
            r = np.abs(1.0 - Xs @ theta)                                 # |relative residual|
            s = max(1.4826 * float(np.median(r)), 1e-3)                 # robust spread, at least 0.1 %
            w = (np.minimum(1.0, HUBER_K * s / np.maximum(r, 1e-12)) if i < IRLS_ROUNDS
                 else np.clip(1.0 - (r / (TUKEY_C * s)) ** 2, 0.0, None) ** 2)
        a, b, cd, d = (max(0.0, float(v)) for v in theta / scale)
        self.coefficients = Coefficients(a, b, cd, d)
        self.spread = min(s, MAX_SPREAD)
        self._since_fit = 0

    # ---- estimates ------------------------------------------------------------------------------------------
    def predict(self, shape: StepShape) -> float | None:
        c = self.coefficients
        if c is None:
            return None
        return (c.intercept + c.prefill_token * shape.prefill_tokens + c.decode_row * shape.decode_rows
                + c.key * shape.keys)

    def _token_seconds(self) -> float:
        """What a prefill token costs; where the fit found nothing for it, what a decode row costs (both are
        a row through every product)."""
        c = self.coefficients
        return c.prefill_token if c.prefill_token > 0 else c.decode_row

    def usable(self) -> bool:
        """Whether the estimate can size a prefill chunk (it says a prefill token costs something)."""
        return self.coefficients is not None and (self._token_seconds() > 0 or self.coefficients.key > 0)

    def prefill_seconds(self, n: int, start: int) -> float:
        """What a chunk of n prompt tokens from position `start` adds to a step."""
        return self._token_seconds() * n + self.coefficients.key * StepShape.chunk_keys(n, start)

    def prefill_tokens_within(self, seconds: float, start: int) -> int:
        """The longest chunk from position `start` that adds at most `seconds` to a step: the largest n with
        b n + d (n start + n (n + 1) / 2) <= seconds."""
        if seconds <= 0:
            return 0
        b, d = self._token_seconds(), self.coefficients.key
        if d <= 0:
            n = seconds / b
        else:
            lin = b + d * (start + 0.5)
            n = (math.sqrt(lin * lin + 2.0 * d * seconds) - lin) / d
        n = int(min(n, 1 << 30))
        while n > 0 and self.prefill_seconds(n, start) > seconds:      # float rounding at the root
            n -= 1
        return n

    def prefill_budget(self, target: float, decodes: StepShape) -> float:
        """The seconds a step of `decodes` leaves for prefill under `target`, planned so that a step as much
        slower than its estimate as the measured steps typically are (one robust spread) still meets it."""
        return target / (1.0 + self.spread) - self.predict(decodes)

    def auto_target(self, rows: int, keys_per_row: float) -> float:
        """The automatic inter-token target: AUTO_TARGET_STEPS times the estimate of a decode-only step of
        `rows` rows (auto_target_rows) that read keys_per_row keys each (the running decodes' mean)."""
        return AUTO_TARGET_STEPS * self.predict(StepShape(0, rows, int(rows * keys_per_row)))


def auto_target_rows(in_engine: int, max_num_seqs: int) -> int:
    """The batch the automatic target is measured against: every sequence running or waiting (in a burst, the
    decode step every stream will see, so a step carrying prefill stays within twice it), max_num_seqs at
    most, and at least AUTO_TARGET_MIN_SHARE of it, so that a long prompt beside a few long-lived streams
    still goes in chunks that cost about a decode step of that many rows instead of one block a step."""
    return min(max_num_seqs, max(in_engine, math.ceil(AUTO_TARGET_MIN_SHARE * max_num_seqs)))


class PrefillAllowance:
    """How much prefill one step may still take: the seconds the latency target leaves after the step's
    decode rows, spent chunk by chunk. The step's first prefill chunk gets at least min_tokens whatever is
    left, so prefill never starves while decodes alone exceed the target."""

    def __init__(self, cost: StepCost, seconds: float, min_tokens: int):
        self.cost = cost
        self.seconds_left = seconds
        self.min_tokens = min_tokens
        self.tokens_taken = 0

    def tokens(self, start: int) -> int:
        """The most tokens a chunk from position `start` may take now."""
        n = self.cost.prefill_tokens_within(self.seconds_left, start)
        return max(n, self.min_tokens) if self.tokens_taken == 0 else n

    def fits(self, n: int, start: int) -> bool:
        """Whether an unsplittable chunk of n tokens (a scoring chunk) goes in now: within what is left, or
        as the step's first prefill (it could never go in otherwise)."""
        return self.tokens_taken == 0 or n <= self.cost.prefill_tokens_within(self.seconds_left, start)

    def take(self, n: int, start: int) -> None:
        self.seconds_left -= self.cost.prefill_seconds(n, start)
        self.tokens_taken += n
