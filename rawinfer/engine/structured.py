"""Structured output: each request's grammar (a JSON schema, a regex, a choice list, a Lark or GBNF grammar),
compiled by llguidance off the engine thread and cached, one matcher per sample, and the token mask of the
sampled rows that have one.

    add_request   prepare(): the grammar's compile, a cache hit or a job on a small thread pool (llguidance
                  releases the GIL); compiled: the sample gets its matcher and is scheduled, else it is
                  held, outside the scheduler, while the other requests keep stepping
    step          release(): held requests whose grammar compiled join the scheduler; a grammar that does
                  not compile ends its request with an error
                  masks(): the bitmask [R, W] of the sampled rows with a matcher, filled by llguidance for
                  all rows at once (on a GPU while the forward pass runs); MaskJob.apply sets every logit
                  the grammar forbids to -inf (backend.grammar_mask) before the sampler edits or draws, so
                  the mask composes with greedy and every sampling option
    add_token     SampleGrammar.advance(): the matcher consumes the token; a complete grammar ends the
                  sample with "stop" (engine/outputs.py)

EOS is allowed exactly where the grammar may end. Where the request would ignore an EOS (ignore_eos, or
fewer than min_tokens output tokens) it is taken out of the mask unless the grammar allows nothing else:
no rule forces a token the grammar forbids, and a complete grammar ends the sample whatever min_tokens says.
A sample's matcher consumes each token once, when it is appended, so a preempted sequence (which keeps its
output tokens and recomputes their K/V) never feeds it a token twice.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

log = logging.getLogger("rawinfer")

GRAMMARS_KEPT = 256       # compiled grammars cached, least recently used dropped first
COMPILE_THREADS = 2       # the compile pool
MASK_THREADS = 16         # most threads llguidance fills one step's bitmask with
HOLD_WAIT_S = 0.02        # how long an engine with nothing else to run waits for a compile per step()
# JSON spelled as json.dumps spells it, with no free whitespace, which a small model may repeat without end;
# a schema's own "x-guidance" options override these
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """structured_outputs that cannot be compiled: the message names the field and the compiler's reason."""


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def spec_key(spec: dict) -> str:
    """The cache key of a (validated) structured_outputs map: canonical JSON, a schema given as a string
    and as a map sharing it."""
    (kind, value), = spec.items()
    if kind == "json" and isinstance(value, str):
        value = json.loads(value)
    return json.dumps([kind, value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def grammar_source(spec: dict) -> str:
    """The llguidance grammar of a (validated) structured_outputs map."""
    import llguidance as llg
    (kind, value), = spec.items()
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(value) if isinstance(value, str) else value
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":     # JSON string literals are Lark's (escapes included)
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    from llguidance.gbnf_to_lark import any_to_lark     # Lark passes through, GBNF (rules with ::=) is converted
    return llg.LLMatcher.grammar_from_lark(any_to_lark(value))


class SampleGrammar:
    """One sample's matcher: which tokens may come next, given the tokens it consumed."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fork(self) -> "SampleGrammar":
        """A matcher of its own in this one's state (n > 1: the samples forked from the first)."""
        return SampleGrammar(self.matcher.deep_copy())

    def valid_prefix(self, tokens) -> tuple[int, ...]:
        """The longest prefix of `tokens` (speculative drafts) the grammar accepts from here, nothing consumed."""
        return tuple(tokens[:self.matcher.validate_tokens([int(t) for t in tokens])])

    def after(self, tokens) -> "SampleGrammar":
        """A matcher of its own in the state this one would reach by consuming `tokens` (which it accepts)."""
        copy = self.matcher.deep_copy()
        copy.consume_tokens([int(t) for t in tokens])
        return SampleGrammar(copy)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True when the sample must end: the grammar is complete (or, never for a
        token the mask allowed, it refused the token)."""
        if self.matcher.consume_token(int(token)):
            return self.matcher.is_stopped()
        log.warning("structured output: the grammar refused token %d (%s); the sample ends here", token,
                    _one_line(self.matcher.get_error(), 200))
        return True


@dataclass
class CompiledGrammar:
    """A compiled grammar: a matcher in its start state that every sample's own is copied from."""
    template: Any              # llguidance.LLMatcher
    compile_s: float           # wall time of the compile

    def matcher(self) -> SampleGrammar:
        return SampleGrammar(self.template.deep_copy())


class GrammarCompiler:
    """Compiles structured_outputs maps on a thread pool, each once: futures of CompiledGrammar by spec_key,
    the least recently used dropped past GRAMMARS_KEPT (a failed compile is kept too, failing at once the
    next time). The llguidance tokenizer is built from the model's tokenizer.json by the first compile.
    Thread-safe: the server's admission thread starts compiles beside the engine thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids):
        self.path, self.vocab_size, self.eos_token_ids = tokenizer_path, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()

    def compile(self, spec: dict) -> Future:
        key = spec_key(spec)
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="rawinfer-grammar")
            future = self._futures[key] = self._pool.submit(self._compile, spec)
            if len(self._futures) > GRAMMARS_KEPT:
                self._futures.popitem(last=False)
            return future

    @property
    def tokenizer(self):
        """llguidance's LLTokenizer over the model's vocabulary: ids up to the model's V (padding ids have
        no bytes, so no grammar allows them) and its EOS ids."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance as llg
                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
                try:
                    self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except ValueError:      # the tokenizer knows more ids than the model's V: its own count
                    self._tokenizer = llg.LLTokenizer(text, eos_token=self.eos_token_ids)
            return self._tokenizer

    def _compile(self, spec: dict) -> CompiledGrammar:
        kind = next(iter(spec))
        t0 = time.perf_counter()
        try:
            import llguidance as llg
            matcher = llg.LLMatcher(self.tokenizer, grammar_source(spec), log_level=0)
        except Exception as e:        # llguidance and the GBNF converter raise plain exceptions
            raise GrammarError(f"structured_outputs {kind!r} does not compile: {_one_line(e)}") from None
        if matcher.is_error():
            raise GrammarError(f"structured_outputs {kind!r} does not compile: {_one_line(matcher.get_error())}")
        return CompiledGrammar(matcher, time.perf_counter() - t0)


@dataclass
class MaskJob:
    """One step's bitmask: filled now (a thread on a GPU, overlapping the forward pass) or in apply()."""
    backend: Any
    rows: np.ndarray                   # [R] the logits rows it masks
    bitmask: np.ndarray                # [R, W] int32
    fill: Callable[[], None]
    keep_raw: bool                     # a masked row asked for log-probabilities: they read the raw logits
    pending: Future | None = None

    def apply(self, logits):
        """Mask the logits in place once the bitmask is ready; returns the logits log-probabilities read (a
        copy taken before masking when keep_raw)."""
        if self.pending is not None:
            self.pending.result()
        else:
            self.fill()
        raw = logits.copy() if self.keep_raw else logits
        self.backend.grammar_mask(logits, self.bitmask, self.rows)
        return raw


@dataclass
class StructuredOutputs:
    """The engine's structured output: the compiler, the requests held for their grammar, the step's mask."""
    backend: Any
    compiler: GrammarCompiler | None   # None: the model has no tokenizer
    held: dict[str, tuple[Any, Future]] = field(default_factory=dict)   # request id -> (SampleState, compile)
    mask_seconds: float = 0.0          # time spent filling bitmasks (benchmarks read it)
    _buffer: np.ndarray | None = None
    _executor: Any = None              # llguidance.LLExecutor: one mask fill for many matchers in parallel
    _filler: ThreadPoolExecutor | None = None

    @classmethod
    def for_model(cls, backend, tokenizer, vocab_size: int, eos_token_ids) -> "StructuredOutputs":
        if tokenizer is None:
            return cls(backend, None)
        return cls(backend, GrammarCompiler(tokenizer.path, max(vocab_size, tokenizer.vocab_size), eos_token_ids))

    def warm(self) -> None:
        """Build llguidance's tokenizer now (a server's start), not in the first structured request's TTFT."""
        if self.compiler is not None:
            self.compiler.tokenizer

    def prepare(self, params) -> Future | None:
        """The compile of params.structured_outputs (None without one). GrammarError when the model has no
        tokenizer, or the grammar is already known not to compile."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.compiler is None:
            raise GrammarError("structured_outputs needs the model's tokenizer and this model has none; convert "
                               "it with its tokenizer.json, or leave structured_outputs out")
        future = self.compiler.compile(spec)
        if future.done() and future.exception() is not None:
            raise future.exception()
        return future

    def attach(self, state, future: Future) -> bool:
        """Give a new sample its matcher if its grammar is compiled (True: schedule it), else hold it."""
        if future.done():
            state.grammar = future.result().matcher()
            return True
        self.held[state.seq.request_id] = (state, future)
        return False

    def release(self, idle: bool) -> tuple[list, dict[str, str]]:
        """(samples whose grammar compiled, now with their matchers; request id -> error of those whose
        grammar did not compile). idle: the engine has nothing else to run, so wait briefly for one."""
        if idle and self.held:
            wait([f for _, f in self.held.values()], timeout=HOLD_WAIT_S, return_when=FIRST_COMPLETED)
        ready, failed = [], {}
        for rid, (state, future) in list(self.held.items()):
            if future.done():
                del self.held[rid]
                if future.exception() is None:
                    state.grammar = future.result().matcher()
                    ready.append(state)
                else:
                    failed[rid] = str(future.exception())
        return ready, failed

    def masks(self, states: list) -> MaskJob | None:
        """The mask of this step's sampled rows (states in logits-row order, None for a row without one: a
        draft's), None when none has a grammar."""
        rows = [i for i, st in enumerate(states) if st is not None and st.grammar is not None]
        if not rows:
            return None
        bitmask = self._bitmask(len(rows))
        matchers = [(states[i].grammar.matcher, k) for k, i in enumerate(rows)]
        no_eos = [k for k, i in enumerate(rows) if _ignores_eos(states[i].seq)]
        job = MaskJob(self.backend, np.asarray(rows, np.int32), bitmask, lambda: self._fill(matchers, bitmask, no_eos),
                      any(states[i].seq.params.logprobs is not None for i in rows))
        if self.backend.capabilities.on_gpu:    # the host fills while the device runs the forward pass
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="rawinfer-mask")
            job.pending = self._filler.submit(job.fill)
        return job

    def _bitmask(self, rows: int) -> np.ndarray:
        words = -(-self.compiler.tokenizer.vocab_size // 32)
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = np.zeros((max(rows, 64), words), np.int32)
        return self._buffer[:rows]

    def _fill(self, matchers: list, bitmask: np.ndarray, no_eos: list[int]) -> None:
        import llguidance as llg
        from llguidance.numpy import fill_next_token_bitmask_par
        t0 = time.perf_counter()
        if self._executor is None:
            self._executor = llg.LLExecutor(max(1, min(os.cpu_count() or 1, MASK_THREADS)))
        fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        for k in no_eos:
            drop_eos(bitmask[k], self.compiler.eos_token_ids)
        self.mask_seconds += time.perf_counter() - t0


def draft_rows(state, draft) -> list:
    """Stand-ins for masks() of a sample's draft rows (row i: the next token after draft[:i + 1]): None without
    a grammar, else the grammar after those tokens and the output count they make (for the EOS rule)."""
    if state.grammar is None:
        return [None] * len(draft)
    seq = state.seq
    return [SimpleNamespace(grammar=state.grammar.after(draft[:i + 1]),
                            seq=SimpleNamespace(params=seq.params, num_output_tokens=seq.num_output_tokens + i + 1))
            for i in range(len(draft))]


def _ignores_eos(seq) -> bool:
    """Whether an EOS sampled now would be ignored (outputs.py: ignore_eos, or before min_tokens)."""
    return seq.params.ignore_eos or seq.num_output_tokens < seq.params.min_tokens


def drop_eos(row: np.ndarray, eos_token_ids: list[int]) -> None:
    """Clear the EOS bits of one bitmask row [W] unless no other token would be left."""
    words = row.view(np.uint32)
    before = words.copy()
    for e in eos_token_ids:
        if e >> 5 < len(words):
            words[e >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (e & 31)))
    if not words.any():
        words[:] = before
