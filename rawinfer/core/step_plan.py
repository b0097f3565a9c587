"""StepPlan: everything one forward pass needs, built on the host once per step by the scheduler.

The scheduler decides which sequences advance by how many tokens; `build_step_plan` turns that
decision into flat arrays. The model runner executes a plan as it is: it never reads the block manager
or a sequence, and the data of a step flows one way, core -> exec -> backend.

A step of B sequences whose new tokens total T rows, S of which need sampled logits:

    token_ids[T], positions[T]     the new tokens, sequence after sequence
    slot_mapping[T]                where each token's K/V goes: table[pos // BS] * BS + pos % BS
    block_tables[B, W]             each sequence's physical blocks (W: the longest table this step;
                                   shorter rows padded with pad_block, never read)
    context_lens[B]                tokens of sequence b in the cache once this step has written its K/V
    query_start_loc[B+1]           rows of sequence b: query_start_loc[b] : query_start_loc[b+1]
    logits_indices[S]              the last row of each sequence whose next token is sampled, in batch order
                                   (a sequence with draft tokens: its last 1 + len(draft) rows)
    score_rows[R]                  every row of a scoring (teacher-forced) sequence, in batch order
    prompt_rows[Q]                 rows whose next token is a prompt token of a sequence that wants prompt
    prompt_targets[Q]              log-probabilities, and that token (prompt_top: alternatives to compute)
    copies                         copy-on-write (src, dst) block pairs to copy before the forward pass
    graph_bucket                   a pure decode step that fits a captured graph: the graph's batch size
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from rawinfer.core.sequence import Sequence
from rawinfer.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class PlanLayout:
    """How plans are shaped for the runner that executes them (given by the engine at start)."""

    block_size: int
    graph_buckets: tuple[int, ...] = ()    # decode batch sizes with a captured graph (empty: always eager)
    pad_block: int = 0                     # fills block-table entries past a sequence's blocks


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step, decided by the scheduler."""

    seq: Sequence
    num_new_tokens: int
    samples: bool            # the chunk reaches the last known token and the next one is to be sampled
    prompt_logprob_rows: int = 0   # the chunk's first rows whose next token is a prompt token whose
                                   # log-probability the request wants (Sequence.wants_prompt_logprobs)
    forks: tuple[Sequence, ...] = ()   # the other samples of an n > 1 request, forked from this one once the
                                       # chunk computed its prompt: they draw from its logits row
    draft: tuple[int, ...] = ()    # speculative decoding: proposed tokens computed after the sequence's last
                                   # one (the chunk's last len(draft) rows), each row's logits sampled

    @property
    def scores(self) -> bool:
        """A scoring sequence: every row of the chunk gets logits, none is sampled."""
        return self.seq.is_scoring


@dataclass(frozen=True)
class StepPlan:
    token_ids: np.ndarray          # [T] int32
    positions: np.ndarray          # [T] int32
    slot_mapping: np.ndarray       # [T] int32
    block_tables: np.ndarray       # [B, W] int32
    context_lens: np.ndarray       # [B] int32
    query_start_loc: np.ndarray    # [B+1] int32
    logits_indices: np.ndarray     # [S] int32
    score_rows: np.ndarray         # [R] int32
    copies: tuple[tuple[int, int], ...]
    max_query_len: int
    max_context_len: int
    graph_bucket: int | None
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))      # [Q] int32
    prompt_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))   # [Q] int32
    prompt_top: int = 0            # alternatives per prompt row: MAX_LOGPROBS when any wants some, else 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


def slot_mapping(table, positions, block_size: int):
    """The cache slot of a position (an int or an int array) of a sequence with block table `table`:
    its block's id * BS + its row in the block. The one place this formula lives."""
    return table[positions // block_size] * block_size + positions % block_size


def bucket_for(batch: int, buckets: Seq[int]) -> int:
    """The smallest bucket that holds `batch` rows."""
    i = bisect.bisect_left(buckets, batch)
    if batch < 1 or i == len(buckets):
        raise ValueError(f"a decode batch of {batch} sequences fits no graph bucket "
                         f"(largest {buckets[-1] if buckets else 'none'})")
    return buckets[i]


def build_step_plan(scheduled: Seq[ScheduledSeq], tables: Seq[Seq[int]], copies: Seq[tuple[int, int]],
                    layout: PlanLayout) -> StepPlan:
    """The plan of a step: scheduled[b] advances by its num_new_tokens from its num_computed_tokens,
    with block table tables[b] (already grown for this step)."""
    if not scheduled:
        raise ValueError("a step plan needs at least one scheduled sequence")
    # a sequence verifying drafts decodes too: one row per token, as if each were a sequence of its own
    decode = all(s.num_new_tokens - len(s.draft) == 1 and not s.scores and not s.prompt_logprob_rows for s in scheduled)
    build = _decode_arrays if decode else _chunk_arrays
    arrays = build(scheduled, tables, layout)
    B = int(arrays["context_lens"].shape[0])
    bucket = None
    if decode and layout.graph_buckets and B <= layout.graph_buckets[-1]:
        bucket = bucket_for(B, layout.graph_buckets)
    # NOTE: always MAX_LOGPROBS alternatives when any row wants some, so a row's do not depend on the others
    top = MAX_LOGPROBS if any(s.prompt_logprob_rows and s.seq.params.prompt_logprobs for s in scheduled) else 0
    return StepPlan(**arrays, copies=tuple(copies), prompt_top=top,
                    max_query_len=int(np.diff(arrays["query_start_loc"]).max()),
                    max_context_len=int(arrays["context_lens"].max()), graph_bucket=bucket)


def _padded_tables(tables: Seq[Seq[int]], pad_block: int) -> np.ndarray:
    """int32 [B, longest table] with each row's table copied in, the rest pad_block (padded as Python lists and
    converted once: a NumPy assignment per row would cost more than the rows' data)."""
    width = max(map(len, tables), default=1) or 1
    flat: list[int] = []
    for t in tables:
        flat += t
        if len(t) < width:
            flat += [pad_block] * (width - len(t))
    return np.array(flat, np.int32).reshape(len(tables), width)


def _decode_arrays(scheduled: Seq[ScheduledSeq], tables: Seq[Seq[int]], layout: PlanLayout) -> dict:
    """A pure decode step (one new token per sequence) in scalar Python: per-sequence NumPy calls
    would cost more than the step's host work. A sequence verifying k drafts takes k + 1 rows, row i at
    position p + i with context p + i + 1 over the same block table: the decode kernels write every row's
    K/V before any row attends, so each row reads the drafts before it, exactly as its own decode step would."""
    BS = layout.block_size
    ids, positions, slots, logits, row_tables = [], [], [], [], []
    for s, table in zip(scheduled, tables):
        pos = s.seq.num_computed_tokens
        for i, tok in enumerate((s.seq.token_ids[pos], *s.draft)):
            if s.samples:
                logits.append(len(ids))
            ids.append(tok)
            positions.append(pos + i)
            slots.append(slot_mapping(table, pos + i, BS))
            row_tables.append(table)
    B = len(ids)
    pos = np.asarray(positions, np.int32)
    return dict(token_ids=np.asarray(ids, np.int32), positions=pos, slot_mapping=np.asarray(slots, np.int32),
                block_tables=_padded_tables(row_tables, layout.pad_block), context_lens=pos + 1,
                query_start_loc=np.arange(B + 1, dtype=np.int32), logits_indices=np.asarray(logits, np.int32),
                score_rows=np.zeros(0, np.int32), prompt_rows=np.zeros(0, np.int32),
                prompt_targets=np.zeros(0, np.int32))


def _pieces(scheduled: Seq[ScheduledSeq], tables: Seq[Seq[int]]):
    """(scheduled seq, first position, its tokens, block table) per query sequence of the plan: a sequence
    verifying drafts is k + 1 pieces of one row each, as in a decode step, so that its rows' bits do not
    depend on whether the step also carries prefill."""
    for s, table in zip(scheduled, tables):
        start = s.seq.num_computed_tokens
        if s.draft:
            for i, tok in enumerate((s.seq.token_ids[start], *s.draft)):
                yield s, start + i, [tok], table
        else:
            yield s, start, s.seq.token_ids[start:start + s.num_new_tokens], table


def _chunk_arrays(scheduled: Seq[ScheduledSeq], tables: Seq[Seq[int]], layout: PlanLayout) -> dict:
    """Any step: prefill chunks, decode tokens and scoring chunks mixed."""
    BS = layout.block_size
    pieces = list(_pieces(scheduled, tables))
    B = len(pieces)
    ids, positions, slots, logits, score, prompt_rows, targets = [], [], [], [], [], [], []
    context_lens = np.zeros(B, np.int32)
    qsl = np.zeros(B + 1, np.int32)
    row = 0
    for b, (s, start, tokens, table) in enumerate(pieces):
        seq, n = s.seq, len(tokens)
        pos = np.arange(start, start + n, dtype=np.int32)
        ids.append(np.asarray(tokens, np.int32))
        positions.append(pos)
        slots.append(slot_mapping(np.asarray(table, np.int32), pos, BS))
        context_lens[b] = start + n
        qsl[b + 1] = qsl[b] + n
        if s.scores:
            score.extend(range(row, row + n))
        elif s.samples:
            logits.append(row + n - 1)
        if s.prompt_logprob_rows:
            q = s.prompt_logprob_rows
            prompt_rows.extend(range(row, row + q))
            targets.extend(seq.token_ids[start + 1:start + 1 + q])
        row += n
    return dict(token_ids=np.concatenate(ids), positions=np.concatenate(positions),
                slot_mapping=np.concatenate(slots).astype(np.int32),
                block_tables=_padded_tables([t for *_, t in pieces], layout.pad_block),
                context_lens=context_lens, query_start_loc=qsl, logits_indices=np.asarray(logits, np.int32),
                score_rows=np.asarray(score, np.int32), prompt_rows=np.asarray(prompt_rows, np.int32),
                prompt_targets=np.asarray(targets, np.int32))
