"""Warm-up: every kind of step the engine will run, once, at start, so that no request waits for a kernel.

The CPU kernels compile on their first call with each combination of argument types, and a step of
another shape takes other kernels: a prompt under 32 tokens and one over it (attention on BLAS), a
decode step of one sequence (the fused one-call path), of a few (matrix-vector kernels where no
integer GEMM applies) and of many (the integer GEMM), a prompt past 96 tokens (float32 products on
BLAS), a step that mixes prefill chunks and decode tokens. Without a warm-up each of those compiles
during the first request that reaches it. On CUDA the same steps compile the RawKernels and capture
the decode graphs of the bucket sizes they meet.

The warm-up runs dummy requests through the ordinary engine (scheduler, runner, sampler), then gives
the engine a fresh block manager and scheduler, so nothing of it is left: no cached prefix, no
counters, no seed drawn. With the user's kernel cache (backend/cpu/cache.py) a later start loads the
compiled kernels instead of compiling them. When the first wave meets a kernel that is not in the cache,
a second process compiles the second wave's prefills meanwhile (compile_helper.py).

Last, with every kernel ready, the waves run once more, with a longer prompt, and their measured steps seed
the scheduler's step-cost model (core/step_cost.py), which sizes prefill beside decodes to the inter-token
target: the one thing of the warm-up the engine keeps.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")

LONG_PROMPT = 100       # a prompt past the CPU's thresholds for attention on BLAS (32 query rows) and
                        # for float32 products on BLAS instead of fgemm.py (96 rows)
MID_PROMPT = 20         # under that threshold, with enough query rows x kv heads for the attention
                        # kernel's parallel build (a prompt's later chunk, a prefix-cache hit's remainder)
BATCH = 8               # a decode batch past the matrix-vector kernels' row limit (4)
COST_BATCH = 32         # the step-cost seed's wider decode batch (the automatic target extrapolates to
COST_BATCH_PROMPT = 5   # max_num_seqs rows), of prompts this long, ...
COST_PROMPT = 256       # ... and longer prompt: the attention's share of a prefill token grows with its
                        # position, which prompts of a few dozen tokens do not show


def warm_up(engine) -> float:
    """Run the warm-up requests on `engine` and reset its scheduling state; returns the seconds taken."""
    t0 = time.monotonic()
    log.info("warming up: compiling (or loading from the kernel cache) what this model and configuration run")
    prompt, ok = _prompts(engine), (lambda n, k=1: _fits(engine, n, k))
    helper = _helper_for(engine)
    try:
        for w, wave in enumerate(_waves(prompt)):
            if w == 1 and helper is not None:
                helper.finish()                     # its builds in the cache before the wave that runs them
            first = helper is not None and w == 0
            with _on_first_compile(helper.start if first else None):
                _run_wave(engine, w, wave, ok, after_first_step=helper.release if first else None)
    finally:
        if helper is not None:
            helper.close()
    _score_and_reset(engine, prompt, ok)
    _seed_step_cost(engine, prompt, ok)
    seconds = time.monotonic() - t0
    log.info("warm-up done in %.1f s", seconds)
    return seconds


def warm_thread(engine) -> float:
    """The warm-up's requests once more, on the calling thread, once warm_up has run on another; returns the
    seconds taken. A thread's first steps pay costs of their own, which the warm-up on the constructing
    thread did not take away: OpenMP starts a team of workers for each thread that opens parallel regions,
    and each new thread gets its own malloc arena and OpenBLAS buffers, first touched in those steps.
    A server steps its engine on a thread of its own (frontends/server/worker.py), whose first request
    would pay them. Nothing compiles here: the kernels are in memory by now."""
    t0 = time.monotonic()
    prompt, ok = _prompts(engine), (lambda n, k=1: _fits(engine, n, k))
    for w, wave in enumerate(_waves(prompt)):
        _run_wave(engine, w, wave, ok)
    _score_and_reset(engine, prompt, ok)
    _seed_step_cost(engine, prompt, ok)         # this thread's steps are the ones the server runs
    return time.monotonic() - t0


def _seed_step_cost(engine, prompt, ok) -> None:
    """Time the waves again, nothing compiling now, then a wider decode batch and a longer prompt: the steps
    the step-cost model starts from. The first wave runs once untimed before (the first steps after the
    thread count was reset pay for it). The fresh scheduler left behind takes the model over."""
    cost = engine.scheduler.step_cost
    _run_wave(engine, 0, _waves(prompt)[0], ok)
    cost.forget()
    for w, wave in enumerate(_waves(prompt)):
        _run_wave(engine, w, wave, ok)
    ecfg = engine.config
    if ok(COST_BATCH_PROMPT + 4, min(COST_BATCH, ecfg.max_num_seqs)):    # all at once: one prefill, then decodes
        for i in range(min(COST_BATCH, ecfg.max_num_seqs, ecfg.max_num_batched_tokens // COST_BATCH_PROMPT)):
            engine.add_request(f"__warmup_cost_{i}", prompt(COST_BATCH_PROMPT), _greedy(4))
        while engine.has_unfinished():
            engine.step()
    _run_wave(engine, 2, [(prompt(min(COST_PROMPT, ecfg.max_num_batched_tokens)), 1)], ok)
    engine.reset_state()
    engine.scheduler.step_cost = cost
    if cost.coefficients is not None:
        target = engine.config.itl_target_ms
        full = cost.auto_target(engine.config.max_num_seqs, 0) * 1e3 if cost.usable() else float("nan")
        log.info("step cost: %s; inter-token target %s", cost.coefficients.describe(), "off" if target == 0 else
                 f"{target:g} ms" if target else f"auto, twice the decode step of the batch ({full:.0f} ms when full)")


def _score_and_reset(engine, prompt, ok) -> None:
    """The warm-up's last request, then nothing of it left. Teacher forcing (every row's logits): a prefill
    chunk within the step's token budget, then three decode steps, so that every chunk fits
    max_num_batched_tokens however small it is."""
    head = min(5, engine.config.max_num_batched_tokens)
    if ok(head + 3):
        engine.score(prompt(head + 3), [head, 1, 1, 1])
    engine.reset_state()
    engine.backend.after_warm_up()


def _waves(prompt) -> list:
    """wave 1: a short prefill, then one sequence decoding, then two: its second sample is forked and
    copies their shared partial block on write. wave 2: a long and a middling prefill beside decoding
    sequences, then a decode batch past the matrix-vector kernels' limit."""
    return [[(prompt(3), 2)], [(prompt(LONG_PROMPT), 1), (prompt(MID_PROMPT), 1)] +
            [(prompt(5), 1) for _ in range(BATCH - 1)]]


def _run_wave(engine, w: int, wave: list, ok, max_tokens: int = 4, after_first_step=None) -> None:
    """Add the wave's (prompt, n) requests that fit; the first runs two steps alone, the rest join it
    (a mixed step: prefill chunks beside a decoding sequence); then step until every one is done.
    after_first_step: called after the first step (a prefill), if not None."""
    wave = [(p, n) for p, n in wave if ok(len(p) + max_tokens, n)][:engine.config.max_num_seqs]
    for i, (p, n) in enumerate(wave):
        engine.add_request(f"__warmup_{w}_{i}", p, _greedy(max_tokens, n))
        if i == 0:
            engine.step()
            if after_first_step is not None:
                after_first_step()
            engine.step()
    while engine.has_unfinished():
        engine.step()


def helper_wave(engine) -> None:
    """The compile helper's share (compile_helper.py): the second wave's prefills, in mixed steps as
    there: the long prompt beside a short request's second token, then the middling one and the short
    ones beside its third. No step only decodes: the fused decode kernels are the first wave's, which
    the engine compiles meanwhile."""
    prompt = _prompts(engine)
    later = [[prompt(LONG_PROMPT)], [prompt(MID_PROMPT)] + [prompt(5) for _ in range(BATCH - 1)]]
    if not _fits(engine, 6):
        return
    engine.add_request("__helper", prompt(3), _greedy(3))
    engine.step()
    for w, prompts in enumerate(later):
        for i, p in enumerate(prompts[:engine.config.max_num_seqs - 1]):
            if _fits(engine, len(p) + 1):
                engine.add_request(f"__helper_{w}_{i}", p, _greedy(1))
        engine.step()
    while engine.has_unfinished():
        engine.step()


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    """A warm-up request's sampling: seeded greedy, so no draw from the engine's default seed sequence."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, n=n, ignore_eos=True, seed=0)


def _prompts(engine):
    """prompt(n): n random token ids of the model's vocabulary (the same ones in every process)."""
    V = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    return lambda n: [int(t) for t in rng.integers(min(3, V - 1), V, n)]


def _helper_for(engine):
    """A CompileHelper for this engine's warm-up, or None where none would help (compile_helper.why_not)."""
    from rawinfer.engine import compile_helper
    why = compile_helper.why_not(engine)
    if why is not None:
        log.debug("warm-up in one process: %s", why)
        return None
    return compile_helper.CompileHelper(engine)


@contextlib.contextmanager
def _on_first_compile(callback):
    """Call `callback` (once, if not None) when Numba starts compiling a function that is not in its cache."""
    if callback is None:
        yield
        return
    from numba.core import event

    class Listener(event.Listener):
        called = False

        def on_start(self, ev):
            if not self.called:
                self.called = True
                callback()

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Listener()):
        yield


def _fits(engine, num_tokens: int, n: int = 1) -> bool:
    """Whether n sequences of num_tokens fit the context and the whole KV pool of this engine."""
    blocks = -(-num_tokens // engine.config.block_size) * n
    return num_tokens <= engine.max_model_len and blocks <= engine.block_manager.num_blocks


def warm_up_like(engine, prompt_len: int, params: SamplingParams) -> float:
    """A one-shot command's warm-up (`rawinfer generate`): one dummy request shaped like the one coming (its
    prompt length, so the same chunks and attention paths; its sample count; up to two decode steps), then
    nothing of it left. Its first token waits for no kernel, and a start loads only the kernels it runs;
    a later step that meets another compiles under say_when_compiling's warning. Returns the seconds taken."""
    t0 = time.monotonic()
    log.info("warming up: compiling (or loading from the kernel cache) the steps of this prompt")
    prompt, n, tokens = _prompts(engine), params.n, min(3, params.max_tokens)
    if _fits(engine, prompt_len + tokens, n):
        engine.add_request("__warmup_like", prompt(prompt_len), _greedy(tokens, n))
        while engine.has_unfinished():
            engine.step()
    # NOTE: no backend.after_warm_up(): no compile helper ran beside this warm-up, so what the CPU backend's
    # thread governor read of the machine meanwhile was other programs, and holds for the request
    engine.reset_state()
    seconds = time.monotonic() - t0
    log.info("warm-up done in %.1f s", seconds)
    return seconds


@contextlib.contextmanager
def say_when_compiling():
    """Within: one warning when a kernel compiles (a step of a shape warm_up_like did not run), since the
    request in progress waits for it."""
    def warn():
        log.warning("compiling a kernel this prompt's warm-up did not run; this answer waits for it (it is "
                    "cached for the next start; `rawinfer warmup` compiles every kernel ahead of time)")
    with _on_first_compile(warn):
        yield
