"""Reasoning parsers (engine/reasoning.py) and the chain of reasoning and tool-call parsers (engine/chat_output.py):
whole outputs against expected splits, and streams split at every position against the whole parse."""

import codecs

import pytest

from rawinfer.engine.chat_output import ChatOutputParser, parse_chat_output
from rawinfer.engine.reasoning import REASONING_PARSERS, parse_reasoning, reasoning_parser
from rawinfer.engine.tool_calls import collect

THOUGHT = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nIt is 4."

# (parser, text, expected reasoning (None: no block), expected content)
CASES = [
    ("qwen3", THOUGHT, "The user wants 2+2.\nThat is 4.", "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),                                   # enable_thinking=false: no block
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),              # or an empty one
    ("qwen3", "  <think>cut short by max_tokens ", "cut short by max_tokens", ""),
    ("qwen3", "<think>a</think>", "a", ""),
    ("qwen3", "<thinking> is not the tag", None, "<thinking> is not the tag"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "Done.</think> stray", None, "Done.</think> stray"),
    ("qwen3", "<think>one < two </thinker> </think> ok </think>", "one < two </thinker>", "ok </think>"),
    ("qwen3", "<think>éè ☀️</think>ünï", "éè ☀️", "ünï"),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "The user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4."),
    ("deepseek_r1", THOUGHT, "The user wants 2+2.\nThat is 4.", "It is 4."),
    ("deepseek_r1", "no end tag", "no end tag", ""),
    ("deepseek_r1", "\n</think>\n\nanswer", "", "answer"),
    ("deepseek_r1", "", "", ""),
]


def streamed(parser: str, pieces) -> tuple[str | None, str]:
    p = reasoning_parser(parser)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    for d in deltas:
        assert len(d) == 1 and next(iter(d.values())), deltas          # one kind per piece, never empty
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    return (reasoning if p.saw_reasoning else None), "".join(d.get("content", "") for d in deltas)


def splits(text: str):
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    raw = text.encode()
    for i in range(len(raw) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        yield [dec.decode(raw[:i]), dec.decode(raw[i:], final=True)]
    yield list(text)


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_whole(parser, text, reasoning, content):
    assert parse_reasoning(text, parser) == (reasoning, content)


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_every_split(parser, text, reasoning, content):
    for pieces in splits(text):
        assert streamed(parser, pieces) == (reasoning, content), pieces


def test_streams_as_it_comes():
    """Reasoning flows out while it is written; only a possible tag (and the whitespace before it) waits."""
    p = reasoning_parser("qwen3")
    assert p.feed("<thi") == []
    assert p.feed("nk>\nStep one") == [{"reasoning_content": "Step one"}]
    assert p.feed(", step two.\n</th") == [{"reasoning_content": ", step two."}]
    assert p.feed("ink>\n\nAnswer") == [{"content": "Answer"}]
    assert p.feed(" here.\n") == [{"content": " here.\n"}]
    assert p.finish() == []


def test_registry():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'; choose one of qwen3, deepseek_r1"):
        reasoning_parser("o1")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHAINED = [
    (THOUGHT, "qwen3", "hermes", "The user wants 2+2.\nThat is 4.", "It is 4.", []),
    ("<think>I need the weather.</think>\n\n" + CALL, "qwen3", "hermes", "I need the weather.", "",
     [("get_weather", '{"city": "Paris"}')]),
    ("<think>Maybe <tool_call> here?</think>Let me see. " + CALL, "qwen3", "hermes",
     "Maybe <tool_call> here?", "Let me see.", [("get_weather", '{"city": "Paris"}')]),
    (CALL, None, "hermes", None, "", [("get_weather", '{"city": "Paris"}')]),
    (THOUGHT, "qwen3", None, "The user wants 2+2.\nThat is 4.", "It is 4.", []),
    (THOUGHT, None, None, None, THOUGHT, []),
]


@pytest.mark.parametrize("text, reasoning_name, tools_name, reasoning, content, calls", CHAINED)
def test_reasoning_then_tool_calls(text, reasoning_name, tools_name, reasoning, content, calls):
    """The reasoning parser runs first and the tool-call parser reads the content it leaves: a tag inside the
    reasoning is no call. Whole and every split agree."""
    out = parse_chat_output(text, reasoning_name, tools_name)
    assert (out.reasoning_content, out.content, [(c.name, c.arguments) for c in out.tool_calls]) == \
        (reasoning, content, calls)
    for pieces in splits(text):
        p = ChatOutputParser(reasoning_name, tools_name)
        deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
        got_content, got_calls = collect(deltas)
        got_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert (got_reasoning if p.saw_reasoning else None, got_content) == (reasoning, content), pieces
        assert [(c.name, c.arguments) for c in got_calls] == calls


def test_chat_output_message():
    """The whole answer as OpenAI's assistant message: content null beside calls, reasoning_content when any."""
    out = parse_chat_output("<think>hm</think>" + CALL, "qwen3", "hermes")
    msg = out.message()
    assert msg["content"] is None and msg["reasoning_content"] == "hm"
    assert msg["tool_calls"] == [out.tool_calls[0].openai()]
    assert parse_chat_output("Hi", None, "hermes").message() == {"role": "assistant", "content": "Hi"}
    assert parse_chat_output("", "qwen3", None).message() == {"role": "assistant", "content": ""}
