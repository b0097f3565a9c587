"""One HTTP worker process: the app under uvicorn on a listening socket inherited from `rawinfer serve`.

Started by launcher.py as `python -m rawinfer.frontends.http.worker` with its settings in the environment
(RAWINFER_HTTP_WORKER, JSON: so the API key is not on the command line). It exits when its parent does,
however the parent ended, so no worker outlives the engine it fronts. Its log lines (refused requests,
ignored fields) go to the stderr it shares with `rawinfer serve`, in the same format.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time

ENV = "RAWINFER_HTTP_WORKER"


def _follow_parent(parent: int) -> None:
    """SIGTERM to this process once the parent is gone (re-parented processes see another ppid)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    import uvicorn

    from rawinfer.frontends.http.app import create_app
    from rawinfer.frontends.http.config import HTTPConfig
    from rawinfer.frontends.http.connections import guarded
    from rawinfer.frontends.server.activity import log_with_time
    settings = json.loads(os.environ.pop(ENV))
    log_with_time(f"rawinfer http {os.getpid()}", settings.get("level", logging.INFO))
    threading.Thread(target=_follow_parent, args=(settings["parent"],), daemon=True).start()
    cfg = HTTPConfig(**settings["config"])
    fast = {}
    try:
        import uvloop  # noqa: F401
        fast["loop"] = "uvloop"
    except ImportError:
        pass
    config = uvicorn.Config(create_app(cfg), log_level=settings.get("log_level", "warning"),
                            access_log=False, timeout_graceful_shutdown=3, lifespan="on",
                            http=guarded(_protocol_class(), cfg.read_timeout_s), timeout_keep_alive=cfg.keep_alive_s,
                            **fast)
    uvicorn.Server(config).run(sockets=[inherited_socket(settings["fd"])])
    return 0


def _protocol_class() -> type:
    """uvicorn's HTTP protocol on httptools' parser when it is installed, else on h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket at descriptor fd, as the TCP socket it is. Not uvicorn's Config(fd=...): that
    wraps the descriptor as an AF_UNIX socket, so the event loop treats each connection as a Unix one and
    leaves Nagle's algorithm on; on a kept-alive connection each streamed response's second write then
    waited for the client's delayed ACK (Linux's delayed-ACK timer) in every request after a connection's first."""
    return socket.socket(fileno=fd)          # family, type and protocol read from the descriptor


if __name__ == "__main__":
    sys.exit(main())
