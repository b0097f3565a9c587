"""GPU suite (marker `gpu`): backend.logprobs on CUDA (CuPy over the device logits, one row at a time) equals
the CPU backend's results on the same logits, row-local and with ties by the smaller id, and only the small
results reach the host. Skipped wherever no usable GPU is present."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cuda.runtime import cuda_status

USABLE, WHY = cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable GPU: {WHY}")]


@pytest.mark.parametrize("vocab, k", [(512, 0), (512, 20), (49152, 5), (262144, 20)])
def test_logprobs_match_the_cpu_backend(gpu, vocab, k):
    from rawinfer.backend.cpu.backend import CPUBackend
    rng = np.random.default_rng(vocab + k)
    logits = (rng.standard_normal((5, vocab)) * 3).astype(np.float32)
    logits[2, 10:40] = logits[2].max() + 1                       # ties at the top
    rows, toks = np.array([0, 2, 2, 4]), rng.integers(0, vocab, 4)
    want = CPUBackend.logprobs(CPUBackend.__new__(CPUBackend), logits, rows, toks, k)   # NumPy, no pool needed
    got = gpu.logprobs(gpu.xp.asarray(logits), rows, toks, k)
    assert np.allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert np.array_equal(got.ranks, want.ranks)
    assert np.array_equal(got.top_ids, want.top_ids)
    assert np.allclose(got.top_logprobs, want.top_logprobs, atol=1e-5)
    assert isinstance(got.top_ids, np.ndarray) and got.top_ids.shape == (4, k)
    one = gpu.logprobs(gpu.xp.asarray(logits[2:3]), np.array([0]), toks[1:2], k)
    assert np.array_equal(one.logprobs, got.logprobs[1:2]) and np.array_equal(one.top_ids, got.top_ids[1:2])
