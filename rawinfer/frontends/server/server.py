"""The serving loop: one ROUTER socket in front of an LLMEngine, streaming each request's tokens to its client.

    clients (DEALER) ──msgpack──> ROUTER ── I/O thread (run()): decode, check, answer ping/stats/model_info
                                    ^          │ Prepare / Cancel
                                    │          v
                                    │     admission thread: render the chat, tokenise   (admission.py)
                                    │          │ Admit / Cancel
                                    │          v
                                    └─ Outgoing ── engine thread: add_request, abort, step   (worker.py)

Three threads, so that none of them waits for another's work: the engine steps while messages are read
and sent; a huge prompt is tokenised (or refused for its length, before anyone tokenises it) while the
engine steps and `stats` is answered; a client that stops reading only grows its own queue. The I/O
thread (the caller of run(), normally the main thread) alone touches the socket, and waits in poll() on
the socket and a wake-up socket pair that the other threads and any signal write to (wakeup.py).

A client that vanishes is found three ways: ROUTER_MANDATORY makes a send to a peer whose connection is
gone fail; ZMTP heartbeats close connections to silent or stalled peers; and the loop sends a `heartbeat`
to every client with something outstanding that heard nothing for a heartbeat interval. Its requests are
aborted and freed at once, and counted (clients.py says when a final counts as delivered).

Beside this module: config.py, security.py and ipc.py (who may connect, the socket file), handoff.py (what
the threads pass), clients.py (the per-client record), activity.py (the log lines).
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from rawinfer.config import VERSION
from rawinfer.engine.tokenizer import has_chat_template
from rawinfer.sampling import MAX_LOGPROBS, SamplingParams
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.activity import PeriodicLog, log_request_done, log_requests_lost
from rawinfer.frontends.server.admission import Admission, PromptLimits
from rawinfer.frontends.server.clients import FULL, GONE, SENT, STALLED, ClientTable
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.handoff import Cancel, Convert, Outbound, Prepare, Stop
from rawinfer.frontends.server.inflight import engine_request_id
from rawinfer.frontends.server.ipc import bind_private
from rawinfer.frontends.server.security import (SecurityError, apply_curve, check_bind_security,
                                                is_loopback_endpoint, load_secret_key)
from rawinfer.frontends.server.wakeup import Wakeup, install_stop_signals
from rawinfer.frontends.server.worker import EngineWorker

# ServerConfig and the security checks are imported from here by `rawinfer serve`
__all__ = ["SecurityError", "Server", "ServerConfig", "check_bind_security", "is_loopback_endpoint",
           "load_secret_key"]

log = logging.getLogger("rawinfer")

SHUTDOWN_WAIT_S = 60.0        # for the engine thread to finish its step and abort what is in flight


class Server:
    """Serve one engine on one endpoint until shutdown() or SIGINT/SIGTERM. Not thread-safe except shutdown()."""

    def __init__(self, engine, config: ServerConfig, context: zmq.Context | None = None, kv_connector=None):
        """kv_connector: the decode role's prefill link (frontends/disagg/connector.py), run by the engine thread."""
        check_bind_security(config)
        self.engine, self.cfg = engine, config
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
        self._outbound = Outbound(self._wake.set)
        self._worker = EngineWorker(engine, self._outbound, kv_connector)
        self._limits = PromptLimits(engine)
        self._admission = Admission(engine, self._limits, self._worker.inbox, self._outbound)
        zmtp = config.zmtp_heartbeat_timeout_s
        self._stall_s = zmtp * 1.25 + config.heartbeat_interval_s
        self._table = ClientTable(self._try_send, grace_s=config.heartbeat_interval_s,
                                  max_outbox=config.max_backlog_messages)
        self._started = time.monotonic()
        self._started_unix = time.time()
        self._periodic = PeriodicLog(config.log_interval_s, self._started)

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

    # ---- lifecycle -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the loop to stop (safe from another thread or a signal handler)."""
        self._stopping = True
        self._wake.set()

    def run(self) -> int:
        """Serve until shutdown; then abort every request in flight (each gets a final `abort`) and return 0
        (1 if the engine thread died)."""
        restore = install_stop_signals(self._wake, self.shutdown)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake.reader, zmq.POLLIN)
        self._worker.start()
        self._admission.start()
        log.info("serving on %s (protocol v%d%s)", self.endpoint, P.PROTOCOL_VERSION,
                 ", CurveZMQ" if self.cfg.curve_secret_key_file else "")
        status = 0
        try:
            while not self._stopping:
                poller.poll(self._poll_timeout_ms())
                self._wake.clear()
                if not self._stopping:
                    self._read_burst()
                self._pump()
                if not self._worker.thread.is_alive():
                    log.error("the engine thread stopped; shutting down")
                    status = 1
                    break
            self._finish()
        finally:
            restore()
            self.close()
        return status

    def _poll_timeout_ms(self) -> int:
        if len(self._outbound):
            return 0
        if self._table.backlogged:
            return 10
        if self._table.clients or self._table.in_flight:
            return int(min(self.cfg.heartbeat_interval_s / 2, 0.1) * 1000)
        return int(self.cfg.log_interval_s * 1000)

    def _finish(self) -> None:
        """Stop taking messages; the engine thread aborts what is in flight; send those finals."""
        self._admission.queue.put(Stop())
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while self._worker.thread.is_alive() and time.monotonic() < deadline:
            self._worker.thread.join(0.05)
            self._pump()
        self._pump()

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
        if isinstance(msg, P.Generate):
            self._generate(client, msg)
        elif isinstance(msg, P.Abort):
            self._abort(client, msg)
        elif isinstance(msg, P.Ping):
            self._reply(client, P.Pong(time.time(), msg.tag))
        elif isinstance(msg, P.Stats):
            self._reply(client, P.StatsReply(self.stats(), msg.tag))
        elif isinstance(msg, P.ModelInfo):
            self._reply(client, P.ModelInfoReply(self.model_info(), msg.tag))
        elif isinstance(msg, (P.Tokenize, P.Detokenize)):
            if self._stopping:
                self._reply(client, P.Error(str(P.ErrorCode.SHUTTING_DOWN), "the server is shutting down", tag=msg.tag))
            else:
                self._admission.queue.put(Convert(client, msg))

    def _refuse(self, client: bytes, code: P.ErrorCode, message: str, request_id: str) -> None:
        self._table.counts.requests_rejected += 1
        self._reply(client, P.Error(str(code), message, request_id))

    def _generate(self, client: bytes, msg: P.Generate) -> None:
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
            params = SamplingParams.from_dict(msg.params)
        except (ValueError, TypeError) as e:
            return self._refuse(client, P.ErrorCode.INVALID_PARAMS, str(e).replace("SamplingParams.", ""), rid)
        refused = self._limits.refuse(msg)          # before anyone tokenises it
        if refused is not None:
            return self._refuse(client, refused[0], refused[1], rid)
        engine_id = engine_request_id(client, rid)
        self._table.add(client, rid, engine_id, time.monotonic())
        self._admission.queue.put(Prepare(engine_id, client, msg, params))

    def _abort(self, client: bytes, msg: P.Abort) -> None:
        engine_id = self._table.lookup(client, msg.request_id)
        if engine_id is None:
            self._reply(client, P.Error(str(P.ErrorCode.UNKNOWN_REQUEST), f"request {msg.request_id!r} is not in "
                                        "flight (it may have finished already)", msg.request_id))
            return
        self._table.counts.requests_aborted_by_client += 1
        self._admission.queue.put(Cancel(engine_id, notify=True))

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

    def _pump(self) -> None:
        """Send what the other threads produced, retry what ZeroMQ refused, confirm finals, heartbeats, log."""
        now = time.monotonic()
        for item in self._outbound.take(4 * self.cfg.max_messages_per_drain):
            if item.data is None:                 # a vanished client's request, freed by the engine
                self._table.cancelled(item.engine_id)
                continue
            if item.engine_id is not None and self._table.owner(item.engine_id) is None:
                continue                          # its client went away meanwhile
            if not self._sent(item.client, self._table.send(item.client, item.data, now)):
                continue
            if item.ends:
                rid = self._table.end(item.engine_id, item.is_final, now)
                if item.summary is not None and rid is not None:
                    log_request_done(rid, item.client, item.summary)
        for client, why in self._table.flush(now, self._stall_s):
            self._client_gone(client, why)
        self._table.confirm(now)
        for client in self._table.heartbeats_due(now, self.cfg.heartbeat_interval_s):
            self._sent(client, self._table.send(client, P.encode(P.Heartbeat()), now))
        if self._periodic.due(now):
            self._periodic.emit(now, self._worker.snapshot, self._table.in_flight)

    def _client_gone(self, client: bytes, why: str) -> None:
        running, lost = self._table.drop(client)
        for engine_id in running:
            self._admission.queue.put(Cancel(engine_id, notify=False))
        if lost:
            log_requests_lost(client, why, lost)

    # ---- gauges --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c, t = self._table.counts, self._table
        return {**self._worker.snapshot,
                "requests_in_flight": t.in_flight, "finals_unconfirmed": t.unconfirmed,
                "clients_with_requests": t.clients_with_requests, "clients_backlogged": sum(
                    1 for s in t.clients.values() if s.outbox),
                "requests_received": c.requests_received, "requests_rejected": c.requests_rejected,
                "requests_completed": c.requests_completed,
                "requests_aborted_by_client": c.requests_aborted_by_client,
                "requests_aborted_vanished": c.requests_aborted_vanished, "clients_vanished": c.clients_vanished,
                "messages_invalid": c.messages_invalid, "uptime_s": time.monotonic() - self._started,
                "server_time": time.time()}

    def model_info(self) -> dict:
        mc, eng = self.engine.model_config, self.engine
        tok = eng.tokenizer
        return {"model": os.path.basename(os.path.normpath(eng.model_dir)) if eng.model_dir else None,
                "model_path": os.path.abspath(eng.model_dir) if eng.model_dir else None,
                "created": int(self._started_unix), "max_logprobs": MAX_LOGPROBS,
                "architecture": mc.architecture, "vocab_size": mc.vocab_size, "num_layers": mc.num_layers,
                "hidden_size": mc.hidden_size, "dtype": mc.dtype, "quant": mc.quant,
                "max_model_len": eng.max_model_len, "eos_token_ids": list(mc.eos_token_ids),
                "bos_token_id": mc.bos_token_id, "has_tokenizer": tok is not None,
                "has_chat_template": has_chat_template(tok), "max_message_bytes": self.cfg.max_message_bytes,
                "max_prompt_chars": self._limits.max_chars,
                "block_size": eng.config.block_size, "kv_blocks_total": eng.block_manager.num_blocks,
                "device": eng.backend.name, "protocol_version": P.PROTOCOL_VERSION, "rawinfer_version": VERSION}
