"""Reaching a `rawinfer serve` from the command line: a ping with a short limit first, so that a missing
server is reported in about a second instead of after the request's silence limit, then the Client.

A server that is still loading its model has not bound its endpoint yet and counts as missing. The
endpoint probe of `rawinfer serve` (probe_endpoint) is the other side: it refuses an endpoint another
server holds before the model is loaded.
"""

from __future__ import annotations

import os
import socket

from rawinfer.frontends.options import EXIT_FAILED, CLIError

PING_TIMEOUT_S = 1.5     # a loopback or LAN server answers a ping in milliseconds; its loop answers between steps


def ping_server(addr: str, server_key=None, client_key_file: str | None = None,
                timeout_s: float = PING_TIMEOUT_S) -> float:
    """Round-trip seconds of one ping, or a CLIError (exit status 1) saying that nothing answers at addr."""
    from rawinfer.frontends.client.client import Client, ClientError, ServerTimeout
    try:
        with Client(addr, server_key=server_key, client_key_file=client_key_file, timeout_s=timeout_s) as c:
            return c.ping()
    except ServerTimeout:
        hint = ", and that --server-key is its public key" if server_key else ""
        raise CLIError(f"no rawinfer server answered at {addr} within {timeout_s:g} s: start one with `rawinfer "
                       f"serve` (it answers once its model is loaded), or check --addr{hint}", EXIT_FAILED) from None
    except ClientError as e:
        raise CLIError(f"cannot talk to the server at {addr}: {e}", EXIT_FAILED) from None
    except Exception as e:          # zmq refuses a malformed endpoint: one line, not a traceback
        if type(e).__name__ == "ZMQError":
            raise CLIError(f"cannot connect to {addr!r} ({e}); give --addr as tcp://HOST:PORT or ipc://PATH") \
                from None
        raise


def probe_endpoint(bind: str) -> None:
    """CLIError unless `bind` can be bound now: checked before `rawinfer serve` loads its model."""
    import zmq
    scheme, _, rest = bind.partition("://")
    if scheme == "ipc":
        # NOTE: no test bind here: zmq replaces whatever is at the path (a live server's socket, a regular
        # file) and leaves a socket file of the umask's mode; the server's own checks are the ones to run
        from rawinfer.frontends.server.ipc import check_ipc_path   # (abstract sockets: refused before this)
        try:
            check_ipc_path(rest)
        except OSError as e:
            raise CLIError(f"cannot bind {bind}: {e}") from None
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(bind)
    except zmq.ZMQError as e:
        busy = " (is another `rawinfer serve` running there?)" if e.errno == zmq.EADDRINUSE else ""
        reason = str(e.strerror).split(" (addr=")[0]          # pyzmq appends the address, named here already
        raise CLIError(f"cannot bind {bind}: {reason}{busy}; choose another --bind address") from None
    finally:
        sock.close(linger=0)
        ctx.term()
