"""LLMEngine: requests in, token and text outputs out, one step at a time (add_request / add_score / step /
abort / stats).

One step runs one way, each stage feeding the next (docs/architecture.md, "One step"):

    scheduler.schedule()    core: who advances by how many tokens, forks -> SchedulerOutput (+ its StepPlan)
    runner.run(plan)        exec: copy-on-write copies, forward pass -> RunnerOutput
    scheduler.update(out)   core: computed tokens, prefix cache, forks join, finishes -> StepUpdate
    _outputs(...)           engine: grammar masks, sampling, text, stop rules (outputs.py), log-probabilities,
                            scores (scoring.py) -> RequestOutputs
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

import numpy as np

from rawinfer.backend.base import Backend
from rawinfer.backend.select import get_backend
from rawinfer.config import DEFAULT_MODEL, EngineConfig, ModelConfig, is_int, resolve_max_model_len
from rawinfer.core.block_manager import BlockManager
from rawinfer.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from rawinfer.core.sequence import FinishReason, Sequence
from rawinfer.engine.kv_transfer import KVTransfer
from rawinfer.engine.logprobs import Logprobs, store_prompt_logprobs, take_prompt_logprobs, token_logprobs
from rawinfer.engine.metrics import EngineStats, engine_stats, request_metrics
from rawinfer.engine.outputs import OutputRules, RequestOutput, SampleState, join_outputs
from rawinfer.engine.requests import RequestRejected, check_fits, encode_prompt
from rawinfer.engine.sampler import Sampler, make_generator
from rawinfer.engine.scoring import score_sequence, store_scores
from rawinfer.engine.speculative import Speculator
from rawinfer.engine.structured import GrammarError, MaskJob, StructuredOutputs, draft_rows
from rawinfer.engine.warmup import warm_up
from rawinfer.exec.graphs import DecodeGraphs
from rawinfer.exec.memory import MemoryPool
from rawinfer.exec.model import DecoderModel
from rawinfer.exec.runner import ModelRunner, RunnerOutput
from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "engine_config_from"]


def engine_config_from(options: dict[str, Any]) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return EngineConfig(**options).validate()


class LLMEngine:
    def __init__(self, model_dir: str = DEFAULT_MODEL, engine_config: EngineConfig | None = None, *,
                 backend: Backend | None = None, **options):
        """backend: run on this instance, not the one engine_config.device selects (benchmarks: backend/null.py)."""
        if engine_config is not None and (not isinstance(engine_config, EngineConfig) or options):
            raise ValueError("engine_config must be an EngineConfig and comes alone: pass either it or the engine "
                             f"options as keywords (got {type(engine_config).__name__} and {sorted(options)})")
        cfg = ModelConfig.from_dir(model_dir)
        ecfg = engine_config.validate() if engine_config is not None else engine_config_from(options)
        if ecfg.chat_template is not None:   # it replaces the model's template; a bad file is refused before loading
            from rawinfer.engine.tokenizer import load_chat_template
            cfg = dataclasses.replace(cfg, chat_template=load_chat_template(ecfg.chat_template))
        self._setup(cfg, ecfg, backend)
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

    def _setup(self, cfg: ModelConfig, ecfg: EngineConfig, backend: Backend | None = None) -> None:
        self.model_config, self.config = cfg, ecfg
        self.max_model_len = resolve_max_model_len(cfg, ecfg)
        self.backend = backend if backend is not None else get_backend(
            ecfg.device, ecfg.num_threads, ecfg.cpu_int_gemm, ecfg.cache_dir, ecfg.batch_invariant,
            ecfg.int8_activations)
        if ecfg.int8_activations and cfg.quant not in ("int8", "q4"):
            raise ValueError(f"int8_activations (--int8-activations) runs the products of int8 and q4 models; this "
                             f"model is {cfg.quant or cfg.dtype}: convert it with --quant int8 or --quant q4, or leave "
                             "the option off")
        if cfg.quant is not None and cfg.quant not in self.backend.capabilities.quantized_weights:
            raise ValueError(f"{cfg.quant} weight-only models run on the CPU backend; convert "
                             f"{self.backend.capabilities.conversions()} for --device {self.backend.name} (or run this "
                             "model with --device cpu)")
        graphs, extra = DecodeGraphs.pool_options(cfg, ecfg, self.backend)
        self.pool = MemoryPool(cfg, ecfg, self.backend, padding_block=graphs, extra_workspace=extra,
                               guest=Speculator.pool_guest(ecfg, cfg))    # a draft model's room, or None
        log.info("%s backend; %s", self.backend.name, self.pool.describe())
        self.model = DecoderModel(cfg, self.pool)
        self.runner = ModelRunner(self.model, graphs=graphs)
        self.sampler = Sampler(self.backend)
        self.tokenizer = None
        self.model_dir = None
        self.rules = OutputRules(None, cfg.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs.for_model(self.backend, None, cfg.vocab_size, cfg.eos_token_ids)
        self._seed_counter = 0
        self._requests: dict[str, list[SampleState]] = {}   # request id -> its samples' states, index order
        self.kv_transfer = KVTransfer(self)     # K/V exported to / received from another engine
        self.speculator = Speculator.from_config(ecfg, cfg, self.max_model_len, self.pool)    # None: none
        self.reset_state()

    def reset_state(self) -> None:
        """Forget every request, cached prefix and counter: a fresh block manager and scheduler over the
        same pool (its KV contents are garbage nobody reads). For an engine with nothing in flight."""
        if self._requests:
            raise RuntimeError(f"reset_state with {len(self._requests)} request(s) in flight; abort them first")
        ecfg = self.config
        self.block_manager = BlockManager(self.pool.kv.num_blocks, ecfg.block_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(ecfg, self.block_manager, self.runner.plan_layout,
                                   sliding_window=self.model_config.kv_window)
        self.structured.held.clear()                       # requests waiting for their grammar
        self.stats_tracker = EngineStats(max_model_len=self.max_model_len)
        self.kv_transfer.clear()                           # the same object: the decode role's link holds it
        if self.speculator is not None:
            self.speculator.clear()

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def _check_fits(self, num_tokens: int, n: int, what: str) -> None:
        check_fits(num_tokens, n, what, max_model_len=self.max_model_len, ecfg=self.config,
                   kv_window=self.model_config.kv_window, num_blocks=self.block_manager.num_blocks)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises RequestRejected (a ValueError) when the
        request can never run, naming the limit and the fix."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestRejected("params must be a SamplingParams")
        self._check_id(request_id)
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

    def _check_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("request_id must be a non-empty string")
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already in use; choose a unique id")

    def add_score(self, request_id: str, token_ids: list[int],
                  chunk_sizes: int | Iterable[int] | None = None) -> list[int]:
        """Queue a scoring request (engine/scoring.py): teacher-forced logits at every position of token_ids,
        computed through the paged cache in chunks (an int: a fixed size; sizes, e.g. [21, 1, 1, ...] = a prefill
        then decode steps; None: the step's token budget), each at most max_num_batched_tokens. Its final
        output's `scores` holds them, [T, V] float32. Returns the token ids; RequestRejected as add_request."""
        self._check_id(request_id)
        ids = self.encode_prompt(list(token_ids))
        try:
            seq = score_sequence(request_id, ids, chunk_sizes, self.config.max_num_batched_tokens)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        self._check_fits(len(ids), 1, f"the scored sequence ({len(ids)} tokens)")
        self._requests[request_id] = [self._new_state(seq)]
        self.scheduler.add(seq)
        return ids

    def score(self, token_ids: list[int], chunk_sizes: int | Iterable[int] | None = None) -> np.ndarray:
        """add_score, then step until its logits [T, V] float32 come out (alone; beside others: add_score)."""
        if self._requests:
            raise RuntimeError(f"score() runs alone and {len(self._requests)} request(s) are in flight; queue it "
                               "with add_score and read its final output's scores from step()")
        ids = self.add_score("score", token_ids, chunk_sizes)
        try:
            for _ in range(len(ids)):               # alone, every step computes its next chunk
                for out in self.step():
                    return out.scores
            raise RuntimeError("the KV pool is too small to score this sequence")
        except BaseException:
            self.abort("score")                     # after an error: nothing of it stays
            raise

    def _new_state(self, seq: Sequence) -> SampleState:
        if seq.is_scoring:
            return SampleState(seq, None, scores=np.empty((seq.num_tokens, self.model_config.vocab_size), np.float32))
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
        return outs + self._unforked(outs[0], len(states), states[0].seq.params.n) if outs else outs

    def discard_all(self) -> None:
        """The last resort after a failed step whose requests could not be aborted one by one: forget every
        request and start a fresh block manager and scheduler over the same pool (the counters are kept,
        the prefix cache is lost). Their outputs are the caller's to send."""
        stats = self.stats_tracker
        self._requests = {}
        self.reset_state()
        self.stats_tracker = stats

    def has_unfinished(self) -> bool:   # NOTE: a request waiting for remote K/V is not (kv_transfer.py)
        return self.scheduler.has_unfinished or bool(self.structured.held)

    def sequences(self, request_id: str) -> list[Sequence]:
        """The sequences of a request in flight, one per sample started so far ([] if unknown)."""
        return [st.seq for st in self._requests.get(request_id, ())]

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, update the scheduler, sample, detokenize, finish. Returns what
        advanced or ended."""
        outputs = self._release_held() if self.structured.held else []
        out = self.scheduler.schedule(self._drafts())
        if out.is_empty:
            return outputs
        started = time.monotonic()
        # in logits-row order, a draft row's grammar as it stands after the drafts before it; on a GPU filled
        # during the pass
        mask = self.structured.masks(self._mask_rows(out))
        result = self.runner.run(out.plan)
        self.kv_transfer.after_step(out)                # exports copy their blocks before update() frees them
        update = self.scheduler.update(out)
        return outputs + self._outputs(out, result, update, mask, started)

    def _mask_rows(self, out: SchedulerOutput) -> list:
        """The states masks() reads, one per logits row of the step (draft rows' stand-ins after their sample's)."""
        rows = []
        for s in out.seqs:
            if s.samples:
                st = self._state(s.seq)
                rows.append(st)
                if s.draft:
                    rows += draft_rows(st, s.draft)
        return rows

    def _release_held(self) -> list[RequestOutput]:
        """Requests held for their grammar: scheduled once it compiled, ended with its error if it did not."""
        ready, failed = self.structured.release(idle=not self.scheduler.has_unfinished)
        for st in ready:
            self.scheduler.add(st.seq)
        outputs = [out for rid in failed for out in self.abort(rid)]
        for out in outputs:
            out.finish_reason, out.error = "error", failed[out.request_id]
        return outputs

    def _outputs(self, out: SchedulerOutput, result: RunnerOutput, update: StepUpdate, mask: MaskJob | None,
                 started: float) -> list[RequestOutput]:
        """The step's outputs: masked sampling of every sample update() names (a fork from its parent's row),
        scored rows and prompt log-probabilities filed, finals of what it finished."""
        raw = mask.apply(result.logits) if mask is not None else result.logits   # log-probabilities read raw
        store_prompt_logprobs(out, result.prompt_logprobs, self._state)
        store_scores(out, result.score_logits, self._state)
        seqs, rows = [seq for seq, _ in update.samples], [row for _, row in update.samples]
        states, logits = [self._state(seq) for seq in seqs], result.logits
        if rows != list(range(int(logits.shape[0]))):    # forks share a row; max_tokens 0 rows draw nothing
            logits = logits[self.backend.as_index_array(np.asarray(rows, np.int32))]
        histories = [s.token_ids if s.params.edits_logits else None for s in seqs]
        tokens = self.sampler.sample(logits, [s.params for s in seqs], histories, [st.rng for st in states],
                                     [s.num_prompt_tokens for s in seqs])
        kept = self._verified(result.logits, update, seqs, rows, tokens, states)    # [(token, row), ...] per sample
        now = time.monotonic()
        logprobs = iter(token_logprobs(self.backend, raw, [(st.seq.params.logprobs, row, tok)
                                                           for st, ks in zip(states, kept) for tok, row in ks]))
        outputs = [self._add_tokens(st, ks, now, [next(logprobs) for _ in ks], update.drafts)
                   for st, ks in zip(states, kept)]
        for seq in update.finished:     # scored to the end, or a max_tokens 0 prompt: every sample ends, no token
            first = self._final(self._state(seq), [], "")
            outputs += [first, *self._unforked(first, 1, seq.params.n)]
        self.stats_tracker.on_step(now, started, out.plan.num_tokens, sum(map(len, kept)), self.block_manager.usage)
        self.scheduler.step_cost.observe_plan(out.plan, now - started)    # what steps cost here (itl_target_ms)
        return outputs

    def _state(self, seq: Sequence) -> SampleState:
        """seq's output state; a sample forked this step gets its own, its parent's grammar forked."""
        states = self._requests[seq.request_id]
        if seq.index == len(states):
            st, parent = self._new_state(seq), states[0]
            st.prompt_logprobs = parent.prompt_logprobs          # the same prompt: read only from here on
            st.grammar = parent.grammar.fork() if parent.grammar is not None else None
            states.append(st)
        return states[seq.index]

    def _unforked(self, first: RequestOutput, start: int, n: int) -> list[RequestOutput]:
        """Finals of samples start..n-1 of first's request, never forked: they end as it did."""
        for _ in range(start, n):
            self.stats_tracker.count_finish(first.finish_reason)
        return [dataclasses.replace(first, index=index) for index in range(start, n)]

    def _drafts(self) -> dict:
        """Speculative decoding: the tokens proposed to follow the running sequences that speculate this step."""
        if self.speculator is None:
            return {}
        drafts = self.speculator.propose(self.scheduler.running, self.scheduler.step_cost)
        for seq in self.scheduler.running:      # a grammar keeps the drafts it accepts
            grammar = self._state(seq).grammar if seq.seq_id in drafts else None
            if grammar is not None:
                drafts[seq.seq_id] = grammar.valid_prefix(drafts[seq.seq_id])
        return {sid: d for sid, d in drafts.items() if d}

    def _verified(self, logits, update: StepUpdate, seqs, rows, tokens, states) -> list[list[tuple[int, int]]]:
        """Per sample the tokens it keeps this step, with their logits rows: the one drawn from its row, and for
        a sequence that verified drafts, one more per agreeing draft (speculative.py)."""
        kept = [[(tok, row)] for tok, row in zip(tokens, rows)]
        if update.drafts:
            idx = [i for i, seq in enumerate(seqs) if seq.seq_id in update.drafts]
            checked = self.speculator.verify(self.backend, logits, [
                (seqs[i], rows[i], tokens[i], update.drafts[seqs[i].seq_id], states[i].rng) for i in idx])
            for i, ks in zip(idx, checked):
                kept[i] = ks
        return kept

    def _add_tokens(self, st: SampleState, kept, now: float, logprobs: list, drafts: dict) -> RequestOutput:
        """One sample's kept tokens through the output rules, in order, until one finishes it; a sequence that
        verified drafts and still runs then counts the agreeing ones as computed (scheduler.accept)."""
        if len(kept) == 1 and not drafts:      # a plain decode row: one token, nothing to accept
            return self._add_token(st, kept[0][0], now, logprobs[0])
        outs = []
        for (tok, _), lp in zip(kept, logprobs):
            outs.append(self._add_token(st, tok, now, lp))
            if outs[-1].finished:
                break
        if st.seq.seq_id in drafts and not st.seq.is_finished:
            self.scheduler.accept(st.seq, len(kept) - 1)
        return join_outputs(outs)

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
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)
        if not seq.is_scoring:
            self.stats_tracker.on_finish(seq)
        scores = st.scores if seq.finish_reason == FinishReason.LENGTH else None     # not after an abort
        return RequestOutput(seq.request_id, seq.index, new_ids, text, True, str(seq.finish_reason),
                             request_metrics(seq), logprobs, take_prompt_logprobs(st), scores=scores)

    # ---- gauges -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Gauges and counters (metrics.engine_stats)."""
        return engine_stats(self.scheduler, self.stats_tracker, self.speculator)
