"""The prefill role: an engine that computes prompts for decode instances and sends their K/V back.

One thread owns the engine and the ROUTER socket (bound on its own endpoint, reached by decode instances
only; wire.py is the format). Between steps it takes in `prefill`, `abort` and `ping` messages; after each
step it sends the K/V of every prompt just computed and the engine frees those blocks in the same step:
no KV block is held for a slow decode instance. A send that would block (the decode instance is not reading
fast enough, or a step finished more prompts than its ZeroMQ queue holds) waits in a backlog of host copies
and goes out as the queue drains; one not taken within backlog_s is dropped, and the decode side's
deadline has prefilled it there by then.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from rawinfer.engine.kv_transfer import Fingerprint
from rawinfer.engine.warmup import warm_thread
from rawinfer.frontends.disagg import wire
from rawinfer.frontends.server.security import SecurityError, is_loopback_endpoint, load_secret_key
from rawinfer.settings import SECONDS, check_options, int_argument, is_int, option

log = logging.getLogger("rawinfer")

MAX_TAKEN_PER_STEP = 256      # messages taken in between two engine steps
MAX_BACKLOG_ERRORS = 1024     # error replies kept for peers that do not read (K/V replies: max_queued, _queued)


_FLAG_OFF = {"flag": None, "help": ""}       # a field the command line does not offer (or the server's own)


@dataclass
class PrefillConfig:
    """The prefill role's socket and queues; the flags are `rawinfer serve --role prefill`'s (read into
    `prefill_<field>`: the server's own `bind` is beside it)."""

    bind: str = option("tcp://127.0.0.1:5560", flag="--prefill-bind", parse=str, metavar="ENDPOINT",
                       check=lambda v: isinstance(v, str) and "://" in v, what="an endpoint such as tcp://HOST:PORT",
                       help="--role prefill: the endpoint decode instances connect to")
    max_queued: int = option(64, flag="--prefill-max-queued", parse=int_argument,
                             check=lambda v: is_int(v) and v > 0, what="a positive number of prompts",
                             help="--role prefill: prompts queued before it answers busy")
    # inbound (a prompt's token ids); the K/V go the other way
    max_message_bytes: int = option(8 * 1024**2, check=lambda v: is_int(v) and v > 0, what="a positive size",
                                    **_FLAG_OFF)
    # per decode instance in ZeroMQ's queue; the rest waits in a backlog
    send_queue_messages: int = option(16, check=lambda v: is_int(v) and v > 0, what="a positive number",
                                      **_FLAG_OFF)
    backlog_s: float = option(60.0, **{**SECONDS, **_FLAG_OFF})   # K/V not taken in this long is dropped
    insecure: bool = option(False, check=lambda v: isinstance(v, bool), what="true or false",
                            **_FLAG_OFF)          # allow a non-loopback bind without CurveZMQ (serve's --insecure)
    curve_secret_key_file: str | None = option(None, check=lambda v: v is None or isinstance(v, str),
                                               what="a file name or None", **_FLAG_OFF)   # serve's --curve-secret-key
    poll_s: float = option(0.05, **{**SECONDS, **_FLAG_OFF})      # how long an idle loop waits for a message


class PrefillServer:
    def __init__(self, engine, cfg: PrefillConfig | None = None, ctx: zmq.Context | None = None):
        self.engine, self.cfg = engine, cfg or PrefillConfig()
        check_options(self.cfg, "prefill option")
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
        # replies that did not fit a decode instance's ZeroMQ queue (a step that finished many prompts sends
        # them all at once), oldest first: (decode identity, frames, bytes of K/V, when queued). Host copies
        # only: the prompt's KV blocks are free already.
        self._backlog: deque[tuple[bytes, list, int, float]] = deque()
        self._stop = False

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, warm: bool = False) -> None:
        """Serve until stop(). warm: the calling thread is not the one that built the engine (a Ray actor's
        serving thread); it repeats the warm-up's requests first (warmup.warm_thread), so that the first
        prompt does not pay this thread's first-use costs."""
        try:
            if warm and self.engine.config.warmup:
                log.debug("prefill thread warmed up in %.2f s", warm_thread(self.engine))
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
        self._flush()
        if self.sock.poll(int(wait * 1000)):
            taken = 0                                   # bounded: a peer flooding the socket cannot stall steps
            while taken < MAX_TAKEN_PER_STEP and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._handle(self.sock.recv_multipart(copy=True))
                taken += 1
        if self.engine.has_unfinished():
            self.engine.step()                          # prompt-only requests: their outputs say nothing new
            for export in self.engine.kv_transfer.take_ready():
                self._send_kv(export)

    def close(self) -> None:
        for engine_id in list(self._jobs):
            self.engine.kv_transfer.abort_export(engine_id)
        self._jobs.clear()
        self.sock.close(0)

    def stats(self) -> dict:
        """This instance's gauges and counters, sent with every pong: a decode instance's `stats` shows them
        (prefill_instances), so leaked blocks or a growing backlog here are visible from the client side."""
        e = self.engine.stats()
        return {**{k: e[k] for k in ("kv_blocks_used", "kv_blocks_total", "running", "waiting")},
                "queued": self._queued(), "backlog": len(self._backlog), **self.counters}

    # ---- messages ------------------------------------------------------------------------------
    def _handle(self, frames: list[bytes]) -> None:
        ident, tid = frames[0], None
        try:
            if len(frames) != 2:
                raise wire.WireError(f"a prefill-link request is one header frame, got {len(frames) - 1}")
            h = wire.decode(frames[1])
            tid = h.fields.get("id") if isinstance(h.fields.get("id"), str) else None   # for the error reply
            if h.type == "ping":
                stats = self.stats()
                self._reply(ident, wire.encode("pong", seq=h.fields.get("seq"), queued=stats["queued"],
                                               fingerprint=self.fingerprint, stats=stats))
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
            self._error(ident, tid, "rejected", str(e))

    def _prefill(self, ident: bytes, h: wire.Header) -> None:
        tid = h.get("id", str)
        try:
            theirs = Fingerprint.from_dict(h.get("fingerprint", dict))
        except (TypeError, ValueError) as e:
            raise wire.WireError(str(e)) from None
        mismatch = Fingerprint.from_dict(self.fingerprint).mismatch(theirs)
        if mismatch:
            return self._error(ident, tid, "fingerprint", mismatch)
        queued = self._queued()
        if queued >= self.cfg.max_queued:
            return self._error(ident, tid, "busy", f"the prefill instance has {queued} prompts queued or unsent")
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

    def _queued(self) -> int:
        """Prompts taken and not sent yet: computing, or their K/V waiting in the backlog (so host memory
        for unsent K/V stays within max_queued prompts)."""
        return len(self._jobs) + sum(1 for item in self._backlog if item[2])

    def _send_kv(self, export) -> None:
        job = self._jobs.pop(export.request_id, None)
        if job is None:
            return
        ident, tid = job
        self._send_or_keep(ident, wire.kv_frames(export, tid, self.fingerprint), export.nbytes)

    def _error(self, ident: bytes, tid: str | None, code: str, message: str) -> None:
        self.counters["refused"] += 1
        self._send_or_keep(ident, [wire.encode("error", id=tid, code=code, message=message)], 0)

    def _send_or_keep(self, ident: bytes, frames: list, nbytes: int) -> None:
        """Send behind whatever waits in the backlog; what does not fit ZeroMQ's queue waits there."""
        sent = None if self._backlog else self._reply(ident, *frames)
        if sent is None and (nbytes or len(self._backlog) < MAX_BACKLOG_ERRORS):   # errors to a flood: dropped
            self._backlog.append((ident, frames, nbytes, time.monotonic()))
        elif sent:
            self.counters["sent_bytes"] += nbytes
        elif nbytes:
            self.counters["dropped"] += 1

    def _flush(self) -> None:
        """Send backlogged replies, oldest first, while their queues take them; drop those whose decode
        instance is gone or has not taken them for backlog_s (it has long recomputed the prompt)."""
        now, kept, full = time.monotonic(), deque(), set()
        while self._backlog:
            ident, frames, nbytes, since = self._backlog.popleft()
            if ident in full:                            # keep one instance's replies in order
                kept.append((ident, frames, nbytes, since))
                continue
            sent = self._reply(ident, *frames)
            if sent:
                self.counters["sent_bytes"] += nbytes
            elif sent is None and now - since < self.cfg.backlog_s:
                full.add(ident)
                kept.append((ident, frames, nbytes, since))
            elif nbytes:
                self.counters["dropped"] += 1
        self._backlog = kept

    def _reply(self, ident: bytes, *frames) -> bool | None:
        """True: sent; None: its queue is full (try again later); False: that decode instance is gone."""
        try:
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return None
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
