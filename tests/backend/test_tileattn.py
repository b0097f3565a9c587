"""tileattn.py, the attention of long query runs on AVX-512, against NumPy (float64), as the other attention
kernels are held, and a sequence's bits alone and in a batch."""

import numpy as np
import pytest

from paged_cases import float_cache, paged_case
from reference_ops import paged_attention_ref
from rawinfer.backend.cpu import tileattn
from rawinfer.backend.cpu.attention import attention_work_items
from rawinfer.backend.cpu.backend import ATTN_BLAS_QUERY_TILE, CPUBackend

needs_avx512 = pytest.mark.skipif(not tileattn.available(), reason="the CPU Numba compiles for lacks AVX-512")


def run_kernel(qkv, kc, vc, tables, ctx, qsl, H):
    out = np.full((qkv.shape[0], H * kc.shape[3]), np.nan, np.float32)
    ws, w0, w1 = attention_work_items(qsl, ATTN_BLAS_QUERY_TILE)
    kc, vc = (c.view(np.uint16) if c.dtype == np.float16 else c for c in (kc, vc))   # as the backend passes them
    tileattn.attend(qkv, kc, vc, tables, ctx, qsl, np.ones(len(ctx), bool), ws, w0, w1, kc.shape[3] ** -0.5, H, out, 2)
    return out


CASES = [
    ([500], [500], 9, 3, 64, 16),          # SmolLM2's heads: 16 key blocks, the last one partial
    ([130, 40], [150, 40], 9, 3, 64, 16),  # a chunk after a cached prefix, beside a fresh prompt
    ([37], [70], 4, 1, 128, 5),            # D = 128, one kv head, blocks of 5 tokens (not a divisor of 32)
    ([33], [33], 8, 2, 32, 16),            # D = 32: one pair of 16-column chunks
    ([64, 45], [64, 101], 6, 6, 64, 16),   # no kv grouping (G = 1): rows of several queries per tile
]


@needs_avx512
@pytest.mark.parametrize("q_lens,ctx_lens,H,Hkv,D,BS", CASES)
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_matches_numpy(q_lens, ctx_lens, H, Hkv, D, BS, kv_dtype):
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 11, kv_dtype=kv_dtype)
    out = run_kernel(qkv, kc, vc, tables, ctx, qsl, H)
    ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, D ** -0.5, H)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@needs_avx512
def test_a_sequence_has_the_same_bits_alone_and_in_a_batch():
    qkv, kc, vc, tables, ctx, qsl = paged_case([130, 40, 77], [150, 40, 77], 9, 3, 64, 16, 5)
    batch = run_kernel(qkv, kc, vc, tables, ctx, qsl, 9)
    for b in range(3):
        rows = slice(qsl[b], qsl[b + 1])
        alone = run_kernel(np.ascontiguousarray(qkv[rows]), kc, vc, tables[b:b + 1].copy(), ctx[b:b + 1].copy(),
                           np.array([0, qsl[b + 1] - qsl[b]], np.int32), 9)
        np.testing.assert_array_equal(alone, batch[rows])


@pytest.mark.parametrize("a8", [False, True])
def test_long_query_runs_take_it_where_the_cpu_and_the_layer_allow(a8, monkeypatch):
    """Long query runs take tileattn on AVX-512, with 8-bit activations or without, whatever BLAS NumPy
    has; sliding-window layers and other CPUs keep blas.prefill_attention (or, without it, the tiled
    kernel)."""
    from rawinfer.backend.cpu import a8gemm
    from rawinfer.backend.cpu import blas as cpu_blas
    if a8 and not a8gemm.available():
        pytest.skip("8-bit activations need AVX2 and FMA")
    be = CPUBackend(int8_activations=a8)
    if not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    assert be.tile_attention == tileattn.available()
    taken = []
    monkeypatch.setattr(tileattn, "attend", lambda *a: taken.append("tile"))
    monkeypatch.setattr(cpu_blas, "prefill_attention", lambda *a: taken.append("blas"))
    qkv, kc, vc, tables, ctx, qsl = paged_case([40], [40], 4, 2, 64, 16, 3)
    out = np.empty((40, 4 * 64), np.float32)
    for window in (0, 16):
        be.paged_attention_prefill(qkv, kc, vc, tables, ctx, qsl, 0.125, out, 40, window)
    assert taken == (["tile", "blas"] if be.tile_attention else ["blas", "blas"])
    # NumPy on a BLAS that blas.py cannot call (MKL): tileattn needs none and still takes long runs;
    # the sliding-window layer's run goes to the Numba tiled kernel, not to BLAS
    be.blas_on_numba_pool = False
    taken.clear()
    for window in (0, 16):
        be.paged_attention_prefill(qkv, kc, vc, tables, ctx, qsl, 0.125, out, 40, window)
    assert taken == (["tile"] if be.tile_attention else [])
