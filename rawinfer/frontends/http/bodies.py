"""The request body limits: its size and its read timeout, enforced while a body arrives (an ASGI middleware,
before anything parses it; body_parsing.py parses it after)."""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from rawinfer.frontends.http.errors import APIError, log_failure

DRAIN_S = 2.0                       # how long an oversized body is read and dropped before its 413 is sent, so a
                                    # client that sends it whole before reading can read the answer

_BODY_METHODS = ("POST", "PUT", "PATCH")


class BodyLimit:
    """ASGI middleware: reads a request's whole body before the app runs, refusing it with 413 once it is over
    `limit` bytes (at once when its Content-Length says so) and with 408 when it stops arriving for
    `read_timeout_s`; the app then reads the body from memory. Refusals close the connection."""

    def __init__(self, app, limit: int, read_timeout_s: float):
        self.app, self.limit, self.read_timeout_s = app, limit, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            if headers.get(b"expect", b"").lower() != b"100-continue":     # it sends the body unasked: drop it
                await self._drain(receive)
            return await self._refuse(scope, send, self._too_large(f"{int(declared)} bytes"))
        chunks, total = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await self._refuse(scope, send, APIError(
                    408, f"the request body stopped arriving for {self.read_timeout_s:g} s (`rawinfer serve "
                    "--http-read-timeout`); send it without pauses", code="request_timeout"))
            if message["type"] == "http.disconnect":
                return                                  # nobody to answer
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.limit:
                await self._drain(receive)
                return await self._refuse(scope, send, self._too_large(f"over {self.limit} bytes"))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()                 # after the body: the disconnect, for streams
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body is {size}, more than this server takes ({self.limit} bytes, `rawinfer "
                        "serve --max-request-body`); send a smaller request", code="request_too_large")

    async def _drain(self, receive) -> None:
        """Read and drop the rest of a refused body for up to DRAIN_S."""
        loop = asyncio.get_running_loop()
        end = loop.time() + DRAIN_S
        try:
            while True:
                message = await asyncio.wait_for(receive(), max(0.0, end - loop.time()))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
        except asyncio.TimeoutError:
            return

    @staticmethod
    async def _refuse(scope, send, e: APIError) -> None:
        log_failure(e, f"{scope['method']} {scope['path']}")
        response = JSONResponse(e.body(), status_code=e.status, headers={"connection": "close"})
        await response(scope, _nothing, send)


async def _nothing():
    return {"type": "http.disconnect"}
