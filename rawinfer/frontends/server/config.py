"""What a server is configured with: its endpoint, its keys, and the limits and intervals of its loop."""

from __future__ import annotations

from dataclasses import dataclass

from rawinfer.frontends.server import protocol as P


@dataclass
class ServerConfig:
    bind: str = P.DEFAULT_ADDR
    curve_secret_key_file: str | None = None     # the server's certificate with its secret key (CurveZMQ)
    curve_client_keys_dir: str | None = None     # if set, only clients whose public keys are here get in
    insecure: bool = False                       # allow a non-loopback bind without CurveZMQ
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_interval_s: float = 1.0
    zmtp_heartbeat_timeout_s: float = 10.0       # a connection silent this long is closed by ZeroMQ
    max_requests_in_flight: int = 4096
    max_messages_per_drain: int = 1024           # bounds the time taken from the engine by one burst
    shutdown_linger_s: float = 2.0               # how long the final `abort` messages may take to leave
