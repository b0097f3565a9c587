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
for `timeout_s` (the server sends heartbeats while requests run), ServerTimeout is raised. A request over
the server's message size limit is refused here, before it is sent (ValueError): the server would drop the
connection, and every other request on it.

Both classes are I/O shells over one ClientCore (core.py), which holds the requests in flight and
routes what arrives: the Client receives in whichever call is waiting, the AsyncClient in a reader task.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator, Callable, Iterator

import zmq
import zmq.asyncio
import zmq.auth

from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.core import (ClientCore, ClientError, Completion, RequestError, ServerTimeout,
                                                   make_generate, validate_generate)
from rawinfer.frontends.server.protocol import DEFAULT_ADDR

__all__ = ["AsyncClient", "Client", "ClientError", "Completion", "DEFAULT_ADDR", "RequestError", "ServerTimeout",
           "load_public_key", "make_generate"]


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


def _open_socket(context: zmq.Context, addr: str, server_key, client_key_file: str | None) -> zmq.Socket:
    """A DEALER socket connected to addr (under CurveZMQ when server_key is given); closed again on failure."""
    sock = context.socket(zmq.DEALER)
    try:
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
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class Client:
    """Blocking client over one DEALER socket."""

    def __init__(self, addr: str = DEFAULT_ADDR, *, server_key: str | bytes | None = None,
                 client_key_file: str | None = None, timeout_s: float = 60.0, context: zmq.Context | None = None):
        self.addr, self.timeout_s = addr, timeout_s
        self.sock = _open_socket(context or zmq.Context.instance(), addr, server_key, client_key_file)
        self.core = ClientCore(addr, timeout_s)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # ---- requests ------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 params: SamplingParams | dict | None = None, stream: bool = True, request_id: str | None = None,
                 priority: int = 0, chat_options: dict | None = None) -> Iterator[P.Chunk | P.Final]:
        """Send a request now; the returned iterator yields its chunks and then one Final per sample.
        chat_options: how the server renders `messages` ({"add_generation_prompt": bool,
        "continue_final_message": bool, "template_kwargs": {...}}; PROTOCOL.md). Raises ValueError, before
        sending, for a message over the server's size limit, and RequestError if the server refuses it."""
        msg = make_generate(prompt, messages, params, stream, request_id, priority, False, chat_options)
        size = len(P.encode(msg))
        if self.core.needs_limit(size):
            self.core.learn_limit(self.model_info())
        self.core.check_size(size)             # first: the checks below take time on a huge prompt
        msg = validate_generate(msg)
        data = self.core.open_stream(msg)
        try:
            self.sock.send(data)
        except BaseException:
            self.core.close_stream(msg.request_id)
            raise
        return self._iterate(msg.request_id)

    def _iterate(self, rid: str) -> Iterator[P.Chunk | P.Final]:
        try:
            while not self.core.stream_over(rid):
                self._pump(lambda: self.core.has_message(rid))
                yield self.core.next_message(rid)
        finally:
            abort = self.core.close_stream(rid)
            if abort is not None and not self.sock.closed:      # abandoned mid-way: stop it on the server too
                try:
                    self.sock.send(abort, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass                                # not connected: the server will not hear from us anyway

    def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        """Non-streaming: wait for the whole result."""
        kw["stream"] = False
        return Completion.from_messages(self.generate(prompt, **kw))

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its iterator then ends with a Final whose reason is "abort"."""
        self.sock.send(self.core.abort_message(request_id))

    # ---- control -------------------------------------------------------------------------------------
    def ping(self) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        self._call(P.Ping)
        return time.monotonic() - t0

    def stats(self) -> dict:
        return self._call(P.Stats).stats

    def scale(self, replicas: int) -> int:
        """Ask a replica router (`rawinfer serve --replicas`) for this many replicas; the previous target."""
        return self._call(P.Scale, replicas=replicas).previous

    def model_info(self) -> dict:
        return self._call(P.ModelInfo).info

    def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 add_special_tokens: bool = True, chat_options: dict | None = None) -> list[int]:
        """Token ids of a text, or of a chat as a generate would render it; RequestError if refused."""
        return self._call(P.Tokenize, prompt=prompt, messages=messages, add_special_tokens=add_special_tokens,
                          chat_options=chat_options).token_ids

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._call(P.Detokenize, token_ids=[int(t) for t in token_ids],
                          skip_special_tokens=skip_special_tokens).text

    def _call(self, cls, **fields) -> Any:
        tag, data = self.core.open_call(cls, **fields)
        try:
            if self.core.needs_limit(len(data)):        # tokenize carries a prompt: as generate, checked first
                self.core.learn_limit(self.model_info())
            self.core.check_size(len(data))
            self.sock.send(data)
            self._pump(lambda: self.core.has_reply(tag))
            return self.core.take_reply(tag)
        finally:
            self.core.close_call(tag)

    # ---- the receive pump ----------------------------------------------------------------------------
    def _pump(self, done: Callable[[], bool]) -> None:
        """Receive and route messages until done() or until the server has been silent for timeout_s."""
        started = time.monotonic()
        while not done():
            left = self.core.silence_left(started, time.monotonic())
            # NOTE: poll even when the time is up: if this process was not scheduled for a while, what arrived
            # meanwhile is waiting in the socket and the server was not silent.
            if not self.sock.poll(max(0, int(left * 1000) + 1), zmq.POLLIN):
                if left <= 0:
                    raise self.core.timeout_error()
                continue
            self.core.receive(self.sock.recv(), time.monotonic())


class AsyncClient:
    """asyncio client over one DEALER socket; a background task routes incoming messages."""

    def __init__(self, addr: str = DEFAULT_ADDR, *, server_key: str | bytes | None = None,
                 client_key_file: str | None = None, timeout_s: float = 60.0, context=None):
        self.addr, self.timeout_s = addr, timeout_s
        self.sock = _open_socket(context or zmq.asyncio.Context.instance(), addr, server_key, client_key_file)
        self.core = ClientCore(addr, timeout_s)
        self._wakers: dict[tuple[str, str], asyncio.Future] = {}  # core destination -> its waiter's future
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
                       request_id: str | None = None, priority: int = 0,
                       chat_options: dict | None = None) -> AsyncIterator[P.Chunk | P.Final]:
        """Yields the request's chunks and then one Final per sample; RequestError if it is refused."""
        msg = make_generate(prompt, messages, params, stream, request_id, priority, False, chat_options)
        rid = msg.request_id
        size = len(P.encode(msg))
        if self.core.needs_limit(size):
            self.core.learn_limit(await self.model_info())
        self.core.check_size(size)             # first: the checks below take time on a huge prompt
        msg = validate_generate(msg)
        data = self.core.open_stream(msg)
        self._start_reader()
        try:
            await self.sock.send(data)
            while not self.core.stream_over(rid):
                await self._wait(("stream", rid), lambda: self.core.has_message(rid))
                yield self.core.next_message(rid)
        finally:
            self._wakers.pop(("stream", rid), None)
            abort = self.core.close_stream(rid)
            if abort is not None and not self.sock.closed:
                await self.sock.send(abort)

    async def complete(self, prompt: str | list[int] | None = None, **kw) -> Completion:
        kw["stream"] = False
        return Completion.from_messages([m async for m in self.generate(prompt, **kw)])

    async def abort(self, request_id: str) -> None:
        await self.sock.send(self.core.abort_message(request_id))

    async def ping(self) -> float:
        t0 = time.monotonic()
        await self._call(P.Ping)
        return time.monotonic() - t0

    async def stats(self) -> dict:
        return (await self._call(P.Stats)).stats

    async def model_info(self) -> dict:
        return (await self._call(P.ModelInfo)).info

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       add_special_tokens: bool = True, chat_options: dict | None = None) -> list[int]:
        return (await self._call(P.Tokenize, prompt=prompt, messages=messages, add_special_tokens=add_special_tokens,
                                 chat_options=chat_options)).token_ids

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return (await self._call(P.Detokenize, token_ids=[int(t) for t in token_ids],
                                 skip_special_tokens=skip_special_tokens)).text

    async def _call(self, cls, **fields) -> Any:
        tag, data = self.core.open_call(cls, **fields)
        self._start_reader()
        try:
            if self.core.needs_limit(len(data)):
                self.core.learn_limit(await self.model_info())
            self.core.check_size(len(data))
            await self.sock.send(data)
            await self._wait(("reply", tag), lambda: self.core.has_reply(tag))
            return self.core.take_reply(tag)
        finally:
            self._wakers.pop(("reply", tag), None)
            self.core.close_call(tag)

    async def _wait(self, where: tuple[str, str], ready: Callable[[], bool]) -> None:
        """Wait until ready(), woken by the reader when it files a message under `where`; ServerTimeout
        once the server has been silent for timeout_s. Each wait is one future and one timer (not
        wait_for, which makes a task per wait: a streamed token is one wait)."""
        loop = asyncio.get_running_loop()
        started, grace = time.monotonic(), True
        while not ready():
            if self._reader is not None and self._reader.done() and not self._reader.cancelled():
                raise ClientError(f"the connection to {self.addr} failed: {self._reader.exception()}")
            left = self.core.silence_left(started, time.monotonic())
            if left > 0:
                grace = True
            else:
                if not grace:
                    raise self.core.timeout_error()
                # NOTE: one more short wait: if the event loop was starved, the reader task has yet to take
                # what arrived meanwhile, and the server was not silent.
                grace, left = False, 0.2
            waiter = self._wakers[where] = loop.create_future()     # ready() was false just now, no await since
            timer = loop.call_later(min(left, 1.0), _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        # after each awaited message, what else has arrived is read at once through a shadow of the socket
        # (the same socket, not awaited): a server step sends a message for each of its requests together
        now = zmq.Socket.shadow(self.sock.underlying)
        while True:
            self._route(await self.sock.recv())
            while True:
                try:
                    data = now.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(data)

    def _route(self, data: bytes) -> None:
        where = self.core.receive(data, time.monotonic())
        waiter = self._wakers.get(where) if where is not None else None
        if waiter is not None:
            _wake(waiter)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
