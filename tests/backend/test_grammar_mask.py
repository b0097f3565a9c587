"""grammar_mask (structured output's token mask) against a NumPy reference: the CPU backend's op and the CUDA
kernel cuda/grammar_mask.cu run through the host shim (tests/cuda_shim), over ragged (S, V) sizes, V not a
multiple of 32, bitmask rows wider than the vocabulary, a subset of the rows, every storage dtype."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu.backend import CPUBackend
from reference_ops import DTYPE_IDS, DTYPES, rand

SIZES = [(1, 1), (3, 31), (4, 32), (5, 33), (2, 100), (6, 257), (3, 1000)]   # (S, V)


def grammar_mask_ref(logits, bitmask, rows):
    """logits [S, V] with -inf wherever bitmask row i's bit of token v is clear, in row rows[i]."""
    out = logits.copy()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        for v in range(V):
            if not (int(bitmask[i, v // 32]) >> (v % 32)) & 1:
                out[r, v] = -np.inf
    return out


def case(S, V, dtype, seed, extra_words=0):
    """Random logits, a random subset of the rows (in a random order) and random words, some all-set."""
    rng = np.random.default_rng(seed)
    logits = rand(rng, (S, V), dtype)
    rows = rng.permutation(S)[:max(1, S - 1)].astype(np.int32)
    W = -(-V // 32) + extra_words
    bitmask = rng.integers(-2**31, 2**31, (len(rows), W), dtype=np.int64).astype(np.int32)
    bitmask[:, ::3] = -1                                    # every token of those words allowed
    return logits, bitmask, rows


@pytest.mark.parametrize("S,V", SIZES)
def test_cpu_grammar_mask(S, V):
    logits, bitmask, rows = case(S, V, np.float32, S * 1000 + V, extra_words=V % 2)
    want = grammar_mask_ref(logits, bitmask, rows)
    CPUBackend().grammar_mask(logits, bitmask, rows)
    np.testing.assert_array_equal(logits, want)


def test_grammar_mask_checks_shapes():
    be = CPUBackend()
    logits = np.zeros((2, 40), np.float32)
    with pytest.raises(ValueError, match=r"bitmask .* ceil\(V / 32\) = 2"):
        be.grammar_mask(logits, np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="rows has shape"):
        be.grammar_mask(logits, np.zeros((1, 2), np.int32), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="index the 2 logits rows"):
        be.grammar_mask(logits, np.zeros((1, 2), np.int32), np.array([2], np.int32))


harness = pytest.importorskip("cuda_shim.harness")


@pytest.fixture(scope="module")
def cuda_backend():
    if harness.compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA shim")
    from rawinfer.backend.cuda.backend import CUDABackend
    return CUDABackend(launcher=harness.ShimLauncher({"grammar_mask.cu": harness.build("grammar_mask.cu")}))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("S,V", SIZES)
def test_cuda_grammar_mask(cuda_backend, S, V, dtype):
    logits, bitmask, rows = case(S, V, dtype, S * 7 + V, extra_words=V % 3)
    want = grammar_mask_ref(logits, bitmask, rows)
    cuda_backend.grammar_mask(logits, bitmask, rows)
    np.testing.assert_array_equal(logits.astype(np.float32), want.astype(np.float32))
    expr, grid, block, _ = cuda_backend._launcher.launches[-1]
    assert grid == (-(-V // 256), len(rows), 1) and block == (256, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_grammar_mask(dtype):
    """The same kernel on a device (skipped without one; tools/gpu_check.sh runs the `gpu` marker)."""
    from rawinfer.backend.cuda.runtime import cuda_status
    usable, why = cuda_status()
    if not usable:
        pytest.skip(f"no usable GPU: {why}")
    from rawinfer.backend.cuda.backend import CUDABackend
    gpu = CUDABackend()
    for S, V in SIZES + [(32, 49152 + 40)]:
        logits, bitmask, rows = case(S, V, dtype, S + V, extra_words=1)
        want = grammar_mask_ref(logits, bitmask, rows) if V < 2000 else None
        d = gpu.empty(logits.shape, logits.dtype)
        gpu.upload(d, logits)
        gpu.grammar_mask(d, bitmask, rows)
        got = gpu.to_host(d)
        if want is None:            # the big case against the CPU backend's op (the reference is a Python loop)
            want = logits.astype(np.float32)
            CPUBackend().grammar_mask(want, bitmask, rows)
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
