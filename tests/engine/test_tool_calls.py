"""Tool-call parsers (engine/tool_calls.py): whole outputs against expected calls, and streams split at every
position (characters and UTF-8 bytes) against the whole parse."""

import codecs
import json
import re

import pytest

from rawinfer.engine.stream_scan import HEADER_LIMIT, match_header
from rawinfer.engine.tool_calls import (TOOL_CALL_PARSERS, ToolCall, collect, detect_tool_call_parser,
                                        parse_tool_calls, tool_call_parser)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (text, expected content, expected [(name, arguments)])
HERMES = [
    ("The weather is fine.", "The weather is fine.", []),
    ("", "", []),
    ("  spaced out \n\n", "  spaced out \n\n", []),
    (CALL, "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n\n" + CALL + "\n", "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), "",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}]{"}],"c":"q\\"}"}}</tool_call>', "",
     [("f", '{"a":[1,{"b":"}]{"}],"c":"q\\"}"}')]),
    ('<tool_call>\n{"name": "f", "parameters": {}}\n</tool_call>', "", [("f", "{}")]),
    ('Before <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nAfter.', "Before\nAfter.", [("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}\n</tool_call>', "", [("f", '{"x": 1}')]),   # outer } left out
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "", [("f", '{"x": 1}')]),                 # never closed
    ('<tool_call>{"name": "f", "arguments": {"x": "cut', "", [("f", '{"x": "cut')]),             # cut short
    ('<tool_call>{"name": "caf\\u00e9", "arguments": {"v": "été ☀️"}}</tool_call>', "", [("café", '{"v": "été ☀️"}')]),
    # not a call: stays content as written
    ("<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    ('A <tool_call>{"arguments": {}, "name": "f"}</tool_call>', 'A <tool_call>{"arguments": {}, "name": "f"}</tool_call>', []),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '<tool_call>{"name": "", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ("x <tool_cal", "x <tool_cal", []),
    ("x <tool_call>", "x <tool_call>", []),
    ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),
    ("a < b <tool_calls> c", "a < b <tool_calls> c", []),
    ("<tool_call>oops " + CALL, "<tool_call>oops", [("get_weather", '{"city": "Paris"}')]),
]

LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('  \n{"name": "f", "arguments": {"a": [1, 2]}}  ', "", [("f", '{"a": [1, 2]}')]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "", [("f", '{"a": 1}'), ("g", "{}")]),
    ('{"name": "f", "parameters": {"a": 1}} That is the call.', "That is the call.", [("f", '{"a": 1}')]),
    ('{"name": "f", "parameters": {"a": 1}}; not a call', "not a call", [("f", '{"a": 1}')]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),
    ("  <|python", "  <|python", []),
    ('Call {"name": "f", "parameters": {}}', 'Call {"name": "f", "parameters": {}}', []),   # not at the start
    ("", "", []),
]

CASES = [("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA]


def calls_of(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def streamed(parser: str, pieces) -> tuple[list[dict], str, list[ToolCall]]:
    p = tool_call_parser(parser)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    return (deltas, *collect(deltas))


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for c in got_calls:
        assert c.openai() == {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_every_split(parser, text, content, calls):
    """Two pieces split at every character, at every UTF-8 byte (decoded as a detokenizer would), and single
    characters all give the whole parse's content and calls."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    raw = text.encode()
    for i in range(len(raw) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        splits.append([dec.decode(raw[:i]), dec.decode(raw[i:], final=True)])
    splits.append(list(text))
    for pieces in splits:
        deltas, got_content, got_calls = streamed(parser, pieces)
        assert (got_content, calls_of(got_calls)) == (content, calls), pieces
        check_delta_shapes(deltas)


def check_delta_shapes(deltas: list[dict]) -> None:
    """OpenAI's streaming shape: a call's first delta has index, id, type and name with arguments ""; later ones
    only index and an arguments fragment; indices count up from 0; no empty content."""
    opened = 0
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            continue
        (piece,) = d["tool_calls"]
        if "id" in piece:
            assert piece["index"] == opened and piece["type"] == "function"
            assert piece["function"]["arguments"] == "" and piece["function"]["name"]
            opened += 1
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            assert piece["index"] == opened - 1 and piece["function"]["arguments"]


def test_arguments_stream_as_they_come():
    """A call's name goes out as soon as its opening is complete, its arguments piece by piece, and text that
    may open a call is held back only until it is decided."""
    p = tool_call_parser("hermes")
    assert p.feed("Sure. <tool") == [{"content": "Sure."}]
    assert p.feed("_call>\n{\"name\": \"get_weather\", ") == []
    opened, first = p.feed('"arguments": {"ci')
    assert opened["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert p.feed('ty": "Par') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Par'}}]}]
    assert p.feed('is"}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert p.finish() == []
    p = tool_call_parser("hermes")
    assert p.feed("a <tool") == [{"content": "a"}]
    assert p.feed("box>") == [{"content": " <toolbox>"}]


def test_held_call_header_is_bounded():
    """An opening that never completes is decided as not a call within HEADER_LIMIT characters."""
    text = "<tool_call>{" + " " * HEADER_LIMIT + '"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "hermes") == (text, [])
    p = tool_call_parser("hermes")
    assert p.feed(text[:HEADER_LIMIT + 20]) == [{"content": text[:HEADER_LIMIT + 20].rstrip()}]   # the space held
    assert match_header('{"name": "f", "arguments": {', ("arguments",)).state == "yes"
    assert match_header('{"name": "f\\u00', ("arguments",)).state == "more"
    assert match_header('{"name": "f\\x', ("arguments",)).state == "no"


def test_registry_and_detection():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; choose one of hermes, llama3_json"):
        tool_call_parser("mistral")
    qwen_like = ("{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> "
                 "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>{% endif %}")
    llama_like = ("<|start_header_id|>system<|end_header_id|>{% if tools %}Respond in the format "
                  "{\"name\": function name, \"parameters\": dictionary of argument name and its value}{% endif %}")
    smollm2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}")
    assert detect_tool_call_parser(qwen_like) == "hermes"
    assert detect_tool_call_parser(llama_like) == "llama3_json"
    assert detect_tool_call_parser(smollm2) is None
    assert detect_tool_call_parser(None) is None and detect_tool_call_parser("") is None
    with open("rawinfer/templates/smollm2-tools.jinja") as f:
        assert detect_tool_call_parser(f.read()) == "hermes"


def test_arguments_are_the_models_text():
    """Arguments are the object's text as written (valid JSON here), not re-serialised."""
    _, (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"b":2,  "a" : [1]}}</tool_call>', "hermes")
    assert call.arguments == '{"b":2,  "a" : [1]}' and json.loads(call.arguments) == {"b": 2, "a": [1]}
