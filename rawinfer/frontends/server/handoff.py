"""What the server's three threads hand each other: requests ready for the engine, cancellations, and the
encoded messages (with what the I/O thread must know about them) going back out.

    I/O thread ──Prepare/Convert/Cancel──> admission thread ──Admit/Cancel──> engine thread
        ^                                │ Outgoing (refusals)              │ Outgoing (chunks, finals, Ended)
        └────────────── Outbound (a deque and a wake-up) <──────────────────┘

Every item for one request travels the same FIFO path, so a cancellation never overtakes its request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P


@dataclass
class Prepare:
    """A generate whose cheap checks passed on the I/O thread; the admission thread tokenises and sizes it."""
    engine_id: str
    client: bytes
    msg: P.Generate
    params: SamplingParams


@dataclass
class Admit:
    """A request ready for engine.add_request: its prompt already token ids, its size already checked."""
    engine_id: str
    client: bytes
    request_id: str
    stream: bool
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass
class Convert:
    """A tokenize or detokenize call, answered by the admission thread (tokenising stalls neither the socket
    nor the engine)."""
    client: bytes
    msg: P.Tokenize | P.Detokenize


@dataclass
class Cancel:
    """Stop a request. notify: its client asked (it gets `abort` finals); else its client is gone (nothing
    is sent; an Outgoing with ends=True and no data tells the I/O thread the blocks are free)."""
    engine_id: str
    notify: bool


@dataclass
class Stop:
    """Shut down: the admission thread refuses what is still queued; the engine thread aborts every request
    (each gets `abort` finals) and exits."""


@dataclass
class Summary:
    """What the per-request log line says about a request that ended."""
    tokens: int
    reasons: list[str]
    ttft_s: float | None
    e2e_s: float | None


@dataclass
class Outgoing:
    """One message for one client, already encoded (None: nothing to send, only the note). ends: this is the
    request's last message (its last final, or the error that refused it). engine_id None: a reply to a call
    (tokenize, detokenize), not part of a request."""
    client: bytes
    data: bytes | None
    engine_id: str | None = None
    ends: bool = False
    is_final: bool = False               # a `final` (the request ran), not an `error` (it was refused)
    summary: Summary | None = None


@dataclass
class Outbound:
    """Messages from the worker threads to the I/O thread, which alone touches the socket. put() wakes it."""
    wake: Callable[[], None]
    _items: deque = field(default_factory=deque)

    def put(self, items: list[Outgoing]) -> None:
        if items:
            self._items.extend(items)        # deque.extend is atomic for other threads
            self.wake()

    def take(self, limit: int) -> list[Outgoing]:
        out = []
        while self._items and len(out) < limit:
            out.append(self._items.popleft())
        return out

    def __len__(self) -> int:
        return len(self._items)
