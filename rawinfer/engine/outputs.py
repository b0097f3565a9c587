"""Outputs: each sampled token becomes text, is checked against stop conditions, and may finish its
sequence — the per-sequence output state and the rules that end a sample.

For every sampled token of a sequence, in this order:

    text = detokenizer.add(token)                       incremental, never broken UTF-8
    stop strings (past min_tokens): hold back text that may begin one; a complete one ends the sample
    EOS / a stop token id (past min_tokens)             -> finish reason "stop"
    structured output: the grammar consumed the token and is complete (whatever min_tokens says;
    engine/structured.py)                               -> finish reason "stop"
    max_tokens or the model's context reached           -> finish reason "length"

At a finish for another reason than a stop string, the text the detokenizer and the stop checker held
back is released with the final output.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from rawinfer.core.sequence import FinishReason, Sequence
from rawinfer.engine.logprobs import Logprobs
from rawinfer.engine.metrics import RequestMetrics
from rawinfer.engine.stop import StopChecker, StopStrings
from rawinfer.engine.structured import SampleGrammar
from rawinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What one step produced for one sample of one request."""
    request_id: str
    index: int                      # sample index (0 unless n > 1)
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None        # "stop", "length", "abort", or "error" (with `error`)
    metrics: RequestMetrics | None = None   # set on the final output
    logprobs: Logprobs | None = None        # of new_token_ids, when the request asked (params.logprobs)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.., on a sample's first output (params.prompt_logprobs)
    error: str | None = None                # why the request failed (finish_reason "error"): e.g. its grammar
    scores: np.ndarray | None = None        # a scoring request's logits [T, V] float32, on its final output


def join_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One sample's outputs of one step (speculative decoding keeps several tokens) as one: tokens, text and
    log-probabilities in order, the rest from the last (prompt log-probabilities from the first)."""
    if len(outs) == 1:
        return outs[0]
    lps = [o.logprobs for o in outs if o.logprobs is not None]
    logprobs = None
    if lps:
        logprobs = lps[0].copy()
        for lp in lps[1:]:
            logprobs.extend(lp)
    return dataclasses.replace(outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids],
                               text_delta="".join(o.text_delta for o in outs), logprobs=logprobs,
                               prompt_logprobs=outs[0].prompt_logprobs)


@dataclass
class SampleState:
    """One sequence's output machinery: its random generator and, with a tokenizer, its text state (and
    with structured output its grammar's matcher); a scoring sequence's logits instead."""
    seq: Sequence
    rng: np.random.Generator | None                 # None for a scoring sequence (it samples nothing)
    detok: IncrementalDetokenizer | None = None
    stop: StopChecker | None = None
    prompt_logprobs: Logprobs | None = None    # filled during prefill when asked for; handed out once
    grammar: SampleGrammar | None = None        # structured_outputs, once its grammar has compiled
    scores: np.ndarray | None = None            # a scoring sequence's host logits [T, V], filled chunk by chunk


class OutputRules:
    """The finish rules of one engine (its tokenizer, end-of-sequence ids and context length)."""

    STOP_LISTS_KEPT = 16           # compiled stop lists kept for reuse (the samples of a request, repeated lists)

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._stop_lists: OrderedDict[tuple[str, ...], StopStrings] = OrderedDict()   # least recently used first

    def stop_strings(self, stop: list[str]) -> StopStrings:
        """The compiled form of a stop list, shared by every sample (and request) that uses the same list."""
        key = tuple(stop)
        compiled = self._stop_lists.get(key)
        if compiled is None:
            compiled = self._stop_lists[key] = StopStrings(key)
            if len(self._stop_lists) > self.STOP_LISTS_KEPT:
                self._stop_lists.popitem(last=False)
        else:
            self._stop_lists.move_to_end(key)
        return compiled

    def new_state(self, seq: Sequence, rng: np.random.Generator) -> SampleState:
        st = SampleState(seq, rng)
        if self.tokenizer is not None:
            st.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                                              skip_special_tokens=True)
            st.stop = StopChecker(self.stop_strings(seq.params.stop)) if seq.params.stop else None
        return st

    def add_token(self, st: SampleState, token: int, now: float) -> tuple[str, FinishReason | None]:
        """Append `token` to st's sequence; (text that may be shown now, the finish reason or None)."""
        seq, p = st.seq, st.seq.params
        seq.append_token(token, now)
        reason = None
        text = ""
        past_min = seq.num_output_tokens > p.min_tokens
        if st.detok is not None:
            text = st.detok.add(token)
            if st.stop is not None and past_min:
                upd = st.stop.add(text)
                text = upd.text
                if upd.stopped:
                    reason = FinishReason.STOP
        eos = (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
        complete = st.grammar is not None and st.grammar.advance(token)
        if reason is None and ((eos and past_min) or complete):
            reason = FinishReason.STOP
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None and st.detok is not None and not (st.stop is not None and st.stop.stopped):
            text += self._release(st)
        return text, reason

    @staticmethod
    def _release(st: SampleState) -> str:
        """At a finish without a stop string: the text the detokenizer and the stop checker held back."""
        tail = st.detok.finish()
        if st.stop is None:
            return tail
        upd = st.stop.add(tail)
        return upd.text if upd.stopped else upd.text + st.stop.flush()
