"""One HTTP worker's connection to the engine: an AsyncClient over the ZeroMQ protocol, the model's
description fetched once, readiness from a ping with a short limit, and the engine's refusals and
silences turned into APIErrors."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from rawinfer.frontends.http.errors import APIError, from_engine
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.client import AsyncClient, ClientError, RequestError

READY_PING_S = 1.0      # a serving engine answers a ping from its I/O thread at once, also mid-step


class EngineLink:
    """For one event loop (the worker's)."""

    def __init__(self, addr: str, server_key: str | None = None, timeout_s: float = 60.0):
        self.addr = addr
        self.client = AsyncClient(addr, server_key=server_key, timeout_s=timeout_s)
        self._info: dict | None = None
        self._texts = None

    def close(self) -> None:
        self.client.close()

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
        """The engine request's messages; APIError if it is refused or the engine goes silent. Closing the
        iterator early aborts the request in the engine."""
        try:
            async for msg in self.client.generate(**prompt, params=params, stream=stream, request_id=request_id,
                                                  priority=priority):
                yield msg
        except RequestError as e:
            raise from_engine(e.code, e.message, prompt_param) from None
        except ValueError as e:           # over the engine's message size limit, or a message it would refuse
            raise refused(e, prompt_param) from None
        except ClientError as e:
            raise APIError(503, f"lost the engine at {self.addr}: {e}", code="engine_unavailable") from None

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
