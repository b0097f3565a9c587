"""What third-party OpenAI clients send and expect, through a real `rawinfer serve`: unknown fields ignored
and named once in the log (refused by name under --strict-api), OpenAI's message roles, vLLM's
stream_options.continuous_usage_stats, a chat stream that opens with the role, and vLLM's serving
conventions (a positional model, --served-model-name, GET /v1/models/{id}, --default-max-tokens)."""

from __future__ import annotations

import argparse
import json
import socket
import time
import uuid

import httpx
import pytest

from cli_util import Server, free_port, make_chat_model, rawinfer  # noqa: E402
from http_util import AUTH, http_server, openai_client, post, sse_events  # noqa: E402,F401

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """A tiny chat model served with --strict-api, two served names and a default max_tokens (the model also
    given as vLLM's positional argument: the same one twice is no conflict)."""
    model = make_chat_model(str(tmp_path_factory.mktemp("models") / "tiny-chat"))
    srv = Server(model, model, "--strict-api", "--served-model-name", "tiny", "my/tiny", "--default-max-tokens", "5",
                 http=True)
    try:
        yield srv.wait_ready().wait_http()
    finally:
        srv.stop()


def test_unknown_fields_are_ignored_and_named_once_in_the_log(http_server):
    tag = uuid.uuid4().hex[:8]
    body = {"prompt": "Hello", "max_tokens": 2, f"frobnicate_{tag}": 1, "metadata": {"k": "v"}}
    r = post(http_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lines = http_server.log_lines(f"frobnicate_{tag}")
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
    (line,) = http_server.log_lines(f"opt_{tag}")
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


def test_served_model_names_and_models_by_id(strict_server):
    import openai
    client = openai.OpenAI(base_url=strict_server.base_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "my/tiny"]
    assert client.models.retrieve("my/tiny").id == "my/tiny"
    for name in (None, "tiny", "my/tiny"):
        r = post(strict_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "model": name}, headers={})
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    for r in (httpx.get(strict_server.base_url + "/v1/models/tiny-chat"),
              post(strict_server, "/v1/completions", {"prompt": "hi", "model": "tiny-chat"}, headers={})):
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("model_not_found", "model") and "'my/tiny'" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_default_max_tokens_when_a_request_leaves_it_out(strict_server):
    def tokens(path, body):
        r = post(strict_server, path, {**body, "ignore_eos": True}, headers={})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    assert tokens("/v1/completions", {"prompt": "hello there"}) == 5              # not OpenAI's 16
    assert tokens("/v1/chat/completions", {"messages": CHAT}) == 5                # not what the context leaves
    assert tokens("/v1/completions", {"prompt": "hello there", "max_tokens": 7}) == 7
    assert tokens("/v1/completions", {"prompt": [5] * 1022}) == 2                 # what the context (1024) leaves
    assert tokens("/v1/completions", {"prompt": [[5] * 3, [5] * 1021]}) == 3 + 3     # by the longest prompt


def test_served_model_name_defaults_to_the_models_own_name(tmp_path):
    """The folder's or GGUF file's name as given; a folder of the conversion cache: its source's name, never
    the cache's digest."""
    from rawinfer.frontends.cli.serve import served_model_names

    def names(model, given=None):
        return served_model_names(argparse.Namespace(model=model, served_names=given))
    cached = tmp_path / "SmolLM2-135M-Instruct-Q4_K_M-0123456789abcdef-q4"
    cached.mkdir()
    (cached / "source.json").write_text(json.dumps({"source": "/models/SmolLM2-135M-Instruct-Q4_K_M.gguf"}))
    assert names(str(cached)) == ["SmolLM2-135M-Instruct-Q4_K_M"]
    assert names("/models/Qwen3-0.6B.GGUF") == ["Qwen3-0.6B"]
    assert names(str(tmp_path / "Llama-3.2-1B") + "/") == ["Llama-3.2-1B"]
    assert names("smollm2-135m-instruct") == ["smollm2-135m-instruct"]
    assert names(None) == ["smollm2-135m-instruct"]          # the default model by its name, whichever copy runs
    assert names("x", ["a", "b"]) == ["a", "b"]


def test_vllm_style_command_line_and_a_busy_http_port(tiny_llama_dir):
    """`rawinfer serve MODEL` takes the model as --model does; two different ones are refused; --port is
    --http-port, and a port in use stops the start with exit status 2 before the model loads."""
    bind = ["--bind", f"tcp://127.0.0.1:{free_port()}", "--device", "cpu"]
    r = rawinfer("serve", "no-such-model", "--no-http", *bind, timeout=60)
    assert r.returncode == 2 and "model 'no-such-model' does not exist" in r.stderr, r.stderr
    r = rawinfer("serve", tiny_llama_dir, "--model", "another-model", "--no-http", *bind, timeout=60)
    assert r.returncode == 2 and "two models given" in r.stderr and "give one of them" in r.stderr, r.stderr
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t = time.monotonic()
        r = rawinfer("serve", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port), *bind, timeout=60)
        assert time.monotonic() - t < 30
    assert r.returncode == 2 and r.stderr.endswith(
        f"rawinfer: error: cannot bind HTTP on 127.0.0.1:{port}: Address already in use (is another server running "
        "there?); choose another --http-port, or --no-http\n"), r.stderr
