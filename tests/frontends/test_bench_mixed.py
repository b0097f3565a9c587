"""`rawinfer bench serve` with the mixed workload (issue 20): short and long requests reported apart with
p50/p90/p99, goodput under the stated objectives, the long class's lengths checked against the context."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cli_util import Server, rawinfer  # noqa: E402


def _args(**kw):
    base = dict(num_requests=10, input_len=8, output_len=4, range_ratio=0.0, seed=0, long_fraction=0.3,
                long_input_len=40, long_output_len=2)
    return SimpleNamespace(**(base | kw))


def test_mixed_workload_is_seeded_and_has_the_stated_share_of_long_prompts():
    from rawinfer.frontends.bench.mixed import make_mixed_workload
    wl, is_long = make_mixed_workload(_args(), 512)
    assert sum(is_long) == 3 and (wl, is_long) == make_mixed_workload(_args(), 512)
    assert [len(p) for p in wl.prompts] == [40 if g else 8 for g in is_long]
    assert wl.output_lens == [2 if g else 4 for g in is_long]
    wl, is_long = make_mixed_workload(_args(long_fraction=0.0), 512)
    assert not any(is_long) and {len(p) for p in wl.prompts} == {8}


def test_long_prompts_that_do_not_fit_the_context_are_refused():
    from rawinfer.frontends.bench.mixed import check_mixed_lengths
    check_mixed_lengths(_args(), 42)
    with pytest.raises(ValueError, match="--long-input-len"):
        check_mixed_lengths(_args(), 41)


def test_goodput_counts_requests_meeting_both_objectives():
    from rawinfer.frontends.bench.serve import RequestRecord, summarize_run
    fast = RequestRecord(8, 3, sent=0.0, token_times=[0.1, 0.2, 0.3], message_times=[0.1, 0.2, 0.3],
                         finished=0.3, output_tokens=3, finish_reason="length")
    stalled = RequestRecord(8, 3, sent=0.0, token_times=[0.1, 0.6, 0.7], message_times=[0.1, 0.6, 0.7],
                            finished=0.7, output_tokens=3, finish_reason="length")
    late = RequestRecord(40, 2, sent=0.0, token_times=[1.5, 1.6], message_times=[1.5, 1.6], finished=1.6,
                         output_tokens=2, finish_reason="length", long=True)
    r = summarize_run([fast, stalled, late], 2.0, [], {"request_rate": 1.0, "slo_ttft_ms": 1000,
                                                       "slo_itl_ms": 200})
    assert r["goodput_requests"] == 1 and r["goodput_requests_per_s"] == pytest.approx(0.5)
    assert (r["short"]["requests"], r["long"]["requests"]) == (2, 1)
    assert r["short"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert r["short"]["itl_ms"]["p99"] > r["short"]["itl_ms"]["p50"]


def test_bench_serve_mixed_report(tiny_llama_dir, tmp_path):
    srv = Server(tiny_llama_dir)
    try:
        srv.wait_ready()
        out = tmp_path / "r.json"
        r = rawinfer("bench", "serve", "--addr", srv.addr, "--num-requests", "8", "--request-rate", "50",
                     "--input-len", "8", "--output-len", "6", "--long-fraction", "0.25", "--long-input-len", "200",
                     "--long-output-len", "2", "--slo-ttft-ms", "5000", "--slo-itl-ms", "5000",
                     "--json", str(out), "--figure", "", timeout=180)
        assert r.returncode == 0, r.stderr
    finally:
        srv.stop()
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (8, 0)
    assert (res["short"]["requests"], res["long"]["requests"]) == (6, 2)
    for cls in ("short", "long"):
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            assert set(res[cls][key]) == {"mean", "p50", "p90", "p99"} and res[cls][key]["p99"] > 0
    assert res["slo"] == {"ttft_ms": 5000.0, "itl_ms": 5000.0} and res["goodput_requests"] == 8
    assert res["goodput_requests_per_s"] > 0
    assert "short requests" in r.stdout and "goodput" in r.stdout
    r = rawinfer("bench", "serve", "--addr", "tcp://127.0.0.1:1", "--long-fraction", "2", timeout=60)
    assert r.returncode == 2 and "--long-fraction: must be a number in [0, 1], got 2" in r.stderr


def test_kv_transfer_report_is_the_run_delta_of_the_decode_sides_counters():
    import io

    from rawinfer.frontends.bench.mixed import kv_transfer_report, print_kv_transfer
    zero = {"remote": 0, "local": 0, "fallbacks": 0, "failed": 0, "stale": 0, "bytes": 0, "transfer_s": 0.0}
    before = {"kv_transfer": {**zero, "remote": 2, "bytes": 1000, "transfer_s": 0.1}}
    after = {"kv_transfer": {**zero, "remote": 6, "local": 1, "bytes": 9000, "transfer_s": 0.3}}
    r = kv_transfer_report(before, after, duration=2.0)
    assert r["remote"] == 4 and r["local"] == 1 and r["bytes"] == 8000
    assert abs(r["mean_transfer_ms"] - 50.0) < 1e-9 and abs(r["mb_per_s"] - 0.004) < 1e-12
    routed = {"replicas": {"0": {"stats": {"kv_transfer": {**zero, "remote": 3}}},
                           "1": {"stats": {"kv_transfer": {**zero, "remote": 2, "fallbacks": 1}}}}}
    r = kv_transfer_report({}, routed, duration=1.0)        # behind a router: summed over the replicas
    assert r["remote"] == 5 and r["fallbacks"] == 1
    assert kv_transfer_report({}, {"running": 0}, 1.0) is None      # colocated: nothing to report
    out = io.StringIO()
    print_kv_transfer(kv_transfer_report(before, after, 2.0), out)
    assert "4 prompts remote, 1 local, 0 fallbacks, 0 failed; 0.0 MB" in out.getvalue()
