"""Sampler: logits rows -> next token ids (greedy, temperature, top-k, top-p, min-p, repetition penalty).

Order of the transforms for one row: repetition penalty (on prompt + output tokens, the Hugging Face
rule: a positive logit is divided by the penalty, a negative one multiplied), then greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw from the sequence's own random generator. Every
sequence owns its generator (seeded from the request's seed and the sample index), so a sequence's
draws do not depend on what else is in the batch: same seed, same output.
"""

from __future__ import annotations

import numpy as np

from .sampling import SamplingParams


def make_generator(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index)])


def apply_repetition_penalty(row: np.ndarray, token_ids, penalty: float) -> None:
    """In place on row[V]."""
    if penalty == 1.0 or not len(token_ids):
        return
    ids = np.unique(np.asarray(token_ids, dtype=np.int64))
    vals = row[ids]
    row[ids] = np.where(vals > 0, vals / penalty, vals * penalty)


def filtered_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities [V] (float64, sums to 1) after temperature, top-k, top-p and min-p."""
    x = row.astype(np.float64) / p.temperature
    V = x.shape[0]
    if 0 < p.top_k < V:
        kth = np.partition(x, V - p.top_k)[V - p.top_k]
        x[x < kth] = -np.inf
    x -= x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        keep = cum - probs[order] < p.top_p
        drop = order[~keep]
        probs[drop] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    probs /= probs.sum()
    return probs


def sample_row(row: np.ndarray, p: SamplingParams, history, rng: np.random.Generator | None) -> int:
    """One token from one logits row [V] (row is not modified)."""
    if p.repetition_penalty != 1.0:
        row = row.copy()
        apply_repetition_penalty(row, history, p.repetition_penalty)
    if p.greedy:
        return int(np.argmax(row))
    probs = filtered_probs(row, p)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


class Sampler:
    def __init__(self, backend):
        self.backend = backend

    def sample(self, logits, params: list[SamplingParams], histories: list, rngs: list) -> list[int]:
        """logits: device [S, V]; one (params, token history, generator) per row -> S token ids.

        Plain greedy rows are reduced on the device (one argmax over the batch, no logits copy);
        the other rows are copied to the host and transformed there."""
        S = len(params)
        if S == 0:
            return []
        plain = [p.greedy and p.repetition_penalty == 1.0 for p in params]
        out = [0] * S
        if any(plain):
            best = self.backend.argmax(logits)
            for i in range(S):
                if plain[i]:
                    out[i] = int(best[i])
        if not all(plain):
            host = self.backend.to_host(logits)
            for i in range(S):
                if not plain[i]:
                    out[i] = sample_row(host[i], params[i], histories[i], rngs[i])
        return out
