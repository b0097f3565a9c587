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
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import zmq
import zmq.auth

from rawinfer import __version__
from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P

log = logging.getLogger("rawinfer")


@dataclass
class ServerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    curve_secret_key_file: str | None = None     # the server's certificate with its secret key (CurveZMQ)
    curve_client_keys_dir: str | None = None     # if set, only clients whose public keys are here get in
    insecure: bool = False                       # allow a non-loopback bind without CurveZMQ
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_interval_s: float = 1.0
    zmtp_heartbeat_timeout_s: float = 10.0       # a connection silent this long is closed by ZeroMQ
    max_requests_in_flight: int = 4096
    max_messages_per_drain: int = 1024           # bounds the time taken from the engine by one burst
    shutdown_linger_s: float = 2.0               # how long the final `abort` messages may take to leave


class SecurityError(ValueError):
    """A bind that would expose the engine without encryption, or an unusable key file."""


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # "*", interface names and host names may reach other machines
        return False


def check_bind_security(cfg: ServerConfig) -> None:
    if not is_loopback_endpoint(cfg.bind) and cfg.curve_secret_key_file is None and not cfg.insecure:
        raise SecurityError(
            f"{cfg.bind} is not a loopback address: serving it unencrypted would let anyone on the network use "
            "the engine; give --curve-secret-key FILE (make one with `rawinfer keygen DIR`), or --insecure to "
            "accept the risk")
    if cfg.curve_client_keys_dir is not None and cfg.curve_secret_key_file is None:
        raise SecurityError("--curve-client-keys needs --curve-secret-key: client keys are only checked under CurveZMQ")


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a certificate written by `rawinfer keygen` (zmq.auth format)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read the Curve key file {path!r} ({e}); make one with `rawinfer keygen DIR`") \
            from None
    if secret is None:
        raise SecurityError(f"{path!r} holds only a public key; the server needs the .key_secret file")
    return public, secret


@dataclass
class _Inflight:
    """One generate request of one client, as the loop tracks it."""
    client: bytes                    # ROUTER routing id of the sender
    request_id: str                  # the client's id
    stream: bool
    prompt_token_ids: list[int]
    pending: int                     # samples not finished yet
    held_ids: list[list[int]]        # non-streaming: tokens per sample, sent with the final
    held_text: list[list[str]]
    finished: set[int] = field(default_factory=set)   # sample indices whose final has been sent


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
        self._inflight: dict[str, _Inflight] = {}            # engine request id -> state
        self._by_client: dict[bytes, dict[str, str]] = {}    # routing id -> {client's id: engine id}
        self._last_sent: dict[bytes, float] = {}
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
        if cfg.curve_secret_key_file is not None:
            public, secret = load_secret_key(cfg.curve_secret_key_file)
            if cfg.curve_client_keys_dir is not None:
                from zmq.auth.thread import ThreadAuthenticator
                if not os.path.isdir(cfg.curve_client_keys_dir):
                    raise SecurityError(f"--curve-client-keys {cfg.curve_client_keys_dir!r} is not a folder of "
                                        "client .key files")
                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=cfg.curve_client_keys_dir)
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
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
        n = len(self._inflight)
        for engine_id in list(self._inflight):
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
        mine = self._by_client.get(client, {})
        if self._stopping:
            return self._refuse(client, P.ErrorCode.SHUTTING_DOWN, "the server is shutting down", rid)
        if rid in mine:
            return self._refuse(client, P.ErrorCode.DUPLICATE_REQUEST_ID,
                                f"request id {rid!r} is already in flight on this connection; choose a unique id", rid)
        if len(self._inflight) >= self.cfg.max_requests_in_flight:
            return self._refuse(client, P.ErrorCode.OVERLOADED, f"the server already has "
                                f"{len(self._inflight)} requests in flight; retry later", rid)
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
        engine_id = f"{client.hex()}/{rid}"
        try:
            ids = self.engine.add_request(engine_id, prompt, params, msg.priority)
        except ValueError as e:         # RequestRejected: too long for the context or the pool, bad token id
            return self._refuse(client, P.ErrorCode.REJECTED, str(e), rid)
        self._by_client.setdefault(client, {})[rid] = engine_id
        self._last_sent.setdefault(client, time.monotonic())
        self._inflight[engine_id] = _Inflight(client, rid, msg.stream, ids, params.n,
                                              [[] for _ in range(params.n)], [[] for _ in range(params.n)])

    def _prompt(self, msg: P.Generate) -> str | list[int]:
        tok = self.engine.tokenizer
        if msg.messages is not None:
            if tok is None or not tok.config.chat_template:
                raise ValueError("this model has no chat template; send the prompt as text or token ids instead "
                                 "of messages")
            return tok.apply_chat_template(msg.messages, add_generation_prompt=True)
        return msg.prompt

    def _abort(self, client: bytes, msg: P.Abort) -> None:
        engine_id = self._by_client.get(client, {}).get(msg.request_id)
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
        for engine_id in list(self._inflight):
            self._abort_request(engine_id, error=reason)

    def _abort_request(self, engine_id: str, error: str | None = None) -> None:
        """Abort in the engine and send a final for every sample not finished yet (reason `abort`, or
        `error` with the reason given); the engine returns one final per unfinished sample, forked or not."""
        st = self._inflight.get(engine_id)
        outs = self.engine.abort(engine_id)
        if st is None:
            return
        for out in outs:
            if error is not None:
                out.finish_reason = "error"
            if self._inflight.get(engine_id) is st:      # the client may vanish while we send
                self._finish_sample(engine_id, st, out, error)

    def _dispatch(self, outputs) -> None:
        for out in outputs:
            st = self._inflight.get(out.request_id)
            if st is None:              # its client vanished earlier in this batch
                continue
            if not out.finished:
                if st.stream:
                    self._send(st.client, P.Chunk(st.request_id, out.index, out.new_token_ids, out.text_delta))
                else:
                    st.held_ids[out.index].extend(out.new_token_ids)
                    st.held_text[out.index].append(out.text_delta)
                continue
            self._finish_sample(out.request_id, st, out)

    def _finish_sample(self, engine_id: str, st: _Inflight, out, error: str | None = None) -> None:
        ids, text = list(out.new_token_ids), out.text_delta
        if not st.stream:
            ids = st.held_ids[out.index] + ids
            text = "".join(st.held_text[out.index]) + text
        m = out.metrics
        usage = P.Usage(m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens) if m else \
            P.Usage(len(st.prompt_token_ids), 0, len(ids))
        timings = P.Timings(m.ttft_s, m.mean_itl_s, m.e2e_s) if m else P.Timings(None, None, None)
        st.pending -= 1
        st.finished.add(out.index)
        if st.pending == 0:
            self._forget(engine_id, st)
        self._send(st.client, P.Final(st.request_id, out.index, ids, text, out.finish_reason, st.prompt_token_ids,
                                      usage, timings, error))

    def _forget(self, engine_id: str, st: _Inflight) -> None:
        self._inflight.pop(engine_id, None)
        mine = self._by_client.get(st.client)
        if mine is not None:
            mine.pop(st.request_id, None)
            if not mine:
                del self._by_client[st.client]
                self._last_sent.pop(st.client, None)

    # ---- outbound ------------------------------------------------------------------------------------
    def _send(self, client: bytes, msg) -> bool:
        try:
            self.sock.send_multipart([client, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(client, "disconnected" if e.errno == zmq.EHOSTUNREACH else "not reading")
            return False
        if client in self._last_sent:
            self._last_sent[client] = time.monotonic()
        return True

    def _client_gone(self, client: bytes, why: str) -> None:
        mine = self._by_client.pop(client, None)
        self._last_sent.pop(client, None)
        if not mine:
            return
        self._counts.clients_vanished += 1
        self._counts.requests_aborted_vanished += len(mine)
        log.info("client %s %s: aborting its %d request(s)", client.hex(), why, len(mine))
        for engine_id in mine.values():
            self._inflight.pop(engine_id, None)
            self.engine.abort(engine_id)     # frees its KV blocks now; nobody is left to tell

    def _heartbeats(self, now: float) -> None:
        due = [c for c, t in self._last_sent.items() if now - t >= self.cfg.heartbeat_interval_s]
        for client in due:
            self._send(client, P.Heartbeat())

    # ---- gauges --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self._counts
        return {**self.engine.stats(),
                "requests_in_flight": len(self._inflight), "clients_with_requests": len(self._by_client),
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
                "has_chat_template": bool(tok is not None and tok.config.chat_template),
                "block_size": eng.config.block_size, "kv_blocks_total": eng.block_manager.num_blocks,
                "device": eng.backend.name, "protocol_version": P.PROTOCOL_VERSION, "rawinfer_version": __version__}
