"""The HTTP API's refusals, metrics and cleanup, through a real server: every error class in OpenAI's
JSON shape with its status (400 naming the parameter, 401, 404, 400 beyond the context, 429/503), a stream
whose client disconnects freeing its KV blocks, /metrics parsed by prometheus_client and agreeing with the
requests sent, the host rule and a busy port refused before the model loads, and shutdown."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from cli_util import Server, free_port, rawinfer  # noqa: E402
from http_util import (API_KEY, AUTH, engine_stats, http_server, metrics, openai_client, post,  # noqa: E402,F401
                       wait_idle)


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "top_k": -5}, "top_k", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "from 1 to 64"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "0 to 20"),
    ("/v1/completions", {"prompt": "hi", "priority": 2**70}, "priority", "64 bits"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"+5": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"05": 1, "5": 2}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "token ids"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/v1/completions", {"max_tokens": 2}, "prompt", "required"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens", ">= 0"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role",
     "'developer'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "refusal": None}],
                              "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "boolean"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least one"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
])
def test_invalid_values_are_400_naming_the_parameter(http_server, path, body, param, words):
    err = _error(post(http_server, path, body), 400, param)
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_400(http_server):
    r = httpx.post(http_server.base_url + "/v1/completions", content=b"{nope", timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert "JSON" in _error(r, 400)["message"]
    for body, ctype in ((b"", "application/json"), (b"[1, 2]", "application/json"), (b'"hi"', "application/json"),
                        (b"prompt=hi", "application/x-www-form-urlencoded"), (b"\xff\xfe{", "application/json")):
        r = httpx.post(http_server.base_url + "/v1/completions", content=body, timeout=30,
                       headers={**AUTH, "content-type": ctype})
        err = _error(r, 400)
        assert "JSON" in err["message"] and not err["param"], (body, err)


def test_an_unknown_model_is_404(http_server):
    err = _error(post(http_server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found" and "smollm2-135m-instruct" in err["message"]
    _error(httpx.get(http_server.base_url + "/v1/nothing", headers=AUTH), 404)


def test_a_prompt_beyond_the_context_is_400(http_server):
    err = _error(post(http_server, "/v1/completions", {"prompt": [42] * 8192, "max_tokens": 4}), 400, "prompt")
    assert "context" in err["message"]
    _error(post(http_server, "/v1/completions", {"prompt": [10 ** 6], "max_tokens": 4}), 400, "prompt")


def test_without_the_api_key_every_route_but_health_and_version_is_401(http_server):
    for path, method in (("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/completions", "POST")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, http_server.base_url + path, headers=headers, json={"prompt": "x"})
            assert _error(r, 401)["code"] == "invalid_api_key"
    assert httpx.get(http_server.base_url + "/health").status_code == 200
    import openai
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=http_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_openai_fields_at_their_neutral_values_are_accepted(http_server):
    ok = post(http_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "presence_penalty": 0,
                                               "frequency_penalty": 0.0, "user": "u1", "logit_bias": {}})
    assert ok.status_code == 200, ok.text
    _error(post(http_server, "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}), 400, "logit_bias")


def test_engine_refusals_map_to_openai_statuses():
    from rawinfer.frontends.http.errors import from_engine
    assert from_engine("overloaded", "too many").status == 429
    assert from_engine("shutting_down", "stopping").status == 503
    e = from_engine("invalid_params", "SamplingParams.top_k=-2 is invalid: it must be an integer >= 0")
    assert (e.status, e.param, e.message) == (400, "top_k", "top_k=-2 is invalid: it must be an integer >= 0")
    e = from_engine("rejected", "prompt + max_tokens = 9000 tokens is beyond the context of 8192", "messages")
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
    assert from_engine("internal", "bug").status == 500


STREAM_GONE = "HTTP 499 POST /v1/completions: the client went away during the stream; its request was aborted"
REQUEST_GONE = "HTTP 499 POST /v1/completions: the client went away before the answer; its request was aborted"


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(http_server):
    before, logged = wait_idle(http_server), len(http_server.log_lines(STREAM_GONE, at_least=0))
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", http_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert engine_stats(http_server)["kv_blocks_used"] > 0
    t = time.monotonic()
    after = wait_idle(http_server, timeout_s=10)             # the connection closed above
    assert time.monotonic() - t < 5
    assert after["requests_aborted_by_client"] == before["requests_aborted_by_client"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < 400
    lines = http_server.log_lines(STREAM_GONE, at_least=logged + 1)
    assert len(lines) == logged + 1, http_server.output()[-3000:]   # one line


def test_a_client_that_disconnects_from_a_non_streaming_request_frees_its_blocks(http_server):
    """Without streaming, the request once ran to its end for nobody; now it is aborted within a moment."""
    before, logged = wait_idle(http_server), len(http_server.log_lines(REQUEST_GONE, at_least=0))
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(http_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=1.5)
    t = time.monotonic()
    after = wait_idle(http_server, timeout_s=10)
    assert time.monotonic() - t < 5
    assert after["requests_aborted_by_client"] == before["requests_aborted_by_client"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < 400
    lines = http_server.log_lines(REQUEST_GONE, at_least=logged + 1)
    assert len(lines) == logged + 1, http_server.output()[-3000:]


def test_requests_the_engine_link_cannot_send_are_400_or_413_not_500(http_server):
    """Found by fuzzing: each of these was a 500 or dropped the HTTP worker's connection to the engine."""
    huge = "a " * 600000                                          # over the engine's 1 MiB message limit
    assert _error(post(http_server, "/tokenize", {"prompt": huge}), 413)["code"] == "request_too_large"
    _error(post(http_server, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    err = _error(post(http_server, "/v1/completions", {"prompt": "a", "max_tokens": 10 ** 20}), 400)
    assert "64 bits" in err["message"]
    err = _error(post(http_server, "/v1/completions", {"prompt": [2 ** 40], "echo": True, "max_tokens": 1}), 400,
                 "prompt")
    assert "vocabulary" in err["message"]
    r = post(http_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})   # and the link still works
    assert r.status_code == 200, r.text


def test_a_chat_without_max_tokens_fits_the_kv_pool(http_server):
    """OpenAI's default max_tokens for a chat is what the context leaves; here the pool (64 MiB) holds less
    than the context, so the default is what the pool holds (it was refused as too big for the pool)."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "stop": [" "]}
    r = post(http_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_metrics_agree_with_the_requests_sent(http_server):
    wait_idle(http_server)
    m0 = metrics(http_server)
    assert {"rawinfer:num_requests_running", "rawinfer:num_requests_waiting", "rawinfer:kv_cache_usage_perc",
            "rawinfer:generation_tokens_total", "rawinfer:prompt_tokens_total", "rawinfer:num_preemptions_total",
            "rawinfer:prefix_cache_queries_total", "rawinfer:prefix_cache_hits_total"} <= set(m0)
    client = openai_client(http_server)
    sent = prompt = 0
    for i in range(3):
        r = client.completions.create(model="smollm2-135m-instruct", prompt=f"Metrics test {i}:", max_tokens=5 + i,
                                      temperature=0, extra_body={"ignore_eos": True})
        sent, prompt = sent + r.usage.completion_tokens, prompt + r.usage.prompt_tokens
    wait_idle(http_server)
    m1 = metrics(http_server)

    def delta(name: str) -> float:
        return m1.get(name, 0) - m0.get(name, 0)
    assert delta("rawinfer:generation_tokens_total") == sent == 18
    assert delta("rawinfer:prompt_tokens_total") == prompt
    assert delta("rawinfer:requests_received_total") == 3
    assert delta("rawinfer:request_success_total{finished_reason=length}") == 3
    assert m1["rawinfer:num_requests_running"] == 0 and m1["rawinfer:kv_cache_usage_perc"] == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(f"rawinfer:{name}_count") == 3, name
        assert delta(f"rawinfer:{name}_bucket{{le=+Inf}}") == 3, name
    assert delta("rawinfer:request_generation_tokens_sum") == 18
    assert delta("rawinfer:inter_token_latency_seconds_count") == 18 - 3     # gaps: tokens - 1 per request


def test_a_non_loopback_host_needs_an_api_key_and_a_busy_port_is_refused(tiny_llama_dir):
    r = rawinfer("serve", "--model", tiny_llama_dir, "--bind", f"tcp://127.0.0.1:{free_port()}", "--http-host",
                 "0.0.0.0", "--http-port", str(free_port()), timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr and "--insecure" in r.stderr
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = rawinfer("serve", "--model", tiny_llama_dir, "--bind", f"tcp://127.0.0.1:{free_port()}", "--http-port",
                     str(port), timeout=60)
    assert r.returncode == 2
    assert r.stderr == (f"rawinfer: error: cannot bind HTTP on 127.0.0.1:{port}: Address already in use (is another "
                        "server running there?); choose another --http-port, or --no-http\n")


def test_two_workers_serve_and_shutdown_ends_streams_and_health(tiny_llama_dir):
    srv = Server(tiny_llama_dir, "--api-workers", "2", http=True)
    try:
        srv.wait_ready()
        srv.wait_http()
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        answers = {post(srv, "/v1/completions", body, headers={}).json()["choices"][0]["text"] for _ in range(4)}
        assert len(answers) == 1
        long = {**body, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=long, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.terminate()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest)
        assert srv.proc.wait(20) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.base_url + "/health", timeout=2)
    finally:
        srv.stop()


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def test_every_refused_request_leaves_one_timestamped_warning_line(http_server):
    """The workers log through the serve process's stderr, in its format: time, level, who, then the status,
    the route and the reason."""
    import re
    tag = f"no-such-model-{time.monotonic_ns()}"
    _error(post(http_server, "/v1/completions", {"prompt": "hi", "model": tag}), 404, "model")
    _error(post(http_server, f"/v1/{tag}", {}), 404)
    _error(post(http_server, "/v1/chat/completions", {"messages": [{"role": tag, "content": "x"}]}), 400)
    _error(httpx.get(http_server.base_url + f"/v1/models?{tag}"), 401)
    lines = http_server.log_lines(tag, at_least=3)
    head = rf"^{STAMP} WARNING rawinfer http \d+: HTTP "
    assert len(lines) == 3, lines
    assert re.match(head + r"404 POST /v1/completions: the model '" + tag + r"' does not exist.*\(param model\)$",
                    lines[0]), lines
    assert re.match(head + rf"404 POST /v1/{tag}: Not Found", lines[1]), lines
    assert re.match(head + r"400 POST /v1/chat/completions: 'messages.0.role' must be one of", lines[2]), lines
    log = http_server.output()
    assert re.search(head + r"401 GET /v1/models: a valid API key is required", log, re.M), log[-2000:]
    assert re.search(rf"^{STAMP} INFO rawinfer: serving on ", log, re.M), log[-2000:]
