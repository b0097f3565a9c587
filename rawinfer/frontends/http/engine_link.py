"""One HTTP worker's connection to the engine: an AsyncClient over the ZeroMQ protocol, the model's
description fetched once, readiness from a ping with a short limit, the engine's refusals and silences
turned into APIErrors, and the requests in flight failed when the engine's connection drops."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from rawinfer.frontends.http.errors import APIError, from_engine
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.client import AsyncClient, ClientError, RequestError

READY_PING_S = 1.0      # a serving engine answers a ping from its I/O thread at once, also mid-step


class EngineLink:
    """For one event loop (the worker's)."""

    def __init__(self, addr: str, server_key: str | None = None, timeout_s: float = 60.0):
        self.addr = addr
        self.client = AsyncClient(addr, server_key=server_key, timeout_s=timeout_s)
        self._info: dict | None = None
        self._texts = None
        self._open: set[str] = set()                    # request ids in flight
        self._lost: set[str] = set()                    # in flight when the engine's connection dropped
        self._watcher: asyncio.Task | None = None
        self._dropped = False                           # the connection dropped and is not back yet

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self.client.close()

    async def _watch(self) -> None:
        """Fail the requests in flight when the connection to the engine drops (its process ended, or it
        restarted): nothing more will come for them, and waiting for the silence timeout would hold their
        clients for a minute, or cut their streams when this worker stops with the engine."""
        monitor = self.client.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        monitor.setsockopt(zmq.LINGER, 0)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                self._dropped = event == zmq.EVENT_DISCONNECTED
                if self._dropped:
                    self._drop_all()
        finally:
            monitor.close()

    def _drop_all(self) -> None:
        """An error filed with the client for each request in flight, after what arrived for it before: its
        reader finds it at its next wait's wake-up (within a second), and no token pays for the check."""
        now = time.monotonic()
        for rid in self._open - self._lost:
            self._lost.add(rid)
            self.client.core.receive(P.encode(P.Error(P.ErrorCode.SHUTTING_DOWN.value, "connection lost", rid)), now)

    def _gone(self) -> APIError:
        return APIError(503, f"lost the engine at {self.addr}: its connection closed (it stopped or restarted); retry "
                        "later (GET /health says when it is ready)", code="engine_unavailable")

    async def ready(self) -> bool:
        """Whether the engine answers now: it binds only once loaded and warm, and stops answering when
        it shuts down. A replica router answers pings before any replica serves: until one has, it has no
        model to describe, so the model's description is asked for too (once: it is kept)."""
        try:
            await asyncio.wait_for(self.client.ping(), READY_PING_S)
            await self.info()
        except (asyncio.TimeoutError, ClientError, APIError):
            return False
        return True

    async def info(self) -> dict:
        """model_info (fetched once: it does not change while the engine runs); 503 while unreachable."""
        if self._info is None:
            try:
                self._info = await self._control(self.client.model_info)
            except RequestError as e:           # a replica router with no replica serving yet
                raise APIError(503, f"the engine at {self.addr} is not ready: {e.message}; retry later (GET "
                               "/health says when it is ready)", code="engine_unavailable") from None
        return self._info

    async def token_texts(self):
        """The TokenTexts of the served model (loaded on first use)."""
        if self._texts is None:
            from rawinfer.frontends.http.logprobs import TokenTexts
            self._texts = TokenTexts((await self.info()).get("model_path"))
        return self._texts

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_special_tokens: bool = True, prompt_param: str = "prompt",
                       chat_options: dict | None = None) -> list[int]:
        try:
            return await self._control(lambda: self.client.tokenize(prompt, messages=messages,
                                                                    add_special_tokens=add_special_tokens,
                                                                    chat_options=chat_options))
        except RequestError as e:
            raise from_engine(e.code, e.message, prompt_param) from None
        except ValueError as e:           # over the engine's message size limit, or a message it would refuse
            raise refused(e, prompt_param) from None

    async def detokenize(self, token_ids: list[int]) -> str:
        try:
            return await self._control(lambda: self.client.detokenize(token_ids))
        except RequestError as e:
            raise from_engine(e.code, e.message, "tokens") from None
        except ValueError as e:
            raise refused(e, "tokens") from None

    async def stats(self) -> dict:
        return await self._control(self.client.stats)

    async def _control(self, call):
        try:
            return await asyncio.wait_for(call(), 5.0)
        except RequestError:
            raise
        except (asyncio.TimeoutError, ClientError) as e:
            raise APIError(503, f"the engine at {self.addr} does not answer ({type(e).__name__}); it may still be "
                           "loading or shutting down: retry later (GET /health says when it is ready)",
                           code="engine_unavailable") from None

    async def generate(self, request_id: str, prompt: dict, params: dict, stream: bool, priority: int,
                       prompt_param: str) -> AsyncIterator[P.Chunk | P.Final]:
        """The engine request's messages; APIError if it is refused, the engine goes silent or its connection
        drops. Closing the iterator early aborts the request in the engine."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        if self._dropped:                       # until the engine is back, nothing sent would be answered
            raise self._gone()
        self._open.add(request_id)
        try:
            async for msg in self.client.generate(**prompt, params=params, stream=stream, request_id=request_id,
                                                  priority=priority):
                yield msg
        except RequestError as e:
            if request_id in self._lost:
                raise self._gone() from None
            raise from_engine(e.code, e.message, prompt_param) from None
        except ValueError as e:           # over the engine's message size limit, or a message it would refuse
            raise refused(e, prompt_param) from None
        except ClientError as e:
            raise APIError(503, f"lost the engine at {self.addr}: {e}", code="engine_unavailable") from None
        finally:
            self._open.discard(request_id)
            self._lost.discard(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """Stop requests in the engine (their blocks are freed; each ends with an `abort` final)."""
        for rid in request_ids:
            try:
                await self.client.abort(rid)
            except Exception:            # the socket is closing: the engine drops the requests with us
                pass


def refused(e: ValueError, param: str) -> APIError:
    """The client library's refusal before sending (ValueError): 413 for a message over the engine's size
    limit, else 400 for a message the engine would refuse (naming param)."""
    if "limit" in str(e):
        return APIError(413, str(e), param=param, code="request_too_large")
    return APIError(400, str(e), param=param, code="invalid_value")
