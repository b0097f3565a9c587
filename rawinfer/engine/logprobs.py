"""Log-probabilities a request asked for: the per-token record the engine hands out, and how the rows a backend
computed (backend.logprobs) become one.

The numbers are log-softmax of the model's raw logits (before temperature, top-k/p, penalties and biases),
computed on the device that ran the step; only [rows, K] values reach the host. A row's values depend on its
logits alone, and K is always LOGPROB_TOP when alternatives are asked for (each request keeps its own first k),
so what a request sees does not depend on what else ran in its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rawinfer.backend.logprobs import LogprobRows
from rawinfer.sampling import MAX_LOGPROBS

LOGPROB_TOP = MAX_LOGPROBS       # alternatives every backend call computes when any row wants some


@dataclass
class Logprobs:
    """Consecutive tokens' log-probabilities, one entry per token in every list: the token, its log-probability,
    its rank (1 = the most likely token), and the k most likely tokens with theirs (most likely first; they
    may include the token itself; k = 0 gives empty lists)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: "Logprobs") -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs

    def truncate(self, n: int) -> None:
        """Keep the first n entries (a preempted prefill recomputes the rest)."""
        for name in ("token_ids", "logprobs", "ranks", "top_token_ids", "top_logprobs"):
            del getattr(self, name)[n:]

    def copy(self) -> "Logprobs":
        return Logprobs(list(self.token_ids), list(self.logprobs), list(self.ranks),
                        [list(t) for t in self.top_token_ids], [list(t) for t in self.top_logprobs])


def entries(rows: LogprobRows, token_ids, start: int, stop: int, k: int) -> Logprobs:
    """Entries start..stop of a backend.logprobs result as a Logprobs with k alternatives each."""
    return Logprobs([int(t) for t in token_ids], rows.logprobs[start:stop].tolist(), rows.ranks[start:stop].tolist(),
                    rows.top_ids[start:stop, :k].tolist(), rows.top_logprobs[start:stop, :k].tolist())


def token_logprobs(backend, logits, picks: list[tuple[int | None, int, int]]) -> list[Logprobs | None]:
    """For (params.logprobs, logits row, chosen token) per new token: the records of the tokens whose request
    asked, computed on the device in one call; None for the others, which cost nothing."""
    want = [i for i, (k, _, _) in enumerate(picks) if k is not None]
    out: list[Logprobs | None] = [None] * len(picks)
    if not want:
        return out
    top = LOGPROB_TOP if any(picks[i][0] for i in want) else 0
    rows = backend.logprobs(logits, np.asarray([picks[i][1] for i in want], np.int64),
                            np.asarray([picks[i][2] for i in want], np.int64), top)
    for j, i in enumerate(want):
        k, _, tok = picks[i]
        out[i] = entries(rows, [tok], j, j + 1, k)
    return out


def store_prompt_logprobs(out, rows: LogprobRows | None, state_of) -> None:
    """File a step's prompt log-probabilities (the runner's rows, in batch order) under their samples' states
    (state_of(seq)), by prompt position: a prefill restarted by preemption overwrites what it computed before.
    After scheduler.update()."""
    row = 0
    for s in out.seqs:
        q = s.prompt_logprob_rows
        if not q:
            continue
        seq = s.seq
        start = seq.num_computed_tokens - s.num_new_tokens       # update() has moved it past this chunk
        acc = state_of(seq).prompt_logprobs
        acc.truncate(start)
        acc.extend(entries(rows, seq.token_ids[start + 1:start + 1 + q], row, row + q, seq.params.prompt_logprobs))
        row += q


def take_prompt_logprobs(st) -> Logprobs | None:
    """A sample's (SampleState's) prompt log-probabilities, once, with its first output, when they are complete
    (an abort mid-prefill sends none)."""
    lp = st.prompt_logprobs
    if lp is None or len(lp) != st.seq.num_prompt_tokens - 1:
        return None
    st.prompt_logprobs = None
    return lp
