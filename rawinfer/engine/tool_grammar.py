"""Grammars that force tool calls (OpenAI's tool_choice "required" or a named function): exactly the text of a
tool-call parser's format, each call's arguments held to its function's JSON schema.

The format's fixed text around the arguments (hermes: `<tool_call>\\n{"name": "f", "arguments": ` ...
`}\\n</tool_call>`) is not JSON, so this is an llguidance Lark grammar with the schemas inlined (`%json {...}`),
handed to the structured-output machinery as SamplingParams.structured_outputs = {"grammar": ...}. The arguments
are written as json.dumps writes them (", " and ": ", no other whitespace), the way chat templates render past
calls, so a conversation's earlier calls read back as the model wrote them.
"""

from __future__ import annotations

import json
from typing import Any

from rawinfer.engine.chat_messages import check_tools

# parser -> (text before the name, between the name and the arguments, after the arguments, between calls)
CALL_FORMATS = {
    "hermes": ('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ('{"name": ', ', "parameters": ', "}", "; "),
}
# llguidance's JSON options: the separators json.dumps uses, and no whitespace elsewhere (a model left free to
# write whitespace inside a forced object may write it without end)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(tools: Any, choice: Any, parser: str, parallel_tool_calls: bool = True) -> dict[str, str]:
    """The structured_outputs map {"grammar": LARK} that makes the model call a tool: with choice "required" one
    of `tools` (one or more calls when parallel_tool_calls), with {"type": "function", "function": {"name": ...}}
    that function, once. ValueError naming the field: tools, tool_choice, the parser, or a function's parameters
    that llguidance cannot enforce."""
    if parser not in CALL_FORMATS:
        raise ValueError(f"tool calls cannot be forced for the tool-call parser {parser!r}; those that can: "
                         f"{', '.join(CALL_FORMATS)}")
    tools = check_tools(tools)
    if not tools:
        raise ValueError("tool_choice requires a tool call, but 'tools' lists none: give the functions in 'tools'")
    chosen = _chosen(tools, choice)
    before, middle, after, between = CALL_FORMATS[parser]
    lines = []
    for k, i in enumerate(chosen):
        fn = tools[i]["function"]
        lines.append(f"call_{k}: {_literal(before + json.dumps(fn['name']) + middle)} args_{k} {_literal(after)}")
        lines.append(f"args_{k}: %json {json.dumps(_schema(fn))}")
    call = " | ".join(f"call_{k}" for k in range(len(chosen)))
    repeat = choice == "required" and parallel_tool_calls
    grammar = "\n".join([f"start: call ({_literal(between)} call)*" if repeat else "start: call",
                         f"call: {call}", *lines]) + "\n"
    _validate(grammar, tools, chosen)
    return {"grammar": grammar}


def _chosen(tools: list[dict[str, Any]], choice: Any) -> list[int]:
    """The indices of the tools a choice allows."""
    if choice == "required":
        return list(range(len(tools)))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ValueError(f"tool_choice must be \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": "
                         f"...}}}} to force a call, got {choice!r}")
    for i, tool in enumerate(tools):
        if tool["function"]["name"] == name:
            return [i]
    raise ValueError(f"tool_choice names the function {name!r}, which 'tools' does not list; give one of "
                     f"{', '.join(t['function']['name'] for t in tools)}")


def _schema(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema, written compactly; a function without parameters takes {} alone."""
    params = dict(fn.get("parameters") or {"properties": {}, "additionalProperties": False})
    params.setdefault("type", "object")
    params["x-guidance"] = {**params.get("x-guidance", {}), **COMPACT}
    return params


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _validate(grammar: str, tools: list[dict[str, Any]], chosen: list[int]) -> None:
    """Compile the grammar once without a tokenizer; a schema llguidance refuses is named by its tool."""
    from llguidance import LLMatcher

    if not LLMatcher.validate_grammar(grammar):
        return
    for i in chosen:
        fn = tools[i]["function"]
        error = LLMatcher.validate_grammar(f"start: %json {json.dumps(_schema(fn))}\n")
        if error:
            raise ValueError(f"tools[{i}].function.parameters cannot be enforced as a grammar: "
                             f"{error.strip().splitlines()[0]}; simplify the schema or leave tool_choice \"auto\"")
    raise ValueError(f"the tool-call grammar does not compile: {LLMatcher.validate_grammar(grammar).strip()}")
