"""Sampler: logits rows -> next token ids (greedy, temperature, top-k, top-p, min-p, penalties, logit bias).

Order of the transforms for one row: repetition penalty (on prompt + output tokens, the Hugging Face
rule: a positive logit is divided by the penalty, a negative one multiplied), frequency and presence
penalties (OpenAI's rule, on output tokens: logit -= frequency * count + presence * [count > 0]), the
logit bias (added), then greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw from the sequence's own random generator. Every
sequence owns its generator (seeded from the request's seed and the sample index), so a sequence's
draws do not depend on what else is in the batch: same seed, same output.

Where the rows are transformed.  Plain greedy rows: one device argmax, no logits copy.  On a backend
with a device sampler (`backend.sample`, CUDA: cuda/sampling.cu applies the same rule, top-k, then
top-p, then min-p, then the inverse CDF at u) the rows without logit edits (penalties, bias) are drawn on the
device with u = one draw of the sequence's generator, exactly what the host path consumes, so seeds
stay batch-invariant and a row picks the same token on either path except where float32 rounding
decides a boundary.  Rows with logit edits, and every non-greedy row on a backend without a
device sampler (the CPU), are copied to the host and sampled by `sample_row`.
"""

from __future__ import annotations

import numpy as np

from rawinfer.sampling import SamplingParams


def make_generator(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index)])


def apply_repetition_penalty(row: np.ndarray, token_ids, penalty: float) -> None:
    """In place on row[V]."""
    if penalty == 1.0 or not len(token_ids):
        return
    ids = np.unique(np.asarray(token_ids, dtype=np.int64))
    vals = row[ids]
    with np.errstate(over="ignore", divide="ignore"):     # a tiny penalty overflows to inf: filtered_probs copes
        row[ids] = np.where(vals > 0, vals / penalty, vals * penalty)


def apply_logit_edits(row: np.ndarray, p: SamplingParams, history, num_prompt: int) -> None:
    """In place on row[V]: the repetition penalty (history = prompt + output ids), the frequency and presence
    penalties (history[num_prompt:], the output), the logit bias."""
    apply_repetition_penalty(row, history, p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(history) > num_prompt:
        ids, counts = np.unique(np.asarray(history[num_prompt:], dtype=np.int64), return_counts=True)
        row[ids] -= (p.frequency_penalty * counts + p.presence_penalty).astype(row.dtype)
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
        row[ids] += np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias)).astype(row.dtype)


def filtered_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities [V] (float64, sums to 1) after temperature, top-k, top-p and min-p. The maximum is
    subtracted before dividing by the temperature, so that a tiny temperature (or a logit a penalty made
    huge) gives the best tokens' share instead of inf / inf; +inf logits (a penalty's overflow) share it."""
    x = row.astype(np.float64)
    top = x.max()
    with np.errstate(over="ignore", divide="ignore"):
        x = np.where(x == np.inf, 0.0, -np.inf) if top == np.inf else (x - top) / p.temperature
    V = x.shape[0]
    if 0 < p.top_k < V:
        kth = np.partition(x, V - p.top_k)[V - p.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x)                        # its maximum is 0 already: top-k only adds -inf
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


def sample_row(row: np.ndarray, p: SamplingParams, history, rng: np.random.Generator | None,
               num_prompt: int = 0) -> int:
    """One token from one logits row [V] (row is not modified); history: prompt + output ids, the first
    num_prompt of them the prompt's (read only when p.edits_logits)."""
    if p.edits_logits:
        row = row.copy()
        apply_logit_edits(row, p, history, num_prompt)
    if p.greedy:
        return int(np.argmax(row))
    probs = filtered_probs(row, p)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


# The largest float32 below 1: a float64 draw in [0, 1) may round up to 1.0 in float32.
_BELOW_ONE = np.float32(1.0) - np.float32(2.0**-24)


def device_sampling_arrays(params: list[SamplingParams], rows: list[int], rngs: list,
                           vocab: int) -> tuple[np.ndarray, ...]:
    """(temperature, top_k, top_p, min_p, uniform) host arrays [S] for a device sampler: the rows in
    `rows` get their parameters and one draw u of their generator; every other row is greedy
    (temperature 0, no draw)."""
    S = len(params)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    uniform = np.zeros(S, np.float32)
    for i in rows:
        p = params[i]
        temperature[i] = p.temperature
        top_k[i] = min(p.top_k, vocab)      # 0 or >= V keeps every token, on both paths
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        uniform[i] = min(np.float32(rngs[i].random()), _BELOW_ONE)
    return temperature, top_k, top_p, min_p, uniform


class Sampler:
    def __init__(self, backend):
        self.backend = backend
        self._device_sample = backend.sample if backend.capabilities.device_sampling else None

    def sample(self, logits, params: list[SamplingParams], histories: list, rngs: list,
               prompt_lens: list[int] | None = None) -> list[int]:
        """logits: device [S, V]; one (params, token history, generator, prompt length) per row -> S token
        ids. A row's history is read only when its params edit logits (the engine passes None otherwise).

        Plain greedy rows are reduced on the device (no logits copy); so are sampled rows without logit
        edits where the backend has a device sampler; the other rows are copied to the host and
        transformed there."""
        S = len(params)
        if S == 0:
            return []
        prompt_lens = prompt_lens or [0] * S
        plain = [p.greedy and not p.edits_logits for p in params]
        drawn = [i for i, p in enumerate(params) if not p.greedy and not p.edits_logits]
        on_device = plain[:]
        out = [0] * S
        if drawn and self._device_sample is not None:
            # one launch for every row without a penalty: greedy rows ride along as temperature 0
            arrays = device_sampling_arrays(params, drawn, rngs, int(logits.shape[1]))
            ids = self._device_sample(logits, *arrays)
            for i in drawn:
                on_device[i] = True
            for i in range(S):
                if on_device[i]:
                    out[i] = int(ids[i])
        elif any(plain):
            best = self.backend.argmax(logits)
            for i in range(S):
                if plain[i]:
                    out[i] = int(best[i])
        if not all(on_device):
            host = self.backend.to_host(logits)
            for i in range(S):
                if not on_device[i]:
                    out[i] = sample_row(host[i], params[i], histories[i], rngs[i], prompt_lens[i])
        return out
