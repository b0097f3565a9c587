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
compiled kernels instead of compiling them.
"""

from __future__ import annotations

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


def warm_up(engine) -> float:
    """Run the warm-up requests on `engine` and reset its scheduling state; returns the seconds taken."""
    t0 = time.monotonic()
    log.info("warming up: compiling (or loading from the kernel cache) what this model and configuration run")
    V = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompt = (lambda n: [int(t) for t in rng.integers(min(3, V - 1), V, n)])
    ok = (lambda n, k=1: _fits(engine, n, k))
    # wave 1: a short prefill, then one sequence decoding, then two: its second sample is forked and
    # copies their shared partial block on write. wave 2: a long and a middling prefill beside decoding
    # sequences, then a decode batch past the matrix-vector kernels' limit.
    waves = [[(prompt(3), 2)], [(prompt(LONG_PROMPT), 1), (prompt(MID_PROMPT), 1)] +
             [(prompt(5), 1) for _ in range(BATCH - 1)]]
    for w, wave in enumerate(waves):
        wave = [(p, n) for p, n in wave if ok(len(p) + 4, n)][:engine.config.max_num_seqs]
        for i, (p, n) in enumerate(wave):
            # seeded greedy: no draw from the engine's default seed sequence
            engine.add_request(f"__warmup_{w}_{i}", p, SamplingParams(max_tokens=4, temperature=0, n=n,
                                                                      ignore_eos=True, seed=0))
            if i == 0:
                engine.step()                                   # the rest join a decoding request: a mixed step
                engine.step()
        while engine.has_unfinished():
            engine.step()
    # teacher forcing (every row's logits): a prefill chunk within the step's token budget, then three
    # decode steps, so that every chunk fits max_num_batched_tokens however small it is
    head = min(5, engine.config.max_num_batched_tokens)
    if ok(head + 3):
        engine.score(prompt(head + 3), [head, 1, 1, 1])
    engine.reset_state()
    seconds = time.monotonic() - t0
    log.info("warm-up done in %.1f s", seconds)
    return seconds


def _fits(engine, num_tokens: int, n: int = 1) -> bool:
    """Whether n sequences of num_tokens fit the context and the whole KV pool of this engine."""
    blocks = -(-num_tokens // engine.config.block_size) * n
    return num_tokens <= engine.max_model_len and blocks <= engine.block_manager.num_blocks
