"""The serving loop: one ROUTER socket in front of an LLMEngine, streaming each request's tokens to its client.

    clients (DEALER) ──msgpack──> ROUTER ──> handle(): generate / abort / stats / ping / model_info
                                     ^                   │ engine.add_request / engine.abort
                                     │                   v
                     chunks, finals  └──── dispatch() <── engine.step()

One thread owns the socket and the engine, so neither needs a lock. While the engine has nothing to do
the loop blocks in poll(); while it is busy it drains whatever has arrived without blocking before every
step, so a new request joins the very next step. A client that vanishes is found two ways: the ROUTER is
ROUTER_MANDATORY, so a send to a peer whose connection is gone fails (EHOSTUNREACH), and ZMTP heartbeats
close connections to silent peers; the loop also sends a `heartbeat` message to every client that has
requests in flight but heard nothing for a heartbeat interval, so a non-streaming request of a vanished
client is noticed too. Either way its requests are aborted and their KV blocks freed at once.

Beside this module: config.py (ServerConfig), security.py (which binds need CurveZMQ, the Curve keys) and
inflight.py (the record of each request in flight and the messages it turns engine outputs into).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from rawinfer.config import VERSION
from rawinfer.engine.tokenizer import has_chat_template, render_chat
from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.inflight import Inflight, InflightTable, engine_request_id
from rawinfer.frontends.server.security import (SecurityError, apply_curve, check_bind_security,
                                                is_loopback_endpoint, load_secret_key)

# ServerConfig and the security checks are imported from here by `rawinfer serve`
__all__ = ["SecurityError", "Server", "ServerConfig", "check_bind_security", "is_loopback_endpoint",
           "load_secret_key"]

log = logging.getLogger("rawinfer")


@dataclass
class _Counters:
    requests_received: int = 0
    requests_rejected: int = 0
    requests_aborted_by_client: int = 0
    requests_aborted_vanished: int = 0
    clients_vanished: int = 0
    messages_invalid: int = 0


@dataclass
class _Wakeup:
    """A socket pair the poll also watches, so a signal or another thread can interrupt a blocking wait."""
    reader: socket.socket
    writer: socket.socket

    @classmethod
    def create(cls) -> "_Wakeup":
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        return cls(r, w)

    def set(self) -> None:
        try:
            self.writer.send(b"x")
        except (BlockingIOError, OSError):    # already pending, or closed during shutdown
            pass

    def clear(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class Server:
    """Serve one engine on one endpoint until shutdown() or SIGINT/SIGTERM. Not thread-safe except shutdown()."""

    def __init__(self, engine, config: ServerConfig, context: zmq.Context | None = None):
        check_bind_security(config)
        self.engine, self.cfg = engine, config
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self._auth = None
        try:
            self.sock = self._make_socket()
        except BaseException:
            if self._auth is not None:
                self._auth.stop()
            if self._own_ctx:
                self.ctx.term()
            raise
        self._wake = _Wakeup.create()
        self._stopping = False                               # set by shutdown(), read by the loop
        self._requests = InflightTable()
        self._counts = _Counters()
        self._started = time.monotonic()

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
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)             # sends to vanished peers raise EHOSTUNREACH
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)   # larger inbound messages drop the peer
        sock.setsockopt(zmq.SNDHWM, 100_000)                 # per client; beyond it the client is not reading
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(max(cfg.zmtp_heartbeat_timeout_s / 4, 0.1) * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.zmtp_heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(cfg.shutdown_linger_s * 1000))
        self._auth = apply_curve(self.ctx, sock, cfg)
        try:
            sock.bind(cfg.bind)
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
        """Serve until shutdown; then abort every request in flight (each gets a final `abort`) and return 0."""
        restore = self._install_signal_handlers()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake.reader, zmq.POLLIN)
        log.info("serving on %s (protocol v%d%s)", self.endpoint, P.PROTOCOL_VERSION,
                 ", CurveZMQ" if self.cfg.curve_secret_key_file else "")
        try:
            while not self._stopping:
                if self.engine.has_unfinished():
                    self._drain()
                    if not self._stopping:
                        self._step()
                    self._heartbeats(time.monotonic())
                else:
                    poller.poll()           # idle: block until a message (or the wake-up pipe)
                    self._wake.clear()
                    self._drain()
            self._shutdown_requests()
        finally:
            for sig, handler in restore:
                signal.signal(sig, handler)
            self.close()
        return 0

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close()               # LINGER lets queued final messages leave
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._wake.close()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()                 # waits for the linger; also removes an ipc:// socket file

    def _install_signal_handlers(self) -> list:
        if threading.current_thread() is not threading.main_thread():
            return []
        previous = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous.append((sig, signal.getsignal(sig)))
            signal.signal(sig, lambda signum, frame: self.shutdown())
        return previous

    def _shutdown_requests(self) -> None:
        n = len(self._requests)
        for engine_id in self._requests.engine_ids():
            self._abort_request(engine_id)
        log.info("shut down; aborted %d request(s) in flight", n)

    # ---- inbound -------------------------------------------------------------------------------------
    def _drain(self) -> None:
        for _ in range(self.cfg.max_messages_per_drain):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(frames[0], frames[1:])
            except Exception:       # a bug in handling one message must not take the server down
                log.exception("internal error while handling a message")
                self._send(frames[0], P.Error(str(P.ErrorCode.INTERNAL),
                                              "the server failed on this message; see its log"))

    def _handle(self, client: bytes, body: list[bytes]) -> None:
        if len(body) != 1:
            self._counts.messages_invalid += 1
            self._send(client, P.Error(str(P.ErrorCode.BAD_FRAMES), f"got {len(body)} frames; send exactly one "
                                       "frame (a msgpack map) per message from a DEALER socket"))
            return
        try:
            msg = P.decode_request(body[0])
        except P.ProtocolError as e:
            self._counts.messages_invalid += 1
            self._send(client, P.Error(str(e.code), e.message, e.request_id, e.tag))
            return
        if isinstance(msg, P.Generate):
            self._generate(client, msg)
        elif isinstance(msg, P.Abort):
            self._abort(client, msg)
        elif isinstance(msg, P.Ping):
            self._send(client, P.Pong(time.time(), msg.tag))
        elif isinstance(msg, P.Stats):
            self._send(client, P.StatsReply(self.stats(), msg.tag))
        elif isinstance(msg, P.ModelInfo):
            self._send(client, P.ModelInfoReply(self.model_info(), msg.tag))

    def _refuse(self, client: bytes, code: P.ErrorCode, message: str, request_id: str) -> None:
        self._counts.requests_rejected += 1
        self._send(client, P.Error(str(code), message, request_id))

    def _generate(self, client: bytes, msg: P.Generate) -> None:
        self._counts.requests_received += 1
        rid = msg.request_id
        if self._stopping:
            return self._refuse(client, P.ErrorCode.SHUTTING_DOWN, "the server is shutting down", rid)
        if self._requests.lookup(client, rid) is not None:
            return self._refuse(client, P.ErrorCode.DUPLICATE_REQUEST_ID,
                                f"request id {rid!r} is already in flight on this connection; choose a unique id", rid)
        if len(self._requests) >= self.cfg.max_requests_in_flight:
            return self._refuse(client, P.ErrorCode.OVERLOADED, f"the server already has "
                                f"{len(self._requests)} requests in flight; retry later", rid)
        try:
            params = SamplingParams.from_dict(msg.params)
        except (ValueError, TypeError) as e:
            return self._refuse(client, P.ErrorCode.INVALID_PARAMS, str(e).replace("SamplingParams.", ""), rid)
        try:
            prompt = self._prompt(msg)
        except ValueError as e:
            return self._refuse(client, P.ErrorCode.INVALID_PROMPT, str(e), rid)
        if isinstance(prompt, list) and len(prompt) > self.engine.max_model_len:
            # NOTE: checked here so that a huge id list is refused before the engine scans every id.
            return self._refuse(client, P.ErrorCode.REJECTED, f"the prompt has {len(prompt)} tokens but the "
                                f"context holds {self.engine.max_model_len}; shorten it", rid)
        engine_id = engine_request_id(client, rid)
        try:
            ids = self.engine.add_request(engine_id, prompt, params, msg.priority)
        except ValueError as e:         # RequestRejected: too long for the context or the pool, bad token id
            return self._refuse(client, P.ErrorCode.REJECTED, str(e), rid)
        self._requests.add(engine_id, Inflight.start(client, rid, msg.stream, ids, params.n), time.monotonic())

    def _prompt(self, msg: P.Generate) -> str | list[int]:
        """The prompt to hand the engine: the text or ids as sent, or the chat rendered by the model's
        template (ChatTemplateError, a ValueError, without one)."""
        if msg.messages is not None:
            return render_chat(self.engine.tokenizer, msg.messages)
        return msg.prompt

    def _abort(self, client: bytes, msg: P.Abort) -> None:
        engine_id = self._requests.lookup(client, msg.request_id)
        if engine_id is None:
            self._send(client, P.Error(str(P.ErrorCode.UNKNOWN_REQUEST), f"request {msg.request_id!r} is not in "
                                       "flight (it may have finished already)", msg.request_id))
            return
        self._counts.requests_aborted_by_client += 1
        self._abort_request(engine_id)

    # ---- engine --------------------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:          # fail the requests in flight, keep serving the next ones
            log.exception("engine step failed")
            self._fail_all(f"the engine failed ({type(e).__name__}: {e}); the request was aborted")
            return
        self._dispatch(outputs)

    def _fail_all(self, reason: str) -> None:
        for engine_id in self._requests.engine_ids():
            self._abort_request(engine_id, error=reason)

    def _abort_request(self, engine_id: str, error: str | None = None) -> None:
        """Abort in the engine and send a final for every sample not finished yet (reason `abort`, or
        `error` with the reason given); the engine returns one final per unfinished sample, forked or not."""
        st = self._requests.get(engine_id)
        outs = self.engine.abort(engine_id)
        if st is None:
            return
        for out in outs:
            if error is not None:
                out.finish_reason = "error"
            if self._requests.get(engine_id) is st:      # the client may vanish while we send
                self._send(st.client, self._requests.finish(engine_id, st, out, error))

    def _dispatch(self, outputs) -> None:
        for out in outputs:
            st = self._requests.get(out.request_id)
            if st is None:              # its client vanished earlier in this batch
                continue
            if not out.finished:
                chunk = st.chunk(out)
                if chunk is not None:
                    self._send(st.client, chunk)
                continue
            self._send(st.client, self._requests.finish(out.request_id, st, out))

    # ---- outbound ------------------------------------------------------------------------------------
    def _send(self, client: bytes, msg) -> bool:
        try:
            self.sock.send_multipart([client, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(client, "disconnected" if e.errno == zmq.EHOSTUNREACH else "not reading")
            return False
        self._requests.sent(client, time.monotonic())
        return True

    def _client_gone(self, client: bytes, why: str) -> None:
        mine = self._requests.drop_client(client)
        if not mine:
            return
        self._counts.clients_vanished += 1
        self._counts.requests_aborted_vanished += len(mine)
        log.info("client %s %s: aborting its %d request(s)", client.hex(), why, len(mine))
        for engine_id in mine:
            self.engine.abort(engine_id)     # frees its KV blocks now; nobody is left to tell

    def _heartbeats(self, now: float) -> None:
        for client in self._requests.heartbeats_due(now, self.cfg.heartbeat_interval_s):
            self._send(client, P.Heartbeat())

    # ---- gauges --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self._counts
        return {**self.engine.stats(),
                "requests_in_flight": len(self._requests), "clients_with_requests": self._requests.num_clients,
                "requests_received": c.requests_received, "requests_rejected": c.requests_rejected,
                "requests_aborted_by_client": c.requests_aborted_by_client,
                "requests_aborted_vanished": c.requests_aborted_vanished, "clients_vanished": c.clients_vanished,
                "messages_invalid": c.messages_invalid, "uptime_s": time.monotonic() - self._started,
                "server_time": time.time()}

    def model_info(self) -> dict:
        mc, eng = self.engine.model_config, self.engine
        tok = eng.tokenizer
        return {"model": os.path.basename(os.path.normpath(eng.model_dir)) if eng.model_dir else None,
                "architecture": mc.architecture, "vocab_size": mc.vocab_size, "num_layers": mc.num_layers,
                "hidden_size": mc.hidden_size, "dtype": mc.dtype, "quant": mc.quant,
                "max_model_len": eng.max_model_len, "eos_token_ids": list(mc.eos_token_ids),
                "bos_token_id": mc.bos_token_id, "has_tokenizer": tok is not None,
                "has_chat_template": has_chat_template(tok),
                "block_size": eng.config.block_size, "kv_blocks_total": eng.block_manager.num_blocks,
                "device": eng.backend.name, "protocol_version": P.PROTOCOL_VERSION, "rawinfer_version": VERSION}
