"""The client-facing half of a protocol-v1 server: one ROUTER socket, its security, the record of every
client (clients.py), reading and validating messages, sending in order, and finding clients that vanished.

Two servers stand on it: server.py puts one engine behind it, and the replica router (frontends/cluster/
router.py) puts many engines behind it. Each says what a valid message does (`_dispatch`), what to do with
a vanished client's requests (`_cancel`), and runs its own loop; only that loop's thread touches the socket.
"""

from __future__ import annotations

import logging
import time

import zmq

from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.activity import log_requests_lost
from rawinfer.frontends.server.clients import FULL, GONE, SENT, STALLED, ClientTable
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.ipc import bind_private
from rawinfer.frontends.server.security import apply_curve, check_bind_security
from rawinfer.frontends.server.wakeup import Wakeup

log = logging.getLogger("rawinfer")


class ClientFront:
    """The ROUTER socket and client table of a server; subclasses implement _dispatch and _cancel."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None):
        check_bind_security(config)
        self.cfg = config
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self._auth = self._socket_file = None
        try:
            self.sock = self._make_socket()
        except BaseException:
            if self._auth is not None:
                self._auth.stop()
            if self._own_ctx:
                self.ctx.term()
            raise
        self._wake = Wakeup.create()
        self._stopping = False                               # set by shutdown(), read by the loop
        zmtp = config.zmtp_heartbeat_timeout_s
        self._stall_s = zmtp * 1.25 + config.heartbeat_interval_s
        self._table = ClientTable(self._try_send, grace_s=config.heartbeat_interval_s,
                                  max_outbox=config.max_backlog_messages)
        self._started = time.monotonic()
        self._started_unix = time.time()

    def _make_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        try:
            self._configure(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _configure(self, sock: zmq.Socket) -> None:
        cfg = self.cfg
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)             # a send to a vanished peer fails, a full queue too
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)   # larger inbound messages drop the peer
        sock.setsockopt(zmq.SNDHWM, cfg.send_queue_messages)  # per client; beyond it clients.py queues
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(max(cfg.zmtp_heartbeat_timeout_s / 4, 0.1) * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.zmtp_heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(cfg.shutdown_linger_s * 1000))
        self._auth = apply_curve(self.ctx, sock, cfg)
        try:
            self._socket_file = bind_private(sock, cfg.bind)
        except zmq.ZMQError as e:
            raise OSError(f"cannot bind {cfg.bind}: {e.strerror}; choose another --bind address") from None

    @property
    def endpoint(self) -> str:
        """The bound address (with the real port when bound to port 0 or '*')."""
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def shutdown(self) -> None:
        """Ask the loop to stop (safe from another thread or a signal handler)."""
        self._stopping = True
        self._wake.set()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close()               # LINGER lets queued final messages leave
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._wake.close()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()                 # waits for the linger
        if self._socket_file is not None:
            self._socket_file.remove()
            self._socket_file = None

    # ---- what a subclass provides --------------------------------------------------------------------
    def _dispatch(self, client: bytes, msg) -> None:
        raise NotImplementedError

    def _cancel(self, request_ids: list[str]) -> None:
        """Free the requests (by their internal ids) of a client that went away; nobody is told."""
        raise NotImplementedError

    # ---- inbound -------------------------------------------------------------------------------------
    def _read_burst(self) -> None:
        """Read what has arrived, bounded in count and time so that sending is never held up for long."""
        t_end = time.monotonic() + self.cfg.max_read_burst_s
        for _ in range(self.cfg.max_messages_per_drain):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(frames[0], frames[1:])
            except Exception:       # a bug in handling one message must not take the server down
                log.exception("internal error while handling a message")
                self._reply(frames[0], P.Error(str(P.ErrorCode.INTERNAL), "the server failed on this message; "
                                                                          "see its log"))
            if time.monotonic() > t_end:
                return

    def _handle(self, client: bytes, body: list[bytes]) -> None:
        if len(body) != 1:
            self._table.counts.messages_invalid += 1
            self._reply(client, P.Error(str(P.ErrorCode.BAD_FRAMES), f"got {len(body)} frames; send exactly one "
                                        "frame (a msgpack map) per message from a DEALER socket"))
            return
        try:
            msg = P.decode_request(body[0])
        except P.ProtocolError as e:
            self._table.counts.messages_invalid += 1
            self._reply(client, P.Error(str(e.code), e.message, e.request_id, e.tag))
            return
        if isinstance(msg, P.Ping):
            self._reply(client, P.Pong(time.time(), msg.tag))
        else:
            self._dispatch(client, msg)

    def _refuse(self, client: bytes, code: P.ErrorCode, message: str, request_id: str) -> None:
        self._table.counts.requests_rejected += 1
        self._reply(client, P.Error(str(code), message, request_id))

    def _admit(self, client: bytes, msg: P.Generate) -> SamplingParams | None:
        """The checks every generate passes before it is taken in: its parameters, or None once refused."""
        self._table.counts.requests_received += 1
        rid = msg.request_id
        if self._stopping:
            return self._refuse(client, P.ErrorCode.SHUTTING_DOWN, "the server is shutting down", rid)
        if self._table.lookup(client, rid) is not None:
            return self._refuse(client, P.ErrorCode.DUPLICATE_REQUEST_ID,
                                f"request id {rid!r} is already in flight on this connection; choose a unique id", rid)
        if self._table.in_flight >= self.cfg.max_requests_in_flight:
            return self._refuse(client, P.ErrorCode.OVERLOADED, f"the server already has "
                                f"{self._table.in_flight} requests in flight; retry later", rid)
        try:
            return SamplingParams.from_dict(msg.params)
        except (ValueError, TypeError) as e:
            return self._refuse(client, P.ErrorCode.INVALID_PARAMS, str(e).replace("SamplingParams.", ""), rid)

    def _unknown_request(self, client: bytes, request_id: str) -> None:
        self._reply(client, P.Error(str(P.ErrorCode.UNKNOWN_REQUEST), f"request {request_id!r} is not in "
                                    "flight (it may have finished already)", request_id))

    # ---- outbound ------------------------------------------------------------------------------------
    def _try_send(self, client: bytes, data: bytes) -> str:
        try:
            self.sock.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EAGAIN:
                return FULL
            if e.errno == zmq.EHOSTUNREACH:
                return GONE
            raise
        return SENT

    def _reply(self, client: bytes, msg) -> None:
        """A reply to one message (ping, stats, a refusal): in order behind what the client is owed."""
        self._sent(client, self._table.send(client, P.encode(msg), time.monotonic()))

    def _sent(self, client: bytes, result: str) -> bool:
        """Whether the client is still there after a send; if not, its requests are aborted."""
        if result in (GONE, STALLED):
            self._client_gone(client, "disconnected" if result == GONE else "not reading")
            return False
        return True

    def _tend_clients(self, now: float) -> None:
        """Retry what ZeroMQ refused, confirm finals, send heartbeats to clients that heard nothing."""
        for client, why in self._table.flush(now, self._stall_s):
            self._client_gone(client, why)
        self._table.confirm(now)
        for client in self._table.heartbeats_due(now, self.cfg.heartbeat_interval_s):
            self._sent(client, self._table.send(client, P.encode(P.Heartbeat()), now))

    def _client_gone(self, client: bytes, why: str) -> None:
        running, lost = self._table.drop(client)
        if running:
            self._cancel(running)
        if lost:
            log_requests_lost(client, why, lost)

    def _client_poll_ms(self) -> int:
        """How long the loop may sleep as far as the clients are concerned."""
        if self._table.backlogged:
            return 10
        if self._table.clients or self._table.in_flight:
            return int(min(self.cfg.heartbeat_interval_s / 2, 0.1) * 1000)
        return int(self.cfg.log_interval_s * 1000)

    def client_counters(self) -> dict:
        """The client-side counters of `stats` (PROTOCOL.md)."""
        c, t = self._table.counts, self._table
        return {"requests_in_flight": t.in_flight, "finals_unconfirmed": t.unconfirmed,
                "clients_with_requests": t.clients_with_requests, "clients_backlogged": sum(
                    1 for s in t.clients.values() if s.outbox),
                "requests_received": c.requests_received, "requests_rejected": c.requests_rejected,
                "requests_completed": c.requests_completed,
                "requests_aborted_by_client": c.requests_aborted_by_client,
                "requests_aborted_vanished": c.requests_aborted_vanished, "clients_vanished": c.clients_vanished,
                "messages_invalid": c.messages_invalid, "uptime_s": time.monotonic() - self._started,
                "server_time": time.time()}
