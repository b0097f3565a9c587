"""Scoring (teacher forcing) as a request kind: the logits at every position of a token sequence, computed
through the paged cache in the chunks the caller chose, handed out with the request's final output.

A scoring request is one Sequence with chunk_sizes (core/sequence.py): the scheduler takes each chunk whole
(or waits for a step with room for it), never reads or registers the prefix cache, gives every row of the
chunk logits on the host (StepPlan.score_rows) and finishes it (length) once its last chunk is computed.
LLMEngine.add_score queues one beside any other request and its logits come out of step() as
RequestOutput.scores; LLMEngine.score is the blocking form, for an engine with nothing else in flight.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from rawinfer.core.scheduler import SchedulerOutput
from rawinfer.core.sequence import Sequence
from rawinfer.sampling import SamplingParams


def score_sequence(request_id: str, ids: list[int], chunk_sizes: int | Iterable[int] | None, limit: int) -> Sequence:
    """The sequence of a scoring request of token ids `ids` computed in chunks: an int (a fixed size), sizes (e.g.
    [21, 1, 1, ...]: a prefill then decode steps) or None (the step's token budget, `limit`); a chunk takes at
    most `limit` tokens. ValueError unless every size is positive and the chunks cover every token."""
    num_tokens = len(ids)
    if chunk_sizes is None:
        chunk_sizes = limit
    if isinstance(chunk_sizes, int):
        sizes = (chunk_sizes,) * (-(-num_tokens // chunk_sizes)) if chunk_sizes > 0 else (chunk_sizes,)
    else:
        sizes = tuple(int(n) for n in chunk_sizes)
    if any(n < 1 for n in sizes):
        raise ValueError(f"chunk sizes must be positive, got {list(sizes)}")
    covered = sum(min(n, limit) for n in sizes)
    if covered < num_tokens:
        raise ValueError(f"chunk_sizes cover {covered} of {num_tokens} tokens")
    return Sequence(seq_id=request_id, request_id=request_id, index=0, prompt_token_ids=ids, params=SamplingParams(),
                    chunk_sizes=sizes)


def store_scores(out: SchedulerOutput, logits: np.ndarray | None, state_of) -> None:
    """File a step's scored rows (the runner's host logits [R, V], in batch order) into their requests' buffers
    (state_of(seq).scores), by position: a sequence restarted by preemption overwrites what it computed
    before. After scheduler.update()."""
    row = 0
    for s in out.seqs:
        if s.scores:
            seq, n = s.seq, s.num_new_tokens
            end = seq.num_computed_tokens                       # update() has moved it past this chunk
            state_of(seq).scores[end - n:end] = logits[row:row + n]
            row += n
