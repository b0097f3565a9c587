"""The router's record of each replica (its socket, its state, its requests) and of each request it routed.

A replica's life as the router sees it:

    STARTING --ReplicaUp--> CONNECTING --first pong--> UP --silent for lost_after_s--> LOST --ReplicaUp--> CONNECTING
                                                        |                                (Ray restarted it)
                                                        +--scale down--> DRAINING --no requests left--> STOPPING

Only UP replicas are routed to. A LOST replica's requests are retried elsewhere when nothing of them has
reached their client yet, and end with an error final otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from rawinfer.frontends.cluster.routing import PrefixRecord
from rawinfer.frontends.server import monitor as M
from rawinfer.frontends.server import protocol as P

STARTING, CONNECTING, UP, LOST, DRAINING, STOPPING = "starting", "connecting", "up", "lost", "draining", "stopping"


@dataclass
class Routed:
    """One client request as the router tracks it, from arrival to its last final."""
    internal: str                    # the id the replica knows it by (unique for the router's life)
    client: bytes
    request_id: str                  # the client's id
    msg: P.Generate                  # kept to resend it when its replica is lost before anything streamed
    n: int                           # finals that end it
    hashes: list[bytes]              # its prompt's piece hashes (routing.py)
    arrived: float
    slot: int | None = None          # its replica; None while waiting for one
    streamed: bool = False           # something of it reached the client: it can no longer be retried
    attempts: int = 0
    finished_indexes: set = field(default_factory=set)   # samples whose final was passed on


@dataclass
class Link:
    """One replica slot."""
    slot: int
    record: PrefixRecord
    state: str = STARTING
    endpoint: str | None = None
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None              # ZeroMQ's events of `sock`: a dropped connection at once
    facts: dict = field(default_factory=dict)      # pid, node, ... from the pool
    requests: set = field(default_factory=set)     # internal ids routed here and not finished
    last_heard: float = 0.0
    last_probe: float = 0.0
    since: float = field(default_factory=time.monotonic)   # when it entered its state
    stats: dict = field(default_factory=dict)      # its last stats reply
    routed_total: int = 0
    lost_total: int = 0
    fresh_asked: int = 0                           # stats asked for a client's `stats`, and answered
    fresh_got: int = 0

    def set_state(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()

    @property
    def kv_usage(self) -> float:
        v = self.stats.get("kv_usage")
        return float(v) if isinstance(v, (int, float)) else 0.0

    def connect(self, ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None) -> None:
        """A DEALER to the replica at `endpoint`; curve = (server public key, our public, our secret)."""
        self.disconnect()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)              # never drop what a replica sends
        sock.setsockopt(zmq.SNDHWM, 0)              # requests queue while a connection is being made
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
        self.monitor = M.watch(sock)
        sock.connect(endpoint)
        self.sock, self.endpoint = sock, endpoint
        self.last_heard = self.last_probe = time.monotonic()

    def disconnect(self) -> None:
        if self.sock is not None:
            M.unwatch(self.sock, self.monitor)
            self.sock.close(linger=0)
            self.sock = self.monitor = None

    def dropped(self) -> bool:
        """Whether ZeroMQ saw the connection to the replica close (its process died or closed the socket)."""
        return self.monitor is not None and M.disconnected(self.monitor)

    def send(self, msg) -> None:
        if self.sock is not None:
            self.sock.send(P.encode(msg), zmq.NOBLOCK)

    def view(self) -> dict:
        """This replica in the router's `stats`."""
        return {"state": self.state, "endpoint": self.endpoint, **self.facts, "requests_in_flight": len(self.requests),
                "requests_routed": self.routed_total, "times_lost": self.lost_total,
                "prefix_record_pieces": len(self.record), "stats": {k: v for k, v in self.stats.items()
                                                                    if k != "metrics"}}
