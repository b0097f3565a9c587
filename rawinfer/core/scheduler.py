"""Scheduler: continuous batching over a fixed KV pool — token budget, chunked prefill, preemption.

Every step fills one budget of `max_num_batched_tokens` tokens and at most `max_num_seqs` sequences:

  1. running sequences, oldest admission first: one decode token each, or their next prefill chunk;
     when the pool has no block for one of them, the most recently admitted running sequence is
     preempted (blocks freed, sent back to the head of the waiting queue, recomputed later with the
     tokens it has already generated) until it fits;
  2. then, if nothing was preempted this step, waiting sequences in (priority, arrival) order, each
     starting after its longest cached prefix, as long as the budget, the sequence cap and the pool allow.

Invariant (NOTE): a waiting sequence owns no KV blocks; a running one owns exactly the blocks that
cover its computed tokens plus the tokens scheduled this step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from rawinfer.core.block_manager import BlockManager
from rawinfer.config import EngineConfig
from rawinfer.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def needs_logits(self) -> bool:
        """True when this chunk reaches the sequence's last token, so there is a next token to sample."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, ecfg: EngineConfig, block_manager: BlockManager):
        self.ecfg = ecfg
        self.bm = block_manager
        self.waiting: list[Sequence] = []     # sorted by (priority, arrival_order); preempted go first
        self.running: list[Sequence] = []     # admission order
        self.num_preemptions = 0
        self._ticket = 0

    # ---- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._ticket += 1
        seq.arrival_order = self._ticket
        seq.status = SequenceStatus.WAITING
        keys = [(s.priority, s.arrival_order) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, (seq.priority, seq.arrival_order)), seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample (n > 1) that already shares its parent's blocks joins the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove seq from whichever queue holds it, free its blocks, mark it finished."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.ecfg.max_num_batched_tokens
        i = 0
        # NOTE: forked samples (n > 1) join the running set all at once, so it may hold more than
        # max_num_seqs sequences; a step takes at most max_num_seqs of them, oldest first.
        while i < len(self.running) and budget > 0 and len(out.seqs) < self.ecfg.max_num_seqs:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            alloc = self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + n)
            while alloc is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                alloc = self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + n)
            if alloc is None:
                break
            out.copies.extend(alloc.copies)
            out.seqs.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        now = time.monotonic()
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.ecfg.max_num_seqs):
            seq = self.waiting[0]
            cached: list[int] = []
            if self.ecfg.enable_prefix_caching:
                cached = self.bm.find_cached_prefix(seq.all_token_ids)
            num_cached = len(cached) * self.bm.block_size
            n = min(seq.num_tokens - num_cached, budget)
            alloc = self.bm.allocate_slots(seq.seq_id, num_cached + n, cached)
            if alloc is None:
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.timings.scheduled is None:
                seq.timings.scheduled = now
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            self.running.append(seq)
            out.copies.extend(alloc.copies)
            out.seqs.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled tokens are in the cache; register full blocks."""
        bs = self.bm.block_size
        for s in batch.seqs:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            # only when a block filled up (a decode step mostly fills none; all_token_ids copies the sequence)
            if self.ecfg.enable_prefix_caching and \
                    seq.num_computed_tokens // bs > (seq.num_computed_tokens - s.num_new_tokens) // bs:
                self.bm.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
