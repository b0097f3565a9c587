"""LLMEngine.score: teacher-forced logits at every position of a token sequence, through the paged cache.

A scored sequence is scheduled like any request (its own chunk sizes, every row gets logits): requests in
flight keep running meanwhile and their outputs wait in the engine for its next step().
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from rawinfer.core.sequence import FinishReason, Sequence
from rawinfer.core.step_plan import ScheduledBatch
from rawinfer.exec.runner import StepOutput
from rawinfer.sampling import SamplingParams


class Scoring:
    """LLMEngine's scoring half (a mixin: it uses the engine's scheduler, _scores and _run)."""

    def score(self, token_ids: list[int], chunk_sizes: int | Iterable[int] | None = None) -> np.ndarray:
        """Logits [T, V] float32 at every position of token_ids, computed through the paged cache in
        chunks (an int: fixed chunk size; a list: e.g. [21, 1, 1, ...] = prefill then decode steps),
        each chunk at most max_num_batched_tokens. The scoring sequence is scheduled like any request
        (other requests in flight keep running; their outputs come with the next step())."""
        ids = self.encode_prompt(list(token_ids))
        T = len(ids)
        limit = self.config.max_num_batched_tokens
        if chunk_sizes is None:
            chunk_sizes = limit
        if isinstance(chunk_sizes, int):
            sizes = (chunk_sizes,) * (-(-T // chunk_sizes))
        else:
            sizes = tuple(int(n) for n in chunk_sizes)
        if any(n < 1 for n in sizes):
            raise ValueError(f"chunk sizes must be positive, got {list(sizes)}")
        covered = sum(min(n, limit) for n in sizes)
        if covered < T:
            raise ValueError(f"chunk_sizes cover {covered} of {T} tokens")
        self._check_fits(T, 1, f"the scored sequence ({T} tokens)")
        sid = ("score", time.monotonic_ns())          # a tuple: never equal to a request's id
        seq = Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=ids, params=SamplingParams(),
                       chunk_sizes=sizes)
        self._scores[sid] = np.empty((T, self.model_config.vocab_size), np.float32)
        self.scheduler.add(seq)
        try:
            while not seq.is_finished:
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    raise RuntimeError("the KV pool is too small (or too busy) to score this sequence")
                self._pending += self._run(batch)
            return self._scores[sid]
        finally:
            del self._scores[sid]
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)

    def _store_scores(self, batch: ScheduledBatch, result: StepOutput) -> None:
        """Copy the scored rows of this step into their sequences' logits; finish the sequences done."""
        row = 0
        for s in batch.seqs:
            if not s.scores:
                continue
            seq, n = s.seq, s.num_new_tokens
            end = seq.num_computed_tokens                       # advance() has moved it past this chunk
            self._scores[seq.seq_id][end - n:end] = result.score_logits[row:row + n]
            row += n
            if end == seq.num_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
