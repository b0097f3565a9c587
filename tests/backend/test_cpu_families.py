"""The CPU kernels of the ops model families add to the Llama layer (scaled embedding, per-head RMSNorm,
GeGLU, sliding-window paged attention) against their NumPy references, on shapes off the tile and
block grid."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import attention as A
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu import variants as V
from rawinfer.backend.cpu.backend import CPUBackend
from rawinfer.quant import Int8Weight, quantize_int8
from paged_cases import float_cache, paged_case, rand, tile_scales
from reference_ops import embedding_ref, gelu_tanh_mul_ref, head_rmsnorm_ref, paged_attention_ref

be = CPUBackend()


def test_scaled_embedding():
    table = rand(40, 24)
    ids = np.array([5, 0, 39, 5, 7], np.int32)
    out = np.empty((5, 24), np.float32)
    be.embedding(ids, table, out, 640 ** 0.5)
    # Gemma multiplies by the scale as a float32 (transformers keeps it in the embeddings' dtype)
    np.testing.assert_array_equal(out, table[ids] * np.float32(640 ** 0.5))
    np.testing.assert_allclose(out, embedding_ref(ids, table, 640 ** 0.5), rtol=1e-6)
    q, s = quantize_int8(table)
    be.embedding(ids, Int8Weight(q, s), out, 3.0)
    np.testing.assert_allclose(out, embedding_ref(ids, q.astype(np.float32) * s[:, None], 3.0), rtol=1e-6)


@pytest.mark.parametrize("T,H,Hkv,D", [(1, 2, 1, 8), (3, 4, 2, 16), (17, 9, 3, 64), (40, 4, 1, 256), (5, 3, 3, 20)])
def test_head_rmsnorm(T, H, Hkv, D):
    qkv = rand(T, (H + 2 * Hkv) * D) * 3
    qw, kw = rand(D), rand(D)
    ref = head_rmsnorm_ref(qkv, qw, kw, 1e-6, H, Hkv)
    for build in ("serial", "parallel"):
        x = qkv.copy()
        getattr(V.head_rmsnorm_kernel, build)(x, qw, kw, np.float32(1e-6), H, Hkv)
        np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5, err_msg=build)
        if build == "serial":
            serial = x
    np.testing.assert_array_equal(serial, x)             # one fixed summation order in both builds
    x = qkv.copy()
    be.head_rmsnorm(x, qw, kw, 1e-6, H, Hkv)
    np.testing.assert_array_equal(x[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:])   # v untouched
    with pytest.raises(ValueError, match="qkv"):
        be.head_rmsnorm(qkv[:, :-D], qw, kw, 1e-6, H, Hkv)


@pytest.mark.parametrize("T,F", [(1, 8), (3, 160), (17, 2048), (40, 100)])
def test_gelu_tanh_mul(T, F):
    gu = rand(T, 2 * F) * 4
    gu[0, :4] = [-30.0, 30.0, 0.0, -1e-3]                  # the tails and the origin
    ref = gelu_tanh_mul_ref(gu)
    outs = []
    for build in ("serial", "parallel"):
        out = np.empty((T, F), np.float32)
        getattr(V.gelu_tanh_mul_kernel, build)(gu, out)
        np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6, err_msg=build)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    out = np.empty((T, F), np.float32)
    be.gelu_tanh_mul(gu, out)
    np.testing.assert_array_equal(out, outs[0])
    with pytest.raises(ValueError, match="gelu_tanh_mul"):
        be.gelu_tanh_mul(gu, np.empty((T, F + 1), np.float32))


def poison_before_windows(kc, vc, tables, ctx, qsl, window, BS):
    """Point every block-table entry wholly before its sequence's first window at a block of NaN: a
    kernel that reads such a block (a sliding-window sequence may have given it back to the pool)
    turns its output NaN."""
    owned = {int(tables[b, p]) for b in range(len(ctx)) for p in range(-(-int(ctx[b]) // BS))}
    nan_block = min(set(range(kc.shape[0])) - owned)      # paged_case leaves spare blocks
    for c in (kc, vc):
        c[nan_block] = np.nan if c.dtype != np.int8 else 0
        for h in range(c.shape[1] if c.dtype == np.int8 else 0):
            tile_scales(c, nan_block, h, BS)[:] = np.nan
    tables = tables.copy()
    for b in range(len(ctx)):
        first_query = ctx[b] - (qsl[b + 1] - qsl[b])
        tables[b, :max(0, first_query - window + 1) // BS] = nan_block
    return tables


@pytest.mark.parametrize("q_lens,ctx_lens,H,Hkv,D,BS,window", [
    ([1, 1, 1, 1], [5, 24, 25, 100], 4, 2, 16, 16, 24),   # decode: inside, at and past the window
    ([1, 1, 1], [3, 40, 77], 8, 1, 256, 16, 1),            # window 1: a token sees itself only
    ([9, 1, 3], [9, 30, 50], 4, 2, 16, 4, 5),              # prefill + decode + chunk, window off the blocks
    ([40, 20], [40, 90], 4, 2, 32, 16, 24),                # long chunks (BLAS path) crossing the window
    ([70, 1], [600, 700], 4, 1, 256, 16, 512),             # Gemma 3's shape and window
    ([37, 3, 1], [37, 50, 100], 9, 3, 64, 16, 1000),       # a window longer than every context
])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("blas", [True, False])
def test_windowed_paged_attention(q_lens, ctx_lens, H, Hkv, D, BS, window, kv_dtype, blas, monkeypatch):
    if blas and not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    monkeypatch.setattr(be, "blas_on_numba_pool", blas)
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 5, kv_dtype=kv_dtype)
    scale = D ** -0.5
    ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, scale, H, window)
    if max(ctx_lens) > window:                             # the window changes the answer where it cuts
        full = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, scale, H)
        assert not np.allclose(full, ref, rtol=1e-3, atol=1e-3)
    poisoned = poison_before_windows(kc, vc, tables, ctx, qsl, window, BS)
    out = np.full((qkv.shape[0], H * D), np.nan, np.float32)
    be.paged_attention(qkv, kc, vc, poisoned, ctx, qsl, scale, out, max(q_lens), max(ctx_lens), window)
    np.testing.assert_allclose(out, ref, rtol=3e-5, atol=3e-5)
    if (poisoned != tables).any():                         # and the poison is seen by a kernel that reads it
        be.paged_attention(qkv, kc, vc, poisoned, ctx, qsl, scale, out, max(q_lens), max(ctx_lens), 0)
        assert np.isnan(out).any()


@pytest.mark.parametrize("kernel", ["avx2", "portable"])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_windowed_decode_kernels(kernel, kv_dtype):
    """Both pure-decode kernels, called directly, with windows that start inside a block, on a block
    edge, and before position 0."""
    if kernel == "avx2" and not cpu_llvm.available():
        pytest.skip("this CPU has no AVX2 + FMA")
    fn = A.decode_attention_avx2_kernel if kernel == "avx2" else A.decode_attention_kernel
    ctx_lens, H, Hkv, D, BS = [1, 7, 16, 17, 33, 64, 65, 200], 6, 2, 32, 8
    for window in (1, 3, 8, 16, 50, 300):
        qkv, kc, vc, tables, ctx, qsl = paged_case([1] * len(ctx_lens), ctx_lens, H, Hkv, D, BS, 11,
                                                   kv_dtype=kv_dtype)
        ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, D ** -0.5, H,
                                  window)
        tables = poison_before_windows(kc, vc, tables, ctx, qsl, window, BS)
        if kv_dtype == np.float16:
            kc, vc = kc.view(np.uint16), vc.view(np.uint16)
        out = np.full((len(ctx_lens), H * D), np.nan, np.float32)
        fn(len(ctx_lens) * Hkv, qkv, kc, vc, tables, ctx, np.float32(D ** -0.5), H, window, out)
        np.testing.assert_allclose(out, ref, rtol=3e-5, atol=3e-5, err_msg=f"window {window}")
