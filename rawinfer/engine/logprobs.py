"""Log-probabilities a request asked for: the per-token record the engine hands out, and how the rows a backend
computed (backend.logprobs) become one.

The numbers are log-softmax of the model's raw logits (before temperature, top-k/p, penalties and biases),
computed on the device that ran the step; only [rows, K] values reach the host. A row's values depend on its
logits alone, and K is always LOGPROB_TOP when alternatives are asked for (each request keeps its own first k),
so what a request sees does not depend on what else ran in its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
