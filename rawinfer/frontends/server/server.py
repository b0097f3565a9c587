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

Beside this module: front.py (the client-facing socket and table, shared with the replica router),
config.py, security.py and ipc.py (who may connect, the socket file), handoff.py (what the threads pass),
clients.py (the per-client record), activity.py (the log lines).
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from rawinfer.config import VERSION
from rawinfer.engine.tokenizer import has_chat_template
from rawinfer.engine.tool_calls import detect_tool_call_parser
from rawinfer.sampling import MAX_LOGPROBS
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.activity import PeriodicLog, log_request_done
from rawinfer.frontends.server.admission import Admission, PromptLimits
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.front import ClientFront
from rawinfer.frontends.server.handoff import Cancel, Convert, Outbound, Prepare, Stop
from rawinfer.frontends.server.inflight import engine_request_id
from rawinfer.frontends.server.security import (SecurityError, check_bind_security, is_loopback_endpoint,
                                                load_secret_key)
from rawinfer.frontends.server.wakeup import install_stop_signals
from rawinfer.frontends.server.worker import EngineWorker

# ServerConfig and the security checks are imported from here by `rawinfer serve`
__all__ = ["SecurityError", "Server", "ServerConfig", "check_bind_security", "is_loopback_endpoint",
           "load_secret_key"]

log = logging.getLogger("rawinfer")

SHUTDOWN_WAIT_S = 60.0        # for the engine thread to finish its step and abort what is in flight


class Server(ClientFront):
    """Serve one engine on one endpoint until shutdown() or SIGINT/SIGTERM. Not thread-safe except shutdown()."""

    def __init__(self, engine, config: ServerConfig, context: zmq.Context | None = None, kv_connector=None):
        """kv_connector: the decode role's prefill link (frontends/disagg/connector.py), run by the engine thread."""
        super().__init__(config, context)
        self.engine = engine
        self._outbound = Outbound(self._wake.set)
        self._worker = EngineWorker(engine, self._outbound, kv_connector)
        self._limits = PromptLimits(engine)
        self._admission = Admission(engine, self._limits, self._worker.inbox, self._outbound)
        self._periodic = PeriodicLog(config.log_interval_s, self._started)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until shutdown; then abort every request in flight (each gets a final `abort`) and return 0
        (1 if the engine thread died)."""
        restore = install_stop_signals(self._wake, self.shutdown)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake.reader, zmq.POLLIN)
        self._worker.start()
        while not self._worker.ready.wait(0.05) and not self._stopping:     # its first steps, before any ping
            pass
        self._admission.start()
        log.info("serving on %s (protocol v%d%s)", self.endpoint, P.PROTOCOL_VERSION,
                 ", CurveZMQ" if self.cfg.curve_secret_key_file else "")
        status = 0
        try:
            while not self._stopping:
                poller.poll(0 if len(self._outbound) else self._client_poll_ms())
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

    def _finish(self) -> None:
        """Stop taking messages; the engine thread aborts what is in flight; send those finals."""
        self._admission.queue.put(Stop())
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while self._worker.thread.is_alive() and time.monotonic() < deadline:
            self._worker.thread.join(0.05)
            self._pump()
        self._pump()

    # ---- inbound -------------------------------------------------------------------------------------
    def _dispatch(self, client: bytes, msg) -> None:
        if isinstance(msg, P.Generate):
            self._generate(client, msg)
        elif isinstance(msg, P.Abort):
            self._abort(client, msg)
        elif isinstance(msg, P.Stats):
            self._reply(client, P.StatsReply(self.stats(), msg.tag))
        elif isinstance(msg, P.ModelInfo):
            self._reply(client, P.ModelInfoReply(self.model_info(), msg.tag))
        elif isinstance(msg, P.Scale):
            self._reply(client, P.Error(str(P.ErrorCode.REJECTED), "this server is one engine: scaling needs a "
                                        "server started with `rawinfer serve --replicas N`", tag=msg.tag))
        elif isinstance(msg, (P.Tokenize, P.Detokenize)):
            if self._stopping:
                self._reply(client, P.Error(str(P.ErrorCode.SHUTTING_DOWN), "the server is shutting down", tag=msg.tag))
            else:
                self._admission.queue.put(Convert(client, msg))

    def _generate(self, client: bytes, msg: P.Generate) -> None:
        params = self._admit(client, msg)
        if params is None:
            return
        refused = self._limits.refuse(msg)          # before anyone tokenises it
        if refused is not None:
            return self._refuse(client, refused[0], refused[1], msg.request_id)
        engine_id = engine_request_id(client, msg.request_id)
        self._table.add(client, msg.request_id, engine_id, time.monotonic())
        self._admission.queue.put(Prepare(engine_id, client, msg, params))

    def _abort(self, client: bytes, msg: P.Abort) -> None:
        engine_id = self._table.lookup(client, msg.request_id)
        if engine_id is None:
            return self._unknown_request(client, msg.request_id)
        if engine_id in self._table.aborting:     # asked again before it ended: its final comes once
            return
        self._table.aborting.add(engine_id)
        self._table.counts.requests_aborted_by_client += 1
        self._admission.queue.put(Cancel(engine_id, notify=True))

    def _cancel(self, request_ids: list[str]) -> None:
        for engine_id in request_ids:
            self._admission.queue.put(Cancel(engine_id, notify=False))

    # ---- outbound ------------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Send what the other threads produced, then tend the clients (clients.py) and the periodic log."""
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
        self._tend_clients(now)
        if self._periodic.due(now):
            self._periodic.emit(now, self._worker.snapshot, self._table.in_flight)

    # ---- gauges --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self._worker.snapshot, **self.client_counters()}

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
                "has_chat_template": has_chat_template(tok),
                "tool_call_parser": detect_tool_call_parser(tok.config.chat_template if tok is not None else None),
                "max_message_bytes": self.cfg.max_message_bytes,
                "max_prompt_chars": self._limits.max_chars,
                "block_size": eng.config.block_size, "kv_blocks_total": eng.block_manager.num_blocks,
                "device": eng.backend.name, "protocol_version": P.PROTOCOL_VERSION, "rawinfer_version": VERSION}
