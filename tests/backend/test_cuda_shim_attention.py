"""The paged attention kernels (decode split-K + merge, the FMA prefill kernel), run on the CPU under
tests/cuda_shim, against paged_attention_ref.

Launched through the real `CUDABackend` methods with the host launcher, like test_cuda_shim.py.  Block
tables are shuffled assignments of physical blocks with junk past each sequence's end; contexts and
query counts are ragged (not multiples of the block, the split or the 16-row query tile); head_dim runs
16 ... 256.  Sliding-window cases also fill with NaN every block that lies wholly before the window of
its sequence's first query: the scheduler may free such blocks, so the kernels must never read them.
"""

from __future__ import annotations

import numpy as np
import pytest

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from reference_ops import DTYPE_IDS, DTYPES, assert_close, make_paged_batch, paged_attention_ref  # noqa: E402


@pytest.fixture
def backend(shim_libraries):
    """The FMA prefill kernel for every dtype (the tensor-core one has test_cuda_shim_flash.py)."""
    backend = CUDABackend(launcher=harness.ShimLauncher(shim_libraries))
    backend.flash_prefill = False
    return backend


def small_partition_backend(shim_libraries, partition):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries), decode_partition=partition)


def kernel_names(backend) -> list[str]:
    return [launch[0].split("<")[0] for launch in backend._launcher.launches]


DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, context lengths, partition
    (4, 2, 16, 4, [1, 17, 40], 16),        # ragged, splits of 4 blocks
    (8, 1, 32, 8, [300, 5], 64),           # long context in 5 splits, G = 8 > heads per pass
    (3, 3, 64, 16, [33, 16, 70, 2], 512),  # no grouping, one split each
    (6, 2, 16, 3, [50], 9),                # block size 3, partition 9 (3 blocks)
    (4, 1, 256, 16, [1, 3, 17, 600], 512),  # Gemma 3 270M's global layers: D = 256, G = 4
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"decode{i}" for i in range(len(DECODE_CASES))])
def test_paged_attention_decode(shim_libraries, dtype, case):
    heads, kv_heads, head_dim, block_size, ctx_lens, partition = case
    rng = np.random.default_rng(7)
    paged = make_paged_batch(rng, dtype, [1] * len(ctx_lens), ctx_lens, heads, kv_heads, head_dim, block_size)
    qkv, k_cache, v_cache, block_tables, context_lens, qsl = paged
    backend = small_partition_backend(shim_libraries, partition)
    out = np.zeros((len(ctx_lens), heads * head_dim), dtype)
    scale = head_dim ** -0.5
    backend.paged_attention(*paged, scale, out, 1, int(max(ctx_lens)))
    assert kernel_names(backend) == ["paged_attention_decode_kernel", "paged_attention_merge_kernel"]
    splits = backend._launcher.launches[0][1][0]
    assert splits == backend.decode_splits(max(ctx_lens), backend.decode_split_range(
        heads // kv_heads, head_dim, block_size, np.dtype(dtype).itemsize))
    ref = paged_attention_ref(qkv, k_cache, v_cache, block_tables, context_lens, qsl, scale, heads)
    assert_close(out, ref, dtype, "decode attention")


def test_paged_attention_decode_grid_sized_for_graphs(shim_libraries):
    """A grid sized for a longer bound than any sequence (as a captured graph needs) gives the same output."""
    rng = np.random.default_rng(8)
    paged = make_paged_batch(rng, np.float32, [1, 1], [20, 7], 4, 2, 16, 4)
    backend = small_partition_backend(shim_libraries, 8)
    outs = []
    for bound in (20, 200):
        out = np.zeros((2, 64), np.float32)
        backend.paged_attention_decode(*paged, 0.25, out, bound)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert backend._launcher.launches[-2][1][0] == 25


PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths
    (4, 2, 16, 4, [5, 1, 20], [5, 8, 33]),            # fresh prompt, a decode row, chunked prefill
    (2, 1, 24, 16, [40], [40]),                       # three query tiles, two key tiles
    (3, 3, 80, 5, [17, 3], [60, 3]),                  # D = 80, block size 5, long past
    (4, 1, 256, 32, [17, 1, 3], [17, 40, 70]),        # Gemma 3 270M's global layers: D = 256, G = 4
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"prefill{i}" for i in range(len(PREFILL_CASES))])
def test_paged_attention_prefill(backend, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens = case
    rng = np.random.default_rng(9)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    qkv, k_cache, v_cache, block_tables, context_lens, qsl = paged
    out = np.zeros((qkv.shape[0], heads * head_dim), dtype)
    scale = head_dim ** -0.5
    backend.paged_attention(*paged, scale, out, max(q_lens), max(ctx_lens))
    assert kernel_names(backend) == ["paged_attention_prefill_kernel"]
    ref = paged_attention_ref(qkv, k_cache, v_cache, block_tables, context_lens, qsl, scale, heads)
    assert_close(out, ref, dtype, "prefill attention")


def test_prefill_tile_fits_shared_memory():
    for head_dim in (16, 64, 128, 256):
        for itemsize in (2, 4):
            tile, smem = CUDABackend.prefill_kv_tile(head_dim, itemsize)
            assert tile in (8, 16, 32) and smem <= 48 * 1024


# ---- sliding window --------------------------------------------------------------------------------
def poison_out_of_window_blocks(paged, q_lens, block_size, window) -> None:
    """NaN into every physical block whose positions all lie before the window of its sequence's first
    query of the step (position ctx - q_len, window start ctx - q_len - W + 1).  Any read of one, even of
    a masked position, makes the output NaN (a NaN score, or 0 * NaN in P.V)."""
    _, k_cache, v_cache, block_tables, context_lens, _ = paged
    for b, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        first = max(0, int(ctx) - q_len - window + 1)
        stale = block_tables[b, :first // block_size]
        k_cache[stale] = np.nan
        v_cache[stale] = np.nan


WINDOW_DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, context lengths, window, partition
    (4, 1, 256, 16, [1, 3, 17, 40], 5, 512),         # Gemma 3 270M's heads; windows inside and across blocks
    (4, 2, 64, 16, [24, 25, 100, 2], 24, 32),        # context = W, W + 1, many blocks before the window
    (2, 1, 128, 32, [17, 600, 512, 513], 512, 64),   # W = 512, shorter and longer contexts: 8 splits of 2 blocks
    (8, 2, 16, 16, [1, 2, 33], 1, 16),               # W = 1: each query sees itself only
    (6, 3, 32, 32, [70, 5, 64], 24, 32),             # the window straddles a block boundary
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", WINDOW_DECODE_CASES, ids=[f"window{i}" for i in range(len(WINDOW_DECODE_CASES))])
def test_paged_attention_decode_window(shim_libraries, dtype, case):
    """The splits cover the window only; the grid is sized from min(bound, W), here with a bound past every
    context as a captured graph uses."""
    heads, kv_heads, head_dim, block_size, ctx_lens, window, partition = case
    rng = np.random.default_rng(17)
    paged = make_paged_batch(rng, dtype, [1] * len(ctx_lens), ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    poison_out_of_window_blocks(paged, [1] * len(ctx_lens), block_size, window)
    backend = small_partition_backend(shim_libraries, partition)
    out = np.zeros((len(ctx_lens), heads * head_dim), dtype)
    bound = 2 * max(ctx_lens) + 7
    backend.paged_attention(*paged, scale, out, 1, bound, window)
    assert kernel_names(backend) == ["paged_attention_decode_kernel", "paged_attention_merge_kernel"]
    split_range = backend.decode_split_range(heads // kv_heads, head_dim, block_size, np.dtype(dtype).itemsize)
    assert backend._launcher.launches[0][1][0] == backend.decode_splits(min(bound, window), split_range)
    assert_close(out, ref, dtype, "decode attention with a window")


WINDOW_PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size, q lens, context lengths, window
    (4, 1, 256, 16, [17, 3, 1], [17, 40, 30], 5),      # Gemma 3 270M's heads: a prompt, a chunk mid-sequence, a decode row
    (2, 1, 64, 16, [40], [40], 24),                    # the window moves across three query tiles
    (2, 2, 16, 32, [17, 1, 3], [600, 600, 20], 512),   # chunks after a past longer than the window, and shorter
    (3, 1, 128, 32, [33, 3], [33, 90], 1),             # W = 1: each query sees itself only
    (4, 2, 16, 16, [20, 5, 17], [70, 5, 100], 24),     # chunks starting mid-block, mid-window
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", WINDOW_PREFILL_CASES, ids=[f"window{i}" for i in range(len(WINDOW_PREFILL_CASES))])
def test_paged_attention_prefill_window(backend, dtype, case):
    heads, kv_heads, head_dim, block_size, q_lens, ctx_lens, window = case
    rng = np.random.default_rng(18)
    paged = make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*paged, scale, heads, window=window)
    poison_out_of_window_blocks(paged, q_lens, block_size, window)
    out = np.zeros((paged[0].shape[0], heads * head_dim), dtype)
    backend.paged_attention(*paged, scale, out, max(q_lens), max(ctx_lens), window)
    assert kernel_names(backend) == ["paged_attention_prefill_kernel"]
    assert_close(out, ref, dtype, "prefill attention with a window")


def test_window_larger_than_every_context_is_full_attention(shim_libraries):
    """A window past every context changes nothing, bit for bit, in both kernels."""
    rng = np.random.default_rng(19)
    for q_lens in ([1, 1], [9, 4]):
        paged = make_paged_batch(rng, np.float16, q_lens, [30, 9], 4, 2, 16, 16)
        outs = []
        for window in (0, 30, 4096):
            backend = small_partition_backend(shim_libraries, 16)
            out = np.zeros((sum(q_lens), 64), np.float16)
            backend.paged_attention(*paged, 0.25, out, max(q_lens), 30, window)
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("window", [-1, 2.5])
def test_window_must_be_a_count_of_tokens(backend, window):
    paged = make_paged_batch(np.random.default_rng(20), np.float32, [1], [5], 2, 1, 16, 16)
    for op in (backend.paged_attention_decode, backend.paged_attention_prefill):
        with pytest.raises(ValueError, match="window must be 0"):
            op(*paged, 0.25, np.zeros((1, 32), np.float32), 5, window)
