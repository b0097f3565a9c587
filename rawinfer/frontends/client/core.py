"""The client's protocol state without sockets: request ids, per-request queues, routing, the silence rule.

A ClientCore turns calls into the bytes to send and received bytes into messages filed under the request
or call they answer; it knows how many finals each request still expects (one per sample), so it knows
when a stream is over, and which abandoned request needs an `abort`. The blocking Client and the asyncio
AsyncClient (client.py) are I/O shells around one core each: they send what it returns, feed it what
arrives, and wait while the request they serve has nothing to read. Nothing here touches a socket or a
clock: the shells pass the time in.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from rawinfer.config import is_int
from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P

log = logging.getLogger("rawinfer")

SIZE_CHECK_BYTES = 64 << 10     # messages up to this size are sent without asking the server's limit


class ClientError(RuntimeError):
    """The server could not be reached, answered with an error, or broke the protocol."""


class RequestError(ClientError):
    """The server refused a message (an `error` reply); `code` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{message} ({code})")
        self.code, self.message, self.request_id = code, message, request_id


class ServerTimeout(ClientError):
    """Nothing arrived from the server for timeout_s seconds."""


@dataclass
class Completion:
    """A whole request's result: the final message of each sample (index order); the n == 1 fields as properties."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[P.Final]

    @classmethod
    def from_messages(cls, messages: Iterable[P.Chunk | P.Final]) -> "Completion":
        """The completion of a request from everything its stream yielded (only the finals count)."""
        finals = sorted((m for m in messages if isinstance(m, P.Final)), key=lambda f: f.index)
        return cls(finals[0].request_id, finals[0].prompt_token_ids, finals)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def usage(self) -> P.Usage:
        return self.outputs[0].usage

    @property
    def timings(self) -> P.Timings:
        return self.outputs[0].timings


def make_generate(prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                  params: SamplingParams | dict | None = None, stream: bool = True, request_id: str | None = None,
                  priority: int = 0, validate: bool = True, chat_options: dict | None = None) -> P.Generate:
    """Build a generate message and (with validate) check it as the server would; the request id defaults
    to a random one. chat_options: how the server renders `messages` (PROTOCOL.md). Raises ValueError naming
    the bad field."""
    if isinstance(params, SamplingParams):
        params = params.to_dict()
    if prompt is not None and not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]         # tuples, NumPy arrays
    msg = P.Generate(request_id or uuid.uuid4().hex, prompt, messages, dict(params or {}), stream, priority,
                     chat_options)
    return validate_generate(msg) if validate else msg


def validate_generate(msg: P.Generate) -> P.Generate:
    """The message as the server will read it; ValueError naming the bad field."""
    try:                                          # the server's own checks, before anything is sent
        return P.decode_request(P.encode(msg))
    except (P.ProtocolError, TypeError) as e:
        raise ValueError(str(e)) from None


def finals_expected(params: dict[str, Any]) -> int:
    """How many finals end a request: one per sample. An `n` the server will refuse counts as 1: the
    request then ends with one `error` instead."""
    n = params.get("n", 1)
    return n if is_int(n) and n >= 1 else 1


def destination(msg: P.ServerMessage) -> tuple[str, str] | None:
    """Where an incoming message goes: ("stream", request id), ("reply", tag), or None (nobody waits for it)."""
    if isinstance(msg, (P.Chunk, P.Final)):
        return "stream", msg.request_id
    if isinstance(msg, P.Error):
        if msg.tag is not None:
            return "reply", msg.tag
        # NOTE: duplicate_request_id refuses only the new message; the stream under that id carries on
        if msg.request_id is not None and msg.code != P.ErrorCode.DUPLICATE_REQUEST_ID:
            return "stream", msg.request_id
        log.warning("the server reported: %s (%s)", msg.message, msg.code)
        return None
    if isinstance(msg, (P.Pong, P.StatsReply, P.ModelInfoReply, P.TokenizeReply, P.DetokenizeReply,
                        P.ScaleReply)) \
            and msg.tag is not None:
        return "reply", msg.tag
    return None                               # heartbeats: they only show that the server is alive


@dataclass
class _Stream:
    """One request in flight on this client: what has arrived and not been read yet, and what is to come."""
    queue: deque
    remaining: int                            # finals still expected
    over: bool = False                        # its last final, or its error, has been read


class ClientCore:
    """The state of one client connection: its requests and control calls in flight, and when the server
    was last heard from. For one thread (or one event loop), like the shells around it."""

    def __init__(self, addr: str, timeout_s: float):
        self.addr, self.timeout_s = addr, timeout_s
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[str, P.ServerMessage | None] = {}    # tag -> reply; None while awaited
        self._tags = itertools.count()
        self.last_heard = 0.0
        self.max_message_bytes: int | None = None     # the server's limit, asked for when first needed

    # ---- the server's message size limit ---------------------------------------------------------------
    def needs_limit(self, size: int) -> bool:
        """Whether a message of `size` bytes may be over the server's limit, which is not known yet (the shell
        then asks model_info and calls learn_limit)."""
        return self.max_message_bytes is None and size > SIZE_CHECK_BYTES

    def learn_limit(self, info: dict) -> None:
        limit = info.get("max_message_bytes")
        self.max_message_bytes = limit if is_int(limit) and limit > 0 else P.DEFAULT_MAX_MESSAGE_BYTES

    def check_size(self, size: int) -> None:
        """ValueError when a message is over the server's limit: the server would drop the whole connection,
        and every other request on it with it."""
        limit = self.max_message_bytes or P.DEFAULT_MAX_MESSAGE_BYTES
        if size > SIZE_CHECK_BYTES and size > limit:
            raise ValueError(f"the request is {size} bytes, over the server's limit of {limit} bytes per message "
                             "(`rawinfer serve --max-message-size`); shorten the prompt")

    # ---- generate requests ---------------------------------------------------------------------------
    def open_stream(self, msg: P.Generate) -> bytes:
        """Register a request; the bytes to send for it. ValueError if its id is already in flight here."""
        if msg.request_id in self._streams:
            raise ValueError(f"request id {msg.request_id!r} is already in flight on this client")
        self._streams[msg.request_id] = _Stream(deque(), finals_expected(msg.params))
        return P.encode(msg)

    def has_message(self, request_id: str) -> bool:
        """Whether the request has a message waiting to be read."""
        return bool(self._streams[request_id].queue)

    def next_message(self, request_id: str) -> P.Chunk | P.Final:
        """The request's next message (has_message() must be true); RequestError if the server refused it."""
        st = self._streams[request_id]
        msg = st.queue.popleft()
        if isinstance(msg, P.Error):
            st.over = True
            raise RequestError(msg.code, msg.message, request_id)
        if isinstance(msg, P.Final):
            st.remaining -= 1
            st.over = st.remaining == 0
        return msg

    def stream_over(self, request_id: str) -> bool:
        """True once the request's last final (or its error) has been read."""
        return self._streams[request_id].over

    def close_stream(self, request_id: str) -> bytes | None:
        """Forget a request; the `abort` to send when it was left before it was over, else None. What still
        arrives for it is dropped."""
        st = self._streams.pop(request_id, None)
        return None if st is None or st.over else self.abort_message(request_id)

    @staticmethod
    def abort_message(request_id: str) -> bytes:
        return P.encode(P.Abort(request_id))

    # ---- calls (ping, stats, model_info, tokenize, detokenize) ----------------------------------------
    def open_call(self, cls: type, **fields: Any) -> tuple[str, bytes]:
        """A fresh tag and the bytes of a `cls` message with `fields`, carrying the tag. ValueError naming the
        bad field, checked as the server would."""
        msg = cls(tag=f"t{next(self._tags)}", **fields)
        try:
            data = P.encode(msg)
            P.decode_request(data)
        except (P.ProtocolError, TypeError) as e:
            raise ValueError(str(e)) from None
        self._replies[msg.tag] = None
        return msg.tag, data

    def has_reply(self, tag: str) -> bool:
        return self._replies.get(tag) is not None

    def take_reply(self, tag: str) -> Any:
        """The reply to a call (has_reply() must be true), which is then forgotten; RequestError for an `error`."""
        reply = self._replies.pop(tag)
        if isinstance(reply, P.Error):
            raise RequestError(reply.code, reply.message)
        return reply

    def close_call(self, tag: str) -> None:
        """Forget a call, answered or not: a reply that arrives later is dropped."""
        self._replies.pop(tag, None)

    # ---- incoming messages ---------------------------------------------------------------------------
    def receive(self, data: bytes, now: float) -> tuple[str, str] | None:
        """File one message from the server under the request or call it answers; that destination, or None
        when nobody waits for it (heartbeats, late replies, messages of abandoned requests)."""
        try:
            msg = P.decode_reply(data)
        except P.ProtocolError as e:
            raise ClientError(f"the server sent a message this client cannot read: {e.message}") from None
        self.last_heard = now
        where = destination(msg)
        if where is None:
            return None
        kind, key = where
        if kind == "stream" and key in self._streams:
            self._streams[key].queue.append(msg)
            return where
        if kind == "reply" and key in self._replies and self._replies[key] is None:
            self._replies[key] = msg
            return where
        return None

    # ---- silence ---------------------------------------------------------------------------------------
    def silence_left(self, started: float, now: float) -> float:
        """Seconds a wait that began at `started` may still last: the server counts as gone once nothing
        from it has arrived for timeout_s, counted from the later of the wait's start and the last message."""
        return self.timeout_s - (now - max(started, self.last_heard))

    def timeout_error(self) -> ServerTimeout:
        return ServerTimeout(f"no reply from {self.addr} within {self.timeout_s:g} s; is `rawinfer serve` running "
                             "there (and, under CurveZMQ, are the keys right)?")
