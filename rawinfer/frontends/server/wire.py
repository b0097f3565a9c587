"""The field checks of protocol messages (protocol.py): each check returns the wire value or raises
ValueError("must be ..."), and `_build` turns a checked map into its message dataclass.

The names keep their leading underscore: they are protocol.py's vocabulary, not an API of their own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import MISSING, field, fields
from typing import Any, Callable

from rawinfer.config import is_int, is_number
from rawinfer.engine.chat_messages import check_tools, template_messages

MAX_ID_CHARS = 256                      # request ids and tags
MAX_TOKEN_ID = 2**31 - 1
FINISH_REASONS = ("stop", "length", "abort", "error")


def _id(v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS:
        raise ValueError(f"must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return v


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def opt(v: Any) -> Any:
        return None if v is None else check(v)
    return opt


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _int(v: Any) -> int:
    if not is_int(v):
        raise ValueError("must be an integer")
    return v


def _count(v: Any) -> int:
    if not is_int(v) or v < 0:
        raise ValueError("must be an integer >= 0")
    return v


def _seconds(v: Any) -> float:
    if not is_number(v):
        raise ValueError("must be a finite number")
    return float(v)


def _token_ids(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise ValueError(f"must be a list of integer token ids in [0, {MAX_TOKEN_ID}]")
    return v


def _prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return _token_ids(v)
    raise ValueError("must be a string or a list of integer token ids")


def _chat(v: Any) -> list[dict[str, Any]]:
    """OpenAI's messages (assistant tool_calls, tool results included), checked as the renderer reads them."""
    if not isinstance(v, list) or not v:
        raise ValueError('must be a non-empty list of {"role": str, "content": str} maps')
    try:
        template_messages(v)
    except ValueError as e:
        raise ValueError(f"is invalid: {e}") from None
    return v


CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message")


def _chat_options(v: Any) -> dict[str, Any]:
    flags = {k: x for k, x in v.items() if k not in ("template_kwargs", "tools")} if isinstance(v, dict) else None
    if flags is None or not all(k in CHAT_OPTIONS and isinstance(x, bool) for k, x in flags.items()):
        raise ValueError(f"must be a map of {' and '.join(CHAT_OPTIONS)} to booleans, template_kwargs to a map and "
                         "tools to a list of tools")
    if "template_kwargs" in v:
        _map(v["template_kwargs"])
    try:
        check_tools(v.get("tools"), "chat_options.tools")
    except ValueError as e:
        raise ValueError(f"is invalid: {e}") from None
    if v.get("continue_final_message") and v.get("add_generation_prompt", True):   # its default is true
        raise ValueError("cannot both add a generation prompt and continue the final message: set "
                         "add_generation_prompt to false to continue it")
    return v


def _map(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ValueError("must be a map with string keys")
    return v


def _finish_reason(v: Any) -> str:
    if v not in FINISH_REASONS:
        raise ValueError(f"must be one of {', '.join(FINISH_REASONS)}")
    return v


def _nested(cls: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"must be a map of {', '.join(f.name for f in fields(cls))}")
        return _build(cls, v, f"{cls.__name__} map")
    return check


def _f(check: Callable[[Any], Any], default: Any = MISSING, factory: Any = MISSING, omit_none: bool = False) -> Any:
    """A dataclass field whose wire value is validated by `check`; omit_none: not sent while None."""
    return field(default=default, default_factory=factory, metadata={"check": check, "omit_none": omit_none})


def _floats(v: Any) -> list[float]:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                          and not math.isnan(x) for x in v):
        raise ValueError("must be a list of numbers")
    return v


def _counts(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(is_int(x) and x >= 0 for x in v):
        raise ValueError("must be a list of integers >= 0")
    return v


def _lists(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def each(v: Any) -> list:
        if not isinstance(v, list):
            raise ValueError("must be a list of lists")
        return [check(x) for x in v]
    return each


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Callable[[Any], Any]], tuple[str, ...]]:
    """A message class's field checks by name, and its required fields (read once per class: every message
    a client receives is built here)."""
    specs = fields(cls)
    return ({f.name: f.metadata["check"] for f in specs},
            tuple(f.name for f in specs if f.default is MISSING and f.default_factory is MISSING))


def _build(cls: type, body: dict, where: str) -> Any:
    """Check every field of `body` against `cls` and construct it; ValueError names the offending key."""
    checks, required = _fields(cls)
    unknown = [k for k in body if k not in checks]
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(_short(k) for k in unknown[:5])}; "
                         f"known: {', '.join(checks) or 'none'}")
    missing = [n for n in required if n not in body]
    if missing:
        raise ValueError(f"{where} lacks the required field(s) {', '.join(missing)}")
    values = {}
    for name, value in body.items():
        try:
            values[name] = checks[name](value)
        except ValueError as e:
            raise ValueError(f"field {name!r} of {where} {e}") from None
    try:
        return cls(**values)
    except ValueError as e:      # cross-field rules (__post_init__)
        raise ValueError(f"{where}: {e}") from None


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
