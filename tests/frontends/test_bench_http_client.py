"""The HTTP benchmark's own streaming reader (bench/http_load.py) against a hand-written server on loopback:
chunked bodies whose framing and events are split anywhere across writes, CRLF event lines, an error
status with a plain body, a connection that closes inside the body, a server that stops answering."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rawinfer.frontends.bench import http_load as H


class Rec:
    def __init__(self, max_tokens: int = 3):
        self.max_tokens, self.token_times, self.message_times = max_tokens, [], []
        self.error = self.finished = self.finish_reason = self.output_tokens = self.sent = None


class Bar:
    def update(self, n: int) -> None:
        pass


def sse(*events: dict, crlf: bool = False) -> bytes:
    nl = b"\r\n" if crlf else b"\n"
    return b"".join(b"data: " + json.dumps(e).encode() + nl + nl for e in events) + b"data: [DONE]" + nl + nl


STREAM = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
             {"choices": [], "usage": {"completion_tokens": 2}})


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


async def serve_once(reply: bytes, pieces: int, close: bool = True):
    """A server that reads one request, checks it, and writes `reply` in `pieces` writes."""
    seen = {}

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen["head"], seen["body"] = head, json.loads(await reader.readexactly(length))
        step = max(1, len(reply) // pieces)
        for i in range(0, len(reply), step):
            writer.write(reply[i:i + step])
            await writer.drain()
            await asyncio.sleep(0.001)
        if close:
            writer.close()
        else:
            await asyncio.sleep(2)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def run_one(reply: bytes, pieces: int = 7, close: bool = True, timeout: float = 10.0) -> tuple[Rec, dict]:
    async def main():
        server, port, seen = await serve_once(reply, pieces, close)
        rec = Rec()
        async with server:
            await H.one_request(httpx.URL(f"http://127.0.0.1:{port}/"), "k", "m", rec, [1, 2], 0.0, 0.0, Bar(),
                                timeout)
        return rec, seen
    return asyncio.run(main())


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("size,pieces,crlf", [(1, 3, False), (5, 11, True), (1000, 1, False), (7, 200, True)])
def test_chunked_events_split_anywhere_are_read_whole(size, pieces, crlf):
    stream = STREAM if not crlf else sse({"choices": [{"text": "a"}]},
                                         {"choices": [{"text": "b", "finish_reason": "length"}]},
                                         {"choices": [], "usage": {"completion_tokens": 2}}, crlf=True)
    rec, seen = run_one(OK_HEAD + chunked(stream, size), pieces)
    assert rec.error is None and len(rec.token_times) == 2
    assert rec.finish_reason == "length" and rec.output_tokens == 2
    assert seen["head"].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k" in seen["head"]
    assert seen["body"]["prompt"] == [1, 2] and seen["body"]["stream"] is True


def test_an_error_status_keeps_its_body():
    body = b'{"error": {"message": "no such model"}}'
    rec, _ = run_one(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    assert rec.error == "HTTP 404: " + body.decode()


def test_a_body_cut_short_and_a_silent_server_are_errors():
    rec, _ = run_one(OK_HEAD + chunked(STREAM, 9)[:40])
    assert rec.error.startswith("EOFError") and rec.finished is not None
    rec, _ = run_one(OK_HEAD + chunked(STREAM, 9)[:40], close=False, timeout=0.3)
    assert rec.error.startswith("TimeoutError")
