"""The 8-bit-activation integer GEMM (rawinfer/backend/cpu/a8gemm.py; int8 weights on a8tile.py's tiles,
q4 ones on a8q4tile.py's) against NumPy, on every instruction-set path this CPU runs: the same bits on each
path and for a row whatever its batch; and the engine's int8_activations mode around it (its errors)."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import a8gemm as A
from rawinfer.backend.cpu import a8q4tile as Q
from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.q4gemm import unpack_nibbles
from rawinfer.quant import quantize_int8, quantize_q4

RNG = np.random.default_rng(31)
pytestmark = pytest.mark.skipif(not A.available(), reason="the 8-bit-activation GEMM needs AVX2 and FMA")
PATHS = [p for p in A.PATHS if isa.supports(p)]
SHAPES = [(1, 16, 32), (5, 48, 64), (6, 16, 32), (7, 32, 96), (13, 80, 576), (64, 160, 1536), (100, 64, 64)]


def quantized_blocks(x):
    """x [M, K] -> (int8 values as int64 [M, K/32, 32], float32 scales [M, K/32]): a8gemm's quantizer."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    return xq, (amax / np.float32(127)).astype(np.float32)


def reference(x, q, sw):
    """out[m, n] = sw[n] * sum_b xs[m, b] * (int8 x block b . q block b), folded block by block in
    float32 (each step rounded once, as the kernel's fused multiply-add)."""
    M, K = x.shape
    xq, scale = quantized_blocks(x)
    sums = np.einsum("mbk,nbk->mnb", xq, q.astype(np.int64).reshape(len(q), K // 32, 32))
    acc = np.zeros((M, len(q)), np.float32)
    for b in range(K // 32):
        acc = (acc.astype(np.float64) + sums[:, :, b] * scale[:, b, None].astype(np.float64)).astype(np.float32)
    return acc * sw


def reference_q4(x, q, dm):
    """out[m, n] = sum_b xs[m, b] (d[n, b] (x block b . q block b) + m[n, b] (sum of x block b)), each block's
    step in float32 as the tiles do: t = float(s) * xs; acc = fma(t, d, acc); acc = fma(m, xs * sum, acc)."""
    M, K = x.shape
    xq, xs = quantized_blocks(x)
    sums = np.einsum("mbk,nbk->mnb", xq, q.astype(np.int64).reshape(len(q), K // 32, 32))
    d, mins = dm[..., 0].astype(np.float32), dm[..., 1].astype(np.float32)
    xsum = (xs * xq.sum(-1).astype(np.float32)).astype(np.float32)
    acc = np.zeros((M, len(q)), np.float32)
    for b in range(K // 32):
        t = (sums[:, :, b].astype(np.float32) * xs[:, b, None]).astype(np.float32)
        acc = (acc.astype(np.float64) + t.astype(np.float64) * d[None, :, b]).astype(np.float32)
        acc = (acc.astype(np.float64) + np.float64(1) * mins[None, :, b] * xsum[:, b, None]).astype(np.float32)
    return acc


def run(path, x, wq, sw, silu=False):
    M, K = x.shape
    nx, ns = A.x_buffer_sizes(M, K)
    # buffers dirty from an earlier, larger call: the kernel must not read stale panels
    bufs = (RNG.integers(-100, 100, nx + 999).astype(np.int8), np.full(ns + 99, 7, np.float32),
            np.full(ns + 99, 5, np.int32))
    out = np.full((M, wq.shape[0] * 8 if silu else wq.shape[0] * 16), np.nan, np.float32)   # either layout
    A.PATHS[path][1 if silu else 0](x, wq, sw, out, *bufs)
    return out


def operands(M, N, K):
    x = RNG.standard_normal((M, K)).astype(np.float32)
    x[0, :32] *= 50                                      # an outlier block: only its own scale grows
    if M > 2:
        x[2] = 0.0                                       # a zero row
    q, sw = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    return x, q, sw


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_every_path_matches_numpy_and_each_other(M, N, K):
    x, q, sw = operands(M, N, K)
    wq = A.pack_weights(q)
    want = reference(x, q, sw)
    outs = [run(p, x, wq, sw) for p in PATHS]
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        assert np.array_equal(out, outs[0])
    assert (outs[0][2] == 0).all() if M > 2 else True


def test_extreme_bytes_sum_exactly():
    """Weights at -128 and 127 against activations at -127 and 127 (every x in a block of equal magnitude):
    the largest products each path's integer steps meet (AVX2's sign trick takes |-128| as 128 unsigned and
    its int16 pairs reach 2 x 128 x 127), exact on every path."""
    M, N, K = 7, 32, 128
    x = (np.where(RNG.random((M, K)) < 0.5, -1.0, 1.0) * RNG.uniform(0.5, 2, (M, 1))).astype(np.float32)
    q = np.where(RNG.random((N, K)) < 0.5, -128, 127).astype(np.int8)
    q[0], q[1] = -128, 127
    sw = RNG.uniform(0.001, 0.01, N).astype(np.float32)
    want = reference(x, q, sw)
    for path in PATHS:
        assert np.array_equal(run(path, x, A.pack_weights(q), sw), want), path


@pytest.mark.parametrize("M,N,K", [(1, 32, 32), (7, 64, 96), (13, 96, 576)])
def test_silu_epilogue_is_silu_of_gate_times_up(M, N, K):
    x, q, sw = operands(M, N, K)
    wq = A.pack_weights(q)
    gu = reference(x, q, sw)
    g, u = gu[:, :N // 2], gu[:, N // 2:]
    outs = [run(p, x, wq, sw, silu=True) for p in PATHS]
    with np.errstate(over="ignore"):                     # exp(-g) of the outlier row's large negative g
        want = g / (1 + np.exp(-g)) * u
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * np.abs(gu).max() ** 2)
        assert np.array_equal(out, outs[0])


@pytest.mark.parametrize("path", PATHS)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(path):
    x, q, sw = operands(50, 80, 576)
    wq = A.pack_weights(q)
    full = run(path, x, wq, sw)
    for lo, hi in ((0, 1), (3, 10), (11, 17), (49, 50), (5, 50)):
        assert np.array_equal(run(path, x[lo:hi], wq, sw), full[lo:hi]), (lo, hi)
    wq = wq[:4]                                          # silu pairs gate block j with up block j + 2
    fs = run(path, x, wq, sw, silu=True)
    assert np.array_equal(run(path, x[7:8], wq, sw, silu=True), fs[7:8])


def q4_operands(M, N, K):
    x = RNG.standard_normal((M, K)).astype(np.float32)
    x[0, :32] *= 50
    if M > 2:
        x[2] = 0.0
    qs, dm = quantize_q4(RNG.standard_normal((N, K)).astype(np.float32))
    q = unpack_nibbles(qs)
    return x, q, dm, Q.pack_q4(q, dm)


Q4_SHAPES = [(1, 16, 64), (5, 48, 64), (6, 16, 128), (7, 32, 192), (13, 80, 576), (64, 160, 1536), (100, 64, 64)]


@pytest.mark.parametrize("M,N,K", Q4_SHAPES)
def test_q4_on_every_path_matches_numpy_and_each_other(M, N, K):
    x, q, dm, wp = q4_operands(M, N, K)
    want = reference_q4(x, q, dm)
    outs = [run(p, x, wp, dm.view(np.uint16)) for p in PATHS]
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        assert np.array_equal(out, outs[0])
    assert (outs[0][2] == 0).all() if M > 2 else True


def test_q4_silu_epilogue_and_a_row_alone_or_in_any_batch():
    x, q, dm, wp = q4_operands(50, 128, 576)
    gu = reference_q4(x, q, dm)
    with np.errstate(over="ignore"):
        want = gu[:, :64] / (1 + np.exp(-gu[:, :64])) * gu[:, 64:]
    for path in PATHS:
        full, fs = run(path, x, wp, dm.view(np.uint16)), run(path, x, wp, dm.view(np.uint16), silu=True)
        np.testing.assert_allclose(fs, want, rtol=1e-4, atol=1e-5 * np.abs(gu).max() ** 2)
        for lo, hi in ((0, 1), (3, 10), (11, 17), (49, 50), (5, 50)):
            assert np.array_equal(run(path, x[lo:hi], wp, dm.view(np.uint16)), full[lo:hi]), (path, lo, hi)
            assert np.array_equal(run(path, x[lo:hi], wp, dm.view(np.uint16), silu=True), fs[lo:hi]), (path, lo, hi)


def test_q4_real_weights_match_a_float64_product():
    """A q4 weight against activations with outlier channels, as a model's: within 8-bit activations'
    rounding of the exact product of the same q4 weights (|error| <= sum_k |w_k| xs / 2 per block)."""
    _, q, dm, wp = q4_operands(9, 64, 576)
    x = RNG.standard_normal((9, 576)).astype(np.float32)
    x[:, [7, 300]] *= 40
    w = dm[..., 0].astype(np.float64).repeat(32, 1) * q + dm[..., 1].astype(np.float64).repeat(32, 1)
    _, xs = quantized_blocks(x)
    bound = np.abs(w).reshape(64, 18, 32).sum(-1) @ (xs.astype(np.float64).T / 2)          # [N, M]
    for path in PATHS:
        err = np.abs(run(path, x, wp, dm.view(np.uint16)) - x.astype(np.float64) @ w.T)
        assert (err <= bound.T * 1.001 + 1e-4).all()


def test_quantized_activations_are_within_half_a_step_per_block():
    M, K = 9, 96
    x = RNG.standard_normal((M, K)).astype(np.float32) * np.linspace(0.01, 100, K, dtype=np.float32)
    nx, ns = A.x_buffer_sizes(M, K)
    xq, xs, xc = A.quantized_x(x, np.empty(nx, np.int8), np.empty(ns, np.float32), np.empty(ns, np.int32))
    # panels [t, K/4, 6, 4] int8 -> rows [M, K]; scales and corrections [t, K/32, 6] -> [M, K/32]
    vals = xq.view(np.int8).reshape(-1, K // 4, 6, 4).transpose(0, 2, 1, 3).reshape(-1, K)[:M].astype(np.float32)
    scale = xs.reshape(-1, K // 32, 6).transpose(0, 2, 1).reshape(-1, K // 32)[:M]
    corr = xc.reshape(-1, K // 32, 6).transpose(0, 2, 1).reshape(-1, K // 32)[:M]
    back = vals * np.repeat(scale, 32, axis=1)
    assert (np.abs(back - x) <= np.repeat(scale, 32, axis=1) / 2 * (1 + 1e-5)).all()
    assert (corr == -128 * vals.reshape(M, K // 32, 32).sum(-1)).all()
    # for q4 weights the same slot holds xs * sum xq in float32 (what a8q4tile.py's tiles scale the minima by)
    xq4, xs4, xm = A.quantized_x(x, np.empty(nx, np.int8), np.empty(ns, np.float32), np.empty(ns, np.float32))
    assert np.array_equal(xq4, xq) and np.array_equal(xs4, xs) and xm.dtype == np.float32
    xm = xm.reshape(-1, K // 32, 6).transpose(0, 2, 1).reshape(-1, K // 32)[:M]
    assert np.array_equal(xm, scale * vals.reshape(M, K // 32, 32).sum(-1))


def test_shapes_the_layout_cannot_hold_are_refused():
    assert A.supports((32, 64)) and not A.supports((24, 64)) and not A.supports((32, 48))
    with pytest.raises(ValueError, match="K % 32"):
        A.pack_weights(np.zeros((16, 48), np.int8))
    assert Q.supports((32, 128)) and not Q.supports((24, 128)) and not Q.supports((32, 96))
    with pytest.raises(ValueError, match="K % 64"):
        Q.pack_q4(np.zeros((16, 96), np.uint8), np.zeros((16, 3, 2), np.float16))


def test_the_mode_is_for_int8_and_q4_models(tiny_llama_dir, tmp_path):
    from rawinfer import LLMEngine
    with pytest.raises(ValueError, match="--quant int8"):
        LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", int8_activations=True, warmup=False)


def test_the_lm_head_keeps_16_bit_activations_where_8_bit_ones_are_slower(tmp_path_factory):
    """Every layer matrix is packed for a8gemm; the int8 LM head only where int8 weights gain from 8-bit
    activations (vpdpbusd: AVX-512 VNNI or AVX-VNNI), else for qgemm (AVX2 without AVX-VNNI, where a8tile.py
    runs slower than qgemm)."""
    from conftest import _convert_tiny
    from rawinfer import LLMEngine
    engine = LLMEngine(_convert_tiny(tmp_path_factory, "tiny-llama", quant="int8"), device="cpu",
                       kv_cache_memory="8MiB", int8_activations=True, warmup=False)
    model = engine.model
    assert all(getattr(L, k).packed.dtype == np.uint8 for L in model.layers for k in ("qkv_proj", "o_proj"))
    assert (model.lm_head.packed.dtype == np.uint8) == A.int8_gains()
    assert engine.score([5, 9, 200, 31, 7]).shape[0] == 5 and np.isfinite(engine.score([5, 9, 200])).all()


@pytest.mark.skipif(isa.AVX2 not in PATHS, reason="no AVX2 path on this CPU")
def test_the_avx2_tiles_multiply_with_avx_vnni_exactly_where_the_cpu_has_it():
    """With AVX-VNNI (isa.avx_vnni()) both layouts' AVX2 tiles multiply with 256-bit vpdpbusd and nothing
    else; without it both take vpmaddubsw (int8 weights by the sign trick: vpsignb). (The other tests hold
    the bits to NumPy's and the VNNI path's either way; this one holds that the builds take the
    instructions they say.)
    Each tile compiled on its own, uncached, for its assembly."""
    import numba as nb
    from rawinfer.backend.cpu import a8tile
    for layout, builds in (("int8", a8tile.tiles[isa.AVX2]), ("q4", Q.tiles[isa.AVX2])):
        for tile in builds.values():
            def call(a):
                tile(a, a, a, a, a, a, a, a, a, a, a, a, a, a, a)
            f = nb.njit(call)
            f.compile("(int64,)")
            asm = "".join(f.inspect_asm().values())
            counts = {op: asm.count(op) for op in ("vpdpbusd", "vpmaddubsw", "vpmaddwd", "vpsignb", "zmm")}
            if isa.avx_vnni():
                assert counts["vpdpbusd"] > 0 and counts["vpmaddubsw"] == counts["vpmaddwd"] == 0, counts
            else:
                assert counts["vpdpbusd"] == 0 and counts["vpmaddubsw"] > 0, counts
                assert (counts["vpsignb"] > 0) == (layout == "int8"), counts
            assert counts["zmm"] == 0, counts          # an AVX2 build, whatever else the CPU has


def test_avx_vnni_needs_avx2_fma_and_avxvnni():
    assert isa.avx_vnni({"avx2", "fma", "avxvnni", "sse2"})
    assert not isa.avx_vnni({"avx2", "fma"}) and not isa.avx_vnni({"avxvnni", "fma"})
