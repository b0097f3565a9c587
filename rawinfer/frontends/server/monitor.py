"""Whether the peer of a connecting socket closed the connection, from ZeroMQ's socket monitor.

A process that dies closes its TCP connections at once, and the monitor reports EVENT_DISCONNECTED then,
long before missed heartbeats would tell. The replica router and the decode side of disaggregation watch
their links this way, beside their heartbeats (which also catch a peer that hangs with its socket open).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message


def watch(sock: zmq.Socket) -> zmq.Socket:
    """The monitor of `sock`'s disconnections (call before connect)."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def disconnected(monitor: zmq.Socket) -> bool:
    """Whether a disconnection was reported since the last call (reads every pending event, never waits)."""
    seen = False
    while monitor.poll(0):
        seen = recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED or seen
    return seen


def unwatch(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop monitoring (before `sock` is closed)."""
    sock.disable_monitor()
    monitor.close(linger=0)
