"""The q4 integer GEMM (rawinfer/backend/cpu/q4gemm.py) against NumPy: the packed layout, every tile
build (panels of 1..6 rows, one or two column blocks), the AVX2 and AVX-512 paths bit for bit where the
machine has both (the portable build where tools/test_portable.sh makes it), and a row's bits that do not
depend on the other rows of the call."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu import q4gemm as G
from rawinfer.backend.cpu.backend import CPUBackend
from rawinfer.quant import Q4Weight, dequantize_q4, quantize_q4
from reference_ops import silu_mul_ref

# The portable path is the AVX2 drivers built for a CPU without AVX2: tested where the build is that
# (tools/test_portable.sh), since elsewhere it is the AVX2 build again.
PATHS = ([p for p in (isa.AVX2, isa.AVX512_VNNI) if isa.supports(p)]
         + ([isa.PORTABLE] if isa.HOST == isa.PORTABLE else []))
RNG = np.random.default_rng(7)


def q4_pair(N, K, seed=0):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.1
    w[0, :32] = 0.25                                   # a constant block: d = 0
    return quantize_q4(w)


def reference(x, qs, dm):
    """The kernel's arithmetic in float64 where it is exact: x quantized per row to 32767 levels, exact
    integer block sums, float32 block scales; differs from the kernel only by its float32 sums."""
    M = x.shape[0]
    q = G.unpack_nibbles(qs).astype(np.int64)
    N = q.shape[0]
    amax = np.abs(x).max(axis=1)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(x * inv[:, None]).astype(np.int64)
    bs = x.reshape(M, -1, 32).astype(np.float64).sum(axis=2) * inv[:, None]
    s = np.einsum("mbk,nbk->mnb", xq.reshape(M, -1, 32), q.reshape(N, -1, 32))
    d, m = dm[..., 0].astype(np.float64), dm[..., 1].astype(np.float64)
    return ((s * d[None]).sum(axis=2) + bs @ m.T) * (amax / np.float32(32767))[:, None]


def run(path, x, wp, N, silu=False):
    mm, mm_silu = G.PATHS[path]
    xb, sx, bs = (np.empty(n, t) for n, t in zip(G.x_buffer_sizes(*x.shape), (np.int16, np.float32, np.float32)))
    out = np.full((x.shape[0], N // 2 if silu else N), np.nan, np.float32)
    (mm_silu if silu else mm)(x, wp, out, xb, sx, bs)
    return out


def test_unpack_and_pack_keep_every_nibble_and_scale():
    qs, dm = q4_pair(32, 128)
    q = G.unpack_nibbles(qs)
    assert q.shape == (32, 128) and q.max() <= 15
    assert (q * dm[..., 0].astype(np.float32).repeat(32, axis=1) + dm[..., 1].astype(np.float32).repeat(32, axis=1)
            == dequantize_q4(qs, dm)).all()
    wp = G.pack_weights(qs, dm)
    assert wp.shape == (2, 4, G.RECORD) and wp.dtype == np.uint8
    rec = wp[1, 2]                                     # columns 16..31, k 64..95
    lanes = rec[:G.D_AT].view("<u2")                  # per k octet, 32 lanes of 4 nibbles
    for octet in range(G.OCTETS):
        for c in range(16):
            for h in range(2):
                lane = int(lanes[octet * 32 + 2 * c + h])
                for e in range(4):
                    assert (lane >> 4 * e) & 15 == q[16 + c, 64 + 8 * octet + 2 * e + h]
    assert (rec[G.D_AT:G.M_AT].view(np.float16) == dm[16:32, 2, 0]).all()
    assert (rec[G.M_AT:].view(np.float16) == dm[16:32, 2, 1]).all()


def pack_ref(qs, dm):
    """The packed layout by whole-array reshuffles: per column block and k-block, the nibble lanes
    [octet, column, h] (nibble e: k = 8 octet + 2 e + h), then d[16] and m[16]."""
    N, K = qs.shape[0], 2 * qs.shape[1]
    q = G.unpack_nibbles(qs).astype(np.uint16).reshape(N // 16, 16, K // 32, G.OCTETS, 4, 2)
    lanes = q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4) | (q[:, :, :, :, 2] << 8) | (q[:, :, :, :, 3] << 12)
    nib = np.ascontiguousarray(lanes.transpose(0, 2, 3, 1, 4), dtype="<u2").view(np.uint8)
    scales = np.ascontiguousarray(dm.reshape(N // 16, 16, K // 32, 2).transpose(0, 2, 3, 1)).view(np.uint8)
    return np.concatenate([nib.reshape(N // 16, K // 32, -1), scales.reshape(N // 16, K // 32, -1)], axis=2)


@pytest.mark.parametrize("N,K", [(16, 64), (32, 128), (48, 576), (96, 1536)])
def test_pack_matches_the_layout_built_by_reshuffles(N, K):
    qs, dm = q4_pair(N, K, seed=N + K)
    assert (G.pack_weights(qs, dm) == pack_ref(qs, dm)).all()


def test_pack_refuses_shapes_it_cannot_hold():
    qs, dm = q4_pair(24, 128)
    with pytest.raises(ValueError, match="N % 16"):
        G.pack_weights(qs, dm)
    assert not G.supports((24, 128)) and G.supports((32, 128)) and not G.supports((32, 96))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (2, 48, 128), (5, 32, 64), (7, 80, 576), (13, 192, 576),
                                   (50, 96, 1536), (97, 64, 192)])
def test_q4_gemm_matches_numpy(path, M, N, K):
    qs, dm = q4_pair(N, K, seed=M)
    x = RNG.standard_normal((M, K)).astype(np.float32)
    x[0, 3] = 30.0                                     # an outlier channel takes its row's scale
    if M > 1:
        x[1] = 0.0                                     # a zero row
    out = run(path, x, G.pack_weights(qs, dm), N)
    want = reference(x, qs, dm)
    assert np.abs(out - want).max() <= 2e-6 * np.abs(want).max() + 1e-7
    if M > 1:
        assert (out[1] == 0).all()
    # and against the float product of the dequantized weights: only x's rounding to 15 bits between
    wd = dequantize_q4(qs, dm)
    sx = np.abs(x).max(axis=1, keepdims=True) / 32767
    assert (np.abs(out - x @ wd.T) <= sx / 2 * np.abs(wd).sum(axis=1) + 1e-4 * (np.abs(x) @ np.abs(wd).T) + 1e-6).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,F,K", [(1, 16, 64), (4, 48, 576), (11, 32, 1536)])
def test_q4_gemm_silu_is_the_gemm_then_silu_mul(path, M, F, K):
    qs, dm = q4_pair(2 * F, K, seed=F)
    wp = G.pack_weights(qs, dm)
    x = RNG.standard_normal((M, K)).astype(np.float32)
    out = run(path, x, wp, 2 * F, silu=True)
    np.testing.assert_allclose(out, silu_mul_ref(run(path, x, wp, 2 * F)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_bits_do_not_depend_on_the_other_rows(path):
    """Every row alone, and inside calls of 2..20 rows (every tile build, every position in a panel),
    gives the same bits."""
    N, K = 96, 576                                     # 6 column blocks: gate and up 3 each
    qs, dm = q4_pair(N, K)
    wp = G.pack_weights(qs, dm)
    x = RNG.standard_normal((20, K)).astype(np.float32)
    alone = np.concatenate([run(path, x[i:i + 1], wp, N) for i in range(20)])
    for M in (2, 3, 5, 6, 7, 13, 20):
        for start in (0, 20 - M):
            assert np.array_equal(run(path, x[start:start + M], wp, N), alone[start:start + M]), (M, start)
    gate = np.concatenate([run(path, x[i:i + 1], wp, N, silu=True) for i in range(20)])
    assert np.array_equal(run(path, x, wp, N, silu=True), gate)


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs only the AVX2 path")
def test_the_avx2_and_avx512_paths_give_the_same_bits():
    N, K = 112, 1536                                   # 7 column blocks: the AVX-512 path's odd last block
    qs, dm = q4_pair(N, K)
    wp = G.pack_weights(qs, dm)
    x = RNG.standard_normal((23, K)).astype(np.float32)
    assert np.array_equal(run(isa.AVX2, x, wp, N), run(isa.AVX512_VNNI, x, wp, N))
    wp = G.pack_weights(*q4_pair(128, K))              # silu: an even block count (gate 4, up 4)
    assert np.array_equal(run(isa.AVX2, x, wp, 128, silu=True), run(isa.AVX512_VNNI, x, wp, 128, silu=True))


def test_the_backend_takes_the_gemm_for_every_row_count():
    be = CPUBackend()
    N, K = 64, 576
    qs, dm = q4_pair(N, K)
    w = be.prepare_weight(Q4Weight(qs, dm))
    assert w.packed is not None and w.packed.shape == (4, K // 32, G.RECORD)
    x = RNG.standard_normal((40, K)).astype(np.float32)
    full, part = np.empty((40, N), np.float32), np.empty((1, N), np.float32)
    be.linear(x, w, full)
    for i in (0, 17, 39):
        be.linear(x[i:i + 1], w, part)
        assert np.array_equal(part[0], full[i])
    act, act1 = np.empty((40, N // 2), np.float32), np.empty((1, N // 2), np.float32)
    be.linear_silu_mul(x, w, np.empty((40, N), np.float32), act)
    be.linear_silu_mul(x[5:6], w, np.empty((1, N), np.float32), act1)
    assert np.array_equal(act1[0], act[5])
    off = CPUBackend(int_gemm=False)
    assert off.prepare_weight(Q4Weight(qs, dm)).packed is None
