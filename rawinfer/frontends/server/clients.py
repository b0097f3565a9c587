"""The I/O thread's record of every client with something outstanding: its requests in flight, the messages
ZeroMQ would not take yet, and the finals not yet known to have reached it; and the counters of how each
request ended.

Why finals wait to be confirmed: ZeroMQ reports no delivery. When a connection closes (a client that
stopped reading is cut off by the ZMTP heartbeat), what still sits in ZeroMQ's queue to it is dropped
unseen; what the kernel holds still arrives. So ZeroMQ's queue per client is kept small, and what does
not fit waits here, where it is known. A final counts as delivered once ZeroMQ has taken it and then, for
`grace_s` (a heartbeat interval), has taken every further message for that client while the connection
stayed up: a client that stopped reading fills the small queue within that time, and a full queue
restarts the clock. If the connection closes first, or the final never left this table's queue, the
request is counted as aborted because its client went away, never both.

No socket here: the table sends through `try_send(client, data)`, which answers SENT, FULL (ZeroMQ's queue
to that client is full) or GONE (no connection for that routing id).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

SENT, FULL, GONE, STALLED = "sent", "full", "gone", "stalled"


@dataclass
class Counters:
    requests_received: int = 0
    requests_rejected: int = 0            # refused with an `error`: they never ran
    requests_completed: int = 0           # ended with finals known delivered (any finish reason)
    requests_aborted_by_client: int = 0   # `abort` messages taken (those requests count as completed too)
    requests_aborted_vanished: int = 0    # their client went away before their finals were known delivered
    clients_vanished: int = 0
    messages_invalid: int = 0


@dataclass
class Handed:
    """A request whose last final ZeroMQ has taken (or queued here), not yet known delivered."""
    engine_id: str
    request_id: str
    at: float


@dataclass
class ClientState:
    now: float
    requests: dict[str, str] = field(default_factory=dict)   # the client's request id -> engine id
    outbox: deque = field(default_factory=deque)             # encoded messages ZeroMQ refused, in order
    handed: deque = field(default_factory=deque)             # of Handed, oldest first
    last_sent: float = 0.0
    calm_since: float = 0.0             # since then ZeroMQ has taken every message for this client
    stuck_since: float | None = None    # the outbox has not moved since

    def __post_init__(self):
        self.last_sent = self.calm_since = self.now

    @property
    def idle(self) -> bool:
        return not self.requests and not self.outbox and not self.handed


class ClientTable:
    def __init__(self, try_send: Callable[[bytes, bytes], str], grace_s: float, max_outbox: int):
        self._try_send, self.grace_s, self.max_outbox = try_send, grace_s, max_outbox
        self.clients: dict[bytes, ClientState] = {}
        self._owner: dict[str, tuple[bytes, str]] = {}      # engine id -> (client, its request id)
        self.cancelling: set[str] = set()                    # engine ids of vanished clients, not freed yet
        self.aborting: set[str] = set()                      # engine ids whose client asked to abort them
        self.counts = Counters()

    # ---- requests -----------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests taken in and not ended (those of vanished clients until the engine has freed them)."""
        return len(self._owner) + len(self.cancelling)

    @property
    def unconfirmed(self) -> int:
        return sum(len(c.handed) for c in self.clients.values())

    @property
    def clients_with_requests(self) -> int:
        return sum(1 for c in self.clients.values() if c.requests)

    def lookup(self, client: bytes, request_id: str) -> str | None:
        st = self.clients.get(client)
        return st.requests.get(request_id) if st else None

    def owner(self, engine_id: str) -> tuple[bytes, str] | None:
        return self._owner.get(engine_id)

    def engine_ids(self) -> list[str]:
        return list(self._owner)

    def add(self, client: bytes, request_id: str, engine_id: str, now: float) -> None:
        st = self.clients.setdefault(client, ClientState(now))
        st.requests[request_id] = engine_id
        self._owner[engine_id] = (client, request_id)

    def end(self, engine_id: str, delivered_final: bool, now: float) -> str | None:
        """The request's last message was just sent or queued: a final (then it awaits confirmation) or the
        error that refused it. Its request id, or None if it was not in flight."""
        owner = self._owner.pop(engine_id, None)
        self.aborting.discard(engine_id)
        if owner is None:
            return None
        client, request_id = owner
        st = self.clients[client]
        st.requests.pop(request_id, None)
        if delivered_final:
            st.handed.append(Handed(engine_id, request_id, now))
        else:
            self.counts.requests_rejected += 1
            self._forget_if_idle(client)
        return request_id

    def confirm(self, now: float) -> int:
        """Count as completed the finals that have had grace_s of calm; how many."""
        done = 0
        for client, st in list(self.clients.items()):
            if st.outbox:
                continue
            start = st.calm_since
            while st.handed and now - max(st.handed[0].at, start) >= self.grace_s:
                st.handed.popleft()
                done += 1
            self._forget_if_idle(client)
        self.counts.requests_completed += done
        return done

    def drop(self, client: bytes) -> tuple[list[str], list[str]]:
        """Forget a client that went away: (engine ids still running, for the engine to abort; the client's
        request ids of every request counted aborted). Its running requests stay in `cancelling` until the
        engine has freed them (cancelled())."""
        st = self.clients.pop(client, None)
        if st is None:
            return [], []
        running = list(st.requests.values())
        for engine_id in running:
            self._owner.pop(engine_id, None)
        self.aborting.difference_update(running)
        self.cancelling.update(running)
        lost = list(st.requests) + [h.request_id for h in st.handed]
        if lost:
            self.counts.clients_vanished += 1
            self.counts.requests_aborted_vanished += len(lost)
        return running, lost

    def cancelled(self, engine_id: str) -> None:
        self.cancelling.discard(engine_id)

    # ---- sending ------------------------------------------------------------------------------------------
    def send(self, client: bytes, data: bytes, now: float) -> str:
        """Send to a client in order: behind what is already queued here, else straight to ZeroMQ (queued
        here if its queue is full): SENT, FULL (queued here), GONE (no connection) or STALLED (more than
        max_outbox messages queued here: the client is not reading)."""
        st = self.clients.get(client)
        if st is None:               # nothing outstanding: a reply to a control message, not worth queueing
            return self._try_send(client, data)
        if not st.outbox:
            result = self._try_send(client, data)
            if result != FULL:
                if result == SENT:
                    st.last_sent = now
                return result
            st.calm_since, st.stuck_since = now, now
        st.outbox.append(data)
        return STALLED if len(st.outbox) > self.max_outbox else FULL

    def flush(self, now: float, stall_s: float) -> list[tuple[bytes, str]]:
        """Hand ZeroMQ what it refused before; the clients found gone, with why."""
        gone = []
        for client, st in list(self.clients.items()):
            if not st.outbox:
                continue
            result, moved = SENT, False
            while st.outbox:
                result = self._try_send(client, st.outbox[0])
                if result != SENT:
                    break
                st.outbox.popleft()
                moved = True
            if result == GONE:
                gone.append((client, "disconnected"))
                continue
            if moved:
                st.last_sent = now
            if not st.outbox:
                st.stuck_since = None
                self._forget_if_idle(client)
                continue
            st.calm_since = now
            if moved:
                st.stuck_since = now
            elif now - st.stuck_since >= stall_s:
                gone.append((client, "not reading"))
        return gone

    @property
    def backlogged(self) -> bool:
        return any(st.outbox for st in self.clients.values())

    def heartbeats_due(self, now: float, interval_s: float) -> list[bytes]:
        """Clients with something outstanding and nothing queued, sent nothing for interval_s."""
        return [c for c, st in self.clients.items() if not st.outbox and now - st.last_sent >= interval_s]

    def _forget_if_idle(self, client: bytes) -> None:
        st = self.clients.get(client)
        if st is not None and st.idle:
            del self.clients[client]
