"""/metrics of a router's stats (`serve --replicas N`): every engine series once per family with one sample
per replica under a `replica` label, the merged map left out, and the router's own series; a single
engine's stats still rendered without any replica label. `render()` is called directly on hand-made
stats replies and its text parsed by prometheus_client."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from rawinfer.frontends.http.metrics import render

MODEL = "smollm2-135m-instruct"
BOUNDS = [0.01, 0.1, 1.0]


def engine_metrics(running: int, prompt: int, stop: int, length: int, ttft_counts: list[int], ttft_sum: float) -> dict:
    """A metrics map shaped as PROTOCOL.md's `stats.metrics`."""
    return {
        "gauges": {"num_requests_running": running, "num_requests_waiting": 0, "kv_cache_usage_perc": running / 10},
        "counters": {"prompt_tokens_total": prompt, "generation_tokens_total": 2 * prompt, "num_preemptions_total": 0,
                     "request_success_total": {"stop": stop, "length": length}},
        "labels": {"request_success_total": "finished_reason"},
        "histograms": {"time_to_first_token_seconds": {"buckets": BOUNDS, "counts": ttft_counts,
                                                       "count": ttft_counts[-1] + 1, "sum": ttft_sum}},
    }


R0 = engine_metrics(running=1, prompt=100, stop=3, length=2, ttft_counts=[1, 4, 5], ttft_sum=0.5)
R1 = engine_metrics(running=3, prompt=250, stop=7, length=0, ttft_counts=[0, 2, 6], ttft_sum=2.25)
MERGED = engine_metrics(running=4, prompt=350, stop=10, length=2, ttft_counts=[1, 6, 11], ttft_sum=2.75)
ROUTING = {"policy": "cache_aware", "replicas_target": 2, "replicas_serving": 1, "requests_waiting_for_replica": 4,
           "requests_routed": 10, "requests_retried": 2, "requests_failed_replica_lost": 1,
           "requests_timed_out_waiting": 5, "routed_by_prefix": 3, "routed_by_balance": 0, "routed_least_loaded": 7,
           "routed_round_robin": 0, "replicas_lost": 1, "scale_events": 6}
ROUTER_STATS = {
    "requests_in_flight": 2, "requests_received": 12, "requests_rejected": 0, "requests_aborted_by_client": 1,
    "requests_aborted_vanished": 0, "tokens_generated": 700,
    "metrics": MERGED, "replica_metrics": {"0": R0, "1": R1}, "routing": ROUTING,
    "replicas": {"0": {"state": "up", "endpoint": "tcp://127.0.0.1:5001", "pid": 11, "requests_in_flight": 1,
                       "requests_routed": 5, "times_lost": 0, "prefix_record_pieces": 12, "stats": {}},
                 "1": {"state": "lost", "endpoint": "tcp://127.0.0.1:5002", "pid": 12, "requests_in_flight": 0,
                       "requests_routed": 5, "times_lost": 1, "prefix_record_pieces": 0, "stats": {}}},
}


def parse(stats: dict) -> tuple[list, dict]:
    """(family names in order, {(sample name, labels other than model_name as a sorted tuple): value})."""
    text = render(stats, MODEL).decode()
    fams = list(text_string_to_metric_families(text))
    samples = {}
    for fam in fams:
        for s in fam.samples:
            assert s.labels.get("model_name") == MODEL, s
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            assert key not in samples, key
            samples[key] = s.value
    return [f.name for f in fams], samples


def test_each_family_appears_once_and_each_engine_series_once_per_replica():
    families, samples = parse(ROUTER_STATS)
    assert not [n for n, c in Counter(families).items() if c > 1]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                 "generation_tokens", "num_preemptions", "request_success", "time_to_first_token_seconds"):
        assert f"rawinfer:{name}" in families, name
    for replica, m in (("0", R0), ("1", R1)):
        r = (("replica", replica),)
        for name, v in m["gauges"].items():
            assert samples[(f"rawinfer:{name}", r)] == v, (name, replica)
        assert samples[("rawinfer:prompt_tokens_total", r)] == m["counters"]["prompt_tokens_total"]
        assert samples[("rawinfer:generation_tokens_total", r)] == m["counters"]["generation_tokens_total"]
        for reason, v in m["counters"]["request_success_total"].items():
            assert samples[("rawinfer:request_success_total", (("finished_reason", reason),) + r)] == v


def test_histogram_buckets_per_replica():
    _, samples = parse(ROUTER_STATS)
    for replica, m in (("0", R0), ("1", R1)):
        h = m["histograms"]["time_to_first_token_seconds"]
        for le, count in zip(["0.01", "0.1", "1.0", "+Inf"], h["counts"] + [h["count"]]):
            key = ("rawinfer:time_to_first_token_seconds_bucket", (("le", le), ("replica", replica)))
            assert samples[key] == count, key
        assert samples[("rawinfer:time_to_first_token_seconds_count", (("replica", replica),))] == h["count"]
        assert samples[("rawinfer:time_to_first_token_seconds_sum", (("replica", replica),))] == h["sum"]


def test_no_unlabelled_engine_series_and_the_merged_map_is_not_emitted():
    _, samples = parse(ROUTER_STATS)
    engine = ("rawinfer:num_requests_running", "rawinfer:num_requests_waiting", "rawinfer:kv_cache",
              "rawinfer:prompt_tokens", "rawinfer:generation_tokens", "rawinfer:num_preemptions",
              "rawinfer:request_success", "rawinfer:time_to_first_token")
    engine_samples = [(n, labels) for n, labels in samples if n.startswith(engine)]
    assert len(engine_samples) == 2 * (3 + 3 + 2 + 6)    # gauges, counters, by reason, 4 buckets + count + sum
    assert engine_samples and all(dict(labels).get("replica") in ("0", "1") for _, labels in engine_samples)
    assert not [k for k, v in samples.items() if k[0] == "rawinfer:prompt_tokens_total" and v == 350]


def test_server_series_stay_unlabelled_by_replica():
    _, samples = parse(ROUTER_STATS)
    assert samples[("rawinfer:num_requests_in_flight", ())] == 2
    assert samples[("rawinfer:requests_received_total", ())] == 12
    assert samples[("rawinfer:requests_aborted_by_client_total", ())] == 1


def test_router_series():
    _, samples = parse(ROUTER_STATS)
    assert samples[("rawinfer:router_replicas_target", ())] == 2
    assert samples[("rawinfer:router_replicas_serving", ())] == 1
    assert samples[("rawinfer:router_requests_waiting_for_replica", ())] == 4
    routed = {dict(labels)["reason"]: v for (n, labels), v in samples.items()
              if n == "rawinfer:router_requests_routed_total"}
    assert routed == {"prefix": 3, "balance": 0, "least_loaded": 7, "round_robin": 0}
    assert sum(routed.values()) == ROUTING["requests_routed"]
    assert samples[("rawinfer:router_requests_retried_total", ())] == 2
    assert samples[("rawinfer:router_requests_failed_replica_lost_total", ())] == 1
    assert samples[("rawinfer:router_requests_timed_out_waiting_total", ())] == 5
    assert samples[("rawinfer:router_replicas_lost_total", ())] == 1
    assert samples[("rawinfer:router_scale_events_total", ())] == 6
    assert samples[("rawinfer:replica_up", (("replica", "0"),))] == 1
    assert samples[("rawinfer:replica_up", (("replica", "1"),))] == 0


def test_a_replica_missing_a_series_only_lacks_its_sample():
    r1 = {**R1, "gauges": {"num_requests_running": 3}, "histograms": {}}
    families, samples = parse({**ROUTER_STATS, "replica_metrics": {"0": R0, "1": r1}})
    assert not [n for n, c in Counter(families).items() if c > 1]
    assert samples[("rawinfer:num_requests_waiting", (("replica", "0"),))] == 0
    assert ("rawinfer:num_requests_waiting", (("replica", "1"),)) not in samples
    assert ("rawinfer:time_to_first_token_seconds_count", (("replica", "1"),)) not in samples
    assert samples[("rawinfer:num_requests_running", (("replica", "1"),))] == 3


def test_a_single_engine_renders_without_any_replica_label():
    stats = {"requests_in_flight": 0, "requests_received": 3, "metrics": R0}
    families, samples = parse(stats)
    assert not [n for n, c in Counter(families).items() if c > 1]
    assert not [k for k in samples if "replica" in dict(k[1])]
    assert not [n for n in families if "router" in n or "replica" in n]
    assert samples[("rawinfer:num_requests_running", ())] == 1
    assert samples[("rawinfer:prompt_tokens_total", ())] == 100
    assert samples[("rawinfer:request_success_total", (("finished_reason", "stop"),))] == 3
    assert samples[("rawinfer:time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 4
    assert samples[("rawinfer:requests_received_total", ())] == 3


def test_the_http_benchmark_reads_its_gauges_from_the_page():
    """`bench serve --backend openai` scans /metrics for its series: behind a router the replicas' requests and
    tokens add up and their KV usage is averaged; a single engine's page gives its own values."""
    from rawinfer.frontends.bench.http_load import _gauges
    assert _gauges(render(ROUTER_STATS, MODEL).decode()) == {
        "rawinfer:num_requests_running": 4, "rawinfer:num_requests_waiting": 0, "rawinfer:kv_cache_usage_perc": 0.2,
        "rawinfer:generation_tokens_total": 700}
    single = {**ROUTER_STATS, "replica_metrics": None, "metrics": R1}
    assert _gauges(render(single, MODEL).decode()) == {
        "rawinfer:num_requests_running": 3, "rawinfer:num_requests_waiting": 0, "rawinfer:kv_cache_usage_perc": 0.3,
        "rawinfer:generation_tokens_total": 500}


def test_the_http_benchmark_takes_the_server_rate_from_the_token_counter():
    """The figure's server line over HTTP: generated tokens (all replicas) per second between two polls."""
    from rawinfer.frontends.bench.http_load import _gauges, metrics_sample
    first = metrics_sample(_gauges(render(ROUTER_STATS, MODEL).decode()), 1.0, None)
    assert first["server_tokens_per_s"] is None and first["tokens"] == 700 and first["running"] == 4
    later = dict(R1, counters={**R1["counters"], "generation_tokens_total": 800})
    text = render({**ROUTER_STATS, "replica_metrics": {"0": R0, "1": later}}, MODEL).decode()
    assert metrics_sample(_gauges(text), 1.5, first)["server_tokens_per_s"] == 600.0      # (200 + 800 - 700) / 0.5
    assert metrics_sample({}, 2.0, first)["server_tokens_per_s"] is None                 # a server without it
