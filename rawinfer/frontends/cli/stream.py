"""Printing one streamed generation: the loop shared by `rawinfer generate` and `rawinfer client`.

Both commands turn their source into the same events (token ids, text delta, and on the last one the
final numbers) and hand them to print_stream, which writes the text as it comes, or one JSON object
with --json, and the summary line at the end. engine_events and client_events are the two adapters.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

from rawinfer.frontends.options import EXIT_FAILED, CLIError


@dataclass
class Final:
    """What the last event of a generation knows: its prompt, why it ended, its timings."""
    prompt_token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None
    itl_s: float | None
    tokens_per_s: float | None
    error: str | None = None          # why the server failed the request (finish_reason "error")


@dataclass
class Event:
    """New tokens and their text; `final` is set on the generation's last event only."""
    token_ids: list[int]
    text: str
    final: Final | None = None


def result_json(text: str, token_ids: list[int], prompt_token_ids: list[int], finish_reason: str | None,
                ttft_s: float | None, itl_s: float | None, tokens_per_s: float | None) -> dict:
    """The --json object of `rawinfer generate` and `rawinfer client` (same keys)."""
    return {"text": text, "token_ids": token_ids, "prompt_token_ids": prompt_token_ids,
            "finish_reason": finish_reason, "ttft_s": ttft_s, "itl_s": itl_s, "tokens_per_s": tokens_per_s}


def summary_line(n_prompt: int, n_gen: int, ttft: float | None, itl: float | None, tps: float | None) -> str:
    ms = (lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms")
    return (f"[prompt {n_prompt} tokens | generated {n_gen} tokens | TTFT {ms(ttft)} | mean ITL {ms(itl)} | "
            f"{'n/a' if tps is None else f'{tps:.1f}'} tokens/s]")


def print_stream(events: Iterable[Event], as_json: bool, quiet: bool = False, show_ids: bool = False) -> Final:
    """Text to stdout as it arrives (token ids instead with show_ids: a model without a tokenizer), then a
    newline and the summary on stderr (not when quiet); with as_json only one JSON object (result_json)
    on stdout once the generation has ended. A generation that was aborted or failed is then a CLIError
    with exit status 1: the text so far is printed, and one line says why it stopped."""
    ids: list[int] = []
    text: list[str] = []
    final = None
    for ev in events:
        ids.extend(ev.token_ids)
        text.append(ev.text)
        shown = " ".join(map(str, ev.token_ids)) + " " if show_ids and ev.token_ids else ev.text
        if not as_json and shown:
            sys.stdout.write(shown)
            sys.stdout.flush()
        if ev.final is not None:
            final = ev.final
    f = final
    if f is None:
        if not as_json:
            sys.stdout.write("\n")
        raise CLIError("the generation ended without its final message", EXIT_FAILED)
    if as_json:
        print(json.dumps(result_json("".join(text), ids, f.prompt_token_ids, f.finish_reason, f.ttft_s, f.itl_s,
                                     f.tokens_per_s)))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not quiet:
            print(summary_line(len(f.prompt_token_ids), len(ids), f.ttft_s, f.itl_s, f.tokens_per_s), file=sys.stderr)
    if f.finish_reason == "abort":
        raise CLIError(f"the request was aborted after {len(ids)} tokens, before it finished (the server shut "
                       "down or stopped it)", EXIT_FAILED)
    if f.finish_reason == "error":
        raise CLIError(f"the server failed the request after {len(ids)} tokens: {f.error}", EXIT_FAILED)
    return f


def _decode_rate(n_generated: int, gen_s: float | None) -> float | None:
    """Tokens/s after the first token: the first one's time is TTFT, so n - 1 tokens over the rest."""
    return (n_generated - 1) / gen_s if gen_s and n_generated > 1 else None


def engine_events(engine, prompt_token_ids: list[int]) -> Iterator[Event]:
    """Events of the one request in a local LLMEngine, stepping it until it has finished."""
    while engine.has_unfinished():
        for out in engine.step():
            final = None
            if out.finished:
                m = out.metrics
                gen_s = (m.finished_time - m.first_token_time) if m.first_token_time and m.finished_time else None
                final = Final(prompt_token_ids, out.finish_reason, m.ttft_s, m.mean_itl_s,
                              _decode_rate(m.generated_tokens, gen_s))
            yield Event(out.new_token_ids, out.text_delta, final)


def client_events(messages: Iterable) -> Iterator[Event]:
    """Events of one request's messages from `Client.generate` (a failed request's final carries its error)."""
    for msg in messages:
        final = None
        if msg.finished:
            t = msg.timings
            gen_s = t.e2e_s - t.ttft_s if t.e2e_s is not None and t.ttft_s is not None else None
            final = Final(msg.prompt_token_ids, msg.finish_reason, t.ttft_s, t.mean_itl_s,
                          _decode_rate(msg.usage.completion_tokens, gen_s), getattr(msg, "error", None))
        yield Event(msg.token_ids, msg.text, final)
