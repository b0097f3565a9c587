"""LLMEngine: requests in, token and text outputs out, one step at a time (add_request / step / abort /
score / stats).

One step flows one way:

    scheduler.schedule()    core: which sequences advance, by how many tokens -> ScheduledBatch + StepPlan
    runner.run(plan)        exec: copy-on-write copies, forward pass -> device logits (+ host score logits)
    scheduler.advance()     core: computed tokens, prefix-cache registration of filled blocks
    sample, outputs         engine: grammar masks (structured.py), tokens -> text, stop rules, finishes
                            (engine/outputs.py)

A request of n > 1 samples starts as one sequence; when its prompt is computed, the scheduler forks
the other n - 1 from it (sharing the prompt's blocks) and each draws its first token from the same
logits row. Scoring (teacher forcing) is a request too: a sequence whose every row gets logits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import fields
from typing import Any

import numpy as np

from rawinfer.backend.select import get_backend
from rawinfer.config import DEFAULT_MODEL, EngineConfig, ModelConfig, is_int, resolve_max_model_len
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.scheduler import Scheduler
from rawinfer.core.sequence import FinishReason, Sequence, SequenceTimings
from rawinfer.core.step_plan import ScheduledBatch
from rawinfer.engine.kv_transfer import KVTransfer
from rawinfer.engine.logprobs import Logprobs, store_prompt_logprobs, take_prompt_logprobs, token_logprobs
from rawinfer.engine.metrics import EngineStats, request_metrics
from rawinfer.engine.outputs import OutputRules, RequestOutput, SampleState
from rawinfer.engine.sampler import Sampler, make_generator, sample_row
from rawinfer.engine.scoring import Scoring
from rawinfer.engine.structured import GrammarError, MaskJob, StructuredOutputs
from rawinfer.engine.warmup import warm_up
from rawinfer.exec.graphs import DecodeGraphs
from rawinfer.exec.memory import MemoryPool
from rawinfer.exec.model import DecoderModel
from rawinfer.exec.runner import ModelRunner, StepOutput
from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "engine_config_from"]


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool, bad prompt, duplicate id)."""


def engine_config_from(options: dict[str, Any]) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return EngineConfig(**options).validate()


class LLMEngine(Scoring):
    def __init__(self, model_dir: str = DEFAULT_MODEL, engine_config: EngineConfig | None = None, **options):
        if engine_config is not None and (not isinstance(engine_config, EngineConfig) or options):
            raise ValueError("engine_config must be an EngineConfig and comes alone: pass either it or the engine "
                             f"options as keywords (got {type(engine_config).__name__} and {sorted(options)})")
        cfg = ModelConfig.from_dir(model_dir)
        ecfg = engine_config.validate() if engine_config is not None else engine_config_from(options)
        if ecfg.chat_template is not None:   # it replaces the model's template; a bad file is refused before loading
            from rawinfer.engine.tokenizer import load_chat_template
            cfg = dataclasses.replace(cfg, chat_template=load_chat_template(ecfg.chat_template))
        self._setup(cfg, ecfg)
        t0 = time.monotonic()
        self.pool.load_weights(model_dir)
        self.model.weights_loaded()
        log.info("loaded %s weights from %s in %.2f s", cfg.architecture, model_dir, time.monotonic() - t0)
        self.pool.prefault_kv()
        if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            from rawinfer.engine.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(model_dir, cfg)
            self.rules = OutputRules(self.tokenizer, cfg.eos_token_ids, self.max_model_len)
            self.structured = StructuredOutputs.for_model(self.backend, self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.model_dir = model_dir
        if ecfg.warmup:
            warm_up(self)

    @classmethod
    def random(cls, model_config: ModelConfig, engine_config: EngineConfig, seed: int = 0) -> "LLMEngine":
        """An engine over randomly initialised weights (benchmarks of shapes with no checkpoint)."""
        self = cls.__new__(cls)
        self._setup(model_config, engine_config.validate())
        self.pool.init_random_weights(seed)
        self.model.weights_loaded()
        self.pool.prefault_kv()
        if self.config.warmup:
            warm_up(self)
        return self

    def _setup(self, cfg: ModelConfig, ecfg: EngineConfig) -> None:
        self.model_config, self.config = cfg, ecfg
        self.max_model_len = resolve_max_model_len(cfg, ecfg)
        self.backend = get_backend(ecfg.device, ecfg.num_threads, ecfg.cpu_int_gemm, ecfg.cache_dir,
                                   ecfg.batch_invariant, ecfg.int8_activations)
        if ecfg.int8_activations and cfg.quant not in ("int8", "q4"):
            raise ValueError(f"int8_activations (--int8-activations) runs the products of int8 and q4 models; this "
                             f"model is {cfg.quant or cfg.dtype}: convert it with --quant int8 or --quant q4, or leave "
                             "the option off")
        if cfg.quant is not None and cfg.quant not in self.backend.capabilities.quantized_weights:
            raise ValueError(f"{cfg.quant} weight-only models run on the CPU backend; convert without --quant "
                             f"for --device {self.backend.name} (or run this model with --device cpu)")
        graphs = bool(ecfg.use_cuda_graphs) and self.backend.capabilities.graphs
        extra = {}
        if graphs:
            from rawinfer.exec.memory import max_blocks_per_seq
            extra = DecodeGraphs.workspace_request(ecfg, max_blocks_per_seq(cfg, ecfg))
        self.pool = MemoryPool(cfg, ecfg, self.backend, padding_block=graphs, extra_workspace=extra)
        log.info("%s backend; %s", self.backend.name, self.pool.describe())
        self.model = DecoderModel(cfg, self.pool)
        self.runner = ModelRunner(self.model, graphs=graphs)
        self.sampler = Sampler(self.backend)
        self.tokenizer = None
        self.model_dir = None
        self.rules = OutputRules(None, cfg.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs.for_model(self.backend, None, cfg.vocab_size, cfg.eos_token_ids)
        self._seed_counter = 0
        self.reset_state()

    def reset_state(self) -> None:
        """Forget every request, cached prefix and counter: a fresh block manager and scheduler over the
        same pool (its KV contents are garbage nobody reads). For an engine with nothing in flight."""
        if getattr(self, "_requests", None):
            raise RuntimeError(f"reset_state with {len(self._requests)} request(s) in flight; abort them first")
        ecfg = self.config
        self.block_manager = BlockManager(self.pool.kv.num_blocks, ecfg.block_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(ecfg, self.block_manager, self.runner.plan_layout,
                                   sliding_window=self.model_config.kv_window)
        self._requests: dict[str, list[SampleState]] = {}
        self._scores: dict[str, np.ndarray] = {}           # scoring sequence id -> host logits [T, V]
        self._pending: list[RequestOutput] = []            # outputs of steps that score() ran for others
        self.structured.held.clear()                       # requests waiting for their grammar
        self.stats_tracker = EngineStats(max_model_len=self.max_model_len)
        if getattr(self, "kv_transfer", None) is None:     # K/V exported to / received from another engine
            self.kv_transfer = KVTransfer(self)
        self.kv_transfer.clear()                           # the same object: the decode role's link holds it

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        V = self.model_config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: pass the prompt as a list of token ids")
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as e:              # text that is not UTF-8
                raise RequestRejected(f"the prompt cannot be tokenized: {e}") from None
        elif isinstance(prompt, (list, tuple)) and all((is_int(t) or isinstance(t, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        else:
            raise RequestRejected("a prompt must be a string or a list of integer token ids")
        if not ids:
            raise RequestRejected("the prompt is empty: give at least one token")
        return ids

    def _check_fits(self, num_tokens: int, n: int, what: str) -> None:
        """RequestRejected unless n sequences of num_tokens tokens fit the context and the whole pool."""
        if num_tokens > self.max_model_len:
            raise RequestRejected(f"{what} = {num_tokens} exceeds the maximum context of {self.max_model_len} "
                                  "tokens; shorten the prompt or lower max_tokens")
        bs, W = self.config.block_size, self.model_config.kv_window
        need = -(-num_tokens // bs)
        if W:   # every layer slides: blocks behind the window go back, so a sequence holds at most the
            # window plus one chunk of new tokens (scheduler.advance -> BlockManager.release_before)
            need = min(need, (W - 1 + min(num_tokens, self.config.max_num_batched_tokens)) // bs + 2)
        need *= n
        if need > self.block_manager.num_blocks:
            raise RequestRejected(
                f"the request needs up to {need} KV blocks ({num_tokens} tokens x {n} samples) but the whole "
                f"pool has {self.block_manager.num_blocks}; raise --kv-cache-memory or lower max_tokens/n")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises RequestRejected (a ValueError) when the
        request can never run, naming the limit and the fix."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestRejected("params must be a SamplingParams")
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("request_id must be a non-empty string")
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use; choose a unique id")
        if not is_int(priority):
            raise RequestRejected("priority must be an integer")
        ids = self.encode_prompt(prompt)
        V = self.model_config.vocab_size
        bad = [t for t in params.logit_bias if t >= V]
        if bad:
            raise RequestRejected(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {V})")
        self._check_fits(len(ids) + params.max_tokens, params.n,
                         f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens})")
        try:
            grammar = self.structured.prepare(params)       # its compile: done, or on the way
        except GrammarError as e:
            raise RequestRejected(str(e)) from None
        seq = Sequence(seq_id=request_id, request_id=request_id, index=0, prompt_token_ids=ids,
                       params=params, priority=priority)
        st = self._new_state(seq)
        self._requests[request_id] = [st]
        if grammar is None or self.structured.attach(st, grammar):    # else held until it compiled
            self.scheduler.add(seq)
        return ids

    def _new_state(self, seq: Sequence) -> SampleState:
        p = seq.params
        if p.seed is not None:
            rng = make_generator(p.seed, seq.index)
        else:
            self._seed_counter += 1
            rng = make_generator(self.config.seed * 1_000_003 + self._seed_counter, seq.index)
        st = self.rules.new_state(seq, rng)
        if p.prompt_logprobs is not None:
            st.prompt_logprobs = Logprobs()
        return st

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request at once and free its blocks. Returns its final outputs ([] if unknown)."""
        states = self._requests.pop(request_id, None)
        self.structured.held.pop(request_id, None)
        if states is None:
            return []
        outs = []
        for st in states:
            if not st.seq.is_finished:
                self.scheduler.finish(st.seq, FinishReason.ABORT)
                outs.append(self._final(st, [], ""))
        parent = states[0].seq
        for index in range(len(states), parent.params.n):   # samples not forked yet (prompt unfinished)
            self.stats_tracker.count_finish(str(FinishReason.ABORT))
            outs.append(RequestOutput(request_id, index, [], "", True, str(FinishReason.ABORT),
                                      request_metrics(parent)))
        return outs

    def discard_all(self) -> None:
        """The last resort after a failed step whose requests could not be aborted one by one: forget every
        request and start a fresh block manager and scheduler over the same pool (the counters are kept,
        the prefix cache is lost). Their outputs are the caller's to send."""
        stats = self.stats_tracker
        self._requests = {}
        self.reset_state()
        self.stats_tracker = stats

    def has_unfinished(self) -> bool:   # NOTE: a request waiting for remote K/V is not (kv_transfer.py)
        return self.scheduler.has_unfinished or bool(self._pending) or bool(self.structured.held)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, detokenize, finish. Returns what advanced."""
        outputs, self._pending = self._pending, []
        outputs += self._release_held() if self.structured.held else []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        return outputs + self._run(batch)

    def _release_held(self) -> list[RequestOutput]:
        """Requests held for their grammar: scheduled once it compiled, ended with its error if it did not."""
        ready, failed = self.structured.release(idle=not self.scheduler.has_unfinished)
        for st in ready:
            self.scheduler.add(st.seq)
        outputs = [out for rid in failed for out in self.abort(rid)]
        for out in outputs:
            out.finish_reason, out.error = "error", failed[out.request_id]
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """One forward pass of a scheduled batch, then its outputs (step and score share it)."""
        t0 = time.monotonic()
        states = [self._state(s.seq) for s in batch.seqs if s.samples]
        mask = self.structured.masks(states)              # grammar rows: filled during the pass on a GPU
        result = self.runner.run(batch.plan)
        self.scheduler.advance(batch)
        self.kv_transfer.after_step(batch)
        return self._process(batch, result, t0, states, mask)

    def _process(self, batch: ScheduledBatch, result: StepOutput, started: float, states: list[SampleState],
                 mask: MaskJob | None) -> list[RequestOutput]:
        """Mask and sample the sampled rows, store scored rows and prompt log-probabilities, finish what is done."""
        to_sample = [st.seq for st in states]
        raw = mask.apply(result.logits) if mask is not None else result.logits   # log-probabilities read raw
        edits = [s.params.edits_logits for s in to_sample]
        tokens = self.sampler.sample(result.logits, [s.params for s in to_sample],
                                     [s.token_ids if e else None for s, e in zip(to_sample, edits)],
                                     [st.rng for st in states], [s.num_prompt_tokens for s in to_sample])
        self._store_scores(batch, result)
        store_prompt_logprobs(batch, result.prompt_logprobs, self._state)
        now = time.monotonic()
        picks: list[tuple[SampleState, int, int]] = []     # (sample, logits row, its new token)
        prompt_only: list[SampleState] = []
        for row, (seq, st, tok) in enumerate(zip(to_sample, states, tokens)):
            if seq.params.max_tokens == 0:
                prompt_only.append(st)
                continue
            if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                picks += self._fork_samples(st, result.logits, row)
            picks.append((st, row, tok))
        logprobs = token_logprobs(self.backend, raw, [(st.seq.params.logprobs, row, tok)
                                                                for st, row, tok in picks])
        outputs = [self._add_token(st, tok, now, lp) for (st, _, tok), lp in zip(picks, logprobs)]
        for st in prompt_only:
            outputs += self._finish_prompt_only(st)
        self.stats_tracker.on_step(now, started, batch.num_tokens, len(to_sample), self.block_manager.usage)
        self.scheduler.step_cost.observe_plan(batch.plan, now - started)    # what steps cost here (itl_target_ms)
        return outputs

    def _state(self, seq: Sequence) -> SampleState:
        for st in self._requests[seq.request_id]:
            if st.seq is seq:
                return st
        raise KeyError(seq.seq_id)

    def _fork_samples(self, parent_st: SampleState, logits, row: int) -> list[tuple[SampleState, int, int]]:
        """n > 1: the prompt is computed; the scheduler forks n-1 samples that share its blocks, and each
        draws its own first token from the same logits row. Returns (sample, row, token) of each."""
        parent = parent_st.seq
        host_row = self.backend.to_host(logits)[row]
        picks = []
        for i in range(1, parent.params.n):
            t = parent.timings
            child = Sequence(seq_id=(parent.request_id, i), request_id=parent.request_id, index=i,
                             prompt_token_ids=parent.token_ids[:parent.num_prompt_tokens], params=parent.params,
                             priority=parent.priority, timings=SequenceTimings(arrival=t.arrival, scheduled=t.scheduled))
            self.scheduler.fork(parent, child)
            st = self._new_state(child)
            st.prompt_logprobs = parent_st.prompt_logprobs          # the same prompt: read only from here on
            st.grammar = parent_st.grammar.fork() if parent_st.grammar is not None else None
            self._requests[parent.request_id].append(st)
            picks.append((st, row, sample_row(host_row, child.params, child.token_ids, st.rng, child.num_prompt_tokens)))
        return picks

    def _finish_prompt_only(self, st: SampleState) -> list[RequestOutput]:
        """max_tokens 0: the prompt is computed (its log-probabilities taken); every sample ends, no token."""
        seq = st.seq
        self.scheduler.finish(seq, FinishReason.LENGTH)
        first = self._final(st, [], "")
        outs = [first]
        for index in range(1, seq.params.n):
            self.stats_tracker.count_finish(str(FinishReason.LENGTH))
            outs.append(RequestOutput(seq.request_id, index, [], "", True, first.finish_reason, first.metrics,
                                      prompt_logprobs=first.prompt_logprobs))
        return outs

    def _add_token(self, st: SampleState, tok: int, now: float, logprobs: Logprobs | None = None) -> RequestOutput:
        text, reason = self.rules.add_token(st, tok, now)
        self.stats_tracker.on_token(st.seq)
        if reason is None:
            return RequestOutput(st.seq.request_id, st.seq.index, [tok], text, False, logprobs=logprobs,
                                 prompt_logprobs=take_prompt_logprobs(st))
        self.scheduler.finish(st.seq, reason)
        return self._final(st, [tok], text, logprobs)

    def _final(self, st: SampleState, new_ids: list[int], text: str, logprobs: Logprobs | None = None) -> RequestOutput:
        seq = st.seq
        states = self._requests.get(seq.request_id)
        if states is not None and all(s.seq.is_finished for s in states):
            del self._requests[seq.request_id]
        self.stats_tracker.on_finish(seq)
        return RequestOutput(seq.request_id, seq.index, new_ids, text, True, str(seq.finish_reason),
                             request_metrics(seq), logprobs, take_prompt_logprobs(st))

    # ---- gauges -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Gauges and counters. A free block may still hold a cached prefix (prefix_cache_free_blocks, part
        of kv_blocks_free): a hit takes it back, new data evicts it (prefix_cache_evictions)."""
        bm, pc = self.block_manager, self.block_manager.stats
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "receiving_kv": len(self.scheduler.receiving),      # waiting for K/V from a prefill instance
            "kv_blocks_used": bm.num_used_blocks, "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": bm.num_blocks,
            "kv_usage": bm.usage,
            "prefix_cache_blocks": bm.num_cached_blocks, "prefix_cache_free_blocks": pc.cached_free_blocks,
            "prefix_cache_evictions": pc.evicted_blocks,
            "prefix_cache_hit_tokens": pc.hit_tokens, "prefix_cache_query_tokens": pc.query_tokens,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.stats_tracker.snapshot(),
            "metrics": self.stats_tracker.metrics(
                {"num_requests_running": len(self.scheduler.running), "num_requests_waiting": len(self.scheduler.waiting),
                 "kv_cache_usage_perc": bm.usage},
                {"num_preemptions_total": self.scheduler.num_preemptions,
                 "prefix_cache_queries_total": pc.query_tokens, "prefix_cache_hits_total": pc.hit_tokens}),
        }
