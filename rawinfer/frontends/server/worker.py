"""The engine thread: owns the LLMEngine, adds the requests the admission thread made ready, steps, and turns
every engine output into an encoded message for the I/O thread to send.

It never touches the socket and never tokenises, so neither a slow client nor a huge prompt holds up a step.
While the engine has work, whatever has arrived in the inbox is taken in before the next step (so a new
request joins the very next step); while it has none the thread sleeps on the inbox. After taking in and
after every step it publishes the engine's gauges (`snapshot`) before it hands over the messages, so a
client that has read a final and then asks for stats sees the blocks of that request already freed.
"""

from __future__ import annotations

import logging
import queue
import threading

from rawinfer.engine.warmup import warm_thread
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.handoff import Admit, Cancel, Outbound, Outgoing, Stop
from rawinfer.frontends.server.inflight import Inflight

log = logging.getLogger("rawinfer")

MAX_TAKEN_PER_STEP = 512      # inbox items taken in between two steps (each is an add_request or an abort)
LINK_POLL_S = 0.002           # decode role: how long an idle engine waits on the inbox while K/V are on the way


class EngineWorker:
    """Runs the engine on its own thread; fed through `inbox` (Admit, Cancel, Stop), answering via `outbound`."""

    def __init__(self, engine, outbound: Outbound, connector=None):
        """connector: the decode role's prefill link (frontends/disagg/connector.py), used from this thread
        only; None when colocated."""
        self.engine, self.outbound, self.connector = engine, outbound, connector
        self.inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Inflight] = {}           # engine request id -> state
        self.snapshot: dict = engine.stats()               # replaced whole, read by the I/O thread
        self.ready = threading.Event()                     # set once this thread has taken its first steps
        self.thread = threading.Thread(target=self._run, name="rawinfer-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # ---- the loop ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # the warm-up ran on the thread that built the engine; this one's first steps would pay its own
            # first-use costs (warmup.warm_thread) in the first request's TTFT: before the server answers
            if self.engine.config.warmup:
                log.debug("engine thread warmed up in %.2f s", warm_thread(self.engine))
            self.ready.set()
            while True:
                items = self._take()
                out: list[Outgoing] = []
                stop = False
                for item in items:
                    if isinstance(item, Stop):
                        stop = True
                    elif isinstance(item, Admit):
                        out += self._admit(item)
                    elif isinstance(item, Cancel):
                        out += self._cancel(item)
                if stop:
                    self._shutdown(out)
                    return
                if self.connector is not None:
                    out += self._poll_link()
                self._publish(out)
                if self.engine.has_unfinished():
                    self._publish(self._step())
        except BaseException:         # the I/O thread must still hear that nothing more will come
            log.exception("the engine thread failed")
            raise
        finally:
            self.ready.set()

    def _take(self) -> list:
        """Block for the first item while the engine is idle; then everything waiting, up to a bound."""
        items = []
        if self.connector is not None and not self.engine.has_unfinished():
            try:        # wake up for arriving K/V and the link's heartbeats
                wait = LINK_POLL_S if self.connector.num_inflight else self.connector.cfg.heartbeat_s
                items.append(self.inbox.get(timeout=wait))
            except queue.Empty:
                pass
        elif not self.engine.has_unfinished():
            items.append(self.inbox.get())
        while len(items) < MAX_TAKEN_PER_STEP:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        return items

    def _publish(self, out: list[Outgoing]) -> None:
        snapshot = self.engine.stats()
        if self.connector is not None:           # the decode role's transfers: remote, local, fallbacks, bytes
            snapshot["kv_transfer"] = dict(self.connector.counters)
            snapshot["prefill_instances"] = self.connector.peer_stats()
        self.snapshot = snapshot
        self.outbound.put(out)

    def _shutdown(self, out: list[Outgoing]) -> None:
        n = len(self._requests)
        for engine_id in list(self._requests):
            out += self._abort(engine_id)
        if self.connector is not None:
            self.connector.close()
        log.info("shut down; aborted %d request(s) in flight", n)
        self._publish(out)

    # ---- requests ------------------------------------------------------------------------------------------
    def _admit(self, a: Admit) -> list[Outgoing]:
        try:
            ids = self.engine.add_request(a.engine_id, a.prompt_ids, a.params, a.priority)
        except ValueError as e:         # RequestRejected: beyond the context or the pool
            return [refusal(a.client, a.engine_id, P.Error(str(P.ErrorCode.REJECTED), str(e), a.request_id))]
        self._requests[a.engine_id] = Inflight.start(a.client, a.request_id, a.stream, ids, a.params.n)
        if self.connector is not None:
            self.connector.submit(a.engine_id)
        return []

    def _cancel(self, c: Cancel) -> list[Outgoing]:
        if c.notify:
            return self._abort(c.engine_id)
        st = self._requests.pop(c.engine_id, None)
        if self.connector is not None:
            self.connector.abort(c.engine_id)
        self.engine.abort(c.engine_id)       # frees its KV blocks now; nobody is left to tell
        return [Outgoing(st.client if st else b"", None, c.engine_id, ends=True)]

    def _abort(self, engine_id: str, error: str | None = None) -> list[Outgoing]:
        """Abort in the engine; a final for every sample not finished yet (reason `abort`, or `error` with the
        reason given): the engine returns one per unfinished sample, forked or not."""
        if self.connector is not None:
            self.connector.abort(engine_id)
        return self._finals(engine_id, self.engine.abort(engine_id), error)

    def _poll_link(self) -> list[Outgoing]:
        """Arriving K/V let their requests run; a transfer failed under policy `fail` ends its request."""
        return [o for f in self.connector.poll(0) for o in self._finals(f.request_id, f.outputs, f.reason)]

    def _finals(self, engine_id: str, outs: list, error: str | None) -> list[Outgoing]:
        if engine_id not in self._requests:
            return []
        for out in outs:
            if error is not None:
                out.finish_reason = "error"
        return [self._final(engine_id, out, error) for out in outs]

    def _final(self, engine_id: str, out, error: str | None = None) -> Outgoing:
        st = self._requests[engine_id]
        msg = st.final(out, error)
        ends = st.pending == 0
        if ends:
            del self._requests[engine_id]
        return Outgoing(st.client, P.encode(msg), engine_id, ends=ends, is_final=True,
                        summary=st.summary if ends else None)

    # ---- one step ------------------------------------------------------------------------------------------
    def _step(self) -> list[Outgoing]:
        try:
            outputs = self.engine.step()
        except Exception as e:          # fail the requests in flight, keep serving the next ones
            log.exception("engine step failed")
            return self._fail_all(f"the engine failed ({type(e).__name__}: {e}); the request was aborted")
        out = []
        for o in outputs:
            st = self._requests.get(o.request_id)
            if st is None:              # cancelled in this very batch
                continue
            if o.finished:                  # o.error: a request that failed (its grammar did not compile)
                out.append(self._final(o.request_id, o, o.error))
            else:
                chunk = st.chunk(o)
                if chunk is not None:
                    out.append(Outgoing(st.client, P.encode(chunk), o.request_id))
        return out

    def _fail_all(self, reason: str) -> list[Outgoing]:
        """After a failed step: every request in flight ends with `reason`. Should aborting one fail too (the
        step left the engine's bookkeeping inconsistent), the engine starts over empty and the requests
        not yet ended get an `internal` error, so this thread, and every other client, goes on."""
        out: list[Outgoing] = []
        broken = False
        for engine_id in list(self._requests):
            try:
                out += self._abort(engine_id, reason)
            except Exception:
                log.exception("aborting %s after the failed step failed too", engine_id)
                broken = True
        if broken or self.engine.num_requests:
            self.engine.discard_all()
            for engine_id, st in list(self._requests.items()):
                del self._requests[engine_id]
                out.append(refusal(st.client, engine_id, P.Error(str(P.ErrorCode.INTERNAL), reason, st.request_id)))
        return out


def refusal(client: bytes, engine_id: str, err: P.Error) -> Outgoing:
    """The `error` that ends a request which never ran."""
    return Outgoing(client, P.encode(err), engine_id, ends=True)
