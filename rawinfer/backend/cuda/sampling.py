"""Token selection on CUDA: argmax and filtered sampling of logits rows, so only B token ids leave the device,
and structured output's token mask applied to those rows before either (cuda/grammar_mask.cu).

cuda/sampling.cu states the rule; it is the CPU sampler's (engine/sampler.py), so given the same
uniform draw both backends pick the same token except where float32 rounding decides a boundary.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.launch import KernelLaunches, round_up

GRAMMAR_MASK_THREADS = 256   # GRAMMAR_MASK_THREADS in cuda/grammar_mask.cu
SAMPLE_PARAMS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                 ("min_p", np.float32), ("uniform", np.float32))   # sample_kernel's per-row inputs, in order


def sample_threads(vocab: int) -> int:
    """Threads per row: about 16 logits each, a multiple of 32, at most 1024 (SAMPLE_MAX_THREADS)."""
    return min(1024, max(32, round_up(vocab // 16, 32)))


class DeviceSampling(KernelLaunches):
    """Mixin of CUDABackend: argmax(), sample() and grammar_mask() on the device."""

    xp: Any
    to_host: Callable[[Any], np.ndarray]   # CUDABackend.to_host

    def argmax(self, logits) -> np.ndarray:
        """Host int64[B]: the first index of the largest logit of each row, computed on the device."""
        batch, vocab = logits.shape
        ids = self.xp.empty(batch, np.int32)
        if batch:
            self._launch("argmax_kernel", (ks.element_type(logits.dtype),), (batch,),
                         (sample_threads(vocab),), 0, ids, logits, vocab)
        return self.to_host(ids).astype(np.int64)

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform) -> np.ndarray:
        """Host int64[B]: one token per row after temperature / top-k / min-p / top-p filtering.  The
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
            self._launch("sample_kernel", (ks.element_type(logits.dtype),), (batch,), (sample_threads(vocab),),
                         0, ids, logits, *[self.xp.asarray(p) for p in params], vocab)
        return self.to_host(ids).astype(np.int64)

    def grammar_mask(self, logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
        """Structured output, in place on the device logits: -inf for every token bitmask row i forbids in
        logits row rows[i] (Backend.grammar_mask states the layout); the [R, W] words travel to the device."""
        R, V, W = shapes.grammar_mask(logits, bitmask, rows)
        if R:
            self._launch("grammar_mask_kernel", (ks.element_type(logits.dtype),),
                         (-(-V // GRAMMAR_MASK_THREADS), R), (GRAMMAR_MASK_THREADS,), 0, logits,
                         self.xp.asarray(np.ascontiguousarray(bitmask, np.int32)),
                         self.xp.asarray(np.ascontiguousarray(rows, np.int32)), V, W)
