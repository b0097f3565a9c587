"""The decode side of the prefill link: which requests prefill remotely, on which instance, and what happens
when a transfer does not come back whole and in time.

Driven from the decode engine's own thread: submit(request id) right after engine.add_request, poll()
between steps (it writes arriving K/V straight into the reserved blocks and lets the request run). A
request prefills here, as colocated, when its uncached part is under min_remote_tokens, when no prefill
instance is up (heartbeats) or all are saturated, or when the in-flight bounds (count, bytes) are reached.

A transfer fails when its deadline passes, its instance stops answering heartbeats, or its reply is
malformed (wrong frame count or sizes, another model's fingerprint) or an error. Then policy `recompute`
gives the reserved blocks back and the request prefills here; policy `fail` aborts it and poll() reports
it with the reason. A reply for a transfer that already ended (late, duplicated) is dropped. Either way
no block stays reserved.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import zmq

from rawinfer.engine.kv_transfer import Fingerprint
from rawinfer.frontends.disagg import wire
from rawinfer.frontends.server.monitor import disconnected, unwatch, watch
from rawinfer.settings import SECONDS, check_options, int_argument, is_int, option

log = logging.getLogger("rawinfer")
POLICIES = ("recompute", "fail")
PEER_STATS = ("kv_blocks_used", "kv_blocks_total", "running", "waiting", "queued", "backlog", "prefills",
              "sent_bytes", "dropped", "refused", "aborted")      # what a pong's stats may carry (prefill.py)


_FLAG_OFF = {"flag": None, "help": ""}       # a field the command line does not offer


def _positive_int(what: str) -> dict:
    return {"parse": int_argument, "check": lambda v: is_int(v) and v > 0, "what": f"a positive number of {what}"}


@dataclass
class DecodeConfig:
    """The decode role's link to its prefill instances; the flags are `rawinfer serve --role decode`'s."""

    prefill: list[str] = option(
        default_factory=list, parse=str, nargs="+", metavar="ADDR",
        check=lambda v: isinstance(v, list) and all(isinstance(a, str) and a for a in v),
        what="a list of endpoints", help="--role decode: the prefill instances' --prefill-bind endpoints")
    policy: str = option(
        "recompute", flag="--kv-transfer-policy", parse=str, choices=POLICIES, check=lambda v: v in POLICIES,
        what=f"one of {', '.join(POLICIES)}",
        help="--role decode: a transfer that fails is prefilled here (recompute) or fails its request (fail)")
    min_remote_tokens: int = option(
        64, parse=int_argument, check=lambda v: is_int(v) and v >= 0, what="a whole number >= 0",
        help="--role decode: prompts with fewer uncached tokens are prefilled here")
    transfer_timeout_s: float = option(30.0, flag="--kv-transfer-timeout", **SECONDS,
                                       help="--role decode: deadline of one transfer")
    heartbeat_s: float = option(0.5, **{**SECONDS, **_FLAG_OFF})
    # an instance silent this long counts as down (it answers between steps: keep a step shorter)
    peer_timeout_s: float = option(10.0, **{**SECONDS, **_FLAG_OFF})
    max_inflight: int = option(32, **{**_positive_int("transfers"), **_FLAG_OFF})   # all instances together
    max_inflight_bytes: int = option(1024**3, **{**_positive_int("bytes"), **_FLAG_OFF})   # K/V reserved at once
    max_per_peer: int = option(16, **{**_positive_int("transfers"), **_FLAG_OFF})
    server_key: bytes | None = option(None, check=lambda v: v is None or isinstance(v, bytes),
                                      what="the prefill instances' Curve public key (Z85 bytes) or None",
                                      **_FLAG_OFF)

    def validate(self) -> "DecodeConfig":
        if self.policy not in POLICIES:
            raise ValueError(f"--kv-transfer-policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not self.prefill:
            raise ValueError("the decode role needs at least one --prefill ADDR")
        check_options(self, "decode option")
        return self


@dataclass(frozen=True)
class Failed:
    """A request whose transfer failed under policy `fail`: aborted, its blocks freed."""

    request_id: str
    reason: str
    outputs: list                   # the engine's final RequestOutputs (reason `abort`; report `reason`)


@dataclass
class _Peer:
    addr: str
    sock: zmq.Socket
    monitor: zmq.Socket                 # ZeroMQ's events of `sock`: a closed connection is seen at once
    last_seen: float = 0.0          # 0: never answered
    last_ping: float = 0.0
    queued: int = 0                 # prompts queued there, from its last pong
    stats: dict = field(default_factory=dict)   # its gauges and counters, from its last pong
    inflight: set = field(default_factory=set)
    refusal: str | None = None      # why it cannot serve us (another model), once known

    def up(self, now: float, timeout: float) -> bool:
        return self.refusal is None and self.last_seen > 0 and now - self.last_seen < timeout


@dataclass
class _Transfer:
    tid: str
    request_id: str
    peer: _Peer
    deadline: float
    start_block: int
    num_blocks: int
    nbytes: int
    started: float


class DecodeConnector:
    def __init__(self, engine, cfg: DecodeConfig, ctx: zmq.Context | None = None):
        self.engine, self.cfg = engine, cfg.validate()
        self.kvt = engine.kv_transfer
        self.fingerprint = self.kvt.fingerprint
        self.ctx = ctx or zmq.Context.instance()
        self.peers = [self._connect(addr) for addr in cfg.prefill]
        self._transfers: dict[str, _Transfer] = {}       # transfer id -> transfer
        self._by_request: dict[str, str] = {}            # request id -> transfer id
        self._ids = itertools.count()
        self.counters = {"remote": 0, "local": 0, "fallbacks": 0, "failed": 0, "stale": 0, "bytes": 0,
                         "transfer_s": 0.0}

    def _connect(self, addr: str) -> _Peer:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_inflight_bytes + (1 << 20))
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.cfg.server_key is not None:      # CurveZMQ, with a fresh key pair of our own
            sock.curve_serverkey = self.cfg.server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        monitor = watch(sock)
        sock.connect(addr)
        return _Peer(addr, sock, monitor)

    @property
    def num_inflight(self) -> int:
        return len(self._transfers)

    def peer_stats(self) -> list[dict]:
        """Per prefill instance: its endpoint, whether it is up, and its last pong's gauges and counters."""
        now = time.monotonic()
        return [{"addr": p.addr, "up": p.up(now, self.cfg.peer_timeout_s), "inflight": len(p.inflight), **p.stats}
                for p in self.peers]

    def peers_up(self) -> list[str]:
        now = time.monotonic()
        return [p.addr for p in self.peers if p.up(now, self.cfg.peer_timeout_s)]

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str) -> bool:
        """Start a remote prefill of a request just added to the engine; False: it prefills here."""
        now = time.monotonic()
        peers = [p for p in self.peers if p.up(now, self.cfg.peer_timeout_s) and len(p.inflight) < self.cfg.max_per_peer]
        if not peers or len(self._transfers) >= self.cfg.max_inflight:
            return self._local(request_id, "no prefill instance is up and free" if not peers else
                               f"{len(self._transfers)} transfers in flight already")
        r = self.kvt.reserve(request_id, min_tokens=self.cfg.min_remote_tokens)
        if r is None:
            return self._local(request_id, f"fewer than {self.cfg.min_remote_tokens} uncached prompt tokens")
        nbytes = self.kvt.block_bytes(len(r.block_ids))
        if nbytes + sum(t.nbytes for t in self._transfers.values()) > self.cfg.max_inflight_bytes:
            self.kvt.cancel(request_id)
            return self._local(request_id, "the K/V bytes in flight are at their bound")
        peer = min(peers, key=lambda p: len(p.inflight) + p.queued)
        tid = f"{request_id}@{next(self._ids)}"
        prompt = self.engine.sequences(request_id)[0].prompt_token_ids
        t = _Transfer(tid, request_id, peer, now + self.cfg.transfer_timeout_s, r.start_block,
                      len(r.block_ids), nbytes, now)
        _send(peer, wire.encode("prefill", id=tid, prompt=prompt, start_block=r.start_block,
                                fingerprint=self.fingerprint.to_dict()))
        self._transfers[tid], self._by_request[request_id] = t, tid
        peer.inflight.add(tid)
        self.counters["remote"] += 1
        return True

    def _local(self, request_id: str, why: str) -> bool:
        log.info("request %s prefills locally: %s", request_id, why)
        self.counters["local"] += 1
        return False

    def abort(self, request_id: str) -> None:
        """The client went away: tell the instance (the caller's engine.abort frees the blocks)."""
        tid = self._by_request.get(request_id)
        if tid is not None:
            t = self._end(tid)
            _send(t.peer, wire.encode("abort", id=tid))

    # ---- the link ------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[Failed]:
        """Read what the prefill instances sent (waiting up to timeout_s for the first message), write
        arriving K/V, check deadlines and heartbeats. Returns the requests failed under policy `fail`
        (already aborted in the engine, with its final outputs: tell their clients)."""
        failed: list[Failed] = []
        poller = zmq.Poller()
        for p in self.peers:
            poller.register(p.sock, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        for p in self.peers:
            if p.sock not in ready:
                continue
            while True:
                try:
                    frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                p.last_seen = now
                failed += self._on_message(p, frames)
        for t in [t for t in self._transfers.values() if now > t.deadline]:
            failed += self._fail(t, f"the prefill instance {t.peer.addr} did not send the K/V within "
                                    f"{self.cfg.transfer_timeout_s:g} s")
        for p in self.peers:
            closed = disconnected(p.monitor)
            if closed:                    # its process died or closed the socket: down until it answers again
                p.last_seen = 0.0
            if p.inflight and (closed or p.last_seen and now - p.last_seen > self.cfg.peer_timeout_s):
                why = "its connection closed" if closed else f"silent for {now - p.last_seen:.1f} s"
                for tid in list(p.inflight):
                    failed += self._fail(self._transfers[tid], f"the prefill instance {p.addr} stopped answering "
                                                               f"({why})")
            if now - p.last_ping >= self.cfg.heartbeat_s:
                p.last_ping = now
                _send(p, wire.encode("ping", seq=int(now * 1000)))
        return failed

    def _on_message(self, peer: _Peer, frames) -> list[Failed]:
        try:
            h = wire.decode(frames[0].bytes)
        except wire.WireError as e:
            log.warning("prefill link from %s: %s", peer.addr, e)
            return []
        if h.type == "pong":
            self._on_pong(peer, h)
            return []
        t = self._transfers.get(h.fields.get("id")) if isinstance(h.fields.get("id"), str) else None
        if t is None or t.peer is not peer:           # late, duplicated, or for a transfer that ended
            self.counters["stale"] += 1
            return []
        if h.type == "error":
            code = h.fields.get("code")
            reason = f"the prefill instance {peer.addr} refused the prompt ({code}): {h.fields.get('message')}"
            return self._fail(t, reason, recompute=code == "busy")
        if h.type != "kv":
            return self._fail(t, f"the prefill instance {peer.addr} answered with a {h.type!r} message")
        problem = self._check_kv(t, h, frames)
        if problem:
            return self._fail(t, f"the K/V from {peer.addr} were refused: {problem}")
        try:
            for layer, frame in enumerate(frames[1:]):
                self.kvt.write(t.request_id, layer, frame.buffer)
            self.kvt.complete(t.request_id)
        except ValueError as e:
            return self._fail(t, f"the K/V from {peer.addr} were refused: {e}")
        self._end(t.tid)
        self.counters["bytes"] += t.nbytes
        self.counters["transfer_s"] += time.monotonic() - t.started
        log.info("request %s prefilled remotely on %s: %d blocks of K/V in %.3f s", t.request_id, peer.addr,
                 t.num_blocks, time.monotonic() - t.started)
        return []

    def _check_kv(self, t: _Transfer, h: wire.Header, frames) -> str | None:
        L = self.engine.model_config.num_layers
        try:
            fp = Fingerprint.from_dict(h.get("fingerprint", dict))
        except (TypeError, ValueError, wire.WireError) as e:
            return str(e)
        mismatch = self.fingerprint.mismatch(fp)
        if mismatch:
            return mismatch
        layer_bytes = t.nbytes // L
        got = (h.fields.get("start_block"), h.fields.get("num_blocks"), h.fields.get("num_layers"),
               h.fields.get("layer_bytes"))
        if got != (t.start_block, t.num_blocks, L, layer_bytes):
            return (f"the header names blocks from {got[0]}, {got[1]} blocks, {got[2]} layers of {got[3]} bytes; "
                    f"expected from {t.start_block}, {t.num_blocks} blocks, {L} layers of {layer_bytes} bytes")
        if len(frames) - 1 != L:
            return f"{len(frames) - 1} layer frames arrived, expected {L} (a frame was lost or repeated)"
        sizes = [len(f.buffer) for f in frames[1:]]
        if any(n != layer_bytes for n in sizes):
            return f"layer frames of {sorted(set(sizes))} bytes, expected {layer_bytes}"
        return None

    def _on_pong(self, peer: _Peer, h: wire.Header) -> None:
        q, stats = h.fields.get("queued"), h.fields.get("stats")
        peer.queued = q if isinstance(q, int) else 0
        stats = stats if isinstance(stats, dict) else {}
        peer.stats = {k: stats[k] for k in PEER_STATS if isinstance(stats.get(k), (int, float))}
        try:
            theirs = Fingerprint.from_dict(h.fields.get("fingerprint"))
        except (TypeError, ValueError) as e:
            theirs, problem = None, str(e)
        else:
            problem = self.fingerprint.mismatch(theirs)
        if problem and peer.refusal is None:
            log.error("prefill instance %s cannot serve this decode instance: %s", peer.addr, problem)
        peer.refusal = problem

    def _fail(self, t: _Transfer, reason: str, recompute: bool = False) -> list[Failed]:
        self._end(t.tid)
        _send(t.peer, wire.encode("abort", id=t.tid))
        if not self.kvt.is_receiving(t.request_id):      # aborted meanwhile: its blocks are already free
            return []
        if recompute or self.cfg.policy == "recompute":
            log.warning("request %s prefills locally: %s", t.request_id, reason)
            self.kvt.cancel(t.request_id)
            self.counters["fallbacks"] += 1
            return []
        log.warning("request %s failed: %s", t.request_id, reason)
        self.counters["failed"] += 1
        return [Failed(t.request_id, reason, self.engine.abort(t.request_id))]

    def _end(self, tid: str) -> _Transfer:
        t = self._transfers.pop(tid)
        t.peer.inflight.discard(tid)
        if self._by_request.get(t.request_id) == tid:
            del self._by_request[t.request_id]
        return t

    def close(self) -> None:
        for tid in list(self._transfers):
            t = self._end(tid)
            if self.kvt.is_receiving(t.request_id):
                self.kvt.cancel(t.request_id)
        for p in self.peers:
            unwatch(p.sock, p.monitor)
            p.sock.close(0)


def _send(peer: _Peer, header: bytes) -> None:
    """Send without ever blocking: toward an instance that is down the queue fills, and a lost message is
    covered by the deadline and the heartbeats."""
    try:
        peer.sock.send(header, zmq.NOBLOCK)
    except zmq.Again:
        pass
