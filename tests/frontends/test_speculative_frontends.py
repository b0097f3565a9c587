"""Speculative decoding through the front ends, as a user runs them: `rawinfer generate --speculative-method
ngram` prints the text it prints without; a `rawinfer serve --speculative-method ngram` answers the OpenAI
API (streamed or not) with what an in-process engine without speculation answers, reports its spec_decode
counters in ZeroMQ `stats` and /metrics, and `bench serve` (both backends) and `bench throughput` report the
acceptance. The /metrics reading of the bench is checked against the exporter's own rendering."""

from __future__ import annotations

import json

import httpx
import pytest

from cli_util import Server, rawinfer  # noqa: E402
from rawinfer.frontends.bench import speculative
from rawinfer.frontends.http.metrics import render

# input-grounded: the answer repeats the given text, so the n-gram lookup has something to propose
GROUNDED = ("Copy this list exactly, one item per line:\nred apple\ngreen pear\nyellow banana\nred apple\n"
            "green pear\nyellow banana")
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")
REPORT_KEYS = {"method", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
               "mean_acceptance_length", "accepted_per_pos"}


def _check_report(s: dict) -> None:
    """A run's acceptance as the benches report it: consistent, and speculation happened."""
    assert set(s) == REPORT_KEYS and s["method"] == "ngram"
    assert s["num_drafts"] > 0 and 0 <= s["num_accepted_tokens"] <= s["num_draft_tokens"] <= 4 * s["num_drafts"]
    assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert sum(s["accepted_per_pos"]) == s["num_accepted_tokens"] and len(s["accepted_per_pos"]) <= 4
    assert all(a >= b for a, b in zip(s["accepted_per_pos"], s["accepted_per_pos"][1:]))


def test_metrics_page_counters_read_back_and_run_difference():
    """What the exporter renders for two replicas' spec_decode counters reads back as their sums, and a
    run's report is the difference of two readings."""
    def replica(drafts, tokens, accepted, per_pos):
        return {"counters": {"spec_decode_num_drafts_total": {"ngram": drafts},
                             "spec_decode_num_draft_tokens_total": {"ngram": tokens},
                             "spec_decode_num_accepted_tokens_total": {"ngram": accepted},
                             "spec_decode_num_accepted_tokens_per_pos_total": {str(i): n for i, n in enumerate(per_pos)}},
                "labels": {"spec_decode_num_drafts_total": "method", "spec_decode_num_draft_tokens_total": "method",
                           "spec_decode_num_accepted_tokens_total": "method",
                           "spec_decode_num_accepted_tokens_per_pos_total": "position"}}
    page = render({"replica_metrics": {"0": replica(10, 30, 12, [6, 4, 2]), "1": replica(5, 15, 3, [3])}},
                  "m").decode()
    assert 'rawinfer:spec_decode_num_drafts_total{method="ngram",model_name="m",replica="0"} 10.0' in page
    assert "# HELP rawinfer:spec_decode_num_accepted_tokens_total Speculative decoding" in page
    after = speculative.totals_from_metrics(page)
    assert after == {"methods": ["ngram"], "num_drafts": 15, "num_draft_tokens": 45, "num_accepted_tokens": 15,
                     "accepted_per_pos": [9, 4, 2]}
    before = speculative.totals({"metrics": replica(5, 15, 3, [3])})
    run = speculative.run_report(before, after)
    assert run == {"method": "ngram", "num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                   "acceptance_rate": 0.4, "mean_acceptance_length": 2.2, "accepted_per_pos": [6, 4, 2]}
    assert speculative.totals({"metrics": {"counters": {"generation_tokens_total": 3}}}) is None
    assert speculative.totals_from_metrics("rawinfer:generation_tokens_total 3.0\n") is None
    assert speculative.run_report(None, None) is None


def test_generate_with_ngram_prints_the_same_greedy_text(smollm2_q4_dir):
    common = ("generate", "--json", GROUNDED, "--model", smollm2_q4_dir, "--device", "cpu", "--kv-cache-memory",
              "64MiB", "--max-tokens", "40", "--temperature", "0")
    plain, spec = rawinfer(*common), rawinfer(*common, *SPEC)
    assert plain.returncode == 0, plain.stderr
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert b["token_ids"] == a["token_ids"] and b["text"] == a["text"] and len(a["token_ids"]) > 10


def test_bench_throughput_reports_the_acceptance(smollm2_q4_dir, tmp_path):
    out = tmp_path / "t.json"
    r = rawinfer("bench", "throughput", "--model", smollm2_q4_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
                 *SPEC, "--num-requests", "1", "--input-len", "32", "--output-len", "64", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    _check_report(res["speculative"])
    assert res["config"]["speculative_method"] == "ngram" and res["config"]["num_speculative_tokens"] == 4
    assert "speculative:         ngram: " in r.stdout and "mean acceptance length" in r.stdout


@pytest.fixture(scope="module")
def spec_server(smollm2_q4_dir):
    srv = Server(smollm2_q4_dir, *SPEC, "--kv-cache-memory", "64MiB", http=True)
    try:
        srv.wait_ready(240)
        srv.wait_http()
        yield srv
    finally:
        srv.stop()


def test_http_chat_with_ngram_equals_the_engine_without(spec_server, smollm2_q4_dir):
    import openai

    from rawinfer import LLM, SamplingParams
    messages = [{"role": "user", "content": GROUNDED}]
    client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
    text = reply.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    llm = LLM(smollm2_q4_dir, device="cpu", kv_cache_memory="64MiB")
    (want,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert len(want.token_ids) > 10
    assert text == want.text and streamed == want.text

    from rawinfer.server import Client
    with Client(spec_server.addr, timeout_s=10) as c:
        stats = c.stats()                        # the reply decodes: its counters' keys are strings
    s = stats["speculative"]
    assert s["method"] == "ngram" and s["num_drafts"] > 0 and 0 < s["num_accepted_tokens"] <= s["num_draft_tokens"]
    page = httpx.get(spec_server.base_url + "/metrics", timeout=30).text
    assert f'rawinfer:spec_decode_num_drafts_total{{method="ngram",model_name="{model}"}} {float(s["num_drafts"])}' \
        in page
    for family in ("num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert f"# HELP rawinfer:spec_decode_{family}_total Speculative decoding" in page
    assert f'rawinfer:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model}",position="0"}}' in page
    totals = speculative.totals_from_metrics(page)
    assert totals["num_drafts"] == s["num_drafts"] and totals["accepted_per_pos"] == s["accepted_per_pos"]


@pytest.mark.parametrize("backend", ["zmq", "openai"])
def test_bench_serve_reports_the_servers_acceptance(spec_server, tmp_path, backend):
    out = tmp_path / "s.json"
    r = rawinfer("bench", "serve", "--backend", backend, "--addr", spec_server.addr, "--base-url",
                 spec_server.base_url, "--num-requests", "2", "--request-rate", "0.5", "--input-len", "32",
                 "--output-len", "48", "--json", str(out), "--figure", "", timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 2
    _check_report(res["speculative"])
    assert "speculative:             ngram: " in r.stdout
