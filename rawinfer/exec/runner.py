"""ModelRunner: executes a StepPlan — copy-on-write copies, the forward pass (eager, or a replayed decode
graph), logits for the sampled rows and, for scoring sequences, every row's logits on the host.

The runner reads nothing but the plan: the scheduler has already decided everything (core/step_plan.py).

    plan (host int32 arrays) --as_index_array--> FlatBatch (device) --model.forward_hidden--> hidden rows
    hidden[score_rows]     --LM head, workspace-sized pieces--> host logits [R, V]   (scoring)
    hidden[prompt_rows]    --LM head, pieces, backend.logprobs--> host [Q], [Q, K]  (prompt log-probabilities)
    hidden[logits_indices] --LM head-->                         device logits [S, V] (sampling)

The scoring and prompt rows go first: the sampled rows' logits are a workspace view that the next LM head
call would overwrite, and they must survive until the sampler has read them. Prompt rows' logits never
leave the device; only their log-probability summaries do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rawinfer.backend.base import FlatBatch
from rawinfer.backend.logprobs import LogprobRows
from rawinfer.core.step_plan import PlanLayout, StepPlan
from rawinfer.exec.graphs import DecodeGraphs
from rawinfer.exec.model import DecoderModel


@dataclass
class RunnerOutput:
    """What one forward pass produced, for the engine's output processing."""

    logits: Any                        # device [S, V] float32: the rows of plan.logits_indices (a workspace view)
    score_logits: np.ndarray | None    # host [R, V] float32: the rows of plan.score_rows (None when R = 0)
    prompt_logprobs: LogprobRows | None = None   # host, the rows of plan.prompt_rows (None when Q = 0)


class ModelRunner:
    def __init__(self, model: DecoderModel, graphs: bool = False):
        """graphs: replay pure decode steps as captured graphs (the pool must have its padding block
        and the DecodeGraphs workspace region)."""
        self.model = model
        self.backend = model.backend
        self.graphs = DecodeGraphs(model) if graphs else None
        self.use_graphs = self.graphs is not None   # benchmarks may switch graphs off to compare

    @property
    def plan_layout(self) -> PlanLayout:
        """How the scheduler should shape the plans this runner executes."""
        kv = self.model.pool.kv
        if self.graphs is None:
            return PlanLayout(kv.block_size)
        return PlanLayout(kv.block_size, graph_buckets=self.graphs.buckets, pad_block=kv.padding_block)

    def flat_batch(self, plan: StepPlan) -> FlatBatch:
        """The plan's arrays as the device-side inputs of a forward pass."""
        be = self.backend
        return FlatBatch(
            token_ids=be.as_index_array(plan.token_ids), positions=be.as_index_array(plan.positions),
            slot_mapping=be.as_index_array(plan.slot_mapping), block_tables=be.as_index_array(plan.block_tables),
            context_lens=be.as_index_array(plan.context_lens),
            query_start_loc=be.as_index_array(plan.query_start_loc),
            logits_indices=be.as_index_array(plan.logits_indices), num_tokens=plan.num_tokens,
            max_query_len=plan.max_query_len, max_context_len=plan.max_context_len)

    def run(self, plan: StepPlan) -> RunnerOutput:
        """Copy-on-write copies, then the forward pass (a decode graph where the plan names one)."""
        self.backend.begin_step()
        if plan.copies:
            kv = self.model.pool.kv
            self.backend.copy_blocks(kv.k, kv.v, list(plan.copies))
        if plan.graph_bucket is not None and self.use_graphs and self.graphs is not None:
            return RunnerOutput(self.graphs.run(plan), None)
        flat = self.flat_batch(plan)
        self.model.forward_hidden(flat)
        score = self._host_logits(plan.score_rows) if plan.score_rows.size else None
        prompt = self._prompt_logprobs(plan) if plan.prompt_rows.size else None
        return RunnerOutput(self.model.compute_logits(flat.logits_indices), score, prompt)

    def _prompt_logprobs(self, plan: StepPlan) -> LogprobRows:
        """Log-probabilities of plan.prompt_targets under the logits of hidden rows plan.prompt_rows (and
        plan.prompt_top alternatives)."""
        parts = [self.backend.logprobs(logits, np.arange(logits.shape[0]), plan.prompt_targets[a:a + logits.shape[0]],
                                       plan.prompt_top) for a, logits in self._logits_pieces(plan.prompt_rows)]
        return LogprobRows(*(np.concatenate([getattr(p, f) for p in parts])
                             for f in ("logprobs", "ranks", "top_ids", "top_logprobs")))

    def _host_logits(self, rows: np.ndarray) -> np.ndarray:
        """Host logits [R, V] float32 of hidden rows `rows` of the last forward pass."""
        out = np.empty((rows.shape[0], self.model.cfg.vocab_size), np.float32)
        for a, logits in self._logits_pieces(rows):
            out[a:a + logits.shape[0]] = self.backend.to_host(logits)
        return out

    def _logits_pieces(self, rows: np.ndarray):
        """(a, device logits of hidden rows rows[a:a + n]) for the LM head run in pieces of the workspace's
        logits rows; each piece is overwritten by the next."""
        piece = self.model.pool.logits_rows
        for a in range(0, rows.shape[0], piece):
            yield a, self.model.compute_logits(self.backend.as_index_array(rows[a:a + piece]))
