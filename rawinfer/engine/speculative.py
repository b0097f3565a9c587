"""Speculative decoding: proposers of draft tokens, and the check that keeps the ones the model agrees with.

A step with speculation (engine.step):

    Speculator.propose(running)      drafts d1..dk for each decoding sequence that speculates this step
    scheduler.schedule(drafts)       the sequence computes its last token and d1..dk in one chunk: k + 1 rows,
                                     each with logits (core/step_plan.py)
    Speculator.verify(...)           row 0 gives the token after the last one, as without speculation; while
                                     the token row i gave equals d(i+1), row i + 1 gives the next: the tokens
                                     kept are the agreeing drafts plus one from the first row that disagreed
                                     (or from row k when all agreed)
    scheduler.accept(seq, a)         the a agreeing drafts count as computed; blocks of the others go back

Lossless by construction. Each kept token is drawn from the model's own row for its position, given the
tokens before it, by the same rule and the same generator as without speculation: greedy rows take the
argmax, sampled rows one draw of the sequence's generator per kept token. Both proposers here propose
deterministically (n-gram lookup; the draft model's argmax), so the draft distribution q is a point mass,
and for a point mass rejection sampling (Leviathan et al., Chen et al.: keep d with probability
min(1, p(d) / q(d)) = p(d), else draw from the normalised max(0, p - q), which is p without d) is exactly
"draw x from p; keep d when x = d, else emit x". That is what verify does, so the output distribution is
the model's, and a seeded request consumes its generator as it would without speculation.

How many drafts (Speculator.choose_k): the k in 0 .. K with the most expected tokens per second, from the
engine's fitted step-cost model (core/step_cost.py: a step costs a + c per decode row + d per key read)
and each sequence's acceptance rate a_i (a moving average; a sequence keeps 1 + a + ... + a^k tokens in
expectation), plus the proposer's own measured time per draft token (the draft model's passes):

    rate(k) = sum_i (1 - a_i^(k+1)) / (1 - a_i)  /  (cost(rows = B + n k) + k * proposer seconds per token)

for B decoding sequences, n of them speculating. A step of one sequence is bound by reading the weights
once, and its extra rows cost little: k = K. As the batch grows the rows cost their full share, and at
some batch k = 0 wins and no one speculates (k > 0 must win by MIN_GAIN). The model is linear in rows and
fitted mostly to the batch sizes the engine has been running, so it guesses large batches' extra rows too
cheap; above MAX_BATCH decoding sequences no one speculates at all, a bound measured where speculation
started to lose on this project's CPUs (docs/speculative.md).
Per sequence, a proposal rejected whole makes it wait 1, 2, 4, ... steps (at most 16) before it proposes
again. A request with a grammar keeps only the drafts its grammar accepts, and each draft row is masked by
the grammar as it would stand after the drafts before it (engine.py, structured.draft_rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import time
from collections import deque

import numpy as np

from rawinfer.core.sequence import Sequence
from rawinfer.core.step_cost import StepShape
from rawinfer.engine.sampler import sample_row

NGRAM_MAX = 4          # longest suffix n-gram looked up
NGRAM_MIN = 2          # shortest: a single token matches too often to predict what follows
MAX_BATCH = 8          # decoding sequences above which no sequence speculates, whatever the estimate says
MAX_BACKOFF = 16
PRIOR_ACCEPTANCE = 0.7     # a sequence's acceptance rate before its first verified proposal
EMA = 0.3                  # weight of the latest proposal in a sequence's acceptance rate
RECOVERY = 0.05            # share of the way back to the prior per step a sequence does not speculate
PROPOSER_WINDOW = 16       # proposer calls whose time per draft token is remembered
MAX_ACCEPTANCE = 0.95      # keeps the expected length finite and a lucky streak from promising too much
MIN_GAIN = 1.1             # speculate only where the estimate beats plain decoding by this much: the cost
                           # model is a fit, and a wrong guess costs throughput


def _plain(seq: Sequence) -> bool:
    """Greedy without logit edits: the row's argmax, on the device."""
    return seq.params.greedy and not seq.params.edits_logits


class NgramProposer:
    """Prompt lookup (vLLM's ngram, llama.cpp's lookup decoding): the longest suffix of NGRAM_MAX .. NGRAM_MIN
    tokens that occurred earlier in the sequence (prompt or output) proposes the tokens that followed its
    latest earlier occurrence."""

    method = "ngram"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [ngram_lookup(s.token_ids, k) for s, k in zip(seqs, ks)]

    def release(self, seq_id) -> None:
        pass


def ngram_lookup(token_ids: list[int], k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix ([] if none)."""
    L = len(token_ids)
    if k < 1 or L <= min_n:
        return []
    ids = np.asarray(token_ids, np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)    # starts 0 .. L - 1 - n
        hits = np.flatnonzero((windows == ids[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n          # the latest earlier occurrence's continuation
            return ids[start:start + k].tolist()
    return []


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters for one method."""

    num_drafts: int = 0              # proposals verified
    num_draft_tokens: int = 0        # tokens proposed in them
    num_accepted_tokens: int = 0     # proposed tokens kept
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: proposals whose token i was kept

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": rate,
                "mean_acceptance_length": mean, "accepted_per_pos": list(self.accepted_per_pos)}


class Speculator:
    """One engine's speculation: its proposer, the per-sequence back-off and the counters."""

    def __init__(self, proposer, k: int, max_model_len: int, max_batch: int = MAX_BATCH, keeps_state: bool = False):
        """keeps_state: the proposer holds per-sequence state that its first proposal builds (a draft model's KV)."""
        self.proposer, self.k, self.max_model_len, self.max_batch = proposer, k, max_model_len, max_batch
        self.keeps_state = keeps_state
        self.counters = SpecCounters()
        self._wait: dict = {}            # seq id -> (steps left to wait, the current back-off)
        self._acceptance: dict = {}      # seq id -> moving average of its proposals' accepted share
        self._proposer_times: deque = deque(maxlen=PROPOSER_WINDOW)    # seconds per draft token, latest calls

    @property
    def proposer_seconds(self) -> float:
        """The proposer's time per draft token: the median of its latest calls (a slow outlier changes nothing)."""
        return float(np.median(self._proposer_times)) if self._proposer_times else 0.0

    @property
    def method(self) -> str:
        return self.proposer.method

    @classmethod
    def from_config(cls, ecfg, model_config, max_model_len: int, pool=None) -> "Speculator | None":
        """pool: the target's MemoryPool, built with guest=pool_guest(...) (a draft model carves its room)."""
        if ecfg.speculative_method is None:
            return None
        if ecfg.speculative_method == "ngram":
            return cls(NgramProposer(), ecfg.num_speculative_tokens, max_model_len)
        from rawinfer.engine.draft import DraftProposer
        return cls(DraftProposer(ecfg.speculative_model, model_config, ecfg, host=pool), ecfg.num_speculative_tokens,
                   max_model_len, keeps_state=True)

    @staticmethod
    def pool_guest(ecfg, model_config):
        """A draft model's share of the target's memory pool (exec/memory.py GuestPool), None without one;
        checks the draft model before the target's pool is allocated."""
        if ecfg.speculative_method != "draft":
            return None
        from rawinfer.engine.draft import plan_draft
        return plan_draft(ecfg.speculative_model, model_config, ecfg).pool_request()

    def _room(self, seq: Sequence) -> int:
        """Drafts seq may verify: kept tokens never pass max_tokens or the context (one comes from the model)."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.k, left - 1))

    def propose(self, running: list[Sequence], cost=None) -> dict:
        """seq id -> drafts for the decoding sequences that speculate this step; cost: the engine's StepCost."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1 and not s.is_scoring]
        seqs = []
        for seq in decoding:
            if self._late(seq):
                continue
            wait, backoff = self._wait.get(seq.seq_id, (0, 0))
            if wait:
                self._wait[seq.seq_id] = (wait - 1, backoff)
            elif self._room(seq):
                seqs.append(seq)
        k = self.choose_k(decoding, seqs, cost) if seqs else 0
        if not k:
            for seq in seqs:       # drift back toward the prior, so that a sequence is tried again later
                a = self._acceptance.get(seq.seq_id, PRIOR_ACCEPTANCE)
                self._acceptance[seq.seq_id] = a + RECOVERY * (PRIOR_ACCEPTANCE - a)
            return {}
        ks = [min(k, self._room(s)) for s in seqs]
        first = any(s.seq_id not in self._wait for s in seqs)    # a draft model then computes a whole prompt
        for seq in seqs:
            self._wait.setdefault(seq.seq_id, (0, 0))      # known: release() frees the proposer's state
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks)
        if not first:
            self._proposer_times.append((time.perf_counter() - t0) / max(ks))
        return {s.seq_id: d for s, d in zip(seqs, drafts) if d}

    def _late(self, seq: Sequence) -> bool:
        """A proposer that keeps state per sequence (a draft model's KV) computes a sequence's whole text at its
        first proposal: a sequence joins only at its first decode step, where that is its prompt, paid once
        for all the rest; one that did not join then (a large batch chose no drafts) never does."""
        return self.keeps_state and seq.seq_id not in self._wait and seq.num_output_tokens > 1

    def choose_k(self, decoding: list[Sequence], seqs: list[Sequence], cost) -> int:
        """The number of drafts per speculating sequence (0: none) with the most expected tokens per second
        (the module docstring), K without a cost estimate; none above max_batch decoding sequences."""
        if len(decoding) > self.max_batch:
            return 0
        base = None if cost is None else cost.predict(StepShape(0, len(decoding), 0))
        if base is None or base <= 0:
            return self.k
        keys = sum(s.num_tokens for s in decoding) / len(decoding)         # per row, about
        alphas = np.array([self._acceptance.get(s.seq_id, PRIOR_ACCEPTANCE) for s in seqs])
        best, best_rate = 0, 0.0
        for k in range(self.k + 1):
            rows = len(decoding) + k * len(seqs)
            seconds = cost.predict(StepShape(0, rows, int(rows * keys))) + k * self.proposer_seconds
            tokens = len(decoding) - len(seqs) + float(((1 - alphas ** (k + 1)) / (1 - alphas)).sum())
            rate = tokens / seconds / (MIN_GAIN if k else 1.0)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verify(self, backend, logits, picks: list[tuple[Sequence, int, int, tuple, object]]) -> list[list[tuple]]:
        """picks: (sequence, its first logits row, the token drawn from that row, its drafts, its generator), for
        the sequences that verify drafts. Returns per pick the kept tokens as (token, logits row): the first,
        then one more per agreeing draft."""
        plain = [_plain(seq) for seq, *_ in picks]
        best = backend.argmax(logits) if any(plain) else None
        host = backend.to_host(logits) if not all(plain) else None
        kept_all = []
        for (seq, row, tok, draft, rng), argmax in zip(picks, plain):
            kept = [(tok, row)]
            for i, d in enumerate(draft):
                if kept[-1][0] != d:
                    break
                r = row + 1 + i
                nxt = int(best[r]) if argmax else sample_row(host[r], seq.params, seq.token_ids + list(draft[:i + 1]),
                                                             rng, seq.num_prompt_tokens)
                kept.append((nxt, r))
            self._record(seq, len(draft), len(kept) - 1)
            kept_all.append(kept)
        return kept_all

    def _record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.counters.record(proposed, accepted)
        a = self._acceptance.get(seq.seq_id, PRIOR_ACCEPTANCE)
        self._acceptance[seq.seq_id] = min(MAX_ACCEPTANCE, a + EMA * (accepted / proposed - a))
        _, backoff = self._wait.get(seq.seq_id, (0, 0))
        backoff = 0 if accepted else min(MAX_BACKOFF, max(1, 2 * backoff))
        self._wait[seq.seq_id] = (backoff, backoff)

    def release(self, seq_id) -> None:
        """The sequence finished: forget its back-off and the proposer's state of it."""
        self._acceptance.pop(seq_id, None)
        if self._wait.pop(seq_id, None) is not None:
            self.proposer.release(seq_id)

    def clear(self) -> None:
        """Forget every sequence and count from zero (the engine dropped its requests: engine.reset_state)."""
        for seq_id in list(self._wait):
            self.release(seq_id)
        self.counters = SpecCounters()
        self._proposer_times.clear()      # the warm-up's calls compiled kernels
