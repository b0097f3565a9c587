"""What the HTTP front end needs from `rawinfer serve` (issue 17): tokenize / detokenize, model_info's id and
context, the metrics in `stats`, and log-probabilities over the wire, on an in-process server over SmolLM2."""

from __future__ import annotations

import threading

import pytest

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.client import Client, RequestError
from rawinfer.frontends.server.server import Server, ServerConfig

from conftest import free_port  # noqa: E402




@pytest.fixture(scope="module")
def smol_engine(smollm2_dir):
    from rawinfer import LLMEngine
    return LLMEngine(smollm2_dir, device="cpu", kv_cache_memory="32MiB", warmup=False)


@pytest.fixture(scope="module")
def addr(smol_engine):
    addr = f"tcp://127.0.0.1:{free_port()}"
    server = Server(smol_engine, ServerConfig(bind=addr))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield addr
    finally:
        server.shutdown()
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"


def test_tokenize_and_detokenize_match_the_engine(addr, smol_engine):
    tok = smol_engine.tokenizer
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    with Client(addr, timeout_s=30) as c:
        assert c.tokenize("Hello world") == tok.encode("Hello world")
        ids = c.tokenize(messages=chat)
        assert ids == smol_engine.encode_prompt(tok.apply_chat_template(chat, add_generation_prompt=True))
        assert c.detokenize(ids) == tok.decode(ids)
        assert c.detokenize(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
        with pytest.raises(RequestError) as e:
            c.detokenize([10**6])
        assert e.value.code == "rejected" and "vocabulary" in e.value.message
        info = c.model_info()
        assert info["model"] == "smollm2-135m-instruct" and info["max_model_len"] == smol_engine.max_model_len
        assert info["max_logprobs"] == 20 and isinstance(info["created"], int) and info["model_path"]


def test_stats_carry_the_metrics_series(addr):
    with Client(addr, timeout_s=60) as c:
        before = c.stats()["metrics"]
        done = c.complete([1, 2, 3, 4], params={"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        assert done.finish_reason == "length"
        m = c.stats()["metrics"]
    cnt, hist = m["counters"], m["histograms"]
    assert cnt["generation_tokens_total"] - before["counters"]["generation_tokens_total"] == 3
    assert cnt["prompt_tokens_total"] - before["counters"]["prompt_tokens_total"] == 4
    assert cnt["request_success_total"]["length"] - before["counters"]["request_success_total"]["length"] == 1
    assert m["labels"] == {"request_success_total": "finished_reason"}
    assert set(m["gauges"]) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        h = hist[name]
        assert len(h["buckets"]) == len(h["counts"]) and h["buckets"] == sorted(h["buckets"])
        assert h["counts"] == sorted(h["counts"]) and h["counts"][-1] <= h["count"]
    assert hist["inter_token_latency_seconds"]["count"] - before["histograms"]["inter_token_latency_seconds"]["count"] == 2
    assert P.decode_reply(P.encode(P.StatsReply({"metrics": m}))).stats["metrics"] == m


def test_logprobs_travel_in_chunks_and_finals(addr, smol_engine):
    prompt = [504, 3575, 282, 4649, 314]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    with Client(addr, timeout_s=60) as c:
        streamed = list(c.generate(prompt, params=params))
        whole = c.complete(prompt, params=params).outputs[0]
        echo = c.complete(prompt, params={"max_tokens": 0, "prompt_logprobs": 0}).outputs[0]
        plain = list(c.generate(prompt, params={"max_tokens": 2, "temperature": 0.0}))
    ids = [t for m in streamed for t in m.token_ids]
    lp = [x for m in streamed if m.logprobs for x in m.logprobs.logprobs]
    assert ids == whole.token_ids and lp == whole.logprobs.logprobs and len(lp) == 4
    assert all(m.logprobs is not None and len(m.logprobs.token_ids) == len(m.token_ids) for m in streamed)
    assert [m.prompt_logprobs is not None for m in streamed] == [True] + [False] * (len(streamed) - 1)
    assert streamed[0].prompt_logprobs == whole.prompt_logprobs and whole.prompt_logprobs.token_ids == prompt[1:]
    assert all(len(t) == 2 for t in whole.logprobs.top_token_ids)
    assert echo.token_ids == [] and echo.finish_reason == "length"
    assert echo.prompt_logprobs.logprobs == whole.prompt_logprobs.logprobs
    assert all(m.logprobs is None and m.prompt_logprobs is None for m in plain)
