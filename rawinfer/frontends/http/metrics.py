"""GET /metrics: the engine's `stats` reply in the Prometheus text format, under vLLM's metric names with
a `rawinfer:` prefix, so dashboards made for vLLM read it with the prefix changed.

Every number comes from the engine (one `stats` call per scrape: its `metrics` map, PROTOCOL.md, and the
server's own counters), not from this worker: with several HTTP workers, each scrape still sees the
whole engine. A metric whose source the stats reply lacks is left out rather than shown as zero.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# the server's own counters (top level of the stats reply): metric -> (stats key, help)
SERVER_COUNTERS = {
    "requests_received": ("requests_received", "Generate requests the server received."),
    "requests_rejected": ("requests_rejected", "Requests refused before they started."),
    "requests_aborted_by_client": ("requests_aborted_by_client", "Requests their client aborted."),
    "requests_aborted_vanished": ("requests_aborted_vanished", "Requests aborted because their client vanished."),
}
SERVER_GAUGES = {
    "num_requests_in_flight": ("requests_in_flight", "Requests the server holds, from arrival to their final."),
}
HELP = {
    "num_requests_running": "Requests in the engine's running batch.",
    "num_requests_waiting": "Requests waiting for the engine to start them.",
    "kv_cache_usage_perc": "Fraction of the KV-cache blocks in use (1 = full).",
    "prompt_tokens": "Prompt tokens of requests that started generating.",
    "generation_tokens": "Tokens generated.",
    "request_success": "Samples finished, by finish reason.",
    "num_preemptions": "Sequences preempted (their blocks freed, recomputed later).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "time_to_first_token_seconds": "Arrival to first token.",
    "inter_token_latency_seconds": "Gaps between a sample's tokens.",
    "e2e_request_latency_seconds": "Arrival to finish.",
    "request_queue_time_seconds": "Arrival to the first step that schedules the request.",
    "request_prefill_time_seconds": "First scheduled to first token.",
    "request_decode_time_seconds": "First token to finish.",
    "request_prompt_tokens": "Prompt tokens per finished sample.",
    "request_generation_tokens": "Generated tokens per finished sample.",
}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class _Snapshot:
    """A collector of one stats reply (a fresh registry per scrape: nothing is kept between scrapes)."""

    def __init__(self, stats: dict, model: str):
        self.stats, self.labels = stats, {"model_name": model}

    def collect(self) -> Iterable:
        s, names, values = self.stats, list(self.labels), list(self.labels.values())
        m = s.get("metrics") if isinstance(s.get("metrics"), dict) else {}
        for name, v in sorted((m.get("gauges") or {}).items()):
            if (v := _number(v)) is not None:
                yield _single(GaugeMetricFamily, name, HELP.get(name, name), names, values, v)
        for name, (key, doc) in SERVER_GAUGES.items():
            if (v := _number(s.get(key))) is not None:
                yield _single(GaugeMetricFamily, name, doc, names, values, v)
        label_names = m.get("labels") or {}
        for name, v in sorted((m.get("counters") or {}).items()):
            base = name[:-len("_total")] if name.endswith("_total") else name
            if isinstance(v, dict):
                label = str(label_names.get(name, "label"))
                c = CounterMetricFamily(f"rawinfer:{base}", HELP.get(base, base), labels=names + [label])
                for key, count in sorted(v.items()):
                    if (x := _number(count)) is not None:
                        c.add_metric(values + [str(key)], x)
                yield c
            elif (x := _number(v)) is not None:
                yield _single(CounterMetricFamily, base, HELP.get(base, base), names, values, x)
        for name, (key, doc) in SERVER_COUNTERS.items():
            if (v := _number(s.get(key))) is not None:
                yield _single(CounterMetricFamily, name, doc, names, values, v)
        for name, h in sorted((m.get("histograms") or {}).items()):
            if isinstance(h, dict) and (fam := _histogram(name, h, names, values)) is not None:
                yield fam


def _single(family, name: str, doc: str, names: list, values: list, value: float):
    """A gauge or counter family `rawinfer:<name>` with the one sample of this server's labels."""
    f = family(f"rawinfer:{name}", doc, labels=names)
    f.add_metric(values, value)
    return f


def _histogram(name: str, h: dict, names: list, values: list) -> HistogramMetricFamily | None:
    """A histogram from {"buckets": upper bounds, "counts": cumulative counts per bound, "count", "sum"}
    (PROTOCOL.md); None when the map does not have that shape."""
    bounds, counts = h.get("buckets"), h.get("counts")
    total, count = _number(h.get("sum")), _number(h.get("count"))
    if not isinstance(bounds, list) or not isinstance(counts, list) or total is None or count is None \
            or len(counts) != len(bounds) or any(_number(x) is None for x in bounds + counts):
        return None
    buckets = [(str(float(b)), float(c)) for b, c in zip(bounds, counts)] + [("+Inf", count)]
    fam = HistogramMetricFamily(f"rawinfer:{name}", HELP.get(name, name), labels=names)
    fam.add_metric(values, buckets, total)
    return fam


def render(stats: dict, model: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model))
    return generate_latest(registry)
