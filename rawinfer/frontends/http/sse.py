"""Server-sent events: the `data: {json}` framing, and an ASGI response that streams events and notices a
client that goes away, so that its requests are aborted in the engine at once (not at the next token)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class EventStream:
    """A 200 text/event-stream response of `events`. When the client disconnects, `on_disconnect` runs
    (it aborts the engine requests, which ends `events`) and nothing more is sent; `events` is closed
    whatever happens, so its own cleanup runs before the response ends."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]]):
        self.events, self.on_disconnect = events, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            await self.on_disconnect()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for data in self.events:
                if gone.is_set():
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                     # the connection broke under a send
            await self.on_disconnect()
        finally:
            watcher.cancel()
            await self.events.aclose()
