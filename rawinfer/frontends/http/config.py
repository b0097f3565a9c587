"""HTTPConfig: what an HTTP worker needs (where the engine is, who may use the API, the request limits), each
field declared once (settings.option); the ones with a flag are `rawinfer serve`'s HTTP options. Kept apart
from app.py so that building the command line's parser imports no web framework."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rawinfer.config import is_int, is_number
from rawinfer.engine.reasoning import REASONING_PARSERS
from rawinfer.engine.tool_calls import TOOL_CALL_PARSERS
from rawinfer.settings import SECONDS, api_key_default, int_argument, option, optional, size_argument

TOOL_CALL_CHOICES = ("auto", "none", *TOOL_CALL_PARSERS)
_positive = {"parse": int_argument, "check": lambda v: is_int(v) and v >= 1, "what": "a positive integer"}


def _served_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a served model name must not be empty")
    return text


@dataclass
class HTTPConfig:
    engine_addr: str = option("", flag=None, check=lambda v: isinstance(v, str) and "://" in v,
                              what="the engine's ZeroMQ endpoint", help="where the engine serves (from --bind)")
    server_key: str | None = option(None, flag=None, check=optional(lambda v: isinstance(v, str)),
                                    what="a key or key file, or None",
                                    help="the engine's Curve public key (or key file), when it uses CurveZMQ")
    api_key: str | None = option(
        None, parse=str, metavar="KEY", cli_default=api_key_default, check=optional(lambda v: isinstance(v, str)),
        what="a string or None",
        help="require `Authorization: Bearer KEY` on every HTTP route but /health and /version (default: "
             "$RAWINFER_API_KEY, else none)")
    timeout_s: float = option(60.0, flag=None, check=lambda v: is_number(v) and v > 0, what="a positive number",
                              help="the engine silent this long during a request: 503")
    strict_api: bool = option(False, check=lambda v: isinstance(v, bool), what="true or false",
                              help="refuse a request with a field this server does not know (400 "
                                   "unknown_parameter) (default: ignore it, named in a warning line of the log, "
                                   "as vLLM does)")
    served_names: list[str] | None = option(
        None, flag="--served-model-name", parse=_served_name, nargs="+", metavar="NAME",
        check=optional(lambda v: bool(v) and all(isinstance(n, str) and n.strip() for n in v)),
        what="a list of names or None",
        help="the model's names in the API: the first is the one responses and /v1/models report, any of them is "
             "accepted in a request's `model` (default: the model's folder or file name)")
    default_max_tokens: int | None = option(
        None, **{**_positive, "check": optional(_positive["check"]), "what": "a positive integer or None"},
        help="max_tokens of a request that leaves it out, at most what the context leaves after its prompt "
             "(default: OpenAI's: 16 for completions, what the context leaves for chats)")
    tool_call_parser: str = option(
        "auto", parse=str, choices=TOOL_CALL_CHOICES, check=lambda v: v in TOOL_CALL_CHOICES,
        what="one of " + ", ".join(TOOL_CALL_CHOICES),
        help="how tool calls are read from a chat answer into `tool_calls`: hermes (<tool_call> JSON: Hermes, "
             "Qwen2.5/3, --chat-template smollm2-tools), llama3_json (Llama 3.x), none (default: auto, the format "
             "the chat template teaches, if any)")
    reasoning_parser: str | None = option(
        None, parse=str, choices=tuple(REASONING_PARSERS), check=optional(lambda v: v in REASONING_PARSERS),
        what="one of " + ", ".join(REASONING_PARSERS) + ", or None",
        help="return a chat answer's <think> block as `reasoning_content`: qwen3, deepseek_r1 (default: none, the "
             "block stays in the content)")
    max_prompts_per_request: int = option(
        256, **_positive, help="a request whose prompts x n make more generations than N is refused with 400")
    max_in_flight: int = option(
        256, flag="--http-max-in-flight", cli_default=None, **_positive,
        help="generations each HTTP worker keeps in the engine at once; further requests wait in the worker, and "
             "whenever one ends the waiting client holding the fewest goes next (a client is its address) "
             "(default: 2 x --max-num-seqs x the most replicas, at least --max-prompts-per-request)")
    max_body_bytes: int = option(
        16 * 1024 * 1024, flag="--max-request-body", parse=size_argument, metavar="SIZE",
        check=lambda v: is_int(v) and v >= 1, what="a positive size",
        help="a larger request body is refused with 413 while it arrives, before it is parsed (default: 16MiB)")
    read_timeout_s: float = option(
        30.0, flag="--http-read-timeout", **SECONDS,
        help="a connection whose request line and headers are not all there this long after it opened (or after "
             "its last answer) is closed; a body that pauses this long gets 408")
    keep_alive_s: float = option(5.0, flag="--http-keep-alive", **SECONDS,
                                 help="an idle connection is closed this long after its last answer")
