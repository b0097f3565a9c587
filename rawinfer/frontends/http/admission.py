"""Fair admission of HTTP jobs to the engine: the per-request limit on engine requests (prompts x n), and the
Gate that keeps one worker's engine requests under a capacity, letting waiting clients in by least share.

A job is admitted whole or not at all, before any of its engine requests is sent, so a job that is refused
or that waits has nothing running in the engine. A client is the peer's address as uvicorn reports it (a
trusted proxy's X-Forwarded-For, when one is in front): the API key is one secret shared by every client of
a server, so it cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Awaitable, Callable

from rawinfer.frontends.http.errors import APIError, invalid

if TYPE_CHECKING:
    from rawinfer.frontends.http.params import Job

MAX_WAITING_PER_CLIENT = 4096       # engine requests one client may have waiting at one worker; as many as the
                                    # engine takes in flight from all its clients (ServerConfig), so a single
                                    # client's burst is held here as it was held in the engine before
WAIT_POLL_S = 0.25                  # how often a waiting job checks that its client is still there


def job_size(job: "Job") -> int:
    """The engine requests a job makes: one per prompt and sample."""
    return len(job.prompts) * job.n


def check_size(job: "Job", limit: int) -> None:
    """400 for a job of more engine requests than one request may make (--max-prompts-per-request)."""
    size = job_size(job)
    if size <= limit:
        return
    param = "n" if job.n > 1 and len(job.prompts) <= limit else job.prompt_param
    raise invalid(param, f"the request asks for {len(job.prompts)} prompt(s) x n={job.n} = {size} generations, "
                  f"more than this server takes in one request ({limit}, `rawinfer serve --max-prompts-per-request`):"
                  f" send them in several requests")


class Ticket:
    """A job's place at the gate: waiting until `admitted` is set, then holding `size` engine requests until
    release() (idempotent) gives them back."""

    def __init__(self, gate: "Gate", client: str, size: int, order: int):
        self.gate, self.client, self.size, self.order = gate, client, size, order   # order: arrival, for ties
        self.admitted = asyncio.get_running_loop().create_future()
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.leave(self)


class Gate:
    """At most `capacity` engine requests of admitted jobs at once (a job bigger than the capacity is admitted
    alone). A job that does not fit, or arrives while others wait, waits in its client's queue; whenever
    capacity frees, the waiting client holding the fewest engine requests goes first (its oldest job), so a
    client flooding the worker holds no more than its share once others wait. One per event loop."""

    def __init__(self, capacity: int, max_waiting_per_client: int = MAX_WAITING_PER_CLIENT):
        self.capacity, self.max_waiting = capacity, max_waiting_per_client
        self.used = 0
        self.held: dict[str, int] = {}                 # client -> engine requests of its admitted jobs
        self.queues: dict[str, deque[Ticket]] = {}     # client -> its waiting jobs, oldest first
        self.waiting: dict[str, int] = {}              # client -> engine requests of its waiting jobs
        self._order = itertools.count()

    def _fits(self, size: int) -> bool:
        return self.used + size <= self.capacity or self.used == 0

    def _admit_now(self, t: Ticket) -> None:
        self.used += t.size
        self.held[t.client] = self.held.get(t.client, 0) + t.size
        if not t.admitted.done():
            t.admitted.set_result(None)

    async def enter(self, client: str, size: int, gone: Callable[[], Awaitable[bool]] | None = None) -> Ticket | None:
        """Wait until the job may start; its Ticket, or None when `gone()` says its client went away meanwhile
        (checked every WAIT_POLL_S). 429 when the client already has too much waiting."""
        t = Ticket(self, client, size, next(self._order))
        if not self.queues and self._fits(size):
            self._admit_now(t)
            return t
        if self.waiting.get(client, 0) + size > self.max_waiting:
            raise APIError(429, f"this client already has {self.waiting.get(client, 0)} generations waiting at this "
                           f"server (at most {self.max_waiting}); retry when some have finished",
                           code="rate_limit_exceeded")
        self.queues.setdefault(client, deque()).append(t)
        self.waiting[client] = self.waiting.get(client, 0) + size
        self._admit_waiting()                   # a client holding less than the others goes first if it fits
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(t.admitted), WAIT_POLL_S)
                    return t
                except asyncio.TimeoutError:
                    if gone is not None and await gone():
                        t.release()
                        return None
        except BaseException:
            t.release()
            raise

    def leave(self, t: Ticket) -> None:
        """Give back an admitted job's share, or take a waiting one out of its queue; admit who fits next."""
        if t.admitted.done():
            self.used -= t.size
            self.held[t.client] -= t.size
            if not self.held[t.client]:
                del self.held[t.client]
        else:
            t.admitted.cancel()
            queue = self.queues[t.client]
            queue.remove(t)
            self._unqueue(t)
        self._admit_waiting()

    def _unqueue(self, t: Ticket) -> None:
        self.waiting[t.client] -= t.size
        if not self.queues[t.client]:
            del self.queues[t.client]
            del self.waiting[t.client]

    def _admit_waiting(self) -> None:
        while self.queues:
            client = min(self.queues, key=lambda c: (self.held.get(c, 0), self.queues[c][0].order))
            head = self.queues[client][0]
            if not self._fits(head.size):
                return                      # it keeps its turn: the capacity it needs is kept for it
            self.queues[client].popleft()
            self._unqueue(head)
            self._admit_now(head)
