"""`rawinfer bench serve --conversations`: multi-turn conversations that resend their history; the plan
(prompt growth, arrivals round-robin over conversations, the context check) without a server, then a run
against a real tiny server whose prefix cache must serve the later turns."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from cli_util import Server, rawinfer  # noqa: E402


def _args(**kw):
    base = dict(conversations=3, turns=4, input_len=40, turn_input_len=8, output_len=5, seed=0, range_ratio=0.0,
                long_fraction=0.0, backend="zmq", request_rate=float("inf"))
    return SimpleNamespace(**(base | kw))


class _Bar:
    def __init__(self):
        self.n = 0

    def update(self, k: int) -> None:
        self.n += k


def _plan(args):
    from rawinfer.frontends.bench import multiturn
    from rawinfer.frontends.bench.serve import RequestRecord
    times = [float(i) for i in range(args.conversations * args.turns)]
    return multiturn.plan(args, 512, times, RequestRecord)


def test_arrivals_go_round_robin_over_conversations():
    from rawinfer.frontends.bench.multiturn import assign_arrivals
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert assign_arrivals(times, 2, 3) == [[0.0, 0.2, 0.4], [0.1, 0.3, 0.5]]
    assert assign_arrivals(times, 3, 2) == [[0.0, 0.3], [0.1, 0.4], [0.2, 0.5]]
    with pytest.raises(ValueError):
        assign_arrivals(times, 2, 2)


def test_the_plan_is_seeded_with_prompts_of_each_conversation_its_own():
    args = _args()
    convs = _plan(args)
    assert len(convs) == 3 and convs[1].arrivals == [1.0, 4.0, 7.0, 10.0]
    assert [c.first_prompt for c in convs] == [c.first_prompt for c in _plan(args)]
    assert {len(c.first_prompt) for c in convs} == {40} and len({tuple(c.first_prompt) for c in convs}) == 3
    assert all(len(c.new_turns) == 3 and {len(t) for t in c.new_turns} == {8} for c in convs)
    recs = convs[2].records
    assert [(r.conversation, r.turn, r.max_tokens) for r in recs] == [(2, k, 5) for k in (1, 2, 3, 4)]
    assert [r.prompt_tokens for r in recs] == [40, 53, 66, 79]
    assert convs[0].first_prompt != _plan(_args(seed=1))[0].first_prompt


def test_each_turn_resends_the_history_and_what_was_generated():
    from rawinfer.frontends.bench.multiturn import converse
    conv = _plan(_args(conversations=1, turns=3))[0]
    sent = []

    async def send(rec, prompt, delay):
        sent.append((list(prompt), delay))
        rec.finish_reason, rec.output_tokens = "length", 5
        return [1000 + len(sent)] * 5              # ids no random prompt holds
    bar = _Bar()
    asyncio.run(converse(conv, send, bar))
    (p1, d1), (p2, d2), (p3, d3) = sent
    assert (d1, d2, d3) == (0.0, 1.0, 2.0) and p1 == conv.first_prompt
    assert p2 == p1 + [1001] * 5 + conv.new_turns[0]
    assert p3 == p2 + [1002] * 5 + conv.new_turns[1]
    assert bar.n == 0                              # the sender counts what it sends


def test_a_failed_turn_ends_its_conversation():
    from rawinfer.frontends.bench.multiturn import PREVIOUS_FAILED, converse
    conv = _plan(_args(conversations=1, turns=4))[0]

    async def send(rec, prompt, delay):
        rec.error = "boom" if rec.turn == 2 else None
        rec.finish_reason = None if rec.turn == 2 else "length"
        return []
    bar = _Bar()
    asyncio.run(converse(conv, send, bar))
    assert [r.error for r in conv.records] == [None, "boom", PREVIOUS_FAILED, PREVIOUS_FAILED]
    assert bar.n == 2


def test_the_longest_turn_must_fit_the_context():
    from rawinfer.frontends.bench.multiturn import check_fits, prompt_len
    from rawinfer.frontends.options import CLIError
    args = _args()
    assert prompt_len(args, 4) == 40 + 3 * (5 + 8)
    check_fits(args, 84)
    with pytest.raises(CLIError, match="--turns or --input-len"):
        check_fits(args, 83)


def test_options_that_make_no_sense_with_conversations_are_refused():
    from rawinfer.frontends.bench.multiturn import check_options
    from rawinfer.frontends.options import CLIError
    check_options(_args())
    check_options(_args(conversations=0, backend="openai", long_fraction=0.5))
    for bad, fix in ((dict(backend="openai"), "--backend zmq"), (dict(long_fraction=0.1), "--long-fraction"),
                     (dict(range_ratio=0.5), "--range-ratio")):
        with pytest.raises(CLIError, match=fix):
            check_options(_args(**bad))


def test_the_report_takes_the_hit_rate_between_the_two_snapshots():
    from rawinfer.frontends.bench.multiturn import cache_snapshot, report
    from rawinfer.frontends.bench.serve import RequestRecord

    def rec(turn, ttft, conv=0, ok=True):
        return RequestRecord(8, 2, sent=0.0, token_times=[ttft, ttft + 0.01], finished=ttft + 0.01,
                             output_tokens=2, finish_reason="length" if ok else None, conversation=conv, turn=turn)
    records = [rec(1, 0.5), rec(2, 0.1), rec(1, 0.7, conv=1), rec(2, 0.2, conv=1, ok=False)]
    stats = lambda q, h, **kw: {"metrics": {"counters": {"prefix_cache_queries_total": q,  # noqa: E731
                                                         "prefix_cache_hits_total": h}}, **kw}
    m = report(records, 2, 2, cache_snapshot(stats(100, 10)), cache_snapshot(stats(300, 110, routing={"policy": "x"})))
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"], m["prefix_cache_hit_rate"]) == (200, 100, 0.5)
    assert m["routing"] == {"policy": "x"} and m["completed_conversations"] == 1
    assert m["ttft_ms"]["first_turn"]["p50"] == pytest.approx(600.0)
    assert m["ttft_ms"]["later_turns"]["p50"] == pytest.approx(100.0)
    m = report(records, 2, 2, cache_snapshot({}), cache_snapshot(None))
    assert m["prefix_cache_hit_rate"] is None and m["routing"] is None


def test_bench_serve_conversations_hit_the_prefix_cache(tiny_llama_dir, tmp_path):
    C, T, first, new, out_len = 3, 3, 64, 20, 8      # prompts of several 16-token KV blocks
    srv = Server(tiny_llama_dir)
    try:
        srv.wait_ready()
        out = tmp_path / "r.json"
        r = rawinfer("bench", "serve", "--addr", srv.addr, "--conversations", str(C), "--turns", str(T),
                     "--input-len", str(first), "--turn-input-len", str(new), "--output-len", str(out_len),
                     "--request-rate", "30", "--json", str(out), "--figure", "", timeout=180)
        assert r.returncode == 0, r.stderr
        bad = rawinfer("bench", "serve", "--addr", srv.addr, "--conversations", "2", "--turns", "40",
                       "--input-len", "100", "--json", str(tmp_path / "x.json"), timeout=60)
        assert bad.returncode == 2 and "lower --turns or --input-len" in bad.stderr
    finally:
        srv.stop()
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (C * T, 0) and len(res["requests"]) == C * T
    for c in range(C):
        turns = sorted((q for q in res["requests"] if q["conversation"] == c), key=lambda q: q["turn"])
        assert [q["turn"] for q in turns] == list(range(1, T + 1)) and turns[0]["prompt_tokens"] == first
        for prev, cur in zip(turns, turns[1:]):
            assert prev["output_tokens"] == out_len
            assert cur["prompt_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] + new
            assert cur["sent"] >= prev["finished"]
    m = res["multi_turn"]
    assert (m["conversations"], m["turns"], m["completed_conversations"]) == (C, T, C)
    assert 0 < m["prefix_cache_hit_rate"] <= 1 and 0 < m["prefix_cache_hits"] <= m["prefix_cache_queries"]
    # the snapshots bracket the run alone (the warm-up before it): every prompt token was looked up once
    assert m["prefix_cache_queries"] == sum(q["prompt_tokens"] for q in res["requests"])
    # each later turn finds at least the previous turn's prompt, in whole blocks (BS = 16, --block-size)
    previous_prompts = sum(q["prompt_tokens"] - out_len - new for q in res["requests"] if q["turn"] > 1)
    assert m["prefix_cache_hits"] >= sum((q["prompt_tokens"] - out_len - new) // 16 * 16
                                         for q in res["requests"] if q["turn"] > 1) > 0
    assert m["prefix_cache_hits"] <= previous_prompts + (T - 1) * C * out_len
    assert m["routing"] is None                      # one engine, no router in front
    for key in ("all", "first_turn", "later_turns"):
        assert m["ttft_ms"][key]["p99"] >= m["ttft_ms"][key]["p50"] > 0
    assert "prefix-cache hit rate" in r.stdout and "turns > 1" in r.stdout
    r = rawinfer("bench", "serve", "--addr", "tcp://127.0.0.1:1", "--conversations", "2", "--backend", "openai")
    assert r.returncode == 2 and "--backend zmq" in r.stderr
