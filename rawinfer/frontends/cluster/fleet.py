"""The router's replicas: starting them, connecting to them, watching that they answer, scaling and draining.

It owns the links (links.py) and the supervisor (pool.py) and runs on the router's loop thread. What it
finds out about requests, a lost replica's ones, it hands back to the router, which decides their fate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import zmq

from rawinfer.frontends.cluster.links import CONNECTING, DRAINING, LOST, STARTING, STOPPING, UP, Link
from rawinfer.frontends.cluster.pool import ReplicaFailed, ReplicaPool, ReplicaStopped, ReplicaUp, Supervisor
from rawinfer.frontends.cluster.routing import PrefixRecord
from rawinfer.frontends.server import protocol as P

log = logging.getLogger("rawinfer")


@dataclass
class FleetConfig:
    record_capacity: int             # piece hashes remembered per replica (routing.py)
    start_timeout_s: float           # for a replica to load its model and serve
    lost_after_s: float              # a replica silent this long is LOST
    probe_interval_s: float          # ping + stats to every replica this often
    curve: tuple[bytes, bytes, bytes] | None = None


class Fleet:
    def __init__(self, pool: ReplicaPool, wake: Callable[[], None], ctx: zmq.Context, cfg: FleetConfig):
        self.cfg, self.ctx = cfg, ctx
        self.supervisor = Supervisor(pool, wake, cfg.start_timeout_s)
        self.links: dict[int, Link] = {}
        self.target = 0
        self.lost_total = self.scale_events = 0

    def serving(self) -> list[Link]:
        return [link for link in self.links.values() if link.state == UP]

    def routable(self, now: float) -> list[Link]:
        """The serving replicas that answered within two probe intervals: one that misses a heartbeat gets no
        new request until it answers again (or is found lost, lost_after_s after it went silent)."""
        return [link for link in self.serving() if now - link.last_heard <= 2 * self.cfg.probe_interval_s]

    def connected(self) -> list[Link]:
        return [link for link in self.links.values() if link.sock is not None]

    def close(self) -> None:
        self.supervisor.close()
        for link in self.links.values():
            link.disconnect()

    # ---- starting and stopping -----------------------------------------------------------------------
    def add(self) -> None:
        slot = max(self.links, default=-1) + 1
        self.links[slot] = Link(slot, PrefixRecord(self.cfg.record_capacity))
        self.supervisor.start(slot)

    def scale_to(self, n: int) -> None:
        """Aim for n replicas: start new ones, or drain the least useful (not serving yet, then fewest requests)."""
        self.scale_events += 1
        self.target = n
        active = [link for link in self.links.values() if link.state not in (DRAINING, STOPPING)]
        for _ in range(n - len(active)):
            self.add()
        order = {STARTING: 0, LOST: 1, CONNECTING: 2, UP: 3}
        victims = sorted(active, key=lambda lk: (order.get(lk.state, 0), len(lk.requests), -lk.slot))
        for link in victims[:max(0, len(active) - n)]:
            log.info("draining replica %d (%d request(s) in flight)", link.slot, len(link.requests))
            link.set_state(DRAINING)

    def drain(self) -> None:
        """Stop the draining replicas that have no request left."""
        for link in list(self.links.values()):
            if link.state == DRAINING and not link.requests:
                link.set_state(STOPPING)
                link.disconnect()
                self.supervisor.stop(link.slot)

    # ---- what the supervisor found ---------------------------------------------------------------------
    def handle_events(self) -> None:
        while not self.supervisor.events.empty():
            ev = self.supervisor.events.get_nowait()
            link = self.links.get(ev.slot)
            if link is None:
                continue
            if isinstance(ev, ReplicaStopped):
                link.disconnect()
                del self.links[ev.slot]
                log.info("replica %d stopped", ev.slot)
            elif link.state in (DRAINING, STOPPING):
                continue
            elif isinstance(ev, ReplicaUp):
                link.connect(self.ctx, ev.endpoint, self.cfg.curve)
                link.facts = dict(ev.facts)
                link.set_state(CONNECTING)
                link.send(P.Ping("p"))
                link.send(P.ModelInfo("i"))
            elif isinstance(ev, ReplicaFailed):
                log.warning("replica %d is not serving: %s; trying again", ev.slot, ev.why)
                link.set_state(LOST)

    # ---- watching ------------------------------------------------------------------------------------
    def probe(self, now: float) -> list[tuple[list[str], str]]:
        """Ping and ask stats of every connected replica each probe interval; those whose connection closed
        and those silent for lost_after_s are lost: (their requests' internal ids, why) for each."""
        interval, lost = self.cfg.probe_interval_s, []
        for link in list(self.links.values()):
            if link.state == LOST and now - link.since >= interval:
                link.since = now
                self.supervisor.recover(link.slot)
            if link.sock is None or link.state not in (CONNECTING, UP, DRAINING):
                continue
            if link.dropped():
                why = f"replica {link.slot} was lost (its connection closed)"
                lost.append((self.lose(link, why), why))
            elif now - link.last_heard > self.cfg.lost_after_s:
                why = f"replica {link.slot} was lost (silent for {now - link.last_heard:.1f} s)"
                lost.append((self.lose(link, why), why))
            elif now - link.last_probe >= interval:
                link.last_probe = now
                link.send(P.Ping("p"))
                link.send(P.Stats("s"))
        return lost

    def lose(self, link: Link, why: str) -> list[str]:
        """Take a replica out of the rotation and have the pool bring it back; its requests' internal ids."""
        log.warning("%s; %d request(s) in flight there", why, len(link.requests))
        self.lost_total += 1
        link.lost_total += 1
        link.disconnect()
        link.record.clear()                   # a restarted replica starts with an empty prefix cache
        link.stats = {}
        requests = sorted(link.requests)
        link.requests.clear()
        if link.state == DRAINING:            # it was going anyway
            link.set_state(STOPPING)
            self.supervisor.stop(link.slot)
        else:
            link.set_state(LOST)
            self.supervisor.recover(link.slot)
        return requests
