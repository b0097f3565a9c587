"""The client/server wire protocol: message dataclasses and their one msgpack encoder and validating decoder.

Every message is one msgpack map in one ZeroMQ frame (a DEALER sends it; the server's ROUTER sees it
behind the sender's routing id). The map always carries `v` (the protocol version) and `type`; the
other keys are the fields of the dataclass registered under that type. PROTOCOL.md beside this file
is the written contract; this module is its executable form. The decoder trusts nothing: every field
is type-checked, unknown keys are named in the error, and any failure is a ProtocolError whose code and
message go back to the sender as an `error` reply.

Optional fields added after version 1 shipped (`_f(..., omit_none=True)`) leave the wire when they are None,
so a peer that never asks for them exchanges exactly the messages version 1 defined.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, ClassVar

import msgpack

from rawinfer.config import is_int
from rawinfer.frontends.server.wire import (FINISH_REASONS, MAX_ID_CHARS, MAX_TOKEN_ID, _bool, _build,  # noqa: F401 (re-exported)
                                           _chat, _chat_options, _count, _counts, _f, _finish_reason, _floats, _id,
                                           _int, _lists, _map, _nested, _optional, _prompt, _seconds, _short, _str,
                                           _token_ids)

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
DEFAULT_ADDR = "tcp://127.0.0.1:5555"   # where the server binds and clients connect unless told otherwise
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20     # the server caps incoming messages at its socket (ZMQ_MAXMSGSIZE)


class ErrorCode(str, enum.Enum):
    BAD_FRAMES = "bad_frames"                # not exactly one body frame
    BAD_MSGPACK = "bad_msgpack"              # the frame does not decode as msgpack
    INVALID_MESSAGE = "invalid_message"      # not a map, missing/unknown/ill-typed fields
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PARAMS = "invalid_params"        # sampling parameters rejected by SamplingParams
    INVALID_PROMPT = "invalid_prompt"        # text or chat on a model without a tokenizer / template
    REJECTED = "rejected"                    # the engine refused the request (too long, bad token id, ...)
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    UNKNOWN_REQUEST = "unknown_request"      # abort of a request id that is not in flight
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value


class ProtocolError(ValueError):
    """A message that breaks the protocol; carries what the `error` reply needs."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None, tag: str | None = None):
        super().__init__(message)
        self.code, self.message, self.request_id, self.tag = code, message, request_id, tag


# ---- nested records ------------------------------------------------------------------------------------------
@dataclass
class Usage:
    prompt_tokens: int = _f(_count)
    cached_prompt_tokens: int = _f(_count)          # prompt tokens served by the prefix cache
    completion_tokens: int = _f(_count)


@dataclass
class Timings:
    ttft_s: float | None = _f(_optional(_seconds))          # arrival at the server -> first token
    mean_itl_s: float | None = _f(_optional(_seconds))      # mean gap between tokens
    e2e_s: float | None = _f(_optional(_seconds))           # arrival -> finish


@dataclass
class Logprobs:
    """Log-probabilities of consecutive tokens, one entry per token in every list: the token, its log-softmax
    under the model's raw logits (before temperature, top-k/p and penalties), its rank (1 = most likely), and
    the requested number of most likely alternatives (most likely first; they may include the token itself)."""
    token_ids: list[int] = _f(_token_ids)
    logprobs: list[float] = _f(_floats)
    ranks: list[int] = _f(_counts)
    top_token_ids: list[list[int]] = _f(_lists(_token_ids))
    top_logprobs: list[list[float]] = _f(_lists(_floats))

    def __post_init__(self):
        n = len(self.token_ids)
        if not (len(self.logprobs) == len(self.ranks) == len(self.top_token_ids) == len(self.top_logprobs) == n):
            raise ValueError("token_ids, logprobs, ranks, top_token_ids and top_logprobs must have one entry per token")
        if any(len(a) != len(b) for a, b in zip(self.top_token_ids, self.top_logprobs)):
            raise ValueError("each entry of top_token_ids and top_logprobs must have the same length")


# ---- client -> server -----------------------------------------------------------------------------------------
@dataclass
class Generate:
    """Start a request. Exactly one of `prompt` (text or token ids) and `messages` (a chat)."""
    TYPE: ClassVar[str] = "generate"
    request_id: str = _f(_id)                        # chosen by the client, unique among its requests in flight
    prompt: str | list[int] | None = _f(_optional(_prompt), None)
    messages: list[dict[str, str]] | None = _f(_optional(_chat), None)
    params: dict[str, Any] = _f(_map, factory=dict)  # SamplingParams fields; absent ones take their defaults
    stream: bool = _f(_bool, True)
    priority: int = _f(_int, 0)                      # lower runs earlier among waiting requests
    # how `messages` are rendered: add_generation_prompt, continue_final_message (bools), template_kwargs (a map),
    # tools (OpenAI's list, the template's `tools`)
    chat_options: dict[str, Any] | None = _f(_optional(_chat_options), None, omit_none=True)

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.chat_options is not None and self.messages is None:
            raise ValueError("'chat_options' go with 'messages'")


@dataclass
class Abort:
    TYPE: ClassVar[str] = "abort"
    request_id: str = _f(_id)


@dataclass
class Stats:
    TYPE: ClassVar[str] = "stats"
    tag: str | None = _f(_optional(_id), None)       # echoed in the reply


@dataclass
class Ping:
    TYPE: ClassVar[str] = "ping"
    tag: str | None = _f(_optional(_id), None)


@dataclass
class ModelInfo:
    TYPE: ClassVar[str] = "model_info"
    tag: str | None = _f(_optional(_id), None)


@dataclass
class Tokenize:
    """Token ids of a text, or of a chat rendered with the model's template (exactly one of the two)."""
    TYPE: ClassVar[str] = "tokenize"
    prompt: str | None = _f(_optional(_str), None)
    messages: list[dict[str, str]] | None = _f(_optional(_chat), None)
    add_special_tokens: bool = _f(_bool, True)       # the tokenizer's own additions (BOS) to a text
    tag: str | None = _f(_optional(_id), None)
    chat_options: dict[str, Any] | None = _f(_optional(_chat_options), None, omit_none=True)    # as Generate's

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.chat_options is not None and self.messages is None:
            raise ValueError("'chat_options' go with 'messages'")


@dataclass
class Detokenize:
    TYPE: ClassVar[str] = "detokenize"
    token_ids: list[int] = _f(_token_ids)
    skip_special_tokens: bool = _f(_bool, False)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class Scale:
    """Set the number of engine replicas behind a replica router (`rawinfer serve --replicas`)."""
    TYPE: ClassVar[str] = "scale"
    replicas: int = _f(_count)
    tag: str | None = _f(_optional(_id), None)


# ---- server -> client -----------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """Tokens of a streaming request, in order. Never sent for a non-streaming one."""
    TYPE: ClassVar[str] = "chunk"
    request_id: str = _f(_id)
    index: int = _f(_count)                          # sample index (0 unless params.n > 1)
    token_ids: list[int] = _f(_token_ids)
    text: str = _f(_str)                             # text delta ("" for a model without a tokenizer)
    logprobs: Logprobs | None = _f(_optional(_nested(Logprobs)), None, omit_none=True)         # of token_ids
    prompt_logprobs: Logprobs | None = _f(_optional(_nested(Logprobs)), None, omit_none=True)  # prompt ids[1:]
    finished: ClassVar[bool] = False


@dataclass
class Final:
    """The last message of one sample. token_ids/text hold what no chunk carried (everything when not
    streaming), so chunks + final always add up to the whole output."""
    TYPE: ClassVar[str] = "final"
    request_id: str = _f(_id)
    index: int = _f(_count)
    token_ids: list[int] = _f(_token_ids)
    text: str = _f(_str)
    finish_reason: str = _f(_finish_reason)
    prompt_token_ids: list[int] = _f(_token_ids)
    usage: Usage = _f(_nested(Usage))
    timings: Timings = _f(_nested(Timings))
    error: str | None = _f(_optional(_str), None)   # set when finish_reason is "error"
    logprobs: Logprobs | None = _f(_optional(_nested(Logprobs)), None, omit_none=True)         # of token_ids
    prompt_logprobs: Logprobs | None = _f(_optional(_nested(Logprobs)), None, omit_none=True)  # unless a chunk had it
    finished: ClassVar[bool] = True


@dataclass
class Error:
    """A message was refused. With a request_id, that generate never started (except code
    duplicate_request_id, which leaves the request already running under that id alone)."""
    TYPE: ClassVar[str] = "error"
    code: str = _f(_str)
    message: str = _f(_str)
    request_id: str | None = _f(_optional(_id), None)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class Pong:
    TYPE: ClassVar[str] = "pong"
    server_time: float = _f(_seconds)                # the server's time.time()
    tag: str | None = _f(_optional(_id), None)


@dataclass
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    stats: dict[str, Any] = _f(_map)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class ModelInfoReply:
    TYPE: ClassVar[str] = "model_info_reply"
    info: dict[str, Any] = _f(_map)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class TokenizeReply:
    TYPE: ClassVar[str] = "tokenize_reply"
    token_ids: list[int] = _f(_token_ids)
    max_model_len: int = _f(_count)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class DetokenizeReply:
    TYPE: ClassVar[str] = "detokenize_reply"
    text: str = _f(_str)
    tag: str | None = _f(_optional(_id), None)


@dataclass
class ScaleReply:
    TYPE: ClassVar[str] = "scale_reply"
    replicas: int = _f(_count)                       # the new target
    previous: int = _f(_count)                       # the target before
    tag: str | None = _f(_optional(_id), None)


@dataclass
class Heartbeat:
    """Sent to a client with requests in flight that has heard nothing for a heartbeat interval; a send
    that fails tells the server the client is gone."""
    TYPE: ClassVar[str] = "heartbeat"


ClientMessage = Generate | Abort | Stats | Ping | ModelInfo | Tokenize | Detokenize | Scale
ServerMessage = (Chunk | Final | Error | Pong | StatsReply | ModelInfoReply | TokenizeReply | DetokenizeReply
                 | ScaleReply | Heartbeat)
CLIENT_MESSAGES: dict[str, type] = {c.TYPE: c for c in (Generate, Abort, Stats, Ping, ModelInfo, Tokenize,
                                                         Detokenize, Scale)}
SERVER_MESSAGES: dict[str, type] = {c.TYPE: c for c in (Chunk, Final, Error, Pong, StatsReply, ModelInfoReply,
                                                         TokenizeReply, DetokenizeReply, ScaleReply, Heartbeat)}


# ---- the one encoder and decoder -----------------------------------------------------------------------------
def _plain(obj: Any) -> Any:
    """msgpack fallback for NumPy scalars in stats maps (anything with .item())."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, int):          # msgpack packs integers of up to 64 bits
        text = str(obj) if obj.bit_length() < 200 else f"{str(obj)[:20]}... ({obj.bit_length()} bits)"
        raise ValueError(f"the integer {text} is out of range: numbers in a request must fit in 64 bits")
    raise TypeError(f"cannot encode {type(obj).__name__} in a protocol message")


def encode(msg: ClientMessage | ServerMessage) -> bytes:
    # NOTE: fields one level deep, not asdict(msg): asdict copies every element of a token id list
    body = {f.name: getattr(msg, f.name) for f in fields(msg)
            if not (f.metadata.get("omit_none") and getattr(msg, f.name) is None)}
    for name, value in body.items():
        if is_dataclass(value):
            body[name] = asdict(value)
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **body}, use_bin_type=True, default=_plain)


def decode_request(data: bytes) -> ClientMessage:
    """Server side: bytes from a client -> a validated message (or ProtocolError)."""
    return _decode(data, CLIENT_MESSAGES)


def decode_reply(data: bytes) -> ServerMessage:
    """Client side: bytes from the server -> a validated message (or ProtocolError)."""
    return _decode(data, SERVER_MESSAGES)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not used by this protocol")


def _decode(data: bytes, registry: dict[str, type]) -> Any:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_ext, timestamp=0)
    except Exception as e:   # msgpack raises several unrelated types (ExtraData, FormatError, StackError, ...)
        raise ProtocolError(ErrorCode.BAD_MSGPACK,
                            f"the message is not valid msgpack ({type(e).__name__}); send one msgpack map") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE,
                            f"a message must be a msgpack map with 'v' and 'type', got {type(obj).__name__}")
    rid = obj.get("request_id") if isinstance(obj.get("request_id"), str) else None
    rid = rid if rid and len(rid) <= MAX_ID_CHARS else None
    tag = obj.get("tag") if isinstance(obj.get("tag"), str) and 0 < len(obj["tag"]) <= MAX_ID_CHARS else None
    version = obj.get("v")
    if not is_int(version) or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {_short(version)} is not supported; this side speaks version(s) "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}: upgrade the older of client and server",
                            rid, tag)
    kind = obj.get("type")
    cls = registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE,
                            f"unknown message type {_short(kind)}; expected one of {', '.join(registry)}", rid, tag)
    body = {k: v for k, v in obj.items() if k not in ("v", "type")}
    try:
        return _build(cls, body, f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} message")
    except ValueError as e:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, str(e), rid, tag) from None
