"""Log-probabilities of chosen tokens and the most likely alternatives, from logits rows on the device that
holds them (NumPy on the CPU, CuPy on a GPU: the same code over the backend's array module).

For each (row r, token t) pair:

    lse        = max(x) + log(sum(exp(x - max(x))))         x = logits[r] as float32 [V]
    logprob    = x[t] - lse
    rank       = 1 + #{v : x[v] > x[t]}
    top (K)    = the K largest x, most likely first, ties by smaller token id; their x - lse

NOTE: every reduction runs over one row [V] at a time, so a row's values do not depend on how many rows
the call has (a batched reduction may split its sums differently with the batch's shape). Only the
[R], [R, K] results leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class LogprobRows:
    """backend.logprobs' result on the host, for R (row, token) pairs: the token's log-probability [R]
    float32, its rank [R] int64 (1 = most likely), the K most likely tokens [R, K] int64 and theirs
    [R, K] float32."""
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def logprob_rows(xp: Any, to_host, logits: Any, rows: np.ndarray, token_ids: np.ndarray, k: int) -> LogprobRows:
    """logits: [S, V] in xp's memory; rows [R], token_ids [R] host ints (a row may repeat, with other tokens);
    k: alternatives per pair (0: none). to_host copies an xp array to a NumPy one."""
    S, V = (int(n) for n in logits.shape)
    R = int(len(rows))
    if len(token_ids) != R:
        raise ValueError(f"logprobs: rows has {R} entries but token_ids {len(token_ids)}; give one token per row")
    if R and not (0 <= int(np.min(rows)) and int(np.max(rows)) < S):
        raise ValueError(f"logprobs: a row index is outside the {S} logits rows")
    if R and not (0 <= int(np.min(token_ids)) and int(np.max(token_ids)) < V):
        raise ValueError(f"logprobs: a token id is outside the vocabulary [0, {V})")
    if not 0 <= k <= V:
        raise ValueError(f"logprobs: k = {k} must be in [0, V = {V}]")
    lp = xp.empty(R, xp.float32)
    ranks = xp.empty(R, xp.int64)
    top_ids = xp.empty((R, k), xp.int64)
    top_lp = xp.empty((R, k), xp.float32)
    for i in range(R):
        x = logits[int(rows[i])]
        if x.dtype != xp.float32:
            x = x.astype(xp.float32)
        m = x.max()
        lse = m + xp.log(xp.exp(x - m).sum())
        chosen = x[int(token_ids[i])]
        lp[i] = chosen - lse
        ranks[i] = (x > chosen).sum() + 1
        if k:
            # every token at least as likely as the k-th: more than k where the k-th value is tied
            kth = x[xp.argpartition(-x, k - 1)[k - 1]] if k < V else x.min()
            idx = xp.nonzero(x >= kth)[0]
            vals = x[idx]
            order = xp.lexsort(xp.stack([idx, -vals]))[:k]     # the last key sorts first
            top_ids[i] = idx[order]
            top_lp[i] = vals[order] - lse
    return LogprobRows(to_host(lp), to_host(ranks), to_host(top_ids), to_host(top_lp))
