"""Sequence: one sample of one request — its token ids, progress through the cache, status and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rawinfer.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context reached
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


@dataclass(eq=False)
class Sequence:
    seq_id: str                      # unique inside the engine: "<request_id>" or "<request_id>#<index>"
    request_id: str
    index: int                       # sample index for n > 1
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0                # lower runs earlier among waiting sequences; ties by arrival
    arrival_order: int = 0           # monotonically increasing admission ticket
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0   # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    timings: SequenceTimings = field(default_factory=lambda: SequenceTimings(time.monotonic()))
    output_text: str = ""            # text emitted so far (stop strings never included)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (a list copy of the whole sequence)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P:end - P]
        if end <= P:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - P]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(int(token_id))
        if self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.token_times.append(now)
