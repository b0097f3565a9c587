"""The server's record of the requests in flight: which client owns which engine request, the output a
non-streaming request holds back for its final, and when each client was last sent something.

No socket and no engine here: the serving loop (server.py) asks this table what to send and whom to
forget, and does the sending and the aborting itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from rawinfer.frontends.server import protocol as P


def engine_request_id(client: bytes, request_id: str) -> str:
    """The engine's id for a client's request: request ids are unique per connection only."""
    return f"{client.hex()}/{request_id}"


@dataclass
class Inflight:
    """One generate request of one client, as the loop tracks it."""
    client: bytes                    # ROUTER routing id of the sender
    request_id: str                  # the client's id
    stream: bool
    prompt_token_ids: list[int]
    pending: int                     # samples not finished yet
    held_ids: list[list[int]]        # non-streaming: tokens per sample, sent with the final
    held_text: list[list[str]]

    @classmethod
    def start(cls, client: bytes, request_id: str, stream: bool, prompt_token_ids: list[int], n: int) -> "Inflight":
        return cls(client, request_id, stream, prompt_token_ids, n, [[] for _ in range(n)], [[] for _ in range(n)])

    def chunk(self, out) -> P.Chunk | None:
        """The chunk for an unfinished engine output; None when not streaming (the tokens are held instead)."""
        if self.stream:
            return P.Chunk(self.request_id, out.index, out.new_token_ids, out.text_delta)
        self.held_ids[out.index].extend(out.new_token_ids)
        self.held_text[out.index].append(out.text_delta)
        return None

    def final(self, out, error: str | None = None) -> P.Final:
        """The final of one sample (with what it held back when not streaming); counts the sample finished."""
        ids, text = list(out.new_token_ids), out.text_delta
        if not self.stream:
            ids = self.held_ids[out.index] + ids
            text = "".join(self.held_text[out.index]) + text
        m = out.metrics
        usage = P.Usage(m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens) if m else \
            P.Usage(len(self.prompt_token_ids), 0, len(ids))
        timings = P.Timings(m.ttft_s, m.mean_itl_s, m.e2e_s) if m else P.Timings(None, None, None)
        self.pending -= 1
        return P.Final(self.request_id, out.index, ids, text, out.finish_reason, self.prompt_token_ids, usage,
                       timings, error)


class InflightTable:
    """Every request in flight, by engine id and by client; and the time each client with requests in flight
    was last sent a message (for heartbeats)."""

    def __init__(self):
        self._requests: dict[str, Inflight] = {}            # engine request id -> state
        self._by_client: dict[bytes, dict[str, str]] = {}    # routing id -> {client's id: engine id}
        self._last_sent: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_clients(self) -> int:
        """Clients with at least one request in flight."""
        return len(self._by_client)

    def engine_ids(self) -> list[str]:
        return list(self._requests)

    def get(self, engine_id: str) -> Inflight | None:
        return self._requests.get(engine_id)

    def lookup(self, client: bytes, request_id: str) -> str | None:
        """The engine id of a client's request in flight, or None."""
        return self._by_client.get(client, {}).get(request_id)

    def add(self, engine_id: str, st: Inflight, now: float) -> None:
        self._by_client.setdefault(st.client, {})[st.request_id] = engine_id
        self._last_sent.setdefault(st.client, now)
        self._requests[engine_id] = st

    def finish(self, engine_id: str, st: Inflight, out, error: str | None = None) -> P.Final:
        """The final of one sample of `st`; the request is forgotten once its last sample is finished."""
        msg = st.final(out, error)
        if st.pending == 0:
            self._forget(engine_id, st)
        return msg

    def _forget(self, engine_id: str, st: Inflight) -> None:
        self._requests.pop(engine_id, None)
        mine = self._by_client.get(st.client)
        if mine is not None:
            mine.pop(st.request_id, None)
            if not mine:
                del self._by_client[st.client]
                self._last_sent.pop(st.client, None)

    def drop_client(self, client: bytes) -> list[str]:
        """Forget a client and all its requests; their engine ids (for the engine to abort)."""
        mine = self._by_client.pop(client, None)
        self._last_sent.pop(client, None)
        if not mine:
            return []
        for engine_id in mine.values():
            self._requests.pop(engine_id, None)
        return list(mine.values())

    def sent(self, client: bytes, now: float) -> None:
        """Note a message sent to a client (only clients with requests in flight are tracked)."""
        if client in self._last_sent:
            self._last_sent[client] = now

    def heartbeats_due(self, now: float, interval_s: float) -> list[bytes]:
        """Clients with requests in flight that have been sent nothing for interval_s."""
        return [c for c, t in self._last_sent.items() if now - t >= interval_s]
