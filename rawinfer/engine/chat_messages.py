"""The chat a template receives: OpenAI's message and tool shapes checked, and handed over in the shape
Hugging Face chat templates read.

OpenAI's messages are {"role", "content"} maps; an assistant message may carry "tool_calls" ([{"id",
"type": "function", "function": {"name", "arguments": a JSON string}}], its content then null or empty) and a
"tool" message carries "tool_call_id" and the tool's result as content. Templates that know tools (Qwen2.5,
Qwen3, Hermes, Llama 3.1) read `tool_call.function.name` and write `tool_call.function.arguments | tojson` or
iterate it, so the arguments go to the template as a dict, as vLLM hands them over and as transformers'
documentation asks of its users. Also as vLLM does: a null content becomes "", text parts are joined with
newlines, and keys whose value is null are dropped (clients send an assistant message back as they got it,
with "refusal": null and the like, and some templates test whether a key is present).

Every check raises ValueError naming the field, e.g. "messages[2].tool_calls[0].function.arguments ...".
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")   # OpenAI's function names, plus "." and ":" (MCP servers')


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat as the template gets it (new dicts; the caller's are left as they are). ValueError naming the
    first field of a wrong shape."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of {{\"role\": ..., \"content\": ...}} maps, "
                         f"got {type(messages).__name__}")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be a dict with \"role\" and \"content\", got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where} needs a non-empty string \"role\" (e.g. \"user\"), got {role!r}")
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _content(m.get("content"), role, where)
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls, this one is {role!r}")
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\"}} "
                             f"maps, got {type(calls).__name__}")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    else:
        out.pop("tool_calls", None)
    for key in ("tool_call_id", "name"):
        if key in out and not isinstance(out[key], str):
            raise ValueError(f"{where}.{key} must be a string, got {type(out[key]).__name__}")
    return out


def _content(content: Any, role: str, where: str) -> str:
    """A message's text: a string, text parts joined, or "" for an assistant message without any."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}] must be a {{\"type\": \"text\", \"text\": str}} part "
                                 f"(this server reads text only), got {_short(part)}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where} needs a string \"content\" (or a list of text parts), got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """One assistant tool call, its arguments parsed into a dict for the template."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ValueError(f"{where} must be a map with a \"function\" map of \"name\" and \"arguments\", "
                         f"got {_short(call)}")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be \"function\", got {call.get('type')!r}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string, got {fn.get('name')!r}")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object in a string, as the model wrote it "
                             f"(e.g. '{{\"city\": \"Paris\"}}'), got {_short(fn['arguments'])}")
    elif not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object in a string, got {type(args).__name__}")
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = "function"
    out["function"] = {**{k: v for k, v in fn.items() if v is not None}, "arguments": args}
    return out


def check_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}
    (None or [] mean none: templates test `tools is not none`, so [] becomes None). Returns them as given."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of {{\"type\": \"function\", \"function\": {{...}}}} maps, "
                         f"got {type(tools).__name__}")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise ValueError(f"{where}[{i}] must be a map of \"type\": \"function\" and a \"function\" map, "
                             f"got {_short(tool)}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{where}[{i}].function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', "
                             f"got {name!r}")
        if name in seen:
            raise ValueError(f"{where}[{i}].function.name {name!r} is taken by {where}[{seen[name]}]: give each "
                             "tool its own name")
        seen[name] = i
        if not isinstance(fn.get("description", ""), str):
            raise ValueError(f"{where}[{i}].function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise ValueError(f"{where}[{i}].function.parameters must be the JSON schema of an object "
                             f"(\"type\": \"object\"), got {_short(params)}")
    return tools


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
