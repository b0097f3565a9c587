"""Structured output, tool calls and reasoning through the HTTP API, held to what the `openai` package's
helpers expect: `chat.completions.parse` with pydantic models, `pydantic_function_tool`, a two-turn tool loop,
streamed calls. One server with SmolLM2 and the tool-capable template (`--chat-template smollm2-tools`) and
the qwen3 reasoning parser (an answer without a <think> block is all content)."""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from cli_util import Server  # noqa: E402
from http_util import API_KEY, _health_until_ready, openai_client, post, sse_events, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"]}}}


@pytest.fixture(scope="module")
def tools_server(smollm2_dir):
    srv = Server(smollm2_dir, "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--chat-template", "smollm2-tools",
                 "--reasoning-parser", "qwen3", http=True)
    try:
        _health_until_ready(srv)
        yield srv
    finally:
        srv.stop()


# ---- structured output ------------------------------------------------------------------------------------------

class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: Annotated[str, Field(max_length=24)]
    population: Annotated[int, Field(ge=0, le=50_000_000)]


class Country(BaseModel):
    name: Annotated[str, Field(max_length=24)]
    capital: City
    cities: Annotated[list[City], Field(max_length=2)]


class Paint(BaseModel):
    color: Color
    shade: Literal["light", "dark"]
    opacity: Annotated[float, Field(ge=0, le=1)]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=24)]
    age: Annotated[int, Field(ge=0, le=130)]
    nickname: Optional[Annotated[str, Field(max_length=12)]] = None
    tags: Annotated[list[Annotated[str, Field(max_length=10)]], Field(max_length=3)]


@pytest.mark.parametrize("model,question", [
    (Country, "Describe France."), (Paint, "Pick a paint for a bedroom."), (Person, "Invent a person."),
], ids=["nested", "enums", "optional"])
def test_openai_parse_validates_against_pydantic_models(tools_server, model, question):
    client = openai_client(tools_server)
    for seed in (0, 1):
        done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": question}],
                                             response_format=model, max_tokens=200, temperature=0.8, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, model)          # the SDK validated it with the model
        model.model_validate_json(choice.message.content)


def test_json_object_and_vllm_structured_outputs(tools_server):
    client = openai_client(tools_server)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
                                         response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                          extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, max_tokens=8)
    assert pick.choices[0].message.content in ("yes", "no")
    code = client.completions.create(model=MODEL, prompt="A US zip code:", max_tokens=12, temperature=0.8,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{5}"}})
    assert re.fullmatch(r"[0-9]{5}", code.choices[0].text)
    guided = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert guided.choices[0].text in ("alpha", "beta")


def test_structured_stream_joins_into_valid_json(tools_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Invent a person."}], "stream": True,
            "max_tokens": 200, "temperature": 0, "n": 2, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                       "schema": Person.model_json_schema()}}}
    texts = ["", ""]
    for e in sse_events(tools_server, "/v1/chat/completions", body)[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
    for text in texts:
        Person.model_validate_json(text)


def test_bad_constraints_are_refused_by_name(tools_server):
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "response_format": {"type": "json_object"},
                                                    "guided_regex": "[a-z]+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "response_format": {"type": "xml"}})
    assert r.status_code == 400 and "response_format" in r.json()["error"]["param"]
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "structured_outputs": {"grammar": "start: (((("}})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]
    wait_idle(tools_server)


# ---- tool calls -------------------------------------------------------------------------------------------------

def test_two_turn_tool_loop_with_the_openai_package(tools_server):
    client = openai_client(tools_server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city"} and isinstance(args["city"], str)
    else:
        assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET", "PST")
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                            temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens      # the call and its result were rendered


def test_named_function_with_pydantic_function_tool(tools_server):
    import openai

    class GetTime(BaseModel):
        zone: Literal["UTC", "CET", "PST"]

    client = openai_client(tools_server)
    done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                                         tools=[openai.pydantic_function_tool(GetTime)], max_tokens=40,
                                         tool_choice={"type": "function", "function": {"name": "GetTime"}})
    call = done.choices[0].message.tool_calls[0]
    assert call.function.name == "GetTime" and isinstance(call.function.parsed_arguments, GetTime)


def test_streamed_tool_call_deltas_join_into_the_call(tools_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "stream": True,
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
            "temperature": 0}
    events = sse_events(tools_server, "/v1/chat/completions", body)[:-1]
    calls: dict[int, dict] = {}
    for e in events:
        for piece in e["choices"][0]["delta"].get("tool_calls", ()):
            if "id" in piece:
                calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
            calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = post(tools_server, "/v1/chat/completions", {**body, "stream": False}).json()
    call = whole["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["arguments"] == calls[0]["arguments"]          # greedy: the same call


def test_tool_choice_none_and_bad_tools(tools_server):
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                    "tools": [WEATHER], "tool_choice": "none", "temperature": 0})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
                                                    "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tools_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# ---- reasoning --------------------------------------------------------------------------------------------------

def test_reasoning_content_whole_and_streamed(tools_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"regex": "<think>[a-z ]{3,20}</think>[A-Za-z ]{3,20}"}}
    whole = post(tools_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert re.fullmatch(r"[a-z ]*", whole["reasoning_content"]) and "<think>" not in whole["content"]
    events = sse_events(tools_server, "/v1/chat/completions", {**body, "stream": True})[:-1]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]
