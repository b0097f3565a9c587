"""Who starts, finds and stops the replicas behind a router, and the thread that asks them.

A ReplicaPool owns engine replicas by slot number (ray_pool.py on a Ray cluster; tests use processes of
their own). Its calls block (a replica loads its model for seconds; a restarted one is waited for), so
the router never calls it: it posts commands to a Supervisor, whose threads call the pool and post the
answers back as events the router's loop reads after a wake-up.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

log = logging.getLogger("rawinfer")


class ReplicaPool(Protocol):
    def start(self, slot: int) -> None:
        """Begin starting replica `slot` (returns at once)."""

    def endpoint(self, slot: int, timeout_s: float) -> tuple[str, dict]:
        """Wait until replica `slot` serves (after a restart too): its ZeroMQ endpoint and facts about it
        (pid, node); RuntimeError when it does not within timeout_s or is gone for good."""

    def stop(self, slot: int) -> None:
        """Stop replica `slot` for good (it has been drained)."""

    def close(self) -> None:
        """Stop every replica."""


@dataclass
class ReplicaUp:
    slot: int
    endpoint: str
    facts: dict = field(default_factory=dict)


@dataclass
class ReplicaFailed:
    slot: int
    why: str


@dataclass
class ReplicaStopped:
    slot: int


class Supervisor:
    """Runs pool calls on worker threads; each answer becomes an event for the router (then wake() is called)."""

    def __init__(self, pool: ReplicaPool, wake: Callable[[], None], start_timeout_s: float):
        self.pool, self._wake, self.start_timeout_s = pool, wake, start_timeout_s
        self.events: queue.Queue = queue.Queue()
        self._exec = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rawinfer-replicas")
        self._lock = threading.Lock()
        self._busy: set[int] = set()         # slots with a start or recovery under way

    def _post(self, event) -> None:
        self.events.put(event)
        self._wake()

    def start(self, slot: int) -> None:
        """Start a new replica in `slot`; ReplicaUp or ReplicaFailed follows."""
        with self._lock:
            self._busy.add(slot)
        self._exec.submit(self._start, slot)

    def recover(self, slot: int) -> None:
        """A replica stopped answering: wait for it to serve again (Ray restarts dead actors)."""
        with self._lock:
            if slot in self._busy:
                return
            self._busy.add(slot)
        self._exec.submit(self._find, slot)

    def stop(self, slot: int) -> None:
        self._exec.submit(self._stop, slot)

    def _start(self, slot: int) -> None:
        try:
            self.pool.start(slot)
        except Exception as e:
            return self._done(slot, ReplicaFailed(slot, f"could not start: {e}"))
        self._find(slot)

    def _find(self, slot: int) -> None:
        try:
            endpoint, facts = self.pool.endpoint(slot, self.start_timeout_s)
        except Exception as e:
            return self._done(slot, ReplicaFailed(slot, str(e)))
        self._done(slot, ReplicaUp(slot, endpoint, facts))

    def _stop(self, slot: int) -> None:
        try:
            self.pool.stop(slot)
        except Exception as e:           # stopping is best effort: the replica is out of the rotation already
            log.warning("replica %d did not stop cleanly: %s", slot, e)
        self._post(ReplicaStopped(slot))

    def _done(self, slot: int, event) -> None:
        with self._lock:
            self._busy.discard(slot)
        self._post(event)

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
