"""Server-sent events: the `data: {json}` framing, and an ASGI response that streams events and notices a
client that goes away, so that its requests are aborted in the engine at once (not at the next token)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

log = logging.getLogger("rawinfer")

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class EventStream:
    """A 200 text/event-stream response of `events`. The sending runs in a task of its own; when the client
    disconnects that task is cancelled, which closes `events` where it waits, and closing it aborts the
    engine requests behind it (the client library sends `abort` for a stream left before its end). A stream
    left before its end leaves one line in the log, as a non-streaming request whose client went away does."""

    def __init__(self, events: AsyncIterator[bytes]):
        self.events = events

    async def _send_all(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()

    @staticmethod
    async def _disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope, receive, send) -> None:
        sender = asyncio.create_task(self._send_all(send))
        watcher = asyncio.create_task(self._disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not sender.done():
                log.info("HTTP 499 %s %s: the client went away during the stream; its request was aborted",
                         scope["method"], scope["path"])
        finally:
            for task in (watcher, sender):
                if not task.done():
                    task.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
