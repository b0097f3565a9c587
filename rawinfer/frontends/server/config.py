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
    max_messages_per_drain: int = 1024           # messages read in one burst before sending again
    max_read_burst_s: float = 0.02               # ... and the time one burst may take
    send_queue_messages: int = 64                # ZeroMQ's queue per client (small: it is what a cut
                                                 # connection loses unseen); beyond it messages wait here
    max_backlog_messages: int = 100_000          # a client this far behind counts as gone (not reading)
    log_interval_s: float = 10.0                 # the periodic throughput / KV / queue line
    shutdown_linger_s: float = 2.0               # how long the final `abort` messages may take to leave
