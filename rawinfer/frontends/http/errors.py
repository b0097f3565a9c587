"""Errors in OpenAI's JSON shape: APIError, and the mapping of the engine's refusals and of request
validation failures to it, each with the HTTP status a client acts on."""

from __future__ import annotations

import logging
import re
from typing import Any

from rawinfer.frontends.server.protocol import ErrorCode

log = logging.getLogger("rawinfer")


class APIError(Exception):
    """A request the front end answers with `{"error": {message, type, param, code}}` and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or _KIND.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def log_failure(e: APIError, route: str) -> None:
    """The one warning line of a request the front end refused or that failed: its status, its route
    ("METHOD PATH") and the reason."""
    param = f" (param {e.param})" if e.param else ""
    log.warning("HTTP %d %s: %s%s", e.status, route, e.message, param)


_KIND = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


def invalid(param: str, message: str) -> APIError:
    """400 for a parameter with a value the engine does not take."""
    return APIError(400, message, param=param, code="invalid_value")


def unsupported(param: str, what: str | None = None) -> APIError:
    """400 for an OpenAI parameter this engine does not implement (yet)."""
    return APIError(400, f"{what or param!r} is not supported by this server yet; leave it out",
                    param=param, code="unsupported_parameter")


def unknown_field(name: str) -> APIError:
    """400 for a field this server does not know (only under `rawinfer serve --strict-api`)."""
    return APIError(400, f"unknown field {name!r}: this server does not know it; leave it out (this server "
                    "refuses unknown fields: it runs with --strict-api)", param=name, code="unknown_parameter")


# the protocol's error codes (PROTOCOL.md) -> HTTP status and OpenAI code
_ENGINE = {
    ErrorCode.INVALID_PARAMS.value: (400, "invalid_value"),
    ErrorCode.INVALID_PROMPT.value: (400, "invalid_prompt"),
    ErrorCode.INVALID_MESSAGE.value: (400, "invalid_value"),
    ErrorCode.REJECTED.value: (400, "invalid_prompt"),
    ErrorCode.OVERLOADED.value: (429, "overloaded"),
    ErrorCode.SHUTTING_DOWN.value: (503, "shutting_down"),
}


def from_engine(code: str, message: str, prompt_param: str = "prompt") -> APIError:
    """The APIError for an engine refusal (a protocol `error` reply)."""
    status, api_code = _ENGINE.get(code, (500, "internal_error"))
    param = None
    if code == ErrorCode.INVALID_PARAMS.value:
        m = re.search(r"SamplingParams\.(\w+)=", message)
        param = m.group(1) if m else None
        message = message.replace("SamplingParams.", "")
    elif code in (ErrorCode.REJECTED.value, ErrorCode.INVALID_PROMPT.value):
        param = "logit_bias" if "logit_bias" in message else prompt_param
        if "context" in message:
            api_code = "context_length_exceeded"
    return APIError(status, message, param=param, code=api_code)


# field -> what its value must be, for the messages of type errors
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": 'a list of {"role": ..., "content": ...} objects',
    "logit_bias": "an object mapping token ids (as strings) to numbers",
}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def from_validation(errors: list[dict]) -> APIError:
    """400 naming the first field pydantic refused (FastAPI's RequestValidationError.errors())."""
    if not errors:
        return APIError(400, "the request body is invalid", code="invalid_request")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if not loc:                         # the body as a whole: missing, or JSON but not an object
        return APIError(400, "the request body must be a JSON object (content-type application/json)",
                        code="invalid_request")
    if e.get("type") == "missing":
        name = ".".join(loc)
        return APIError(400, f"the field {name!r} is required", param=name, code="missing_parameter")
    if e.get("type") == "literal_error":          # a message's role, a content part's type
        name = ".".join(loc)
        got = repr(e.get("input"))[:40]
        return invalid(name, f"{name!r} must be one of {e.get('ctx', {}).get('expected')} (got {got})")
    top = loc[0]
    if top in _SHAPES:
        return invalid(top, f"{top!r} must be {_SHAPES[top]}")
    # the path without pydantic's union member names ("str", "list[int]", ...)
    name = ".".join(x for x in loc if x not in _TYPE_NAMES and "[" not in x) or top
    return invalid(name or "body", f"invalid value for {name!r}: {e.get('msg', 'invalid')}")
