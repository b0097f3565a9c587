"""Structured output over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` (and its older
`guided_*` fields) as the engine's one constraint, SamplingParams.structured_outputs, checked here so that
a 400 names the field the client sent."""

from __future__ import annotations

import json
from typing import Any

from rawinfer.frontends.http.errors import invalid

# the engine's constraint kinds (SamplingParams.structured_outputs holds exactly one of them)
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's options beside the constraint that change nothing here (the engine has one grammar backend)
_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
            "whitespace_pattern", "structural_tag")
# vLLM's older extra fields, one constraint each
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_of(req) -> dict[str, Any] | None:
    """The request's SamplingParams.structured_outputs, or None when it asks for free text. At most one of
    response_format (other than text), structured_outputs and the guided_* fields may constrain it."""
    found: list[tuple[str, dict]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    extra = getattr(req, "structured_outputs", None)
    if extra is not None:
        found.append(("structured_outputs", _structured_outputs(extra)))
    for name, kind in _GUIDED.items():
        if getattr(req, name, None) is not None:
            found.append((name, _one(name, kind, getattr(req, name))))
    if len(found) > 1:
        raise invalid(found[1][0], f"{found[0][0]!r} and {found[1][0]!r} both constrain the output: send one")
    return found[0][1] if found else None


def _response_format(fmt) -> dict | None:
    kind = fmt.type
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.json_schema
    if spec is None:
        raise invalid("response_format", "'response_format' of type \"json_schema\" needs a 'json_schema' object "
                      "with 'name' and 'schema'")
    schema = spec.schema_ if getattr(spec, "schema_", None) is not None else None
    if schema is None:                  # OpenAI's schema is optional: any JSON object then
        return {"json_object": True}
    return {"json": schema}


def _structured_outputs(value: Any) -> dict:
    if not isinstance(value, dict):
        raise invalid("structured_outputs", "'structured_outputs' must be an object with one of "
                      f"{', '.join(KINDS)}")
    kinds = [k for k in KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid("structured_outputs", f"'structured_outputs' must set exactly one of {', '.join(KINDS)} "
                      f"(got {', '.join(kinds) or 'none'})")
    unknown = [k for k in value if k not in KINDS and k not in _OPTIONS]
    if unknown:
        raise invalid("structured_outputs", f"'structured_outputs' has no field {unknown[0]!r}; it takes one of "
                      f"{', '.join(KINDS)}")
    return _one("structured_outputs", kinds[0], value[kinds[0]])


def _one(param: str, kind: str, value: Any) -> dict:
    """One constraint, its value's type checked (the engine compiles it and names what does not compile)."""
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(param, f"{param!r}: the JSON schema is not valid JSON") from None
    ok = {"json": lambda v: isinstance(v, dict), "json_object": lambda v: v is True,
          "regex": lambda v: isinstance(v, str) and v != "", "grammar": lambda v: isinstance(v, str) and v != "",
          "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) for c in v)}[kind]
    if not ok(value):
        what = {"json": "a JSON schema (an object)", "json_object": "true", "regex": "a non-empty regular expression",
                "grammar": "a non-empty grammar", "choice": "a non-empty list of strings"}[kind]
        raise invalid(param, f"{param!r}: {kind} must be {what}")
    return {kind: value}
