"""Token selection on CUDA: argmax and filtered sampling of logits rows, so only B token ids leave the device,
and structured output's token mask applied to those rows before either (cuda/grammar_mask.cu).

cuda/sampling.cu states the rule; it is the CPU sampler's (engine/sampler.py), so given the same
uniform draw both backends pick the same token except where float32 rounding decides a boundary.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.launch import Launches, round_up

GRAMMAR_MASK_THREADS = 256   # GRAMMAR_MASK_THREADS in cuda/grammar_mask.cu
SAMPLE_PARAMS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                 ("min_p", np.float32), ("uniform", np.float32))   # sample_kernel's per-row inputs, in order


def sample_threads(vocab: int) -> int:
    """Threads per row: about 16 logits each, a multiple of 32, at most 1024 (SAMPLE_MAX_THREADS)."""
    return min(1024, max(32, round_up(vocab // 16, 32)))


class DeviceSampling:
    """CUDABackend's argmax, sample and grammar_mask on the device; the backend brings the token ids to the host."""

    def __init__(self, launches: Launches, xp: Any):
        """launches: the backend's (launch.py); xp: numpy or cupy, for the ids and the per-row parameters."""
        self.launches, self.xp = launches, xp

    def argmax(self, logits):
        """Device int32[B]: the first index of the largest logit of each row."""
        batch, vocab = logits.shape
        ids = self.xp.empty(batch, np.int32)
        if batch:
            self.launches.launch("argmax_kernel", (ks.element_type(logits.dtype),), (batch,),
                                 (sample_threads(vocab),), 0, ids, logits, vocab)
        return ids

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform):
        """Device int32[B]: one token per row after temperature / top-k / min-p / top-p filtering.  The
        per-row parameters are host arrays of length B; temperature 0 is greedy; uniform holds one draw
        in [0, 1) per row from the request's generator.  Repetition penalties and other logit edits
        happen before this call (on the host for the rows that need them)."""
        batch, vocab = logits.shape
        params = [np.ascontiguousarray(p, dtype) for p, (_, dtype)
                  in zip((temperature, top_k, top_p, min_p, uniform), SAMPLE_PARAMS)]
        for (name, _), p in zip(SAMPLE_PARAMS, params):
            if p.shape != (batch,):
                raise shapes.shape_error("sample", name, p.shape, f"(B,) = ({batch},)")
        ids = self.xp.empty(batch, np.int32)
        if batch:
            self.launches.launch("sample_kernel", (ks.element_type(logits.dtype),), (batch,),
                                 (sample_threads(vocab),), 0, ids, logits, *[self.xp.asarray(p) for p in params], vocab)
        return ids

    def grammar_mask(self, logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
        """Structured output, in place on the device logits: -inf for every token bitmask row i forbids in
        logits row rows[i] (Backend.grammar_mask states the layout); the [R, W] words travel to the device."""
        R, V, W = shapes.grammar_mask(logits, bitmask, rows)
        if R:
            self.launches.launch("grammar_mask_kernel", (ks.element_type(logits.dtype),),
                                 (-(-V // GRAMMAR_MASK_THREADS), R), (GRAMMAR_MASK_THREADS,), 0, logits,
                                 self.xp.asarray(np.ascontiguousarray(bitmask, np.int32)),
                                 self.xp.asarray(np.ascontiguousarray(rows, np.int32)), V, W)
