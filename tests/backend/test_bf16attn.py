"""bf16attn.py, the int8_activations mode's prefill attention on AVX-512 (float32 scores, P V on bf16
products), against NumPy: exactly the rounding it documents (V and the weights to bf16), and the exact
attention within bf16's precision."""

import numpy as np
import pytest

from paged_cases import float_cache, paged_case
from reference_ops import paged_attention_ref
from rawinfer.backend.cpu import bf16attn
from rawinfer.backend.cpu.attention import attention_work_items
from rawinfer.backend.cpu.backend import ATTN_BLAS_QUERY_TILE, CPUBackend

needs_bf16 = pytest.mark.skipif(not bf16attn.available(), reason="the CPU Numba compiles for lacks AVX-512 BF16")


def bf16(x):
    """float32 values rounded to the nearest bf16 (ties to even), as float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bf16_attention_ref(qkv, kf, vf, tables, ctx, qsl, scale, H):
    """Causal attention with the kernel's rounding: scores in float64, weights exp(s - max) and V rounded
    to bf16, the sums in float64."""
    NB, Hkv, BS, D = kf.shape
    G = H // Hkv
    out = np.zeros((qkv.shape[0], H * D), np.float64)
    for b in range(len(ctx)):
        q_len = qsl[b + 1] - qsl[b]
        keys = np.arange(ctx[b])
        blk, off = tables[b, keys // BS], keys % BS
        for i in range(q_len):
            t, pos = qsl[b] + i, ctx[b] - q_len + i
            for h in range(H):
                k, v = kf[blk[:pos + 1], h // G, off[:pos + 1]], vf[blk[:pos + 1], h // G, off[:pos + 1]]
                s = k.astype(np.float64) @ (qkv[t, h * D:(h + 1) * D].astype(np.float64) * np.float32(scale))
                p = bf16(np.exp(s - s.max()).astype(np.float32)).astype(np.float64)
                out[t, h * D:(h + 1) * D] = p @ bf16(v).astype(np.float64) / p.sum()
    return out


def run_kernel(qkv, kc, vc, tables, ctx, qsl, H, seqs=None):
    out = np.full((qkv.shape[0], H * kc.shape[3]), np.nan, np.float32)
    seqs = np.arange(len(ctx)) if seqs is None else seqs
    ws, w0, w1 = attention_work_items(qsl, ATTN_BLAS_QUERY_TILE)
    keep = np.isin(ws, seqs)
    kc, vc = (c.view(np.uint16) if c.dtype == np.float16 else c for c in (kc, vc))   # as the backend passes them
    bf16attn.attend(qkv, kc, vc, tables, ctx, qsl, seqs, ws[keep], w0[keep], w1[keep], kc.shape[3] ** -0.5, H, out, 2)
    return out


CASES = [
    ([500], [500], 9, 3, 64, 16),          # SmolLM2's heads: 16 key blocks, the last one partial
    ([130, 40], [150, 40], 9, 3, 64, 16),  # a chunk after a cached prefix, beside a fresh prompt
    ([37], [70], 4, 1, 128, 5),            # D = 128, one kv head, blocks of 5 tokens (not a divisor of 32)
    ([33], [33], 8, 2, 32, 16),            # D = 32: one pair of 16-column chunks
    ([64, 45], [64, 101], 6, 6, 64, 16),   # no kv grouping (G = 1): rows of several queries per tile
]


@needs_bf16
@pytest.mark.parametrize("q_lens,ctx_lens,H,Hkv,D,BS", CASES)
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_matches_numpy_with_its_rounding(q_lens, ctx_lens, H, Hkv, D, BS, kv_dtype):
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 11, kv_dtype=kv_dtype)
    out = run_kernel(qkv, kc, vc, tables, ctx, qsl, H)
    assert np.isfinite(out).all()
    kf, vf = float_cache(kc, BS).astype(np.float32), float_cache(vc, BS).astype(np.float32)
    # the same rounding: only float32 scores (vs float64) differ, which moves a weight across a bf16
    # rounding boundary now and then
    np.testing.assert_allclose(out, bf16_attention_ref(qkv, kf, vf, tables, ctx, qsl, D ** -0.5, H), atol=2e-3)
    # the exact attention, within bf16's precision (8 bits of mantissa in V and the weights)
    exact = paged_attention_ref(qkv, kf, vf, tables, ctx, qsl, D ** -0.5, H)
    np.testing.assert_allclose(out, exact, atol=2e-2)


@needs_bf16
def test_a_sequence_has_the_same_bits_alone_and_in_a_batch():
    qkv, kc, vc, tables, ctx, qsl = paged_case([130, 40, 77], [150, 40, 77], 9, 3, 64, 16, 5)
    batch = run_kernel(qkv, kc, vc, tables, ctx, qsl, 9)
    for b in range(3):
        rows = slice(qsl[b], qsl[b + 1])
        alone = run_kernel(np.ascontiguousarray(qkv[rows]), kc, vc, tables[b:b + 1].copy(), ctx[b:b + 1].copy(),
                           np.array([0, qsl[b + 1] - qsl[b]], np.int32), 9)
        np.testing.assert_array_equal(alone, batch[rows])


@pytest.mark.parametrize("a8", [False, True])
def test_the_mode_takes_it_where_the_cpu_and_the_layer_allow(a8, monkeypatch):
    """Long prompts of the int8_activations mode take bf16attn on a CPU with AVX-512 BF16; sliding-window
    layers, other modes and other CPUs keep blas.prefill_attention."""
    from rawinfer.backend.cpu import a8gemm
    from rawinfer.backend.cpu import blas as cpu_blas
    if a8 and not a8gemm.available():
        pytest.skip("8-bit activations need AVX2 and FMA")
    be = CPUBackend(int8_activations=a8)
    if not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    assert be.bf16_attention == (a8 and bf16attn.available())
    taken = []
    monkeypatch.setattr(bf16attn, "attend", lambda *a: taken.append("bf16"))
    monkeypatch.setattr(cpu_blas, "prefill_attention", lambda *a: taken.append("blas"))
    qkv, kc, vc, tables, ctx, qsl = paged_case([40], [40], 4, 2, 64, 16, 3)
    out = np.empty((40, 4 * 64), np.float32)
    for window in (0, 16):
        be.paged_attention_prefill(qkv, kc, vc, tables, ctx, qsl, 0.125, out, 40, window)
    assert taken == (["bf16", "blas"] if be.bf16_attention else ["blas", "blas"])
