"""The assistant's side of an HTTP chat without a server (frontends/http/chat_shape.py, through params.chat_job as
a request reaches it): tool_choice none / auto / required / a named function, parallel_tool_calls (false keeps
the first call, whole and streamed at every split), each choice of n > 1 streamed on its own, and the 400s that
name the field."""

from __future__ import annotations

import json

import pytest

from rawinfer.frontends.http.chat_shape import Parsers
from rawinfer.frontends.http.errors import APIError
from rawinfer.frontends.http.params import chat_job
from rawinfer.frontends.http.schemas import ChatCompletionRequest
from tests.engine.test_reasoning import splits      # at every character and UTF-8 byte, and piece by piece

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES = Parsers(tool_call="hermes")


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


TWO_CALLS = "Let me check.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {})


def job(parsers: Parsers = HERMES, **body):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], **body})
    return chat_job(req, "m", parsers=parsers)


def streamed(body: dict, pieces: list[str], index: int = 0) -> tuple[str, list[dict], bool]:
    """The content and the calls OpenAI's client would join from the stream deltas of `pieces` (the last one
    arriving with the final), and whether the choice's finish reason would be tool_calls."""
    shape = job(**body).shape
    content, calls, made = "", {}, False
    for i, piece in enumerate(pieces):
        delta, made = shape.delta(index, piece, i == len(pieces) - 1)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", ()):
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function" and c["id"].startswith("call_")
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
            calls[c["index"]]["arguments"] += c["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], made


@pytest.mark.parametrize("parallel, want", [
    (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (True, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (False, [("get_weather", '{"city": "Paris"}')]),
])
def test_parallel_tool_calls_whole_and_streamed_at_every_split(parallel, want):
    """tool_choice auto reads the calls the model wrote; with parallel_tool_calls false only its first one is
    returned, whole and streamed alike (a model that writes two calls anyway loses none of the first)."""
    body = {"tools": [WEATHER, TIME]} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    j = job(**body)
    assert j.params.get("structured_outputs") is None          # auto: free text, read back
    message, made = j.shape.message(TWO_CALLS)
    assert made and message["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == want
    for pieces in splits(TWO_CALLS):
        content, calls, made = streamed(body, pieces)
        assert made and content == "Let me check."
        assert [(c["name"], c["arguments"]) for c in calls] == want, pieces


def test_each_choice_streams_its_own_calls():
    shape = job(tools=[WEATHER, TIME], n=2).shape
    first, second = call("get_weather", {"city": "Rome"}), "No call here."
    got: dict[int, list[dict]] = {0: [], 1: []}
    for i in range(max(len(first), len(second))):
        for index, text in ((0, first), (1, second)):
            if i < len(text):
                got[index].append(shape.delta(index, text[i], i == len(text) - 1)[0])
    assert "".join(d.get("content", "") for d in got[1]) == second
    assert not any("tool_calls" in d for d in got[1])
    pieces = [c for d in got[0] for c in d.get("tool_calls", ())]
    assert pieces[0]["function"]["name"] == "get_weather" and all(c["index"] == 0 for c in pieces)
    assert "".join(c["function"]["arguments"] for c in pieces) == '{"city": "Rome"}'


def test_tool_choice_none_lists_no_tools_and_reads_no_calls():
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        j = job(**body)
        assert "chat_options" not in j.prompts[0] and "structured_outputs" not in j.params
        assert j.shape is None                  # no parser: the text is the content as written


def test_required_and_named_choices_are_forced_by_a_grammar():
    """The grammar of tool_grammar.py in the request's structured_outputs: one or more calls for required
    (exactly one without parallel calls), the named function alone; the template lists the tools."""
    required = job(tools=[WEATHER, TIME], tool_choice="required")
    grammar = required.params["structured_outputs"]["grammar"]
    assert grammar.startswith('start: call ("\\n" call)*') and "get_time" in grammar
    assert required.prompts[0]["chat_options"]["tools"] == [WEATHER, TIME]
    single = job(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert single.params["structured_outputs"]["grammar"].startswith("start: call\n")
    named = job(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    grammar = named.params["structured_outputs"]["grammar"]
    assert "get_time" in grammar and "get_weather" not in grammar


@pytest.mark.parametrize("parsers, body, param, words", [
    (HERMES, {"tool_choice": "required"}, "tool_choice", "'tools' lists none"),
    (HERMES, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "does not list"),
    (HERMES, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", ""),
    (Parsers(), {"tools": [WEATHER]}, "tools", "--chat-template FILE"),
    (HERMES, {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "both constrain the output"),
])
def test_refusals_name_the_field(parsers, body, param, words):
    with pytest.raises(APIError) as e:
        job(parsers, **body)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message
