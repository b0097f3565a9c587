"""Sequence: one sample of one request — its token ids, progress through the cache and timings.

Where a sequence stands (waiting, running) is the scheduler's business: it is in exactly one of the
scheduler's queues until it finishes, and then it has a finish reason. The sequence itself holds only
what is true of it wherever it is queued.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rawinfer.core.block_hashes import BlockHashes
from rawinfer.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context reached (or a scored or max_tokens 0 sequence computed)
    ABORT = "abort"      # aborted by the user, a vanished client or a shutdown

    def __str__(self) -> str:
        return self.value


@dataclass
class SequenceTimings:
    arrival: float                                    # time.monotonic() at add_request
    scheduled: float | None = None                    # first time the sequence got a batch slot
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)   # one per generated token
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def mean_itl(self) -> float | None:
        gaps = self.itls
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


class Sequence:
    """The token ids of one sample (prompt, then generated tokens, in one list that only grows) and how
    many of them are in the KV cache."""

    def __init__(self, seq_id: str, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0, timings: SequenceTimings | None = None,
                 chunk_sizes: tuple[int, ...] | None = None):
        self.seq_id = seq_id                  # unique inside the engine: the request id, or (request id, index)
        #                                       for a sample the scheduler forked
        self.request_id = request_id
        self.index = index                    # sample index for n > 1
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output; read-only outside append_token
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.priority = priority              # lower runs earlier among waiting sequences; ties by arrival
        self.arrival_order = 0                # admission ticket, set by the scheduler
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.num_cached_prompt_tokens = 0     # prompt tokens served by the prefix cache (first admission)
        self.num_preemptions = 0
        self.timings = timings if timings is not None else SequenceTimings(time.monotonic())
        self.block_hashes = BlockHashes()     # prefix-cache digests of its full blocks, computed once each
        # Scoring (teacher forcing): every row gets logits, nothing is sampled, and the prompt is computed
        # in exactly these chunks (chunk_index counts the chunks taken since the last (re)start).
        self.chunk_sizes = chunk_sizes
        self.chunk_index = 0

    @property
    def is_scoring(self) -> bool:
        return self.chunk_sizes is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its request asked for prompt log-probabilities and they have not gone out yet (they go with the
        first output): every prompt position must be computed, none read from the prefix cache."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0 and not self.is_scoring

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's ids."""
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated ids."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(int(token_id))
        if self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.token_times.append(now)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.num_prompt_tokens} prompt + {self.num_output_tokens} output tokens, "
                f"{self.num_computed_tokens} computed)")
