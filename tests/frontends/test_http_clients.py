"""What third-party OpenAI clients send and expect, through a real `rawinfer serve`: unknown fields ignored
and named once in the log (refused by name under --strict-api), OpenAI's message roles, vLLM's
stream_options.continuous_usage_stats, a chat stream that opens with the role, and vLLM's serving
conventions (a positional model, --served-model-name, GET /v1/models/{id}, --default-max-tokens)."""

from __future__ import annotations

import time
import uuid

import pytest

from cli_util import Server, make_chat_model  # noqa: E402
from http_util import AUTH, http_server, openai_client, post, sse_events  # noqa: E402,F401

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def log_lines(srv: Server, text: str, timeout_s: float = 10.0) -> list[str]:
    """The server log's lines holding `text`, once at least one has arrived (the workers' stderr)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in srv.output().splitlines() if text in ln]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """A tiny chat model served with --strict-api."""
    model = make_chat_model(str(tmp_path_factory.mktemp("models") / "tiny-chat"))
    srv = Server(model, "--strict-api", http=True)
    try:
        yield srv.wait_ready().wait_http()
    finally:
        srv.stop()


def test_unknown_fields_are_ignored_and_named_once_in_the_log(http_server):
    tag = uuid.uuid4().hex[:8]
    body = {"prompt": "Hello", "max_tokens": 2, f"frobnicate_{tag}": 1, "metadata": {"k": "v"}}
    r = post(http_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lines = log_lines(http_server, f"frobnicate_{tag}")
    assert len(lines) == 1, lines
    assert "The following fields were present in the request but ignored: " in lines[0]
    assert "'metadata'" in lines[0] and "POST /v1/completions" in lines[0]
    # nested: guidellm's stream option, the fields OpenAI's SDK echoes back in an assistant message
    chat = [{"role": "user", "content": "Hi", f"tag_{tag}": 1},
            {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": []},
            {"role": "user", "content": "And now?"}]
    events = sse_events(http_server, "/v1/chat/completions", {
        "messages": chat, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, f"opt_{tag}": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    (line,) = log_lines(http_server, f"opt_{tag}")
    for name in (f"messages.0.tag_{tag}", "messages.1.refusal", "messages.1.annotations", f"stream_options.opt_{tag}"):
        assert repr(name) in line, line


def test_known_fields_stay_strict_beside_unknown_ones(http_server):
    r = post(http_server, "/v1/chat/completions", {"messages": CHAT, "surprise": 1, "temperature": "0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_openai_roles_and_developer_as_system(http_server):
    system = post(http_server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *CHAT]})
    developer = post(http_server, "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."}, *CHAT]})
    assert developer.status_code == 200 and developer.json()["tokens"] == system.json()["tokens"]
    r = openai_client(http_server).chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=2,
        messages=[{"role": "developer", "content": "Be brief."}, *CHAT])
    assert r.choices[0].message.role == "assistant"
    r = post(http_server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "beep"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.role" and "'robot'" in err["message"], r.text


def test_strict_api_refuses_unknown_fields_by_name(strict_server):
    for path, body, name in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": 1}, "frobnicate"),
            ("/v1/chat/completions", {"messages": [{**CHAT[0], "refusal": None}]}, "messages.0.refusal"),
            ("/v1/chat/completions", {"messages": CHAT, "stream": True,
                                      "stream_options": {"include_usage": True, "later": 1}}, "stream_options.later"),
            ("/tokenize", {"prompt": "hi", "add_special_tokens": True}, "add_special_tokens")):
        r = post(strict_server, path, body, headers={})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (name, "unknown_parameter") and "--strict-api" in err["message"]
    assert post(strict_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={}).status_code == 200


def _per_choice_usage(events: list) -> dict[int, list[dict]]:
    seen: dict[int, list[dict]] = {}
    for e in events:
        for c in e["choices"]:
            seen.setdefault(c["index"], []).append(e["usage"])
    return seen


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http_server):
    """vLLM's meaning: each chunk's usage is its choice's prompt and the tokens generated so far; with
    include_usage the last chunk still carries the whole usage and no choices."""
    prompts = ["The capital of France is", "One, two, three, four, five, six"]
    body = {"prompt": prompts, "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(http_server, "/v1/completions", body)[:-1]
    total = events[-1]
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 10
    lengths = [post(http_server, "/tokenize", {"prompt": p}).json()["count"] for p in prompts]
    assert lengths[0] != lengths[1]
    assert total["usage"]["prompt_tokens"] == sum(lengths)
    for index, usages in _per_choice_usage(events[:-1]).items():
        assert {u["prompt_tokens"] for u in usages} == {lengths[index]}
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == 5 and done[0] >= 1, done
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    echoed = sse_events(http_server, "/v1/completions", {**body, "echo": True, "n": 2})[:-2]
    assert {u["prompt_tokens"] for us in _per_choice_usage(echoed).values() for u in us} == set(lengths)
    # a chat, without include_usage: usage in every chunk (the opening one at 0 tokens), no usage chunk
    body = {"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    events = sse_events(http_server, "/v1/chat/completions", body)[:-1]
    assert all(len(e["choices"]) == 1 for e in events)
    prompt = post(http_server, "/tokenize", {"messages": CHAT}).json()["count"]
    usages = [e["usage"] for e in events]
    assert {u["prompt_tokens"] for u in usages} == {prompt} and usages[-1]["completion_tokens"] == 4
    assert [u["completion_tokens"] for u in usages] == sorted(u["completion_tokens"] for u in usages)
    assert usages[0]["completion_tokens"] == 0 and events[0]["choices"][0]["delta"] == {"role": "assistant",
                                                                                         "content": ""}


def test_a_chat_stream_opens_with_the_role_of_each_choice(http_server):
    body = {"messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 5, "stream": True}
    events = sse_events(http_server, "/v1/chat/completions", body)[:-1]
    openings = [e["choices"][0] for e in events[:2]]
    assert [c["index"] for c in openings] == [0, 1]
    assert all(c["delta"] == {"role": "assistant", "content": ""} and c["finish_reason"] is None for c in openings)
    assert not any("role" in e["choices"][0]["delta"] for e in events[2:])
    stream = openai_client(http_server).chat.completions.create(model="smollm2-135m-instruct", messages=CHAT,
                                                                max_tokens=3, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant" and chunks[0].delta.content == ""
    assert "".join(c.delta.content or "" for c in chunks[1:]) and chunks[-1].finish_reason == "length"
