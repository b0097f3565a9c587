"""The prefill role: an engine that computes prompts for decode instances and sends their K/V back.

One thread owns the engine and the ROUTER socket (bound on its own endpoint, reached by decode instances
only; wire.py is the format). Between steps it takes in `prefill`, `abort` and `ping` messages; after each
step it sends the K/V of every prompt just computed and the engine frees those blocks in the same step:
nothing is held for a slow decode instance. A send that would block (the decode instance is not reading)
drops that transfer; the decode side's deadline then prefills it there.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass

import zmq

from rawinfer.engine.kv_transfer import Fingerprint
from rawinfer.frontends.disagg import wire
from rawinfer.frontends.server.security import SecurityError, is_loopback_endpoint, load_secret_key

log = logging.getLogger("rawinfer")


@dataclass
class PrefillConfig:
    bind: str = "tcp://127.0.0.1:5560"
    max_queued: int = 64                     # prompts accepted and not yet sent; beyond: `busy`
    max_message_bytes: int = 8 * 1024**2     # inbound (a prompt's token ids); the K/V go the other way
    send_queue_messages: int = 16            # per decode instance; a full queue drops the transfer
    insecure: bool = False                   # allow a non-loopback bind without CurveZMQ
    curve_secret_key_file: str | None = None # CurveZMQ: this instance's key pair (`rawinfer keygen`)
    poll_s: float = 0.05                     # how long an idle loop waits for a message


class PrefillServer:
    def __init__(self, engine, cfg: PrefillConfig | None = None, ctx: zmq.Context | None = None):
        self.engine, self.cfg = engine, cfg or PrefillConfig()
        if not is_loopback_endpoint(self.cfg.bind) and not self.cfg.insecure and not self.cfg.curve_secret_key_file:
            raise SecurityError(f"{self.cfg.bind} is not a loopback address: give --curve-secret-key FILE (decode "
                                "instances then need --prefill-key with its public key), or --insecure on a "
                                "network you trust")
        self.fingerprint = engine.kv_transfer.fingerprint.to_dict()
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        self.sock.setsockopt(zmq.SNDHWM, self.cfg.send_queue_messages)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.cfg.curve_secret_key_file:     # encrypted, and only decode instances that know our key get in
            public, secret = load_secret_key(self.cfg.curve_secret_key_file)
            self.sock.curve_secretkey, self.sock.curve_publickey, self.sock.curve_server = secret, public, True
        self.sock.bind(self.cfg.bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._jobs: dict[str, tuple[bytes, str]] = {}      # engine request id -> (decode identity, transfer id)
        self.counters = {"prefills": 0, "sent_bytes": 0, "dropped": 0, "refused": 0, "aborted": 0}
        self._stop = False

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stop:
                self.run_once()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def run_once(self, timeout_s: float | None = None) -> None:
        """Take in what arrived (waiting up to timeout_s, or poll_s, when idle), then one engine step."""
        busy = self.engine.has_unfinished()
        wait = 0 if busy else (self.cfg.poll_s if timeout_s is None else timeout_s)
        if self.sock.poll(int(wait * 1000)):
            while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._handle(self.sock.recv_multipart(copy=True))
        if self.engine.has_unfinished():
            self.engine.step()                          # prompt-only requests: their outputs say nothing new
            for export in self.engine.kv_transfer.take_ready():
                self._send_kv(export)

    def close(self) -> None:
        for engine_id in list(self._jobs):
            self.engine.kv_transfer.abort_export(engine_id)
        self._jobs.clear()
        self.sock.close(0)

    # ---- messages ------------------------------------------------------------------------------
    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            if len(frames) != 2:
                raise wire.WireError(f"a prefill-link request is one header frame, got {len(frames) - 1}")
            h = wire.decode(frames[1])
            if h.type == "ping":
                self._reply(ident, wire.encode("pong", seq=h.fields.get("seq"), queued=len(self._jobs),
                                               fingerprint=self.fingerprint))
            elif h.type == "prefill":
                self._prefill(ident, h)
            elif h.type == "abort":
                engine_id = self._engine_id(ident, h.get("id", str))
                if self._jobs.pop(engine_id, None) is not None:
                    self.engine.kv_transfer.abort_export(engine_id)
                    self.counters["aborted"] += 1
            else:
                raise wire.WireError(f"unknown prefill-link message type {h.type!r}")
        except wire.WireError as e:
            log.warning("prefill link: %s", e)
            self._error(ident, None, "rejected", str(e))

    def _prefill(self, ident: bytes, h: wire.Header) -> None:
        tid = h.get("id", str)
        try:
            theirs = Fingerprint.from_dict(h.get("fingerprint", dict))
        except (TypeError, ValueError) as e:
            raise wire.WireError(str(e)) from None
        mismatch = Fingerprint.from_dict(self.fingerprint).mismatch(theirs)
        if mismatch:
            return self._error(ident, tid, "fingerprint", mismatch)
        if len(self._jobs) >= self.cfg.max_queued:
            return self._error(ident, tid, "busy", f"the prefill instance has {len(self._jobs)} prompts queued")
        engine_id = self._engine_id(ident, tid)
        if engine_id in self._jobs:
            return self._error(ident, tid, "rejected", f"transfer {tid!r} is already running")
        prompt = h.get("prompt", list)
        try:
            self.engine.kv_transfer.add_export(engine_id, prompt, h.get("start_block", int))
        except ValueError as e:          # RequestRejected, a bad start block
            return self._error(ident, tid, "rejected", str(e))
        self._jobs[engine_id] = (ident, tid)
        self.counters["prefills"] += 1

    def _send_kv(self, export) -> None:
        job = self._jobs.pop(export.request_id, None)
        if job is None:
            return
        ident, tid = job
        if self._reply(ident, *wire.kv_frames(export, tid, self.fingerprint)):
            self.counters["sent_bytes"] += export.nbytes
        else:
            self.counters["dropped"] += 1

    def _error(self, ident: bytes, tid: str | None, code: str, message: str) -> None:
        self.counters["refused"] += 1
        self._reply(ident, wire.encode("error", id=tid, code=code, message=message))

    def _reply(self, ident: bytes, *frames) -> bool:
        try:
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:               # its queue is full (not reading) or it is gone: drop, never wait
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    @staticmethod
    def _engine_id(ident: bytes, tid: str) -> str:
        return f"{ident.hex()}/{tid}"


def main(argv: list[str] | None = None) -> None:
    """`python -m rawinfer.frontends.disagg.prefill MODEL --bind ADDR [--engine JSON]`: one prefill instance."""
    p = argparse.ArgumentParser(prog="rawinfer-prefill")
    p.add_argument("model")
    p.add_argument("--bind", default=PrefillConfig.bind)
    p.add_argument("--engine", default="{}", help="engine options as a JSON object (EngineConfig fields)")
    p.add_argument("--max-queued", type=int, default=PrefillConfig.max_queued)
    p.add_argument("--insecure", action="store_true")
    a = p.parse_args(argv)
    from rawinfer.engine.engine import LLMEngine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(message)s")
    server = PrefillServer(LLMEngine(a.model, **json.loads(a.engine)),
                           PrefillConfig(bind=a.bind, max_queued=a.max_queued, insecure=a.insecure))
    log.info("prefill instance on %s", server.endpoint)
    print(f"ready {server.endpoint}", flush=True)
    t0 = time.monotonic()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    log.info("prefill instance stops after %.0f s: %s", time.monotonic() - t0, server.counters)


if __name__ == "__main__":
    main()
