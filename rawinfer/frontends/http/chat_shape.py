"""The assistant's side of an HTTP chat: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` as the
template's tools and, where a call is forced, a grammar; and the model's text back as OpenAI's message
(content, vLLM's reasoning_content, tool_calls), whole or as stream deltas, through the engine's parsers
(engine/chat_output.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rawinfer.engine.chat_messages import check_tools
from rawinfer.engine.chat_output import ChatOutputParser, parse_chat_output
from rawinfer.engine.tool_grammar import tool_call_grammar
from rawinfer.frontends.http.errors import invalid


@dataclass(frozen=True)
class Parsers:
    """The server's choice: the tool-call format of its chat template (None: it shows none) and the reasoning
    parser (None: reasoning is not split off)."""
    tool_call: str | None = None
    reasoning: str | None = None


@dataclass
class ChatShape:
    """What one chat request does with tools and reasoning: the tools the template lists, the grammar that
    forces a call (None unless tool_choice requires one), and how the output is read back."""
    tools: list[dict] | None = None
    grammar: dict | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    single_call: bool = False                # parallel_tool_calls false: the first call only
    _streams: dict[int, ChatOutputParser] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)       # choice -> calls streamed so far

    @property
    def parses(self) -> bool:
        return self.tool_parser is not None or self.reasoning_parser is not None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole answer as OpenAI's assistant message, and whether it holds tool calls."""
        out = parse_chat_output(text, self.reasoning_parser, self.tool_parser)
        if self.single_call:
            out.tool_calls = out.tool_calls[:1]
        return out.message(), bool(out.tool_calls)

    def delta(self, index: int, text: str, final: bool) -> tuple[dict[str, Any], bool]:
        """The stream delta of choice `index` for its next text (and, when final, what the parsers still
        held), and whether the choice has made tool calls so far."""
        parser = self._streams.get(index)
        if parser is None:
            parser = self._streams[index] = ChatOutputParser(self.reasoning_parser, self.tool_parser)
        pieces = parser.feed(text) if text else []
        if final:
            pieces += parser.finish()
        return self._merge(index, pieces), self._calls.get(index, 0) > 0

    def _merge(self, index: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """Pieces as one delta: texts joined per field, a call's argument fragments joined per call."""
        delta: dict[str, Any] = {}
        calls: dict[int, dict] = {}
        for piece in pieces:
            for key in ("content", "reasoning_content"):
                if key in piece:
                    delta[key] = delta.get(key, "") + piece[key]
            for call in piece.get("tool_calls", ()):
                if self.single_call and call["index"] > 0:
                    continue
                if "id" in call:
                    self._calls[index] = self._calls.get(index, 0) + 1
                    calls[call["index"]] = {**call, "function": dict(call["function"])}
                elif call["index"] in calls:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
                else:
                    calls[call["index"]] = {"index": call["index"],
                                            "function": {"arguments": call["function"]["arguments"]}}
        if calls:
            delta["tool_calls"] = [calls[i] for i in sorted(calls)]
        return delta


def chat_shape(req, parsers: Parsers) -> ChatShape:
    """The request's tools and tool_choice checked against what the server can parse; 400 naming the field."""
    try:
        tools = check_tools(req.tools)
    except ValueError as e:
        raise invalid("tools", str(e)) from None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    shape = ChatShape(reasoning_parser=parsers.reasoning)
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise invalid("tool_choice", "'tool_choice' requires a tool call, but 'tools' lists none")
        return shape
    if parsers.tool_call is None:
        raise invalid("tools", "this server cannot read tool calls: the model's chat template shows no tool-call "
                      "format; start it with --chat-template FILE (a template with tools) and --tool-call-parser")
    shape.tools, shape.tool_parser = tools, parsers.tool_call
    parallel = req.parallel_tool_calls is not False
    shape.single_call = not parallel
    if choice != "auto":
        try:
            shape.grammar = tool_call_grammar(tools, choice, parsers.tool_call, parallel)
        except ValueError as e:
            raise invalid("tool_choice", str(e)) from None
    return shape
