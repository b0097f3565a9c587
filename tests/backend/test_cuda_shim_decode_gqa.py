"""Decode attention as flash-decoding: one thread block per (split, KV head, sequence) serves all G query
heads of its KV head, and each sequence's context is cut into about decode_target_splits splits of its
own.  Run on the CPU under tests/cuda_shim against paged_attention_ref.

The backend keeps its default split lengths (64 ... 512 positions, 16 splits), so long contexts land in
many splits.  Cases cover the GQA ratios of the supported families (1, 2, 3, 4, 7, 8) and one past the
kernel's GC = 8 heads per K/V read (16), head dims 64 ... 256 (80 and 96 too), block sizes that are not
powers of two, ragged contexts, sliding windows whose stale blocks are NaN (a read of one fails the
test), and a sequence's bits alone and inside a batch.
"""

from __future__ import annotations

import numpy as np
import pytest

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from reference_ops import DTYPE_IDS, DTYPES, assert_close, bfloat16, make_paged_batch, paged_attention_ref  # noqa: E402


def shim_backend(shim_libraries, **attrs) -> CUDABackend:
    backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
    for name, value in attrs.items():
        setattr(backend, name, value)
    return backend


def poison_stale_blocks(paged, block_size, window) -> None:
    """NaN into every block wholly before its sequence's window (the scheduler may have freed it)."""
    _, k_cache, v_cache, block_tables, context_lens, _ = paged
    for b, ctx in enumerate(context_lens):
        stale = block_tables[b, :max(0, int(ctx) - window) // block_size]
        k_cache[stale] = np.nan
        v_cache[stale] = np.nan


GQA_CASES = [
    # heads, kv_heads, head_dim, block_size, context lengths, window
    (1, 1, 128, 16, [1500], 0),              # G = 1, one long context: 16 splits of 96
    (2, 1, 64, 12, [37, 200], 0),            # G = 2, block size 12
    (3, 1, 80, 5, [123, 7, 64], 0),          # G = 3, D = 80, block size 5
    (8, 2, 128, 16, [513, 1, 300], 0),       # G = 4 (Llama 3), a context of one token
    (7, 1, 64, 7, [150, 29], 0),             # G = 7, block size 7
    (16, 2, 96, 16, [700], 0),               # G = 8, D = 96
    (8, 1, 256, 16, [90, 400], 0),           # G = 8, D = 256
    (16, 1, 64, 16, [200, 33], 0),           # G = 16: two passes of GC = 8 heads
    (14, 2, 64, 16, [300, 20], 48),          # G = 7 on a sliding layer
    (8, 1, 128, 10, [517, 9], 512),          # G = 8, window 512, block size 10
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", GQA_CASES, ids=[f"G{c[0] // c[1]}-D{c[2]}-BS{c[3]}-W{c[5]}" for c in GQA_CASES])
@pytest.mark.parametrize("per_pass", [8, 4], ids=["GC8", "GC4"])
def test_decode_gqa_against_reference(shim_libraries, dtype, case, per_pass):
    """GC = 8 is what the backend runs; GC = 4 is the baseline the decode bench times (G > 4 in passes)."""
    heads, kv_heads, head_dim, block_size, ctx_lens, window = case
    rng = np.random.default_rng(31)
    paged = make_paged_batch(rng, dtype, [1] * len(ctx_lens), ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    if window:
        poison_stale_blocks(paged, block_size, window)
    backend = shim_backend(shim_libraries, decode_heads_per_pass=per_pass)
    # the split-K scratch starts as NaN (all bits set): a merge that read a split no block wrote fails
    nbytes = backend.attention_workspace_bytes(len(ctx_lens), heads, head_dim, block_size, max(ctx_lens),
                                               np.dtype(dtype).itemsize, kv_heads)
    backend.bind_attention_workspace(np.full(nbytes, 0xFF, np.uint8))
    out = np.zeros((len(ctx_lens), heads * head_dim), dtype)
    backend.paged_attention(*paged, scale, out, 1, max(ctx_lens), window)
    name, grid = backend._launcher.launches[0][:2]
    assert name.startswith("paged_attention_decode_kernel<") and name.endswith(f", {per_pass}>")
    split_range = backend.decode_split_range(heads // kv_heads, head_dim, block_size, np.dtype(dtype).itemsize)
    span = min(max(ctx_lens), window) if window else max(ctx_lens)
    assert tuple(grid) == (backend.decode_splits(span, split_range), kv_heads, len(ctx_lens))
    assert grid[0] > 1 or span <= split_range[0]  # a context longer than the shortest split is split
    assert_close(out, ref, dtype, "decode attention (GQA, flash-decoding splits)")


def test_split_length_follows_the_context(shim_libraries):
    """Llama-3-8B shape (G = 4, D = 128, bf16, blocks of 16): splits of 64 ... 512 positions, about 16 a
    context, so one sequence of 2,048 tokens runs 16 splits x 8 KV heads = 128 thread blocks (the fixed
    512-position split made 32), and the grid bound covers every context up to it."""
    backend = shim_backend(shim_libraries)
    split_range = backend.decode_split_range(4, 128, 16, 2)
    assert split_range == (64, 512)
    lengths = {span: backend.decode_split_len(span, 16, split_range) for span in (1, 500, 1000, 2048, 8192, 100000)}
    assert lengths == {1: 64, 500: 64, 1000: 64, 2048: 128, 8192: 512, 100000: 512}
    assert backend.decode_split_len(1000, 5, backend.decode_split_range(4, 128, 5, 2)) == 65  # whole blocks of 5
    for bound in (1, 63, 64, 1000, 2048, 8192, 8193, 131072):
        need = max(-(-span // backend.decode_split_len(span, 16, split_range)) for span in range(1, bound + 1))
        assert need <= backend.decode_splits(bound, split_range) <= max(need, backend.decode_target_splits)
    assert backend.decode_splits(131072, split_range) == 256


def test_a_sequence_rounds_the_same_alone_and_in_a_batch(shim_libraries):
    """Each sequence's split length is its own, so its output bits do not depend on what shares the step
    (the house rule that a request's greedy output never depends on the rest of the batch)."""
    rng = np.random.default_rng(33)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    ctx_lens = [700, 3, 1500, 64]
    paged = make_paged_batch(rng, bfloat16, [1] * 4, ctx_lens, heads, kv_heads, head_dim, block_size)
    qkv, k_cache, v_cache, block_tables, context_lens, _ = paged
    backend = shim_backend(shim_libraries)
    together = np.zeros((4, heads * head_dim), bfloat16)
    backend.paged_attention_decode(*paged, 0.125, together, 2048)
    for b in range(4):
        alone = np.zeros((1, heads * head_dim), bfloat16)
        backend.paged_attention_decode(qkv[b:b + 1], k_cache, v_cache, block_tables[b:b + 1], context_lens[b:b + 1],
                                       np.array([0, 1], np.int32), 0.125, alone, ctx_lens[b])
        np.testing.assert_array_equal(alone[0].view(np.uint16), together[b].view(np.uint16))


def test_workspace_covers_the_bound(shim_libraries):
    """A scratch buffer of attention_workspace_bytes(max_num_seqs, ...) bound to the backend serves every
    batch of 1 ... max_num_seqs with contexts up to the bound, and each result matches the reference."""
    heads, kv_heads, head_dim, block_size, max_ctx, max_seqs = 4, 2, 16, 4, 40, 4
    backend = shim_backend(shim_libraries, decode_partition=32, decode_min_partition=8, decode_target_splits=3)
    split_range = backend.decode_split_range(2, head_dim, block_size, 4)
    assert split_range == (8, 32) and backend.decode_splits(max_ctx, split_range) == 3
    nbytes = backend.attention_workspace_bytes(max_seqs, heads, head_dim, block_size, max_ctx, 4, kv_heads)
    assert nbytes == 4 * max_seqs * heads * 3 * (head_dim + 2)
    backend.bind_attention_workspace(np.zeros(nbytes, np.uint8))
    rng = np.random.default_rng(34)
    for batch in range(1, max_seqs + 1):
        ctx_lens = [max_ctx] + [int(c) for c in rng.integers(1, max_ctx + 1, batch - 1)]
        paged = make_paged_batch(rng, np.float32, [1] * batch, ctx_lens, heads, kv_heads, head_dim, block_size)
        out = np.zeros((batch, heads * head_dim), np.float32)
        backend.paged_attention_decode(*paged, 0.25, out, max_ctx)
        ref = paged_attention_ref(*paged, 0.25, heads)
        assert_close(out, ref, np.float32, f"decode attention, batch {batch}")
