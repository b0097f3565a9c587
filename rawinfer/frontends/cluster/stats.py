"""One `stats` view over every replica: the engines' gauges and counters added up, ratios recomputed from
their parts, the Prometheus-style `metrics` merged (PROTOCOL.md), and each replica's own metrics kept under
`replica_metrics` so that /metrics can label every series with its replica."""

from __future__ import annotations

from typing import Any

# the router's own counters replace these (a replica's client is the router, not the users)
_CLIENT_KEYS = {
    "requests_in_flight", "finals_unconfirmed", "clients_with_requests", "clients_backlogged", "requests_received",
    "requests_rejected", "requests_completed", "requests_aborted_by_client", "requests_aborted_vanished",
    "clients_vanished", "messages_invalid", "uptime_s", "server_time"}
_AVERAGED = {"kv_cache_usage_perc"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merge_metrics(parts: list[dict]) -> dict:
    """Counters and histograms added up (histograms only where their buckets agree), gauges added up except
    the KV usage fraction, which is averaged."""
    out: dict = {"gauges": {}, "counters": {}, "labels": {}, "histograms": {}}
    for m in parts:
        for name, v in (m.get("gauges") or {}).items():
            if _number(v):
                out["gauges"][name] = out["gauges"].get(name, 0) + v
        for name, v in (m.get("counters") or {}).items():
            if isinstance(v, dict):
                acc = out["counters"].setdefault(name, {})
                for k, x in v.items():
                    if _number(x):
                        acc[k] = acc.get(k, 0) + x
            elif _number(v):
                out["counters"][name] = out["counters"].get(name, 0) + v
        out["labels"].update(m.get("labels") or {})
        for name, h in (m.get("histograms") or {}).items():
            acc = out["histograms"].get(name)
            if acc is None:
                out["histograms"][name] = {"buckets": list(h["buckets"]), "counts": list(h["counts"]),
                                           "count": h["count"], "sum": h["sum"]}
            elif acc["buckets"] == list(h["buckets"]):
                acc["counts"] = [a + b for a, b in zip(acc["counts"], h["counts"])]
                acc["count"] += h["count"]
                acc["sum"] += h["sum"]
    for name in _AVERAGED & set(out["gauges"]):
        out["gauges"][name] /= max(1, sum(1 for m in parts if name in (m.get("gauges") or {})))
    return out


def aggregate(replica_stats: dict[str, dict]) -> dict:
    """The engines' part of the router's stats, from each replica's last stats reply (by slot name)."""
    out: dict = {}
    for s in replica_stats.values():
        for k, v in s.items():
            if k not in _CLIENT_KEYS and _number(v):
                out[k] = out.get(k, 0) + v
    if out.get("kv_blocks_total"):
        out["kv_usage"] = out.get("kv_blocks_used", 0) / out["kv_blocks_total"]
    if out.get("prefix_cache_query_tokens"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / out["prefix_cache_query_tokens"]
    out.pop("peak_kv_usage", None)              # a maximum over time does not add up
    metrics = {k: s["metrics"] for k, s in replica_stats.items() if isinstance(s.get("metrics"), dict)}
    out["metrics"] = merge_metrics(list(metrics.values()))
    out["replica_metrics"] = metrics
    return out
