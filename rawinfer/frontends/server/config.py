"""What a server is configured with: its endpoint, its keys, and the limits and intervals of its loop; each
field declared once (settings.option), the ones with a flag offered by `rawinfer serve`."""

from __future__ import annotations

from dataclasses import dataclass

from rawinfer.config import is_int, is_number
from rawinfer.frontends.server import protocol as P
from rawinfer.settings import SECONDS, option, optional, size_argument

_count = {"flag": None, "check": lambda v: is_int(v) and v >= 1, "what": "a positive integer"}
_path = {"check": optional(lambda v: isinstance(v, str)), "what": "a path or None"}


@dataclass
class ServerConfig:
    bind: str = option(P.DEFAULT_ADDR, parse=str, metavar="ENDPOINT",
                       check=lambda v: isinstance(v, str) and "://" in v, what="an endpoint such as tcp://HOST:PORT",
                       help="tcp://HOST:PORT or ipc://PATH")
    curve_secret_key_file: str | None = option(
        None, flag="--curve-secret-key", parse=str, metavar="FILE", **_path,
        help="encrypt with CurveZMQ using this server.key_secret (from `rawinfer keygen`); required for a "
             "non-loopback --bind (default: none, loopback only)")
    curve_client_keys_dir: str | None = option(
        None, flag="--curve-client-keys", parse=str, metavar="DIR", **_path,
        help="with --curve-secret-key: admit only clients whose public .key files are in DIR (default: any client "
             "that knows the server key)")
    insecure: bool = option(False, check=lambda v: isinstance(v, bool), what="true or false",
                            help="allow a non-loopback --bind without CurveZMQ, and an HTTP --host other than a "
                                 "loopback one without --api-key (anyone who can reach it can use it)")
    max_message_bytes: int = option(P.DEFAULT_MAX_MESSAGE_BYTES, flag="--max-message-size", parse=size_argument,
                                    metavar="SIZE", check=lambda v: is_int(v) and v >= 1, what="a positive size",
                                    help="a client that sends a larger message is dropped (default: 1MiB)")
    heartbeat_interval_s: float = option(1.0, flag="--heartbeat-interval", **SECONDS,
                                         help="seconds between heartbeats to clients with requests in flight")
    zmtp_heartbeat_timeout_s: float = option(
        10.0, flag="--client-timeout", **SECONDS,
        help="seconds a connected client may fail to answer ZMTP heartbeats before it counts as gone; ZeroMQ then "
             "closes the connection")
    log_interval_s: float = option(10.0, flag="--log-interval", **SECONDS,
                                   help="seconds between the log's throughput / KV / queue lines; each finished "
                                        "request also gets a line (-q hides both)")
    max_requests_in_flight: int = option(4096, **_count, help="requests the server holds at once")
    max_messages_per_drain: int = option(1024, **_count, help="messages read in one burst before sending again")
    max_read_burst_s: float = option(0.02, flag=None, check=lambda v: is_number(v) and v > 0,
                                     what="a positive number", help="the time one burst of reads may take")
    send_queue_messages: int = option(64, **_count,
                                      help="ZeroMQ's queue per client (small: it is what a cut connection loses "
                                           "unseen); beyond it messages wait in the server")
    max_backlog_messages: int = option(100_000, **_count,
                                       help="a client this far behind counts as gone (not reading)")
    shutdown_linger_s: float = option(2.0, flag=None, check=lambda v: is_number(v) and v >= 0,
                                      what="a number of seconds >= 0",
                                      help="how long the final `abort` messages may take to leave")
