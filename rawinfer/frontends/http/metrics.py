"""GET /metrics: the engine's `stats` reply in the Prometheus text format, under vLLM's metric names with
a `rawinfer:` prefix, so dashboards made for vLLM read it with the prefix changed.

Every number comes from the engine (one `stats` call per scrape: its `metrics` map, PROTOCOL.md, and the
server's own counters), not from this worker: with several HTTP workers, each scrape still sees the
whole engine. A metric whose source the stats reply lacks is left out rather than shown as zero.

Behind a router (`serve --replicas N`) the reply also holds each replica's metrics map (`replica_metrics`):
every engine series is then one sample per replica under a `replica` label, and the merged `metrics` map is
left out (Prometheus adds the replicas up itself; the sum as well would count everything twice). The
router's own series (`rawinfer:router_*`, `rawinfer:replica_up`) come from its `routing` and `replicas`.
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
# the router's `routing` map: metric -> (key, help); requests routed by reason -> key
ROUTER_GAUGES = {
    "router_replicas_target": ("replicas_target", "Replicas the router aims to run."),
    "router_replicas_serving": ("replicas_serving", "Replicas up and taking requests."),
    "router_requests_waiting_for_replica": ("requests_waiting_for_replica",
                                            "Requests held until a replica can take them."),
}
ROUTER_COUNTERS = {
    "router_requests_retried": ("requests_retried", "Requests resent to another replica after theirs was lost."),
    "router_requests_failed_replica_lost": ("requests_failed_replica_lost",
                                            "Requests ended with an error because their replica was lost."),
    "router_requests_timed_out_waiting": ("requests_timed_out_waiting",
                                          "Requests ended because no replica could take them in time."),
    "router_replicas_lost": ("replicas_lost", "Replicas taken out after their connection closed or went silent."),
    "router_scale_events": ("scale_events", "Changes of the replica target."),
}
ROUTED_BY = {"prefix": "routed_by_prefix", "balance": "routed_by_balance", "least_loaded": "routed_least_loaded",
             "round_robin": "routed_round_robin"}
KINDS = {"gauges": GaugeMetricFamily, "counters": CounterMetricFamily, "histograms": HistogramMetricFamily}
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
    "spec_decode_num_drafts": "Speculative decoding: drafts the model verified (one per sequence and step that "
                              "proposed tokens), by proposer method.",
    "spec_decode_num_draft_tokens": "Speculative decoding: tokens proposed in the verified drafts, by method.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: proposed tokens the model agreed with and kept, by "
                                       "method (accepted / draft tokens is the acceptance rate).",
    "spec_decode_num_accepted_tokens_per_pos": "Speculative decoding: drafts whose token at this position (from 0) "
                                               "was kept.",
    "router_requests_routed": "Requests the router sent to a replica, by the reason it chose that replica.",
    "replica_up": "1 while the replica is up and taking requests, else 0.",
}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


class _Snapshot:
    """A collector of one stats reply (a fresh registry per scrape: nothing is kept between scrapes)."""

    def __init__(self, stats: dict, model: str):
        self.stats, self.model = stats, model

    def collect(self) -> Iterable:
        return (fam for fam in self._families() if fam is not None)

    def _families(self) -> Iterable:
        s, names, values = self.stats, ["model_name"], [self.model]
        if isinstance(s.get("replica_metrics"), dict):
            engine_names = names + ["replica"]
            sources = [(values + [str(k)], _dict(m)) for k, m in sorted(s["replica_metrics"].items(), key=_slot_order)]
        else:
            engine_names, sources = names, [(values, _dict(s.get("metrics")))]
        yield from _engine_families("gauges", engine_names, sources)
        for name, (key, doc) in SERVER_GAUGES.items():
            yield _family(GaugeMetricFamily, name, doc, names, [(values, _number(s.get(key)))])
        yield from _engine_families("counters", engine_names, sources)
        for name, (key, doc) in SERVER_COUNTERS.items():
            yield _family(CounterMetricFamily, name, doc, names, [(values, _number(s.get(key)))])
        yield from _engine_families("histograms", engine_names, sources)
        if isinstance(s.get("routing"), dict):
            yield from _router_families(s["routing"], names, values)
        if isinstance(s.get("replicas"), dict):
            up = [(values + [str(k)], float(_dict(r).get("state") == "up"))
                  for k, r in sorted(s["replicas"].items(), key=_slot_order)]
            yield _family(GaugeMetricFamily, "replica_up", HELP["replica_up"], names + ["replica"], up)


def _slot_order(item: tuple) -> tuple:
    """Replica slots ("0", "1", ... "10") in numeric order, any other name after them."""
    k = str(item[0])
    return (0, int(k), k) if k.isdigit() else (1, 0, k)


def _family(kind: type, name: str, doc: str, label_names: list, samples: list):
    """The family `rawinfer:<name>` of `kind` with its samples [(label values, value)], a value being a number
    or, for a histogram, (buckets, sum); samples whose value is None are left out, and a family without any is
    None (collect drops it)."""
    samples = [(v, x) for v, x in samples if x is not None]
    if not samples:
        return None
    fam = kind(f"rawinfer:{name}", doc, labels=label_names)
    for label_values, x in samples:
        if kind is HistogramMetricFamily:
            fam.add_metric(label_values, *x)
        else:
            fam.add_metric(label_values, x)
    return fam


def _engine_families(section: str, label_names: list, sources: list[tuple[list, dict]]) -> Iterable:
    """One family per series of the metrics maps' `section` (gauges, counters or histograms), with the samples
    of every (label values, metrics map) of `sources`: the engine's one map, or each replica's under its
    replica label. A counter by a label (request_success_total by finished_reason) adds that label."""
    series = sorted({name for _, m in sources for name in _dict(m.get(section))})
    for name in series:
        base = name[:-len("_total")] if section == "counters" and name.endswith("_total") else name
        samples: list = []
        extra: list[str] | None = None          # a counter's own label, as the first map that has it names it
        for values, m in sources:
            if (v := _dict(m.get(section)).get(name)) is None:
                continue
            if section == "histograms":
                samples.append((values, _histogram(v) if isinstance(v, dict) else None))
                continue
            labels = [str(_dict(m.get("labels")).get(name, "label"))] if isinstance(v, dict) else []
            extra = labels if extra is None else extra
            if labels == extra:                 # a map whose series has another shape is left out
                points = [([str(k)], x) for k, x in sorted(v.items())] if labels else [([], v)]
                samples += [(values + key, _number(x)) for key, x in points]
        yield _family(KINDS[section], base, HELP.get(base, base), label_names + (extra or []), samples)


def _router_families(routing: dict, names: list, values: list) -> Iterable:
    """The router's own gauges and counters from its `routing` map."""
    for name, (key, doc) in ROUTER_GAUGES.items():
        yield _family(GaugeMetricFamily, name, doc, names, [(values, _number(routing.get(key)))])
    by_reason = [(values + [reason], _number(routing.get(key))) for reason, key in ROUTED_BY.items()]
    yield _family(CounterMetricFamily, "router_requests_routed", HELP["router_requests_routed"],
                  names + ["reason"], by_reason)
    for name, (key, doc) in ROUTER_COUNTERS.items():
        yield _family(CounterMetricFamily, name, doc, names, [(values, _number(routing.get(key)))])


def _histogram(h: dict) -> tuple[list, float] | None:
    """(buckets, sum) of a histogram map {"buckets": upper bounds, "counts": cumulative counts per bound,
    "count", "sum"} (PROTOCOL.md); None when the map does not have that shape."""
    bounds, counts = h.get("buckets"), h.get("counts")
    total, count = _number(h.get("sum")), _number(h.get("count"))
    if not isinstance(bounds, list) or not isinstance(counts, list) or total is None or count is None \
            or len(counts) != len(bounds) or any(_number(x) is None for x in bounds + counts):
        return None
    return [(str(float(b)), float(c)) for b, c in zip(bounds, counts)] + [("+Inf", count)], total


def render(stats: dict, model: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model))
    return generate_latest(registry)
