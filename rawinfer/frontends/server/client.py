"""Client library for `rawinfer serve`: blocking Client and asyncio AsyncClient, yielding chunks as they arrive.

    with Client("tcp://127.0.0.1:5555") as c:
        for msg in c.generate("Hello", params={"max_tokens": 32, "temperature": 0}):
            print(msg.text, end="", flush=True)          # Chunk ... then one Final per sample

    async with AsyncClient(addr) as c:
        async for msg in c.generate(messages=[{"role": "user", "content": "Hi"}]):
            ...

One client is one DEALER socket; several requests may be in flight on it at once (each generate()
iterator reads only its own messages; the others are kept until their iterator asks). A Client is for one
thread; an AsyncClient for one event loop. A request whose iterator is closed before its final message
(`break`, an exception, Ctrl-C) is aborted on the server. When nothing at all arrives from the server
for `timeout_s` (the server sends heartbeats while requests run), ServerTimeout is raised.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import zmq
import zmq.asyncio
import zmq.auth

from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P

DEFAULT_ADDR = "tcp://127.0.0.1:5555"
log = logging.getLogger("rawinfer")


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
                  priority: int = 0) -> P.Generate:
    """Build a generate message and check it as the server would; the request id defaults to a random one.
    Raises ValueError naming the bad field."""
    if isinstance(params, SamplingParams):
        params = params.to_dict()
    if prompt is not None and not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]         # tuples, NumPy arrays
    msg = P.Generate(request_id or uuid.uuid4().hex, prompt, messages, dict(params or {}), stream, priority)
    try:                                          # the server's own checks, before anything is sent
        return P.decode_request(P.encode(msg))
    except (P.ProtocolError, TypeError) as e:
        raise ValueError(str(e)) from None


def load_public_key(key: str | bytes) -> bytes:
    """A Curve public key given as its 40-character Z85 text or as a .key / .key_secret file."""
    text = key.decode() if isinstance(key, bytes) else key
    if len(text) == 40 and not os.path.exists(text):
        return text.encode()
    try:
        public, _ = zmq.auth.load_certificate(text)
    except (OSError, ValueError) as e:
        raise ClientError(f"cannot read the server's public key from {text!r} ({e}); pass the server.key file "
                          "that `rawinfer keygen` wrote, or its 40-character Z85 text") from None
    return public


def _setup_socket(sock: zmq.Socket, addr: str, server_key, client_key_file: str | None) -> None:
    sock.setsockopt(zmq.LINGER, 500)          # long enough for a last abort to leave on close
    sock.setsockopt(zmq.RCVHWM, 0)            # never make the server drop us for reading in bursts
    if server_key is not None:
        sock.curve_serverkey = load_public_key(server_key)
        if client_key_file is not None:
            try:
                public, secret = zmq.auth.load_certificate(client_key_file)
            except (OSError, ValueError) as e:
                raise ClientError(f"cannot read the client key file {client_key_file!r} ({e})") from None
            if secret is None:
                raise ClientError(f"{client_key_file!r} holds no secret key; pass the client's .key_secret file")
        else:
            public, secret = zmq.curve_keypair()      # an anonymous client identity, fresh each time
        sock.curve_publickey, sock.curve_secretkey = public, secret
    elif client_key_file is not None:
        raise ClientError("a client key is only used under CurveZMQ: also give the server's public key")
    sock.connect(addr)


def _destination(msg: P.ServerMessage) -> tuple[str, str | None]:
    """Where an incoming message goes: ("stream", request id), ("reply", tag) or ("none", None)."""
    if isinstance(msg, (P.Chunk, P.Final)):
        return "stream", msg.request_id
    if isinstance(msg, P.Error):
        if msg.tag is not None:
            return "reply", msg.tag
        if msg.request_id is not None and msg.code != P.ErrorCode.DUPLICATE_REQUEST_ID:
            return "stream", msg.request_id
        log.warning("the server reported: %s (%s)", msg.message, msg.code)
        return "none", None
    if isinstance(msg, (P.Pong, P.StatsReply, P.ModelInfoReply)) and msg.tag is not None:
        return "reply", msg.tag
    return "none", None                       # heartbeats: they only show that the server is alive


def _decode(data: bytes) -> P.ServerMessage:
    try:
        return P.decode_reply(data)
    except P.ProtocolError as e:
        raise ClientError(f"the server sent a message this client cannot read: {e.message}") from None


def _silence(addr: str, timeout_s: float) -> str:
    return (f"no reply from {addr} within {timeout_s:g} s; is `rawinfer serve` running there (and, under CurveZMQ, "
            "are the keys right)?")


def _reply_value(reply) -> Any:
    if isinstance(reply, P.Error):
        raise RequestError(reply.code, reply.message)
    return reply


class Client:
    """Blocking client over one DEALER socket."""

    def __init__(self, addr: str = DEFAULT_ADDR, *, server_key: str | bytes | None = None,
                 client_key_file: str | None = None, timeout_s: float = 60.0, context: zmq.Context | None = None):
        self.addr, self.timeout_s = addr, timeout_s
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        try:
            _setup_socket(self.sock, addr, server_key, client_key_file)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self._streams: dict[str, deque] = {}
        self._replies: dict[str, P.ServerMessage | None] = {}
        self._tags = itertools.count()
        self._last_heard = 0.0

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # ---- requests ------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 params: SamplingParams | dict | None = None, stream: bool = True, request_id: str | None = None,
                 priority: int = 0) -> Iterator[P.Chunk | P.Final]:
        """Send a request now; the returned iterator yields its chunks and then one Final per sample.
        Raises RequestError if the server refuses it."""
        msg = make_generate(prompt, messages, params, stream, request_id, priority)
        if msg.request_id in self._streams:
            raise ValueError(f"request id {msg.request_id!r} is already in flight on this client")
        n = msg.params.get("n", 1) if isinstance(msg.params.get("n", 1), int) else 1
        self._streams[msg.request_id] = deque()
        self.sock.send(P.encode(msg))
        return self._iterate(msg.request_id, n)

    def _iterate(self, rid: str, n: int) -> Iterator[P.Chunk | P.Final]:
        queue, remaining, over = self._streams[rid], n, False
        try:
            while remaining:
                self._pump(lambda: bool(queue))
                msg = queue.popleft()
                if isinstance(msg, P.Error):
                    over = True
                    raise RequestError(msg.code, msg.message, rid)
                if isinstance(msg, P.Final):
                    remaining -= 1
                yield msg
            over = True
        finally:
            self._streams.pop(rid, None)
            if not over and not self.sock.closed:       # abandoned mid-way: stop it on the server too
                try:
                    self.sock.send(P.encode(P.Abort(rid)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass                                # not connected: the server will not hear from us anyway

    def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        """Non-streaming: wait for the whole result."""
        kw["stream"] = False
        finals = [m for m in self.generate(prompt, **kw) if isinstance(m, P.Final)]
        finals.sort(key=lambda f: f.index)
        return Completion(finals[0].request_id, finals[0].prompt_token_ids, finals)

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its iterator then ends with a Final whose reason is "abort"."""
        self.sock.send(P.encode(P.Abort(request_id)))

    # ---- control -------------------------------------------------------------------------------------
    def ping(self) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        self._call(P.Ping)
        return time.monotonic() - t0

    def stats(self) -> dict:
        return self._call(P.Stats).stats

    def model_info(self) -> dict:
        return self._call(P.ModelInfo).info

    def _call(self, cls) -> Any:
        tag = f"t{next(self._tags)}"
        self._replies[tag] = None                   # None: awaited; a late reply to an abandoned call is dropped
        try:
            self.sock.send(P.encode(cls(tag=tag)))
            self._pump(lambda: self._replies[tag] is not None)
            return _reply_value(self._replies[tag])
        finally:
            del self._replies[tag]

    # ---- the receive pump ----------------------------------------------------------------------------
    def _pump(self, done: Callable[[], bool]) -> None:
        """Receive and route messages until done() or until the server has been silent for timeout_s."""
        started = time.monotonic()
        while not done():
            left = self.timeout_s - (time.monotonic() - max(started, self._last_heard))
            # NOTE: poll even when the time is up: if this process was not scheduled for a while, what arrived
            # meanwhile is waiting in the socket and the server was not silent.
            if not self.sock.poll(max(0, int(left * 1000) + 1), zmq.POLLIN):
                if left <= 0:
                    raise ServerTimeout(_silence(self.addr, self.timeout_s))
                continue
            msg = _decode(self.sock.recv())
            self._last_heard = time.monotonic()
            where, key = _destination(msg)
            if where == "stream" and key in self._streams:
                self._streams[key].append(msg)
            elif where == "reply" and key in self._replies:
                self._replies[key] = msg


class AsyncClient:
    """asyncio client over one DEALER socket; a background task routes incoming messages."""

    def __init__(self, addr: str = DEFAULT_ADDR, *, server_key: str | bytes | None = None,
                 client_key_file: str | None = None, timeout_s: float = 60.0, context=None):
        self.addr, self.timeout_s = addr, timeout_s
        self.sock = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        try:
            _setup_socket(self.sock, addr, server_key, client_key_file)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._tags = itertools.count()
        self._last_heard = 0.0
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self.sock.close()

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       params: SamplingParams | dict | None = None, stream: bool = True,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[P.Chunk | P.Final]:
        """Yields the request's chunks and then one Final per sample; RequestError if it is refused."""
        msg = make_generate(prompt, messages, params, stream, request_id, priority)
        rid = msg.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        remaining = msg.params.get("n", 1) if isinstance(msg.params.get("n", 1), int) else 1
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._start_reader()
        over = False
        try:
            await self.sock.send(P.encode(msg))
            while remaining:
                out = await self._quiet_wait(queue.get)
                if isinstance(out, P.Error):
                    over = True
                    raise RequestError(out.code, out.message, rid)
                if isinstance(out, P.Final):
                    remaining -= 1
                yield out
            over = True
        finally:
            self._streams.pop(rid, None)
            if not over and not self.sock.closed:
                await self.sock.send(P.encode(P.Abort(rid)))

    async def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        kw["stream"] = False
        finals = [m async for m in self.generate(prompt, **kw) if isinstance(m, P.Final)]
        finals.sort(key=lambda f: f.index)
        return Completion(finals[0].request_id, finals[0].prompt_token_ids, finals)

    async def abort(self, request_id: str) -> None:
        await self.sock.send(P.encode(P.Abort(request_id)))

    async def ping(self) -> float:
        t0 = time.monotonic()
        await self._call(P.Ping)
        return time.monotonic() - t0

    async def stats(self) -> dict:
        return (await self._call(P.Stats)).stats

    async def model_info(self) -> dict:
        return (await self._call(P.ModelInfo)).info

    async def _call(self, cls) -> Any:
        tag = f"t{next(self._tags)}"
        fut = asyncio.get_running_loop().create_future()
        self._replies[tag] = fut
        self._start_reader()
        try:
            await self.sock.send(P.encode(cls(tag=tag)))
            return _reply_value(await self._quiet_wait(lambda: asyncio.shield(fut)))
        finally:
            self._replies.pop(tag, None)

    async def _quiet_wait(self, make: Callable[[], Awaitable]) -> Any:
        """Await make() but give up once the server has been silent for timeout_s."""
        started, grace = time.monotonic(), True
        while True:
            if self._reader is not None and self._reader.done() and not self._reader.cancelled():
                raise ClientError(f"the connection to {self.addr} failed: {self._reader.exception()}")
            left = self.timeout_s - (time.monotonic() - max(started, self._last_heard))
            if left > 0:
                grace = True
            else:
                if not grace:
                    raise ServerTimeout(_silence(self.addr, self.timeout_s))
                # NOTE: one more short wait: if the event loop was starved, the reader task has yet to take
                # what arrived meanwhile, and the server was not silent.
                grace, left = False, 0.2
            try:
                return await asyncio.wait_for(make(), min(left, 1.0))
            except asyncio.TimeoutError:
                continue

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            msg = _decode(await self.sock.recv())
            self._last_heard = time.monotonic()
            where, key = _destination(msg)
            if where == "stream" and key in self._streams:
                self._streams[key].put_nowait(msg)
            elif where == "reply" and key in self._replies and not self._replies[key].done():
                self._replies[key].set_result(msg)
