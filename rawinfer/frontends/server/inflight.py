"""The engine thread's record of one request in flight: whose it is, the output a non-streaming request holds
back for its final, and the messages it turns engine outputs into.

No socket and no engine here: the engine thread (worker.py) feeds it outputs and sends what it returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.server.handoff import Summary


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
    summary: Summary                 # for the log line once the last sample is finished
    held_logprobs: list              # non-streaming: per sample, the engine's Logprobs of its held tokens (or None)
    held_prompt_logprobs: list       # non-streaming: per sample, its prompt logprobs until the final (or None)

    @classmethod
    def start(cls, client: bytes, request_id: str, stream: bool, prompt_token_ids: list[int], n: int) -> "Inflight":
        return cls(client, request_id, stream, prompt_token_ids, n, [[] for _ in range(n)], [[] for _ in range(n)],
                   Summary(0, [], None, None), [None] * n, [None] * n)

    def chunk(self, out) -> P.Chunk | None:
        """The chunk for an unfinished engine output; None when not streaming (the tokens are held instead)."""
        if self.stream:
            return P.Chunk(self.request_id, out.index, out.new_token_ids, out.text_delta, wire_logprobs(out.logprobs),
                           wire_logprobs(out.prompt_logprobs))
        self.held_ids[out.index].extend(out.new_token_ids)
        self.held_text[out.index].append(out.text_delta)
        self._hold_logprobs(out)
        return None

    def _hold_logprobs(self, out) -> None:
        if out.logprobs is not None:
            held = self.held_logprobs[out.index]
            if held is None:
                self.held_logprobs[out.index] = out.logprobs.copy()
            else:
                held.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.held_prompt_logprobs[out.index] = out.prompt_logprobs

    def final(self, out, error: str | None = None) -> P.Final:
        """The final of one sample (with what it held back when not streaming); counts the sample finished."""
        ids, text = list(out.new_token_ids), out.text_delta
        logprobs, prompt_logprobs = out.logprobs, out.prompt_logprobs
        if not self.stream:
            ids = self.held_ids[out.index] + ids
            text = "".join(self.held_text[out.index]) + text
            self._hold_logprobs(out)
            logprobs, prompt_logprobs = self.held_logprobs[out.index], self.held_prompt_logprobs[out.index]
        m = out.metrics
        usage = P.Usage(m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens) if m else \
            P.Usage(len(self.prompt_token_ids), 0, len(ids))
        timings = P.Timings(m.ttft_s, m.mean_itl_s, m.e2e_s) if m else P.Timings(None, None, None)
        self.pending -= 1
        sm = self.summary
        sm.tokens += usage.completion_tokens
        sm.reasons.append(out.finish_reason)
        sm.ttft_s = timings.ttft_s if sm.ttft_s is None else sm.ttft_s
        sm.e2e_s = max(x for x in (sm.e2e_s, timings.e2e_s, 0.0) if x is not None)
        return P.Final(self.request_id, out.index, ids, text, out.finish_reason, self.prompt_token_ids, usage,
                       timings, error, wire_logprobs(logprobs), wire_logprobs(prompt_logprobs))


def wire_logprobs(lp) -> P.Logprobs | None:
    """The engine's Logprobs as the protocol's record (the same five lists)."""
    return None if lp is None else P.Logprobs(**asdict(lp))
