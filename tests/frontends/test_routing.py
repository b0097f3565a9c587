"""The replica router's pure parts: prompt pieces, the per-replica prefix record, the routing decision, the
merged stats and the autoscaling rule (frontends/cluster/). No sockets, no processes."""

from __future__ import annotations

import pytest

from rawinfer.frontends.cluster.autoscale import AutoscaleConfig, Autoscaler
from rawinfer.frontends.cluster.routing import (TEXT_PIECE, TOKEN_PIECE, Candidate, PrefixRecord, Router,
                                                RoutingConfig, prompt_pieces)
from rawinfer.frontends.cluster.stats import aggregate, merge_metrics


def test_pieces_chain_so_equal_prefixes_share_leading_hashes_only():
    a = prompt_pieces(list(range(3 * TOKEN_PIECE + 5)))
    b = prompt_pieces(list(range(TOKEN_PIECE)) + [999] + list(range(TOKEN_PIECE + 1, 3 * TOKEN_PIECE)))
    assert len(a) == 3 and len(b) == 3          # a partial last piece is not hashed
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]   # one differing id changes its piece and all later
    assert prompt_pieces([1, 2, 3]) == []
    t = prompt_pieces("x" * (2 * TEXT_PIECE + 1))
    assert len(t) == 2 and t == prompt_pieces("x" * (2 * TEXT_PIECE))
    chat1 = prompt_pieces(messages=[{"role": "user", "content": "y" * 200}])
    chat2 = prompt_pieces(messages=[{"role": "user", "content": "y" * 200}, {"role": "assistant", "content": "z"}])
    assert chat1 and chat2[:len(chat1)] == chat1
    assert prompt_pieces(messages=[{"role": "system", "content": "y" * 200}]) != chat1   # the role counts


def test_prefix_record_matches_leading_pieces_and_forgets_the_least_recent():
    rec = PrefixRecord(capacity=4)
    p = prompt_pieces(list(range(4 * TOKEN_PIECE)))
    rec.insert(p[:3])
    assert rec.match(p) == 3 and rec.match(prompt_pieces(list(range(1, 4 * TOKEN_PIECE + 1)))) == 0
    q = prompt_pieces(list(range(1000, 1000 + 2 * TOKEN_PIECE)))
    rec.insert(q)                               # 5 pieces > capacity 4: p[0], the oldest, goes
    assert len(rec) == 4 and rec.match(p) == 0 and rec.match(q) == 2
    rec.clear()
    assert len(rec) == 0


def _cands(loads, records=None):
    records = records or [PrefixRecord(1000) for _ in loads]
    return [Candidate(i, n, 0.0, r) for i, (n, r) in enumerate(zip(loads, records))]


def test_cache_aware_sends_a_prompt_where_its_prefix_went():
    r = Router(RoutingConfig())
    recs = [PrefixRecord(1000), PrefixRecord(1000)]
    first = prompt_pieces(list(range(4 * TOKEN_PIECE)))
    d1 = r.choose(first, _cands([0, 0], recs))
    assert d1.reason == "least_loaded" and d1.matched == 0
    longer = prompt_pieces(list(range(6 * TOKEN_PIECE)))     # the same conversation, one turn on
    d2 = r.choose(longer, _cands([0, 1] if d1.slot == 1 else [1, 0], recs))
    assert d2.slot == d1.slot and d2.reason == "prefix" and d2.matched == 4
    other = prompt_pieces(list(range(500, 500 + 4 * TOKEN_PIECE)))
    d3 = r.choose(other, _cands([1, 1], recs))
    assert d3.slot != d1.slot                   # a new prefix goes to the replica with the smaller record


def test_cache_aware_gives_way_to_load_when_one_prefix_is_hot():
    r = Router(RoutingConfig(balance_abs=4, balance_rel=1.5))
    recs = [PrefixRecord(1000), PrefixRecord(1000)]
    hot = prompt_pieces(list(range(4 * TOKEN_PIECE)))
    recs[0].insert(hot)
    assert r.choose(hot, _cands([3, 0], recs)).slot == 0     # within the balance margin: the prefix wins
    d = r.choose(hot, _cands([6, 0], recs))
    assert d.slot == 1 and d.reason == "balance"
    full = [Candidate(0, 0, 1.0, recs[0]), Candidate(1, 0, 0.0, recs[1])]
    assert r.choose(prompt_pieces(list(range(999, 999 + 64))), full).slot == 1   # KV usage counts as load
    low = prompt_pieces(list(range(4 * TOKEN_PIECE)) + list(range(900, 900 + 8 * TOKEN_PIECE)))
    assert r.choose(low, _cands([2, 0], recs)).reason == "least_loaded"      # 4 of 12 pieces: below min_match


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = Router(RoutingConfig(policy="round_robin"))
    p = prompt_pieces(list(range(64)))
    assert [rr.choose(p, _cands([5, 0, 0])).slot for _ in range(4)] == [0, 1, 2, 0]
    ll = Router(RoutingConfig(policy="least_loaded"))
    assert ll.choose(p, _cands([3, 1, 2])).slot == 1
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(RoutingConfig(policy="random"))


def _metrics(ttft_counts, hits, queries, kv):
    return {"gauges": {"num_requests_running": 1, "kv_cache_usage_perc": kv},
            "counters": {"prefix_cache_hits_total": hits, "prefix_cache_queries_total": queries,
                         "request_success_total": {"stop": 1, "length": 2}},
            "labels": {"request_success_total": "finished_reason"},
            "histograms": {"time_to_first_token_seconds": {"buckets": [0.1, 1.0], "counts": ttft_counts,
                                                           "count": ttft_counts[-1] + 1, "sum": 2.5}}}


def test_merged_metrics_add_counters_and_histograms_and_average_kv_usage():
    m = merge_metrics([_metrics([1, 2], 10, 40, 0.2), _metrics([0, 3], 5, 60, 0.6)])
    assert m["gauges"] == {"num_requests_running": 2, "kv_cache_usage_perc": pytest.approx(0.4)}
    assert m["counters"]["prefix_cache_hits_total"] == 15 and m["counters"]["prefix_cache_queries_total"] == 100
    assert m["counters"]["request_success_total"] == {"stop": 2, "length": 4}
    h = m["histograms"]["time_to_first_token_seconds"]
    assert h == {"buckets": [0.1, 1.0], "counts": [1, 5], "count": 7, "sum": 5.0}
    s = aggregate({"0": {"kv_blocks_used": 10, "kv_blocks_total": 100, "prefix_cache_hit_tokens": 10,
                         "prefix_cache_query_tokens": 40, "requests_received": 7, "metrics": _metrics([1, 2], 1, 2, 0)},
                   "1": {"kv_blocks_used": 30, "kv_blocks_total": 100, "prefix_cache_hit_tokens": 5,
                         "prefix_cache_query_tokens": 60, "requests_received": 9, "metrics": _metrics([1, 2], 1, 2, 0)}})
    assert s["kv_usage"] == pytest.approx(0.2) and s["prefix_cache_hit_rate"] == pytest.approx(0.15)
    assert "requests_received" not in s          # the router's own client counters stand for these
    assert set(s["replica_metrics"]) == {"0", "1"}


def test_autoscaler_adds_under_a_lasting_queue_and_removes_when_idle():
    a = Autoscaler(AutoscaleConfig(1, 3, up_depth=4, down_depth=0.5, up_after_s=10, down_after_s=30), now=0.0)
    assert a.target(5.0, 1, 20, 1) == 1           # a queue, not yet for long enough
    assert a.target(16.0, 1, 20, 1) == 2
    assert a.target(20.0, 2, 20, 1) == 2          # the new replica is loading: the clock restarted
    assert a.target(27.0, 2, 20, 2) == 2          # queued since 20 s: 7 s only
    assert a.target(31.0, 2, 20, 2) == 3
    assert a.target(45.0, 3, 40, 3) == 3          # at the maximum
    assert a.target(46.0, 3, 0, 3) == 3
    assert a.target(77.0, 3, 0, 3) == 2           # idle for 31 s
    with pytest.raises(ValueError, match="minimum replicas"):
        AutoscaleConfig(3, 2)
