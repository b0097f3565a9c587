"""Tool calls in a model's output text: the parsers of each family's format (by name), whole and streamed.

    hermes       Hermes / Qwen2.5 / Qwen3 (and rawinfer's smollm2-tools template): calls in tags,
                 <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>, text around them
    llama3_json  Llama 3.1-3.3 JSON tool calling: the whole answer is {"name": ..., "parameters": {...}}, perhaps
                 after <|python_tag|>, several calls joined by "; "

A parser is fed the output's text deltas and returns OpenAI-style `delta` pieces: {"content": str}, and
{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]} when a call opens,
then {"tool_calls": [{"index", "function": {"arguments": fragment}}]} as its arguments arrive. `parse_tool_calls`
runs the same parser over a whole text, so whole and streamed answers agree however the text is split.

The rules, in both formats: a call counts once its opening `{"name": "<name>", "arguments": {` is out (the key may
be "parameters" as well); its arguments are the model's text of that object up to its closing brace, not
re-serialised and not validated (OpenAI's advice holds: check them). An opening that is not of this form stays
content, as written. Whitespace next to a call is dropped with it. Text that may be the start of a call is held
back until decided, so a content delta never has to be taken back.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rawinfer.engine.stream_scan import (MORE, NO, YES, ObjectEnd, StreamParser, content_end, match_header,
                                         match_literals, partial_tag)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; `arguments` is the JSON text of its arguments object."""
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """As an OpenAI chat message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser(StreamParser):
    """What both formats share beyond the stream driver: a state, held text, the calls opened so far, and
    the pieces (content, a call's opening, its argument fragments). A call cut short by the end of the output
    keeps what it has."""

    def __init__(self):
        super().__init__()
        self._state = "content"
        self._held = ""                      # text set aside while a call's opening is decided
        self._calls = 0
        self._args = ObjectEnd()

    # ---- the pieces -----------------------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _open_call(self, name: str) -> None:
        self._out.append({"tool_calls": [{"index": self._calls, "id": new_call_id(), "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        self._calls += 1
        self._args = ObjectEnd()

    def _arguments(self, text: str) -> None:
        if not text:
            return
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": self._calls - 1, "function": {"arguments": text}}]})

    def _header(self, keys: tuple[str, ...], final: bool) -> bool | None:
        """In state "header": open the call (True), wait (None), or find no call here (False)."""
        header = match_header(self._buf, keys)
        if header.state == MORE and not final:
            return None
        if header.state != YES:
            return False
        self._open_call(header.name)
        self._buf, self._held, self._state = self._buf[header.end:], "", "arguments"
        return True

    def _take_arguments(self, final: bool) -> bool:
        """In state "arguments": pass the object's text on; at its closing brace go to state "tail"."""
        end = self._args.feed(self._buf)
        if end is None:
            self._arguments(self._buf)
            self._buf = ""
            return False
        self._arguments(self._buf[:end])
        self._buf, self._state = self._buf[end:], "tail"
        return True


class HermesParser(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks anywhere in the text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEYS = ("arguments", "parameters")

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            return self._in_content(final)
        if self._state == "header":
            opened = self._header(self.KEYS, final)
            if opened is False:               # not a call: the tag and what follows are content
                self._content(self._held)
                self._held, self._state = "", "content"
            return opened is not None
        if self._state == "arguments":
            return self._take_arguments(final)
        return self._in_tail(final)

    def __init__(self):
        super().__init__()
        self._after_call = False             # only whitespace since the last call: dropped if the output ends

    def _in_content(self, final: bool) -> bool:
        if final and self._after_call and self._buf.isspace():
            self._buf = ""
        i = self._buf.find(self.OPEN)
        if i >= 0:
            j = len(self._buf[:i].rstrip())
            self._content(self._buf[:j])
            self._held = self._buf[j:i + len(self.OPEN)]
            self._buf, self._state = self._buf[i + len(self.OPEN):], "header"
            return True
        j = len(self._buf) if final else content_end(self._buf, self.OPEN)
        self._content(self._buf[:j])
        self._buf, self._after_call = self._buf[j:], self._after_call and j == 0
        return False

    def _in_tail(self, final: bool) -> bool:
        """After the arguments: the call's closing brace and tag, dropped; anything else is content again."""
        state, n = match_literals(self._buf, (None, "}", None, self.CLOSE))
        if state == NO:                        # perhaps the call's own closing brace left out
            without = match_literals(self._buf, (None, self.CLOSE))
            if without[0] != NO:
                state, n = without
        if state == MORE and not final:
            return False
        self._buf = "" if state == MORE else self._buf[n:]
        self._state, self._after_call = "content", True
        return True


class Llama3JsonParser(ToolCallParser):
    """An answer that is {"name": ..., "parameters": {...}} (perhaps after <|python_tag|>; calls joined by "; ").
    The tag may be gone from the text (it is a special token, skipped when detokenizing)."""

    PYTHON_TAG = "<|python_tag|>"
    KEYS = ("parameters", "arguments")

    def __init__(self):
        super().__init__()
        self._state = "start"

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            return self._at_start(final)
        if self._state == "header":
            opened = self._header(self.KEYS, final)
            if opened is False:                # not a call: the rest is text (after "; ", without the space)
                self._content(self._held)
                self._held, self._state = "", "content"
                self._buf = self._buf.lstrip() if self._calls else self._buf
            return opened is not None
        if self._state == "arguments":
            return self._take_arguments(final)
        if self._state == "tail":
            return self._in_tail(final)
        self._content(self._buf)               # state "content": the rest of the answer is text
        self._buf = ""
        return False

    def _at_start(self, final: bool) -> bool:
        """The answer's first characters decide: a JSON object (after the tag) may be a call, anything else is text."""
        rest = self._buf.lstrip()
        if rest.startswith(self.PYTHON_TAG):
            rest = rest[len(self.PYTHON_TAG):].lstrip()
        elif rest and self.PYTHON_TAG.startswith(rest) and not final:
            return False
        if not rest and not final:
            return False
        start = len(self._buf) - len(rest)
        self._held, self._buf = self._buf[:start], self._buf[start:]
        self._state = "header" if rest.startswith("{") else "content"
        if self._state == "content":
            self._content(self._held)
            self._held = ""
        return True

    def _in_tail(self, final: bool) -> bool:
        """After the arguments: the call's closing brace, then "; " and another call, or the end."""
        state, n = match_literals(self._buf, (None, "}", None))
        if state == MORE and not final:
            return False
        if state == MORE:
            self._buf, self._state = "", "content"
        elif state == YES and self._buf[n] == ";":
            self._buf, self._state = self._buf[n + 1:], "header"
        else:
            self._buf, self._state = self._buf[n:], "content"
        return True


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_call_parser(name: str) -> ToolCallParser:
    """A fresh streaming parser of the named format; ValueError naming the known ones."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser for the tool-call format a chat template teaches the model, or None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    llama_json = '"parameters": ' in chat_template or "<|python_tag|>" in chat_template
    if "<|start_header_id|>" in chat_template and llama_json:
        return "llama3_json"
    return None


def collect(deltas: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """Deltas joined: the content text and the calls (ids, names, joined argument fragments)."""
    content, calls = [], []
    for d in deltas:
        content.append(d.get("content", ""))
        for piece in d.get("tool_calls", ()):
            if "id" in piece:
                calls.append([piece["id"], piece["function"]["name"], piece["function"]["arguments"]])
            else:
                calls[piece["index"]][2] += piece["function"]["arguments"]
    return "".join(content), [ToolCall(*c) for c in calls]


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """A whole output: its content text (the calls taken out) and its calls."""
    p = tool_call_parser(parser)
    return collect(p.feed(text) + p.finish())
