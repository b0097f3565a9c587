"""Metrics: per-request latencies (TTFT, ITL, end-to-end), the engine's counters and fixed-bucket histograms
(the series a Prometheus exporter shows, PROTOCOL.md's `stats.metrics`), and percentile summaries.

Histograms keep fixed bucket boundaries for the engine's life (vLLM's choice of boundaries per series), a count
per bucket, the number of observations and their sum: cumulative since the engine started, as Prometheus
expects, and cheap to snapshot after every step.
"""

from __future__ import annotations

import bisect
import itertools
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


TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (token-count histograms)."""
    out = []
    for scale in itertools.count():
        for m in (1, 2, 5):
            v = m * 10 ** scale
            if v > limit:
                return tuple(out)
            out.append(v)
    return tuple(out)


class Histogram:
    """Observations counted into fixed buckets (upper bounds, `le`), with their number and sum."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)     # the last one: above every bound (+Inf only)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> dict:
        """{"buckets": bounds, "counts": cumulative counts <= each bound, "count", "sum"}."""
        return {"buckets": list(self.buckets), "counts": list(itertools.accumulate(self._counts[:-1])),
                "count": self.count, "sum": self.sum}


def _histograms(max_model_len: int) -> dict[str, Histogram]:
    lengths = buckets_1_2_5(max(max_model_len, 1))
    return {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS_S),
            "e2e_request_latency_seconds": Histogram(REQUEST_BUCKETS_S),
            "request_queue_time_seconds": Histogram(REQUEST_BUCKETS_S),
            "request_prefill_time_seconds": Histogram(REQUEST_BUCKETS_S),
            "request_decode_time_seconds": Histogram(REQUEST_BUCKETS_S),
            "request_prompt_tokens": Histogram(lengths),
            "request_generation_tokens": Histogram(lengths)}


FINISH_REASON_LABELS = ("stop", "length", "abort")


@dataclass
class EngineStats:
    """Counters and histograms since the engine started, and a sliding window for the recent generation rate."""
    window_s: float = 5.0
    max_model_len: int = 2048          # the largest token-count bucket
    steps: int = 0
    tokens_processed: int = 0      # prompt + decode tokens through the model
    tokens_generated: int = 0
    requests_finished: int = 0
    peak_kv_usage: float = 0.0
    busy_s: float = 0.0
    prompt_tokens_total: int = 0       # prompt tokens of requests that started generating
    generation_tokens_total: int = 0   # every generated token of every sample
    finished_by_reason: dict = field(default_factory=lambda: dict.fromkeys(FINISH_REASON_LABELS, 0))
    histograms: dict = field(default_factory=dict)
    _recent: deque = field(default_factory=deque)   # (time, tokens generated in that step)

    def __post_init__(self):
        self.histograms = _histograms(self.max_model_len)

    def on_step(self, now: float, started: float, num_tokens: int, num_generated: int, kv_usage: float) -> None:
        self.steps += 1
        self.tokens_processed += num_tokens
        self.tokens_generated += num_generated
        self.busy_s += now - started
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)
        self._recent.append((now, num_generated))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def on_token(self, seq: Sequence) -> None:
        """After seq got a token: its first one (TTFT, prefill time, the request's prompt tokens) or the gap."""
        t, h = seq.timings, self.histograms
        self.generation_tokens_total += 1
        if seq.num_output_tokens == 1:
            h["time_to_first_token_seconds"].observe(t.first_token - t.arrival)
            if t.scheduled is not None:
                h["request_prefill_time_seconds"].observe(t.first_token - t.scheduled)
            if seq.index == 0:            # forked samples share the parent's prompt
                self.prompt_tokens_total += seq.num_prompt_tokens
        elif len(t.token_times) >= 2:
            h["inter_token_latency_seconds"].observe(t.token_times[-1] - t.token_times[-2])

    def on_finish(self, seq: Sequence) -> None:
        self.requests_finished += 1
        self.count_finish(str(seq.finish_reason))
        t, h = seq.timings, self.histograms
        if t.finished is not None:
            h["e2e_request_latency_seconds"].observe(t.finished - t.arrival)
            if t.first_token is not None:
                h["request_decode_time_seconds"].observe(t.finished - t.first_token)
        if t.scheduled is not None:
            h["request_queue_time_seconds"].observe(t.scheduled - t.arrival)
        h["request_prompt_tokens"].observe(seq.num_prompt_tokens)
        h["request_generation_tokens"].observe(seq.num_output_tokens)

    def count_finish(self, reason: str) -> None:
        """A finished sample by reason (also one that never started: a request aborted before its forks)."""
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def metrics(self, gauges: dict, counters: dict) -> dict:
        """PROTOCOL.md's `stats.metrics`: the given gauges and counters beside this tracker's."""
        return {"gauges": gauges,
                "counters": {"prompt_tokens_total": self.prompt_tokens_total,
                             "generation_tokens_total": self.generation_tokens_total, **counters,
                             "request_success_total": dict(self.finished_by_reason)},
                "labels": {"request_success_total": "finished_reason"},
                "histograms": {name: h.snapshot() for name, h in self.histograms.items()}}

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


def engine_stats(scheduler, tracker: EngineStats, speculator=None) -> dict:
    """An engine's gauges and counters (PROTOCOL.md's `stats`). A free block may still hold a cached prefix
    (prefix_cache_free_blocks, part of kv_blocks_free): a hit takes it back, new data evicts it
    (prefix_cache_evictions). With speculative decoding, `speculative` and vLLM's spec_decode counters."""
    bm, pc = scheduler.bm, scheduler.bm.stats
    counters = {"num_preemptions_total": scheduler.num_preemptions,
                "prefix_cache_queries_total": pc.query_tokens, "prefix_cache_hits_total": pc.hit_tokens}
    extra, labels = {}, {}
    if speculator is not None:
        spec = speculator.counters.snapshot()
        extra["speculative"] = {"method": speculator.method, **spec}
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            counters[f"spec_decode_{name}_total"] = {speculator.method: spec[name]}
            labels[f"spec_decode_{name}_total"] = "method"
        counters["spec_decode_num_accepted_tokens_per_pos_total"] = {  # str keys: msgpack on the wire takes no int keys
            str(i): n for i, n in enumerate(spec["accepted_per_pos"])}
        labels["spec_decode_num_accepted_tokens_per_pos_total"] = "position"
    metrics = tracker.metrics({"num_requests_running": len(scheduler.running),
                               "num_requests_waiting": len(scheduler.waiting), "kv_cache_usage_perc": bm.usage},
                              counters)
    metrics["labels"].update(labels)
    return {
        "running": len(scheduler.running), "waiting": len(scheduler.waiting),
        "receiving_kv": len(scheduler.receiving),      # waiting for K/V from a prefill instance
        "kv_blocks_used": bm.num_used_blocks, "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": bm.num_blocks,
        "kv_usage": bm.usage,
        "prefix_cache_blocks": bm.num_cached_blocks, "prefix_cache_free_blocks": pc.cached_free_blocks,
        "prefix_cache_evictions": pc.evicted_blocks,
        "prefix_cache_hit_tokens": pc.hit_tokens, "prefix_cache_query_tokens": pc.query_tokens,
        "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
        "num_preemptions": scheduler.num_preemptions,
        **tracker.snapshot(), **extra, "metrics": metrics,
    }
