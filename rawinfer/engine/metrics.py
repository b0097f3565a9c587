"""Metrics: per-request latencies (TTFT, ITL, end-to-end) and engine gauges, plus percentile summaries."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from rawinfer.core.sequence import Sequence


@dataclass
class RequestMetrics:
    arrival_time: float            # time.monotonic() clock
    first_token_time: float | None
    finished_time: float | None
    ttft_s: float | None           # arrival -> first token
    mean_itl_s: float | None       # mean gap between consecutive tokens
    itl_s: list[float]             # every gap
    e2e_s: float | None            # arrival -> finish
    prompt_tokens: int
    cached_prompt_tokens: int      # served by the prefix cache
    generated_tokens: int
    preemptions: int

    def to_dict(self) -> dict:
        return asdict(self)


def request_metrics(seq: Sequence) -> RequestMetrics:
    t = seq.timings
    return RequestMetrics(
        arrival_time=t.arrival, first_token_time=t.first_token, finished_time=t.finished,
        ttft_s=t.ttft, mean_itl_s=t.mean_itl, itl_s=t.itls, e2e_s=t.e2e,
        prompt_tokens=seq.num_prompt_tokens, cached_prompt_tokens=seq.num_cached_prompt_tokens,
        generated_tokens=seq.num_output_tokens, preemptions=seq.num_preemptions)


@dataclass
class EngineStats:
    """Counters and a sliding window for the recent generation rate."""
    window_s: float = 5.0
    steps: int = 0
    tokens_processed: int = 0      # prompt + decode tokens through the model
    tokens_generated: int = 0
    requests_finished: int = 0
    peak_kv_usage: float = 0.0
    busy_s: float = 0.0
    _recent: deque = field(default_factory=deque)   # (time, tokens generated in that step)

    def on_step(self, now: float, started: float, num_tokens: int, num_generated: int, kv_usage: float) -> None:
        self.steps += 1
        self.tokens_processed += num_tokens
        self.tokens_generated += num_generated
        self.busy_s += now - started
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)
        self._recent.append((now, num_generated))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def on_finish(self, seq: Sequence) -> None:
        self.requests_finished += 1

    def recent_tokens_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    def snapshot(self) -> dict:
        return {"steps": self.steps, "tokens_processed": self.tokens_processed,
                "tokens_generated": self.tokens_generated, "requests_finished": self.requests_finished,
                "peak_kv_usage": self.peak_kv_usage, "recent_tokens_per_s": self.recent_tokens_per_s()}


def summarize(values, scale: float = 1.0) -> dict[str, float | None]:
    """mean / p50 / p99 of a list (None entries dropped), multiplied by scale (1000 for ms)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64) * scale
    if v.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
