"""Starting the HTTP front end beside `rawinfer serve`'s engine: the security rule for the HTTP host, the
listening socket (bound by the parent, before the model loads, so a busy port fails at once), and the
worker processes that share it and are stopped with the server.

Each worker reaches the engine through the ZeroMQ endpoint like any client, so tokenising, JSON and
SSE work never run on the engine's threads, and `--api-workers N` spreads them over N processes.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys

from rawinfer.frontends.http.worker import ENV

log = logging.getLogger("rawinfer")


class LaunchError(ValueError):
    """An HTTP front end that cannot start: an unsafe host, a busy port, a bad setting."""


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_http_security(host: str, api_key: str | None, insecure: bool) -> None:
    if not is_loopback_host(host) and not api_key and not insecure:
        raise LaunchError(f"--http-host {host} is not a loopback address: anyone on the network could use the "
                          "engine; give --api-key KEY (clients send `Authorization: Bearer KEY`), or --insecure to "
                          "accept the risk")


def bind_http(host: str, port: int) -> socket.socket:
    """The listening socket, inheritable by the workers; LaunchError when it cannot be bound."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise LaunchError(f"cannot use --http-host {host!r} ({e.strerror or e}); give an address of this machine") \
            from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        busy = " (is another server running there?)" if e.errno == 98 else ""
        raise LaunchError(f"cannot bind HTTP on {host}:{port}: {e.strerror}{busy}; choose another --http-port, "
                          "or --no-http") from None
    sock.set_inheritable(True)
    return sock


def connect_addr(bind: str) -> str:
    """Where a local client reaches a server bound at `bind` (a wildcard host means this machine)."""
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    if scheme == "tcp" and host in ("[::]", "::"):
        return f"tcp://[::1]:{port}"
    return bind


class Workers:
    """The worker processes of one HTTP socket."""

    def __init__(self, sock: socket.socket, count: int, config: dict, level: int = logging.INFO):
        """config: the fields of the workers' HTTPConfig (app.py), as JSON; level: the workers' log level
        (the serve process's, so -q and -v apply to them too; uvicorn's own lines only with -v)."""
        self.sock, self.procs = sock, []
        settings = {"fd": sock.fileno(), "config": config, "parent": os.getpid(), "level": level,
                    "log_level": "info" if level <= logging.DEBUG else "warning"}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = {**os.environ, ENV: json.dumps(settings),
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            for _ in range(count):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "rawinfer.frontends.http.worker"],
                                                   pass_fds=(sock.fileno(),), env=env, stdin=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every worker (uvicorn closes the socket and finishes what is open), then SIGKILL after
        timeout_s."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.sock.close()
