"""The replica router: one protocol-v1 endpoint in front of many engine replicas.

    clients (DEALER) --> ROUTER (front.py) -- router loop --> one DEALER per replica --> replica's `Server`
                                                 ^   |
                              events (ReplicaUp, ...) |  commands (start, recover, stop)
                                                 |   v
                                    Supervisor threads --> ReplicaPool (Ray actors, pool.py)

Clients cannot tell it from one engine: the same messages, the same rule of the sums. A `generate` goes
to the replica routing.py chooses, under an id of the router's own (replicas see one client, the
router); the replica's chunks and finals come back, get the client's id again, and go out through the
client table, which confirms delivery as a single server's does. `ping` is answered here, `model_info`
from the replicas' (cached), `tokenize` by any serving replica, `stats` from every replica's last stats
(stats.py), and `scale` changes the number of replicas.

Faults: every replica is pinged each heartbeat interval; one whose connection closes (ZeroMQ's monitor
sees it at once) or that stays silent for `lost_after_s` is LOST (links.py):
no more requests go to it, those of its requests that nothing reached the client of yet go to another
replica, the others end with a final of reason `error`, and the supervisor waits for the pool to bring it
back (Ray restarts a dead actor). Requests wait here while no replica serves, up to `wait_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import zmq

from rawinfer.frontends.cluster.autoscale import AutoscaleConfig, Autoscaler
from rawinfer.frontends.cluster.fleet import Fleet, FleetConfig
from rawinfer.frontends.cluster.links import CONNECTING, DRAINING, UP, Link, Routed
from rawinfer.frontends.cluster.pool import ReplicaPool
from rawinfer.frontends.cluster.routing import Candidate, Router as Chooser, RoutingConfig, prompt_pieces
from rawinfer.frontends.cluster.stats import aggregate
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.config import ServerConfig
from rawinfer.frontends.server.front import ClientFront
from rawinfer.frontends.server.wakeup import install_stop_signals
from rawinfer.settings import SECONDS, check_options, int_argument, is_int, option

log = logging.getLogger("rawinfer")
FRESH_STATS_S = 1.0
ROUTED_COUNTER = {"prefix": "routed_by_prefix", "balance": "routed_by_balance", "least_loaded": "routed_least_loaded",
                  "round_robin": "routed_round_robin"}     # routing.Decision.reason -> its `stats` counter
RETRYABLE = {str(P.ErrorCode.OVERLOADED), str(P.ErrorCode.SHUTTING_DOWN)}


_count = {"parse": int_argument, "metavar": "N", "check": lambda v: is_int(v) and v >= 1, "what": "a positive integer"}


def _curve_keys(v) -> bool:
    return v is None or (isinstance(v, tuple) and len(v) == 3 and all(isinstance(k, bytes) for k in v))


@dataclass
class RouterConfig:
    """The router's settings; those with a flag are `rawinfer serve --replicas`'s (cli/serve_replicas.py)."""

    replicas: int = option(2, cli_default=None, **_count,
                           help="serve N engine replicas, each a Ray actor, behind one router on --bind (default: one "
                                "engine in this process, no Ray)")
    max_replicas: int = option(64, cli_default=None, **_count,
                               help="`rawinfer scale` and autoscaling stay at or below N (default: --autoscale-max, "
                                    "else 64)")
    routing: RoutingConfig = option(default_factory=RoutingConfig, flag=None,
                                    check=lambda v: isinstance(v, RoutingConfig), what="a RoutingConfig",
                                    help="how a replica is chosen for a request (routing.py)")
    lost_after_s: float = option(5.0, flag="--replica-lost-after", **SECONDS,
                                 help="a replica silent this long is taken out of the rotation, its requests retried "
                                      "or ended (default: 5)")
    start_timeout_s: float = option(600.0, flag=None, **SECONDS, help="for a replica to load its model and serve")
    wait_s: float = option(120.0, flag=None, **SECONDS, help="a request waits this long for a serving replica")
    max_attempts: int = option(3, flag=None, **_count, help="replicas a request may be sent to")
    autoscale: AutoscaleConfig | None = option(
        None, flag=None, check=lambda v: v is None or isinstance(v, AutoscaleConfig), what="an AutoscaleConfig or None",
        help="the autoscaling rule; None: a fixed number of replicas")
    curve: tuple[bytes, bytes, bytes] | None = option(
        None, flag=None, check=_curve_keys, what="(replicas' public key, ours, our secret) as bytes, or None",
        help="CurveZMQ keys of the links to the replicas; None: unencrypted")


class ReplicaRouter(ClientFront):
    def __init__(self, config: ServerConfig, pool: ReplicaPool, rcfg: RouterConfig,
                 context: zmq.Context | None = None):
        check_options(rcfg, "router option")
        super().__init__(config, context)
        self.rcfg = rcfg
        self.chooser = Chooser(rcfg.routing)
        self.fleet = Fleet(pool, self._wake.set, self.ctx, FleetConfig(
            rcfg.routing.capacity, rcfg.start_timeout_s, rcfg.lost_after_s, config.heartbeat_interval_s, rcfg.curve))
        self.links = self.fleet.links
        self.routed: dict[str, Routed] = {}
        self._pending: deque[str] = deque()          # internal ids waiting for a serving replica
        self._calls: dict[str, tuple[bytes, str | None]] = {}   # our tag -> (client, its tag) of forwarded calls
        self._stats_waits: list = []                 # (client, tag, {slot: answers awaited}, deadline)
        self._seq = 0
        self._info: dict | None = None
        self._autoscaler = Autoscaler(rcfg.autoscale, time.monotonic()) if rcfg.autoscale else None
        self.counts = {"requests_routed": 0, "requests_retried": 0, "requests_failed_replica_lost": 0,
                       "requests_timed_out_waiting": 0, **{name: 0 for name in ROUTED_COUNTER.values()}}

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        restore = install_stop_signals(self._wake, self.shutdown)
        self.fleet.scale_to(self.rcfg.replicas)
        log.info("routing on %s to %d replica(s), %s routing", self.endpoint, self.rcfg.replicas,
                 self.rcfg.routing.policy)
        try:
            while not self._stopping:
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                poller.register(self._wake.reader, zmq.POLLIN)
                for link in self.fleet.connected():
                    poller.register(link.sock, zmq.POLLIN)
                    poller.register(link.monitor, zmq.POLLIN)
                ready = dict(poller.poll(min(self._client_poll_ms(), 100)))
                self._wake.clear()
                if not self._stopping:
                    self._read_burst()
                for link in list(self.links.values()):
                    if link.sock is not None and link.sock in ready:
                        self._read_replica(link)
                self._tick(time.monotonic())
            self._finish()
        finally:
            restore()
            self.fleet.close()
            self.close()
        return 0

    def _tick(self, now: float) -> None:
        self.fleet.handle_events()
        for requests, why in self.fleet.probe(now):
            for internal in requests:
                if (r := self.routed.get(internal)) is not None:
                    self._reroute(r, why)
        self._place_pending(now)
        self.fleet.drain()
        self._answer_stats(now)
        if self._autoscaler is not None:
            fleet = self.fleet
            want = self._autoscaler.target(now, fleet.target, len(self.routed), len(fleet.serving()))
            if want != fleet.target:
                log.info("autoscaling from %d to %d replicas (%d requests in flight)", fleet.target, want,
                         len(self.routed))
                fleet.scale_to(want)
        self._tend_clients(now)

    def _finish(self) -> None:
        """Abort what is in flight on the replicas and pass their abort finals on; end what remains here."""
        for r in list(self.routed.values()):
            if r.slot is not None and self.links[r.slot].sock is not None:
                self.links[r.slot].send(P.Abort(r.internal))
        deadline = time.monotonic() + 5.0
        while any(r.slot is not None for r in self.routed.values()) and time.monotonic() < deadline:
            for link in self.fleet.connected():
                if link.sock.poll(20):
                    self._read_replica(link)
            self._tend_clients(time.monotonic())
        for r in list(self.routed.values()):
            self._end_here(r, "abort", None)
        self._tend_clients(time.monotonic())

    def _reroute(self, r: Routed, why: str) -> None:
        """A request whose replica cannot finish it: again elsewhere if nothing of it reached the client."""
        r.slot = None
        if not r.streamed and r.attempts < self.rcfg.max_attempts:
            self.counts["requests_retried"] += 1
            self._pending.appendleft(r.internal)
            return
        self.counts["requests_failed_replica_lost"] += 1
        self._end_here(r, "error", f"{why} after part of the answer was sent; send the request again")

    # ---- requests ------------------------------------------------------------------------------------
    def _place_pending(self, now: float) -> None:
        ups = self.fleet.routable(now)
        for _ in range(len(self._pending)):
            r = self.routed.get(self._pending.popleft())
            if r is None:
                continue
            if not ups:
                if now - r.arrived > self.rcfg.wait_s:
                    self.counts["requests_timed_out_waiting"] += 1
                    self._fail(r, P.ErrorCode.OVERLOADED, f"no replica was serving within {self.rcfg.wait_s:g} s; "
                                                          "retry later")
                else:
                    self._pending.append(r.internal)
                continue
            cands = [Candidate(lk.slot, len(lk.requests), lk.kv_usage, lk.record) for lk in ups]
            d = self.chooser.choose(r.hashes, cands)
            self.counts[ROUTED_COUNTER[d.reason]] += 1
            link = self.links[d.slot]
            r.slot, r.attempts = d.slot, r.attempts + 1
            link.requests.add(r.internal)
            link.routed_total += 1
            self.counts["requests_routed"] += 1
            link.send(dataclasses.replace(r.msg, request_id=r.internal))

    def _generate(self, client: bytes, msg: P.Generate) -> None:
        params = self._admit(client, msg)
        if params is None:
            return
        self._seq += 1
        internal = f"r{self._seq:x}"
        r = Routed(internal, client, msg.request_id, msg, params.n, prompt_pieces(msg.prompt, msg.messages),
                   time.monotonic())
        self.routed[internal] = r
        self._table.add(client, msg.request_id, internal, r.arrived)
        self._pending.append(internal)
        self._place_pending(r.arrived)

    def _abort(self, client: bytes, msg: P.Abort) -> None:
        internal = self._table.lookup(client, msg.request_id)
        if internal is None or internal not in self.routed:
            return self._unknown_request(client, msg.request_id)
        self._table.counts.requests_aborted_by_client += 1
        r = self.routed[internal]
        if r.slot is None:
            self._end_here(r, "abort", None)
        else:
            self.links[r.slot].send(P.Abort(internal))

    def _cancel(self, request_ids: list[str]) -> None:
        for internal in request_ids:
            r = self.routed.pop(internal, None)
            self._table.cancelled(internal)
            if r is not None and r.slot is not None:
                link = self.links[r.slot]
                link.requests.discard(internal)
                link.send(P.Abort(internal))

    def _done(self, r: Routed, delivered_final: bool) -> None:
        self.routed.pop(r.internal, None)
        if r.slot is not None and r.slot in self.links:
            self.links[r.slot].requests.discard(r.internal)
        self._table.end(r.internal, delivered_final, time.monotonic())

    def _fail(self, r: Routed, code: P.ErrorCode, message: str) -> None:
        """End a request that never started, with an `error`."""
        self._send_client(r, P.encode(P.Error(str(code), message, r.request_id)))
        self._done(r, False)

    def _end_here(self, r: Routed, reason: str, error: str | None) -> None:
        """End a request with finals made here, for each sample not finished yet."""
        usage, timings = P.Usage(0, 0, 0), P.Timings(None, None, time.monotonic() - r.arrived)
        for i in range(r.n):
            if i not in r.finished_indexes:
                self._send_client(r, P.encode(P.Final(r.request_id, i, [], "", reason, [], usage, timings, error)))
        self._done(r, True)

    def _send_client(self, r: Routed, data: bytes) -> bool:
        return self._sent(r.client, self._table.send(r.client, data, time.monotonic()))

    # ---- what replicas send --------------------------------------------------------------------------
    def _read_replica(self, link: Link) -> None:
        for _ in range(self.cfg.max_messages_per_drain):
            try:
                data = link.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            link.last_heard = time.monotonic()
            try:
                obj = msgpack.unpackb(data, raw=False)
                self._from_replica(link, obj)
            except Exception:           # a bad message from one replica must not stop the router
                log.exception("replica %d sent a message the router could not handle", link.slot)
            if link.sock is None:       # lost or stopped while handling
                return

    def _from_replica(self, link: Link, obj: dict) -> None:
        kind, tag = obj.get("type"), obj.get("tag")
        if kind in ("chunk", "final") or (kind == "error" and obj.get("request_id") and tag is None):
            return self._request_message(link, obj)
        if kind == "pong" and link.state == CONNECTING:
            link.set_state(UP)
            log.info("replica %d serving on %s %s", link.slot, link.endpoint, link.facts)
        elif kind == "stats_reply":
            link.stats = obj.get("stats") or {}
            link.fresh_got += tag == "f"
        elif kind == "model_info_reply" and self._info is None:
            self._info = obj.get("info") or {}
        elif tag in self._calls:
            client, client_tag = self._calls.pop(tag)
            obj["tag"] = client_tag
            if client_tag is None:
                del obj["tag"]
            self._sent(client, self._table.send(client, msgpack.packb(obj, use_bin_type=True), time.monotonic()))

    def _request_message(self, link: Link, obj: dict) -> None:
        r = self.routed.get(obj["request_id"])
        if r is None or r.slot != link.slot:
            return                      # a request given up on (its client went away, or it was rerouted)
        if obj["type"] == "error":
            if obj.get("code") in RETRYABLE:
                link.requests.discard(r.internal)
                return self._reroute(r, f"replica {link.slot} refused it ({obj.get('message')})")
            obj["request_id"] = r.request_id
            self._send_client(r, msgpack.packb(obj, use_bin_type=True))
            return self._done(r, False)
        obj["request_id"] = r.request_id
        r.streamed = True
        if not self._send_client(r, msgpack.packb(obj, use_bin_type=True)):
            return
        if obj["type"] == "final":
            r.finished_indexes.add(obj.get("index", 0))
            if len(r.finished_indexes) >= r.n:
                self._done(r, True)

    # ---- what clients ask ----------------------------------------------------------------------------
    def _dispatch(self, client: bytes, msg) -> None:
        if isinstance(msg, P.Generate):
            self._generate(client, msg)
        elif isinstance(msg, P.Abort):
            self._abort(client, msg)
        elif isinstance(msg, P.Stats):
            self._ask_stats(client, msg.tag)
        elif isinstance(msg, P.ModelInfo):
            if self._info is None:
                self._reply(client, P.Error(str(P.ErrorCode.OVERLOADED), "no replica is serving yet; retry when "
                                            "one has loaded the model", tag=msg.tag))
            else:
                self._reply(client, P.ModelInfoReply(self.model_info(), msg.tag))
        elif isinstance(msg, P.Scale):
            self._scale(client, msg)
        elif isinstance(msg, (P.Tokenize, P.Detokenize)):
            self._forward_call(client, msg)

    def _scale(self, client: bytes, msg: P.Scale) -> None:
        if not 1 <= msg.replicas <= self.rcfg.max_replicas:
            return self._reply(client, P.Error(str(P.ErrorCode.INVALID_MESSAGE), f"replicas must be from 1 to "
                                               f"{self.rcfg.max_replicas} (--max-replicas), got {msg.replicas}",
                                               tag=msg.tag))
        previous = self.fleet.target
        if self._autoscaler is not None:     # a person's choice moves the autoscaler's range along
            self._autoscaler.cfg.min_replicas = min(self._autoscaler.cfg.min_replicas, msg.replicas)
            self._autoscaler.cfg.max_replicas = max(self._autoscaler.cfg.max_replicas, msg.replicas)
        if msg.replicas != previous:
            log.info("scaling from %d to %d replicas on request", previous, msg.replicas)
            self.fleet.scale_to(msg.replicas)
        self._reply(client, P.ScaleReply(msg.replicas, previous, msg.tag))

    def _forward_call(self, client: bytes, msg) -> None:
        ups = self.fleet.serving()
        if not ups or self._stopping:
            return self._reply(client, P.Error(str(P.ErrorCode.OVERLOADED), "no replica is serving; retry later",
                                               tag=msg.tag))
        self._seq += 1
        tag = f"c{self._seq:x}"
        self._calls[tag] = (client, msg.tag)
        min(ups, key=lambda lk: len(lk.requests)).send(dataclasses.replace(msg, tag=tag))

    # ---- gauges --------------------------------------------------------------------------------------
    def _ask_stats(self, client: bytes, tag: str | None) -> None:
        """A client's `stats` is answered once every serving replica has sent fresh stats (or after
        FRESH_STATS_S), so counters read before and after a run cover exactly that run."""
        want = {}
        for link in self.links.values():
            if link.state in (UP, DRAINING) and link.sock is not None:
                link.fresh_asked += 1
                link.send(P.Stats("f"))
                want[link.slot] = link.fresh_asked
        self._stats_waits.append((client, tag, want, time.monotonic() + FRESH_STATS_S))

    def _answer_stats(self, now: float) -> None:
        keep = []
        for client, tag, want, deadline in self._stats_waits:
            if now < deadline and any(slot in self.links and self.links[slot].fresh_got < n
                                      for slot, n in want.items()):
                keep.append((client, tag, want, deadline))
            else:
                self._reply(client, P.StatsReply(self.stats(), tag))
        self._stats_waits = keep

    def stats(self) -> dict:
        replicas = {str(link.slot): link.stats for link in self.links.values() if link.stats}
        states = [link.state for link in self.links.values()]
        routing = {"policy": self.rcfg.routing.policy, "replicas_target": self.fleet.target,
                   "replicas_serving": states.count(UP), "requests_waiting_for_replica": len(self._pending),
                   **self.counts, "replicas_lost": self.fleet.lost_total, "scale_events": self.fleet.scale_events}
        return {**aggregate(replicas), **self.client_counters(), "routing": routing,
                "replicas": {str(link.slot): link.view() for link in self.links.values()}}

    def model_info(self) -> dict:
        return {**self._info, "replicas": self.fleet.target, "routing": self.rcfg.routing.policy,
                "max_message_bytes": self.cfg.max_message_bytes, "created": int(self._started_unix)}
