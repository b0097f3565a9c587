"""An assistant's output split into reasoning, content and tool calls: the reasoning parser (reasoning.py) first,
the tool-call parser (tool_calls.py) on the content it leaves, whole and streamed alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rawinfer.engine.reasoning import reasoning_parser
from rawinfer.engine.tool_calls import ToolCall, collect, tool_call_parser


@dataclass
class ChatOutput:
    """A whole answer: content ("" when none), reasoning (None when the output had no reasoning block), calls."""
    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """As OpenAI's assistant message (content null when the answer is calls alone; reasoning_content, vLLM's
        field, only when there was reasoning)."""
        msg: dict[str, Any] = {"role": "assistant",
                               "content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.openai() for c in self.tool_calls]
        return msg


class ChatOutputParser:
    """Streams OpenAI delta pieces ({"reasoning_content"}, {"content"}, {"tool_calls"}) from text deltas, with
    either parser optional (None: that part is not looked for)."""

    def __init__(self, reasoning: str | None = None, tools: str | None = None):
        self._reasoning = reasoning_parser(reasoning) if reasoning else None
        self._tools = tool_call_parser(tools) if tools else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._pass(self._reasoning.feed(text) if self._reasoning else [{"content": text}], final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._pass(self._reasoning.finish() if self._reasoning else [], final=True)

    @property
    def saw_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.saw_reasoning

    def _pass(self, deltas: list[dict[str, Any]], final: bool) -> list[dict[str, Any]]:
        """The reasoning parser's content pieces through the tool-call parser (in order)."""
        if self._tools is None:
            return [d for d in deltas if d.get("content", True)]
        out = []
        for d in deltas:
            out.extend(self._tools.feed(d["content"]) if "content" in d else [d])
        return out + (self._tools.finish() if final else [])


def parse_chat_output(text: str, reasoning: str | None = None, tools: str | None = None) -> ChatOutput:
    """A whole output through the same parsers as a stream."""
    p = ChatOutputParser(reasoning, tools)
    deltas = p.feed(text) + p.finish()
    content, calls = collect(deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    return ChatOutput(content, thought if p.saw_reasoning else None, calls)
