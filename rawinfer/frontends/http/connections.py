"""The limits of an HTTP connection below the app: a request head must arrive whole within a time and a
size, so that a connection that sends nothing, a head sent a byte at a time (slowloris) or an endless head
is closed instead of being held open.

uvicorn has neither: its keep-alive timeout (`timeout_keep_alive`) runs only after a response, until the
next request's first byte; httptools' parser takes a head of any size (h11's stops at
`h11_max_incomplete_event_size`, 16 KiB by default). The guard is a subclass of uvicorn's protocol class
that watches which request the connection is on (its `cycle`), the same for both parsers. Both refusals
leave one warning line in the log, as every refused request does (errors.log_failure's form: status, route,
reason); a connection that closes or times out before sending a byte was no request and leaves none.
"""

from __future__ import annotations

import asyncio
import logging

MAX_HEAD_BYTES = 64 * 1024          # a request line and headers larger than this: 431 and the connection closed

_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TOO_LARGE_BODY = (b'{"error":{"message":"the request line and headers are over %d bytes","type":'
                   b'"invalid_request_error","param":null,"code":"headers_too_large"}}' % MAX_HEAD_BYTES)
HEAD_KEPT = 256                     # bytes of a head kept to name its route in the log

log = logging.getLogger("rawinfer")


def head_route(head: bytes) -> str:
    """The route ("METHOD PATH") of a request head's first bytes, for the log; an unfinished request line is
    shown as far as it came."""
    line, complete, _ = head.partition(b"\r\n")
    text = line.decode("latin-1")
    words = text.split(" ")
    if len(words) == 3 and words[2].startswith("HTTP/"):
        return f"{words[0]} {words[1].split('?')[0]}"
    text = text if len(text) <= 80 else text[:80] + "..."
    return f"(request line {'unreadable' if complete else 'incomplete'}: {text!r})"


def guarded(base: type[asyncio.Protocol], head_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's protocol class `base`, closing a connection whose request head is not whole head_timeout_s
    after it opened or after its last response (or whose head grows over MAX_HEAD_BYTES)."""

    class Guarded(base):
        def connection_made(self, transport) -> None:
            self._head_timer, self._head_bytes, self._head = None, 0, b""
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            between = cycle is None or cycle.response_complete      # no request in progress: these are a head's
            super().data_received(data)
            if self.cycle is not cycle:          # a head was completed: its request runs
                self._disarm()
            elif between and not self.transport.is_closing():
                self._head_bytes += len(data)
                if len(self._head) < HEAD_KEPT:
                    self._head += data[:HEAD_KEPT - len(self._head)]
                if self._head_bytes > MAX_HEAD_BYTES:
                    log.warning("HTTP 431 %s: the request line and headers are over %d bytes; the connection was "
                                "closed", head_route(self._head), MAX_HEAD_BYTES)
                    self._disarm()
                    self.transport.write(_TOO_LARGE % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY))
                    self.transport.close()
                elif self._head_timer is None:
                    self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout_s, self._late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_bytes, self._head = 0, b""

        def _late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                if self._head:          # a request had begun: refused; a silent connection was none
                    log.warning("HTTP 408 %s: the request head was not whole %g s after the connection opened or "
                                "its last answer (`rawinfer serve --http-read-timeout`); the connection was closed "
                                "without an answer", head_route(self._head), head_timeout_s)
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
