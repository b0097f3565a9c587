"""Scheduler: continuous batching over a fixed KV pool — token budget, chunked prefill, preemption.

Every step fills one budget of `max_num_batched_tokens` tokens and at most `max_num_seqs` sequences:

  1. running sequences, oldest admission first: one decode token each, or their next prefill chunk (at
     most long_prefill_token_threshold tokens, if set);
     when the pool has no block for one of them, the most recently admitted running sequence is
     preempted (blocks freed, sent back to the head of the waiting queue, recomputed later with the
     tokens it has already generated) until it fits;
  2. then, if nothing was preempted this step, waiting sequences in (priority, arrival) order, each
     starting after its longest cached prefix, as long as the budget, the sequence cap and the pool allow.

With a step-cost model (core/step_cost.py, fitted by the engine to its measured steps) and an inter-token
target (EngineConfig.itl_target_ms: milliseconds; None: twice the estimated decode step of the sequences
running and waiting, step_cost.auto_target_rows; 0: none), a step that carries decode rows takes only the
prefill tokens that keep its estimated time within the target
(stall-free batching, as Sarathi-Serve): the running decodes' estimate first, then prefill chunks in the
order above until the target is spent, planned with the measured steps' spread around their estimates, so
that a step slowed as much as steps usually are still meets the target. The step's first prefill chunk takes at least one block however
little is left, so prefill never starves while decodes alone exceed the target; a step with no decode rows
takes prefill up to the whole token budget. Until the model has an estimate (the engine reports each
step's time to it), or with target 0, the token budget alone limits prefill.

A step runs one way: schedule() -> SchedulerOutput (with the StepPlan of core/step_plan.py) -> forward pass
-> update(output) -> StepUpdate (computed tokens, filled blocks registered, forks joined, finishes).

Every change to the queues and to a sequence's blocks goes through here: admission, the samples of an
n > 1 request (forks of the chunk that computes its prompt, drawing from its logits row), scoring sequences
(Sequence.chunk_sizes), finishing.

Remote prefill (prefill/decode disaggregation, engine/kv_transfer.py): reserve_remote moves a waiting
sequence into `receiving` with blocks for all but its last prompt token (after its own prefix-cache hit);
another engine computes their K/V and the bytes are written straight into those blocks. They are not
scheduled (nobody reads them) and not registered in the prefix cache until complete_remote, after the
transfer is whole and checked, puts the sequence in `running` with everything but its last prompt token
computed: that token is computed here, so its logits, sampling and stop rules are this engine's own.
cancel_remote frees the blocks and queues the sequence again, to be prefilled here.

Invariants (NOTE, checked by check_invariants): a sequence is in at most one queue (waiting, running,
receiving), and in none once finished; a waiting sequence owns no KV blocks; between steps a running
one owns exactly the ceil(num_computed_tokens / BS) blocks that cover its computed tokens, a receiving
one the ceil((P - 1) / BS) blocks of its first P - 1 prompt tokens.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from rawinfer.config import EngineConfig
from rawinfer.core.block_hashes import BlockHashes
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.sequence import FinishReason, Sequence, SequenceTimings
from rawinfer.core.step_cost import PrefillAllowance, StepCost, StepShape, auto_target_rows
from rawinfer.core.step_plan import PlanLayout, ScheduledSeq, StepPlan, build_step_plan


@dataclass(frozen=True)
class Reservation:
    """Blocks of a receiving sequence that a remote prefill fills."""

    start_block: int            # first logical block to fill: those before it are this engine's prefix-cache hit
    block_ids: list[int]        # physical ids of logical blocks start_block, start_block + 1, ...
    num_tokens: int             # prompt tokens whose K/V arrive (positions 0 .. num_tokens - 1): all but the last


@dataclass
class SchedulerOutput:
    """One step's decision (schedule()): who advances by how many tokens, in the plan's batch order (running
    sequences first, then those admitted this step; each with the samples it forks), who was preempted, and the
    plan that carries it out."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepUpdate:
    """What a step changed that becomes outputs (update()): the samples that draw their next token from the
    step's logits, and the sequences finished (length) with nothing to sample."""

    samples: list[tuple[Sequence, int]] = field(default_factory=list)   # (sample, logits row): a fork its parent's
    drafts: dict = field(default_factory=dict)    # seq id -> the draft tokens it verifies; rows row + 1 .. row + k
    finished: list[Sequence] = field(default_factory=list)    # scored to their end; max_tokens 0 prompts computed


class Scheduler:
    def __init__(self, ecfg: EngineConfig, block_manager: BlockManager, layout: PlanLayout | None = None,
                 sliding_window: int = 0, step_cost: StepCost | None = None):
        """sliding_window W > 0: every layer of the model attends through a window of W tokens, so a running
        sequence's blocks wholly before its next query's window go back to the pool after each step.
        step_cost: the step-time model prefill beside decodes is sized by (ecfg.itl_target_ms); a new one,
        without an estimate until the engine reported enough steps, when None. The engine's warm-up seeds it
        and hands it to the fresh scheduler it leaves behind."""
        self.ecfg = ecfg
        self.step_cost = step_cost if step_cost is not None else StepCost()
        self.bm = block_manager
        self.sliding_window = sliding_window
        self.layout = layout or PlanLayout(block_manager.block_size)
        if self.layout.block_size != block_manager.block_size:
            raise ValueError(f"the plan layout's block size {self.layout.block_size} differs from the block "
                             f"manager's {block_manager.block_size}")
        self.waiting: list[Sequence] = []     # sorted by (priority, arrival_order); preempted go first
        self.running: list[Sequence] = []     # admission order
        self.receiving: dict[str, Sequence] = {}   # seq id -> sequence whose prompt K/V a remote prefill sends
        self.num_preemptions = 0
        self._ticket = 0

    # ---- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (it owns no blocks yet)."""
        self._ticket += 1
        seq.arrival_order = self._ticket
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        keys = [(s.priority, s.arrival_order) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, (seq.priority, seq.arrival_order)), seq)

    @staticmethod
    def _forks_of(parent: Sequence) -> tuple[Sequence, ...]:
        """The other n - 1 samples of parent's request: new sequences of its prompt, arrived and scheduled with it."""
        t = parent.timings
        return tuple(Sequence(seq_id=(parent.request_id, i), request_id=parent.request_id, index=i,
                              prompt_token_ids=parent.prompt_token_ids, params=parent.params, priority=parent.priority,
                              timings=SequenceTimings(arrival=t.arrival, scheduled=t.scheduled))
                     for i in range(1, parent.params.n))

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` from parent's prompt, just computed (update() registered its blocks): it shares every
        block (copy-on-write on its first write) and runs at once."""
        self.bm.fork(parent.seq_id, child.seq_id)
        self._ticket += 1
        child.arrival_order = self._ticket
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        full = parent.num_prompt_tokens // self.bm.block_size
        child.block_hashes = BlockHashes(parent.block_hashes.digests[:full])
        self.running.append(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove seq from whichever queue holds it, free its blocks, mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif self.receiving.get(seq.seq_id) is seq:
            del self.receiving[seq.seq_id]
            self.bm.free(seq.seq_id)
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()

    # ---- remote prefill ---------------------------------------------------------------------------
    def can_reserve_remote(self, seq: Sequence) -> bool:
        """Whether `seq` may have its prompt's K/V computed by another engine: a new, waiting request that
        samples and wants no prompt log-probabilities, in a model that keeps every block while it prefills."""
        return (seq in self.waiting and not seq.is_scoring and not seq.num_output_tokens
                and not seq.wants_prompt_logprobs and not self.sliding_window)

    def reserve_remote(self, seq: Sequence, min_tokens: int = 1) -> Reservation | None:
        """Move waiting `seq` to `receiving` with blocks for its first P - 1 prompt tokens, its prefix-cache
        hit first. None (nothing changed) when fewer than min_tokens of them are uncached or the pool lacks
        the blocks: the sequence then prefills here as usual."""
        if not self.can_reserve_remote(seq):
            raise ValueError(f"{seq.seq_id!r} cannot prefill remotely (can_reserve_remote); prefill it here")
        bs, num_tokens = self.bm.block_size, seq.num_prompt_tokens - 1
        cached = self.bm.find_cached_prefix(seq.token_ids, seq.block_hashes) if self.ecfg.enable_prefix_caching else []
        num_cached = len(cached) * bs
        if num_tokens - num_cached < max(1, min_tokens):
            return None
        alloc = self.bm.allocate_slots(seq.seq_id, num_cached, num_tokens - num_cached, cached)
        if alloc is None:
            return None
        self.waiting.remove(seq)
        self.receiving[seq.seq_id] = seq
        seq.timings.scheduled = time.monotonic()
        seq.num_cached_prompt_tokens = num_cached
        return Reservation(len(cached), self.bm.block_table(seq.seq_id)[len(cached):], num_tokens)

    def complete_remote(self, seq: Sequence) -> None:
        """The K/V of receiving `seq`'s first P - 1 tokens are in its blocks: it runs, its last prompt token next."""
        if self.receiving.get(seq.seq_id) is not seq:
            raise ValueError(f"{seq.seq_id!r} is not waiting for remote K/V")
        del self.receiving[seq.seq_id]
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        if self.ecfg.enable_prefix_caching:
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_hashes)
        self.running.append(seq)

    def cancel_remote(self, seq: Sequence) -> None:
        """Give receiving `seq`'s blocks back (their contents never became readable) and queue it again."""
        if self.receiving.get(seq.seq_id) is not seq:
            raise ValueError(f"{seq.seq_id!r} is not waiting for remote K/V")
        del self.receiving[seq.seq_id]
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self._enqueue(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.chunk_index = 0                   # a scoring sequence restarts its chunks
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int, allowance: PrefillAllowance | None = None) -> int:
        """Tokens seq advances by this step within `budget` (0: it waits). No chunk is longer than
        long_prefill_token_threshold, if set: a long prompt takes several short steps, so that prompts
        arriving meanwhile start, and running sequences decode, after one of them instead of after the
        whole prompt; nor, with an allowance (prefill under a latency target), than what it leaves. A scoring
        sequence takes its next chunk whole (capped at the step budget) or waits for a step with room for it."""
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.chunk_sizes is None:
            n = min(n, self.ecfg.long_prefill_token_threshold or n)
            return min(n, allowance.tokens(seq.num_computed_tokens)) if allowance is not None else n
        if seq.chunk_index >= len(seq.chunk_sizes):
            raise ValueError(f"chunk_sizes of {seq.seq_id!r} cover {seq.num_computed_tokens} of its "
                             f"{seq.num_tokens} tokens; give chunks for every token")
        want = min(seq.chunk_sizes[seq.chunk_index], seq.num_uncomputed_tokens, self.ecfg.max_num_batched_tokens)
        if allowance is not None and not allowance.fits(want, seq.num_computed_tokens):
            return 0
        return want if want <= budget else 0

    def _allowance(self) -> PrefillAllowance | None:
        """What the latency target leaves for prefill this step, after the running decodes' estimate; None
        (the token budget alone) without a usable cost model, with target 0, or with no decode row."""
        target_ms, cost = self.ecfg.itl_target_ms, self.step_cost
        if target_ms == 0 or not cost.usable():
            return None
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]     # (a few too many with forks)
        if not decodes:
            return None
        shape = StepShape(0, len(decodes), sum(s.num_computed_tokens + 1 for s in decodes))
        rows = auto_target_rows(len(self.running) + len(self.waiting), self.ecfg.max_num_seqs)
        target = target_ms / 1e3 if target_ms is not None else cost.auto_target(rows, shape.keys / len(decodes))
        return PrefillAllowance(cost, cost.prefill_budget(target, shape), self.bm.block_size)

    def _scheduled(self, seq: Sequence, n: int, allowance: PrefillAllowance | None = None,
                   draft: tuple[int, ...] = ()) -> ScheduledSeq:
        if draft:
            return ScheduledSeq(seq, n, True, draft=draft)
        start = seq.num_computed_tokens
        if seq.chunk_sizes is not None:
            seq.chunk_index += 1
        if allowance is not None:
            allowance.take(n, start)
        prompt_rows = max(0, min(start + n, seq.num_prompt_tokens - 1) - start) if seq.wants_prompt_logprobs else 0
        samples = not seq.is_scoring and start + n == seq.num_tokens
        # n > 1: the chunk that computes the prompt forks the other samples (max_tokens 0: none is drawn)
        forks = samples and seq.index == 0 and not seq.num_output_tokens and seq.params.max_tokens > 0
        return ScheduledSeq(seq, n, samples, prompt_rows, self._forks_of(seq) if forks else ())

    def _scheduled_decode(self, seq: Sequence) -> ScheduledSeq:
        """_scheduled(seq, 1) for a plain decode (its last token uncomputed, no draft, not scoring): it samples,
        has no prompt rows (its chunk starts at or after the prompt's last token), and forks the other samples
        only when that token is the prompt's last."""
        forks = seq.index == 0 and len(seq.token_ids) == seq.num_prompt_tokens and seq.params.max_tokens > 0
        return ScheduledSeq(seq, 1, True, 0, self._forks_of(seq) if forks else ())

    def _draft(self, seq: Sequence, drafts, budget: int, rows: int) -> tuple[int, ...]:
        """The proposed tokens a decoding seq verifies this step: within the token budget (with its own token)
        and the logits rows the step has left beside one per sampling sequence."""
        if seq.num_uncomputed_tokens != 1 or seq.is_scoring or seq.seq_id not in drafts:
            return ()
        return tuple(drafts[seq.seq_id][:max(0, min(budget - 1, rows))])

    def schedule(self, drafts: dict | None = None) -> SchedulerOutput:
        """drafts: seq id -> tokens proposed to follow a running sequence (speculative decoding): a decoding
        sequence computes them after its last token, in the same step, and update() leaves them uncounted
        until accept() says how many the model agreed with."""
        out = SchedulerOutput()
        copies: list[tuple[int, int]] = []
        allowance = self._allowance()
        budget = self._schedule_running(out, copies, drafts or {}, allowance)
        self._admit_waiting(out, copies, budget, allowance)
        if out.seqs:
            tables = [self.bm.block_ids(s.seq.seq_id) for s in out.seqs]
            out.plan = build_step_plan(out.seqs, tables, copies, self.layout)
        return out

    def _schedule_running(self, out: SchedulerOutput, copies: list[tuple[int, int]], drafts: dict,
                          allowance: PrefillAllowance | None) -> int:
        """The running sequences' next chunks (and verified drafts), oldest first, preempting the newest when
        blocks run out; returns the token budget the step has left."""
        rows = self.ecfg.max_num_seqs - min(len(self.running), self.ecfg.max_num_seqs)   # logits rows for drafts
        budget = self.ecfg.max_num_batched_tokens
        i = 0
        # NOTE: the samples of an n > 1 request join the running set together, so it may hold more than
        # max_num_seqs sequences; a step takes at most max_num_seqs of them, oldest first.
        while i < len(self.running) and budget > 0 and len(out.seqs) < self.ecfg.max_num_seqs:
            seq = self.running[i]
            decode = seq.num_computed_tokens + 1 == len(seq.token_ids) and not seq.is_scoring and seq.seq_id not in drafts
            if decode:
                n, prefill, draft = 1, None, ()        # what _chunk and _draft give a plain decode, without the calls
            else:
                prefill = allowance if seq.num_uncomputed_tokens > 1 else None    # decodes are in its estimate
                draft = self._draft(seq, drafts, budget, rows)
                n = self._chunk(seq, budget, prefill) + len(draft)
            if n == 0:
                i += 1
                continue
            alloc = self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            while alloc is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                alloc = self.bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            if alloc is None:
                break
            copies.extend(alloc.copies)
            out.seqs.append(self._scheduled_decode(seq) if decode else self._scheduled(seq, n, prefill, draft))
            budget -= n
            rows -= len(draft)
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, copies: list[tuple[int, int]], budget: int,
                       allowance: PrefillAllowance | None) -> None:
        """Waiting sequences join in arrival order (their cached prefix reused) while the step has room; none
        joins a step that had to preempt."""
        now = time.monotonic()
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.ecfg.max_num_seqs and len(out.seqs) < self.ecfg.max_num_seqs):
            seq = self.waiting[0]
            cached: list[int] = []
            # scoring and prompt log-probabilities need every position computed
            if self.ecfg.enable_prefix_caching and not seq.is_scoring and not seq.wants_prompt_logprobs:
                cached = self.bm.find_cached_prefix(seq.token_ids, seq.block_hashes)
            num_cached = len(cached) * self.bm.block_size
            seq.num_computed_tokens = num_cached
            n = self._chunk(seq, budget, allowance)
            alloc = self.bm.allocate_slots(seq.seq_id, num_cached, n, cached) if n else None
            if alloc is None:
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            if seq.timings.scheduled is None:
                seq.timings.scheduled = now
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            self.running.append(seq)
            copies.extend(alloc.copies)
            out.seqs.append(self._scheduled(seq, n, allowance))
            budget -= n

    def update(self, out: SchedulerOutput) -> StepUpdate:
        """After the forward pass, the scheduled tokens are in the cache: register blocks that filled up, give
        back those that slid out of the window, start the forks, finish (length) what was computed to its end
        with nothing to sample. Returns the samples that draw a token from the step's logits, and those finished."""
        bs, upd, row = self.bm.block_size, StepUpdate(), 0
        for s in out.seqs:
            seq = s.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_new_tokens - len(s.draft)     # drafts count once accepted
            if self.ecfg.enable_prefix_caching and not seq.is_scoring and seq.num_computed_tokens // bs > before // bs:
                self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_hashes)
            if self.sliding_window:   # the next query, at num_computed_tokens, reads W - 1 positions back
                self.bm.release_before(seq.seq_id, seq.num_computed_tokens - self.sliding_window + 1)
            if (s.samples and seq.params.max_tokens == 0) or (s.scores and seq.num_computed_tokens == seq.num_tokens):
                self.finish(seq, FinishReason.LENGTH)
                upd.finished.append(seq)
            elif s.samples:
                for child in s.forks:
                    self._fork(seq, child)
                upd.samples += [(x, row) for x in (seq, *s.forks)]
                if s.draft:
                    upd.drafts[seq.seq_id] = s.draft
            row += s.samples + len(s.draft)
        return upd

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """The first num_accepted of the draft tokens seq verified this step became its tokens (appended): their
        K/V are in the cache and count as computed; the blocks that held only rejected ones go back, and no
        rejected token ever enters the prefix cache (only computed, full blocks of accepted tokens are hashed).
        For a sequence still running after the step's outputs."""
        if num_accepted:
            seq.num_computed_tokens += num_accepted
            if self.ecfg.enable_prefix_caching:
                self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.block_hashes)
        self.bm.truncate(seq.seq_id, seq.num_computed_tokens)

    # ---- checks -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the queue and block invariants of the module docstring (between steps)."""
        bs = self.bm.block_size
        running = {id(s) for s in self.running}
        assert len(running) == len(self.running), "a sequence is in the running queue twice"
        for seq_id, seq in self.receiving.items():
            assert id(seq) not in running and seq not in self.waiting, f"{seq_id!r} is receiving and queued"
            assert not seq.is_finished, f"finished {seq_id!r} is still receiving"
            table = self.bm.block_table(seq_id)
            assert len(table) == -(-(seq.num_prompt_tokens - 1) // bs), \
                f"receiving {seq_id!r} owns {len(table)} blocks for {seq.num_prompt_tokens - 1} prompt tokens"
        for seq in self.waiting:
            assert id(seq) not in running, f"{seq.seq_id!r} is both waiting and running"
            assert seq.seq_id not in self.bm, f"waiting {seq.seq_id!r} owns KV blocks"
            assert not seq.is_finished, f"finished {seq.seq_id!r} is still waiting"
        for seq in self.running:
            assert not seq.is_finished, f"finished {seq.seq_id!r} is still running"
            table = self.bm.block_table(seq.seq_id)
            assert len(table) == -(-seq.num_computed_tokens // bs), \
                f"running {seq.seq_id!r} owns {len(table)} blocks for {seq.num_computed_tokens} computed tokens"
        self.bm.check_invariants()
