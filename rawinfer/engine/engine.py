"""LLMEngine (add_request / step / abort / stats) and LLM, the offline generate() front end."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np

from rawinfer.backend import get_backend
from rawinfer.core.block_manager import BlockManager
from rawinfer.config import DEFAULT_MODEL, EngineConfig, ModelConfig, is_int
from rawinfer.exec.memory import MemoryPool
from rawinfer.engine.metrics import EngineStats, RequestMetrics, request_metrics
from rawinfer.exec.model import LlamaModel
from rawinfer.exec.runner import ModelRunner
from rawinfer.engine.sampler import Sampler, make_generator
from rawinfer.sampling import SamplingParams
from rawinfer.core.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from rawinfer.core.sequence import FinishReason, Sequence

log = logging.getLogger("rawinfer")

class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV pool, bad prompt, duplicate id)."""


@dataclass
class RequestOutput:
    """What one step produced for one sample of one request."""
    request_id: str
    index: int                      # sample index (0 unless n > 1)
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None   # set on the final output


@dataclass
class _SeqState:
    """Per-sequence output text machinery (absent when the model has no tokenizer)."""
    seq: Sequence
    rng: np.random.Generator
    detok: Any = None
    stop: Any = None


def engine_config_from(options: dict[str, Any]) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return EngineConfig(**options).validate()


class LLMEngine:
    def __init__(self, model_dir: str = DEFAULT_MODEL, engine_config: EngineConfig | None = None, **options):
        cfg = ModelConfig.from_dir(model_dir)
        ecfg = engine_config.validate() if engine_config is not None else engine_config_from(options)
        self._setup(cfg, ecfg)
        t0 = time.monotonic()
        self.pool.load_weights(model_dir)
        self.model.weights_loaded()
        log.info("loaded %s weights from %s in %.2f s", cfg.architecture, model_dir, time.monotonic() - t0)
        self.pool.prefault_kv()
        self.tokenizer = None
        if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            from rawinfer.engine.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(model_dir, cfg)
        self.model_dir = model_dir

    @classmethod
    def random(cls, model_config: ModelConfig, engine_config: EngineConfig, seed: int = 0) -> "LLMEngine":
        """An engine over randomly initialised weights (benchmarks of shapes with no checkpoint)."""
        self = cls.__new__(cls)
        self._setup(model_config, engine_config.validate())
        self.pool.init_random_weights(seed)
        self.model.weights_loaded()
        self.pool.prefault_kv()
        self.tokenizer = None
        self.model_dir = None
        return self

    def _setup(self, cfg: ModelConfig, ecfg: EngineConfig) -> None:
        self.model_config, self.config = cfg, ecfg
        self.max_model_len = min(ecfg.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.backend = get_backend(ecfg.device, ecfg.num_threads)
        if cfg.quant is not None and self.backend.name == "cuda":
            raise ValueError(f"{cfg.quant} weight-only models run on the CPU backend; convert without --quant "
                             "for --device cuda (or run this model with --device cpu)")
        self.pool = MemoryPool(cfg, ecfg, self.backend)
        log.info("%s backend; %s", self.backend.name, self.pool.describe())
        self.block_manager = BlockManager(self.pool.kv.num_blocks, ecfg.block_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(ecfg, self.block_manager)
        self.model = LlamaModel(cfg, self.pool)
        self.runner = ModelRunner(self.model, self.block_manager)
        self.sampler = Sampler(self.backend)
        self._requests: dict[str, list[_SeqState]] = {}
        self._seed_counter = 0
        self.stats_tracker = EngineStats()

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        V = self.model_config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all((is_int(t) or isinstance(t, np.integer))
                                                       for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        else:
            raise RequestRejected("a prompt must be a string or a list of integer token ids")
        if not ids:
            raise RequestRejected("the prompt is empty: give at least one token")
        return ids

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
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the maximum "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")
        need = -(-total // self.config.block_size) * params.n
        if need > self.block_manager.num_blocks:
            raise RequestRejected(
                f"the request needs up to {need} KV blocks ({total} tokens x {params.n} samples) but the whole "
                f"pool has {self.block_manager.num_blocks}; raise --kv-cache-memory or lower max_tokens/n")
        seq = Sequence(seq_id=request_id, request_id=request_id, index=0, prompt_token_ids=ids,
                       params=params, priority=priority)
        self._requests[request_id] = [self._new_state(seq)]
        self.scheduler.add(seq)
        return ids

    def _new_state(self, seq: Sequence) -> _SeqState:
        p = seq.params
        if p.seed is not None:
            rng = make_generator(p.seed, seq.index)
        else:
            self._seed_counter += 1
            rng = make_generator(self.config.seed * 1_000_003 + self._seed_counter, seq.index)
        st = _SeqState(seq, rng)
        if self.tokenizer is not None:
            from rawinfer.engine.stop import StopChecker
            from rawinfer.engine.tokenizer import IncrementalDetokenizer
            st.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip_special_tokens=True)
            st.stop = StopChecker(p.stop) if p.stop else None
        return st

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request at once and free its blocks. Returns its final outputs ([] if unknown)."""
        states = self._requests.pop(request_id, None)
        if states is None:
            return []
        outs = []
        for st in states:
            if not st.seq.is_finished:
                self.scheduler.finish(st.seq, FinishReason.ABORT)
                outs.append(self._final(st, [], ""))
        parent = states[0].seq
        for index in range(len(states), parent.params.n):   # samples not forked yet (prompt unfinished)
            outs.append(RequestOutput(request_id, index, [], "", True, str(FinishReason.ABORT),
                                      request_metrics(parent)))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, detokenize, finish. Returns what advanced."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        t0 = time.monotonic()
        to_sample = [s.seq for s in batch.seqs if s.needs_logits]   # before advance() moves the counters
        logits = self.runner.run(batch)
        self.scheduler.advance(batch)
        states = [self._state(seq) for seq in to_sample]
        # token histories only where a repetition penalty reads them (a list copy of each sequence)
        histories = [s.all_token_ids if s.params.repetition_penalty != 1.0 else None for s in to_sample]
        tokens = self.sampler.sample(logits, [s.params for s in to_sample], histories, [st.rng for st in states])
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for row, (seq, st, tok) in enumerate(zip(to_sample, states, tokens)):
            if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                outputs.extend(self._fork_samples(seq, logits, row, now))
            outputs.append(self._append(st, tok, now))
        self.stats_tracker.on_step(now, t0, batch.num_tokens, len(to_sample), self.block_manager.usage)
        return outputs

    def _state(self, seq: Sequence) -> _SeqState:
        for st in self._requests[seq.request_id]:
            if st.seq is seq:
                return st
        raise KeyError(seq.seq_id)

    def _fork_samples(self, parent: Sequence, logits, row: int, now: float) -> list[RequestOutput]:
        """n > 1: after the shared prompt is computed, fork n-1 samples that share its blocks
        (copy-on-write) and draw their own first tokens from the same logits row."""
        host_row = self.backend.to_host(logits)[row]
        from rawinfer.engine.sampler import sample_row
        outs = []
        for i in range(1, parent.params.n):
            child = Sequence(seq_id=f"{parent.request_id}#{i}", request_id=parent.request_id, index=i,
                             prompt_token_ids=list(parent.prompt_token_ids), params=parent.params,
                             priority=parent.priority, timings=_copy_timings(parent))
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            st = self._new_state(child)
            self._requests[parent.request_id].append(st)
            tok = sample_row(host_row, child.params, child.all_token_ids, st.rng)
            outs.append(self._append(st, tok, now))
        return outs

    def _append(self, st: _SeqState, tok: int, now: float) -> RequestOutput:
        seq, p = st.seq, st.seq.params
        seq.append_token(tok, now)
        reason = None
        text = ""
        eos = (not p.ignore_eos and tok in self.model_config.eos_token_ids) or tok in p.stop_token_ids
        if st.detok is not None:
            text = st.detok.add(tok)
            if st.stop is not None and seq.num_output_tokens > p.min_tokens:
                upd = st.stop.add(text)
                text = upd.text
                if upd.stopped:
                    reason = FinishReason.STOP
        if reason is None and eos and seq.num_output_tokens > p.min_tokens:
            reason = FinishReason.STOP
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is None:
            seq.output_text += text
            return RequestOutput(seq.request_id, seq.index, [tok], text, False)
        if st.detok is not None and not (st.stop is not None and st.stop.stopped):
            # finished without a stop string: release the text the detokenizer and checker held back
            tail = st.detok.finish()
            if st.stop is None:
                text += tail
            else:
                upd = st.stop.add(tail)
                text += upd.text if upd.stopped else upd.text + st.stop.flush()
        self.scheduler.finish(seq, reason)
        return self._final(st, [tok], text)

    def _final(self, st: _SeqState, new_ids: list[int], text: str) -> RequestOutput:
        seq = st.seq
        seq.output_text += text
        states = self._requests.get(seq.request_id)
        if states is not None and all(s.seq.is_finished for s in states):
            del self._requests[seq.request_id]
        self.stats_tracker.on_finish(seq)
        return RequestOutput(seq.request_id, seq.index, new_ids, text, True, str(seq.finish_reason),
                             request_metrics(seq))

    # ---- scoring (teacher forcing) ------------------------------------------------------------
    def score(self, token_ids: list[int], chunk_sizes: int | Iterable[int] | None = None) -> np.ndarray:
        """Logits [T, V] float32 at every position of token_ids, computed through the paged cache in
        chunks (an int: fixed chunk size; a list: e.g. [21, 1, 1, ...] = prefill then decode steps)."""
        ids = self.encode_prompt(list(token_ids))
        T = len(ids)
        limit = self.config.max_num_batched_tokens
        if chunk_sizes is None:
            chunk_sizes = limit
        sizes = list(chunk_sizes) if not isinstance(chunk_sizes, int) else []
        if isinstance(chunk_sizes, int):
            sizes = [chunk_sizes] * (-(-T // chunk_sizes))
        sid = f"__score_{time.monotonic_ns()}"
        seq = Sequence(seq_id=sid, request_id=sid, index=0, prompt_token_ids=ids, params=SamplingParams())
        out = np.empty((T, self.model_config.vocab_size), np.float32)
        done = 0
        try:
            for n in sizes:
                n = min(n, T - done, limit)
                if n <= 0:
                    break
                if self.block_manager.allocate_slots(sid, done + n) is None:
                    raise RuntimeError("the KV pool is too small (or too busy) to score this sequence")
                out[done:done + n] = self.runner.score(ScheduledBatch([ScheduledSeq(seq, n)]))
                done += n
                seq.num_computed_tokens = done
            if done < T:
                raise ValueError(f"chunk_sizes cover {done} of {T} tokens")
        finally:
            if sid in self.block_manager:
                self.block_manager.free(sid)
        return out

    # ---- gauges -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.stats_tracker.snapshot(),
        }


def _copy_timings(parent: Sequence):
    from rawinfer.core.sequence import SequenceTimings
    t = parent.timings
    return SequenceTimings(arrival=t.arrival, scheduled=t.scheduled)
