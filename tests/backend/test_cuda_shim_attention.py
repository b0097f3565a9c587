"""The paged attention kernels (decode split-K + merge, prefill), run on the CPU under tests/cuda_shim,
against paged_attention_ref.

Launched through the real `CUDABackend` methods with the host launcher, like test_cuda_shim.py.  Block
tables are shuffled assignments of physical blocks with junk past each sequence's end; contexts and
query counts are ragged (not multiples of the block, the split or the 16-row query tile).
"""

from __future__ import annotations

import numpy as np
import pytest

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from reference_ops import DTYPE_IDS, DTYPES, assert_close, make_paged_batch, paged_attention_ref  # noqa: E402


@pytest.fixture(scope="module")
def shim_libraries():
    return harness.build_all()  # every .cu once, in parallel; cached on disk between sessions


@pytest.fixture
def backend(shim_libraries):
    return CUDABackend(launcher=harness.ShimLauncher(shim_libraries))


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
    assert splits == -(-max(ctx_lens) // backend.decode_partition_size(heads // kv_heads, head_dim, block_size,
                                                                        np.dtype(dtype).itemsize))
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
