"""The HTTP workers' listening socket: taken as the TCP socket it is, so that the event loop turns Nagle's
algorithm off on every connection. (Handed to uvicorn as a bare descriptor it was wrapped as an AF_UNIX
socket, Nagle stayed on, and on a kept-alive connection each streamed response's first token waited for
the client's delayed ACK (docs/benchmarks.md) in every request after a connection's first.)"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from rawinfer.frontends.http.launcher import bind_http
from rawinfer.frontends.http.worker import inherited_socket


def nodelay_of_accepted(listener: socket.socket, new_loop) -> int:
    """TCP_NODELAY of the server side of one connection accepted by `new_loop()`'s create_server."""
    seen = []

    class Record(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def one():
        server = await asyncio.get_running_loop().create_server(Record, sock=listener)
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    loop = new_loop()
    try:
        loop.run_until_complete(one())
    finally:
        loop.close()
    assert len(seen) == 1
    return seen[0]


def loops():
    out = [("asyncio", asyncio.new_event_loop)]
    try:
        import uvloop
        out.append(("uvloop", uvloop.new_event_loop))       # what uvicorn runs where it is installed
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("name,new_loop", loops(), ids=[n for n, _ in loops()])
def test_every_http_connection_has_nagle_off(name, new_loop):
    bound = bind_http("127.0.0.1", 0)
    try:
        sock = inherited_socket(os.dup(bound.fileno()))      # as a worker gets it: a descriptor number
        assert (sock.family, sock.type) == (socket.AF_INET, socket.SOCK_STREAM)
        assert nodelay_of_accepted(sock, new_loop) != 0
    finally:
        bound.close()


def test_the_descriptor_wrapped_as_a_unix_socket_keeps_nagle_on():
    """The way uvicorn's Config(fd=...) wraps it, on asyncio's loop: what the test above guards against."""
    bound = bind_http("127.0.0.1", 0)
    try:
        wrong = socket.fromfd(bound.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        assert nodelay_of_accepted(wrong, asyncio.new_event_loop) == 0
    finally:
        bound.close()
