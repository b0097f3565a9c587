"""Every CPU backend op against a NumPy `<op>_ref`, on several shapes (sizes off the tile/block grid too)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rawinfer.backend.cpu import attention as A
from rawinfer.backend.cpu import kernels as K
from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.backend import ATTN_QUERY_TILE, CPUBackend
from rawinfer.exec.memory import kv_cache_shape
from paged_cases import float_cache, paged_case, tile_scales
from reference_ops import (add_rmsnorm_ref, copy_blocks_ref, cos_sin_table, embedding_ref, kv_write_ref, linear_ref,
                           paged_attention_ref, quantize_rows_ref, rmsnorm_ref, rope_ref, silu_mul_ref, take_rows_ref)

be = CPUBackend()
RNG = np.random.default_rng(1234)


def rand(*shape, rng=None):
    return (rng or RNG).standard_normal(shape).astype(np.float32)


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,C", [(1, 8), (5, 64), (33, 576), (130, 100)])
def test_rmsnorm(T, C):
    x, w = rand(T, C), rand(C)
    out = np.empty_like(x)
    be.rmsnorm(x, w, 1e-5, out)
    np.testing.assert_allclose(out, rmsnorm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,C", [(1, 8), (7, 64), (129, 200)])
def test_add_rmsnorm(T, C):
    x, res, w = rand(T, C), rand(T, C), rand(C)
    res0 = res.copy()
    out = np.empty_like(x)
    ref_out, ref_res = add_rmsnorm_ref(x, res0, w, 1e-6)
    be.add_rmsnorm(x, res, w, 1e-6, out)
    np.testing.assert_allclose(res, ref_res, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 16), (9, 9, 3, 64), (40, 8, 8, 32), (3, 6, 1, 8)])
def test_rope(T, H, Hkv, D):
    P = 100
    qkv = rand(T, (H + 2 * Hkv) * D)
    cos_sin = cos_sin_table(P, D)
    pos = RNG.integers(0, P, T).astype(np.int32)
    ref = rope_ref(qkv, pos, cos_sin, H, Hkv)
    be.rope(qkv, pos, cos_sin, H, Hkv)
    np.testing.assert_allclose(qkv, ref, rtol=1e-5, atol=1e-5)


def test_rope_rejects_positions_past_the_table():
    qkv = rand(2, 4 * 8)
    cos_sin = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="context"):
        be.rope(qkv, np.array([1, 4], np.int32), cos_sin, 2, 1)


@pytest.mark.parametrize("T,F", [(1, 3), (17, 160), (64, 1536)])
def test_silu_mul(T, F):
    gu = rand(T, 2 * F)
    out = np.empty((T, F), np.float32)
    be.silu_mul(gu, out)
    np.testing.assert_allclose(out, silu_mul_ref(gu), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,K,N,bias", [(1, 64, 3, False), (2, 576, 130, False), (13, 576, 1728, True),
                                        (70, 33, 17, True), (3, 100, 1000, False)])
@pytest.mark.parametrize("numba_pool", [True, False])   # GEMMs on Numba's threads, or np.matmul
def test_linear(T, K, N, bias, numba_pool, monkeypatch):
    if numba_pool and not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    monkeypatch.setattr(be, "blas_on_numba_pool", numba_pool)
    x, w = rand(T, K), rand(N, K)
    b = rand(N) if bias else None
    out = np.empty((T, N), np.float32)
    be.linear(x, w, out, bias=b)
    np.testing.assert_allclose(out, linear_ref(x, w, b), rtol=1e-4, atol=1e-4)


def test_matmul_nt_splits_columns_over_any_number_of_parts():
    from rawinfer.backend.cpu import blas as cpu_blas
    if not cpu_blas.available():
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    x, w = rand(5, 40), rand(7, 40)
    for parts in (1, 2, 3, 7, 9):          # 9 parts of 7 columns: some slices are empty
        out = np.full((5, 7), np.nan, np.float32)
        cpu_blas.matmul_nt(x, w, out, parts)
        np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 2, 3, 7, 16, 17, 64, 96, 97])
@pytest.mark.parametrize("N,K", [(5003, 840), (3072, 64), (45, 576)])
def test_matmul_nt_few_rows(M, N, K):
    """3-96 rows of x take the W x^T tiles (tile 2048, so 5003 rows leave a partial tile per part, and
    the transpose partial groups of 16), 1-2 rows GEMV, more the x W^T GEMM: all the same products."""
    from rawinfer.backend.cpu import blas as cpu_blas
    if not cpu_blas.available():
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    x, w = rand(M, K), rand(N, K)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    for parts in (1, 2, 3):
        out = np.full((M, N), np.nan, np.float32)
        cpu_blas.matmul_nt(x, w, out, parts)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_fast_exp_matches_numpy():
    from rawinfer.backend.cpu.kernels import fast_exp
    import numba as nb

    @nb.njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = fast_exp(x[i])
    x = np.concatenate([np.linspace(-87, 88, 100001), [0.0, -1e-8, 1e-8, 0.5 * np.log(2)]]).astype(np.float32)
    out = np.empty_like(x)
    apply(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 1e-6
    tails = np.array([-np.inf, -1000.0, -88.0, 89.0, 1000.0], np.float32)
    out = np.empty_like(tails)
    apply(tails, out)
    assert 0 < out[0] == out[1] == out[2] < 1e-37          # clamped: 0 for any sum it enters
    assert out[3] == out[4] and np.isfinite(out[3])


def _fixed_order_sum(x):
    """reductions.row_total's order in float32: 16 running sums over j (mod 16), folded 8 + 8, 4 + 4, 2 + 2,
    1 + 1, then the tail one by one."""
    n16 = len(x) - len(x) % 16
    lanes = np.zeros(16, np.float32)
    for j in range(0, n16, 16):
        lanes = (lanes + x[j:j + 16]).astype(np.float32)
    while len(lanes) > 1:
        lanes = (lanes[:len(lanes) // 2] + lanes[len(lanes) // 2:]).astype(np.float32)
    s = lanes[0]
    for v in x[n16:]:
        s = np.float32(s + v)
    return s


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 64, 100, 257])
def test_fixed_order_row_reductions(n):
    """reductions.row_sum / row_max / dot (vector IR blocks): the sum in exactly its stated order,
    the max exact, the dot product against float64."""
    import numba as nb
    from rawinfer.backend.cpu.reductions import dot, row_max, row_sum

    @nb.njit
    def run(a, b, n):
        return row_sum(a, n), row_max(a, n), dot(a[:n], b[:n])
    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n + 5) * rng.uniform(0.1, 1000, n + 5)).astype(np.float32)
    b = rng.standard_normal(n + 5).astype(np.float32)
    total, biggest, d = run(a, b, n)
    assert total == _fixed_order_sum(a[:n])
    assert biggest == (a[:n].max() if n else -np.inf)
    ref = float(a[:n].astype(np.float64) @ b[:n].astype(np.float64))
    assert abs(d - ref) <= 1e-5 * (np.abs(a[:n]).astype(np.float64) @ np.abs(b[:n]) + 1e-30)


@pytest.mark.parametrize("n", [0, 1, 15, 63, 64, 65, 130, 576, 1000])
def test_fixed_order_int8_dot(n):
    """reductions.dot_i8 (float32 row x int8 row, 64 running sums): every element counted once (exact on
    small integers, where no order rounds), and close to float64 on random rows."""
    import numba as nb
    from rawinfer.backend.cpu.reductions import dot_i8

    @nb.njit
    def run(a, b):
        return dot_i8(a, b)
    rng = np.random.default_rng(n)
    b = rng.integers(-128, 128, n).astype(np.int8)
    ints = rng.integers(-50, 51, n).astype(np.float32)
    assert run(ints, b) == float(ints.astype(np.int64) @ b.astype(np.int64))
    a = (rng.standard_normal(n) * rng.uniform(0.1, 1000, n)).astype(np.float32)
    ref = float(a.astype(np.float64) @ b.astype(np.float64))
    assert abs(run(a, b) - ref) <= 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(b.astype(np.float64)) + 1e-30)


def test_prefault_leaves_the_bytes_alone():
    arena = be.alloc_arena(8 << 20)
    arena[: 4 << 20] = 7
    be.prefault(arena, 4096 + 3, (6 << 20) - 5)
    assert (arena[: 4 << 20] == 7).all() and (arena[4 << 20:] == 0).all()
    arena[-1] = 1                                           # writable after it too
    assert arena[-1] == 1


def test_embedding_and_take_rows():
    table = rand(50, 12)
    ids = np.array([3, 0, 49, 3], np.int32)
    out = np.empty((4, 12), np.float32)
    be.embedding(ids, table, out)
    np.testing.assert_array_equal(out, embedding_ref(ids, table))
    rows = np.empty((2, 12), np.float32)
    be.take_rows(out, np.array([3, 1], np.int32), rows)
    np.testing.assert_array_equal(rows, take_rows_ref(out, np.array([3, 1], np.int32)))
    np.testing.assert_array_equal(rows, table[[3, 0]])
    with pytest.raises(ValueError, match="out of range"):
        be.embedding(np.array([50], np.int32), table, out[:1])


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_kv_write_and_copy_blocks(kv_dtype):
    H, Hkv, D, BS, NB, T = 4, 2, 8, 4, 6, 7
    qkv = rand(T, (H + 2 * Hkv) * D)
    qkv[0, H * D] = 1e6                                   # beyond float16's range: stored as inf
    qkv[3, (H + Hkv) * D:(H + Hkv + 1) * D] = 0           # an all-zero V row: int8 scale 0
    shape = kv_cache_shape(NB, Hkv, BS, D, kv_dtype)
    assert shape == ((NB, Hkv, BS + 2, D) if kv_dtype == np.int8 else (NB, Hkv, BS, D))
    kc, vc = np.zeros(shape, kv_dtype), np.zeros(shape, kv_dtype)
    slots = np.array([5, 6, 7, 20, 21, 0, 13], np.int32)
    be.kv_write(qkv, kc, vc, slots, H)
    k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
    if kv_dtype == np.int8:
        (kq, ks), (vq, vs) = quantize_rows_ref(k), quantize_rows_ref(v)
        for t, s in enumerate(slots):
            np.testing.assert_array_equal(kc[s // BS, :, s % BS], kq[t])
            np.testing.assert_array_equal(vc[s // BS, :, s % BS], vq[t])
            for h in range(Hkv):
                assert tile_scales(kc, s // BS, h, BS)[s % BS] == ks[t, h]
                assert tile_scales(vc, s // BS, h, BS)[s % BS] == vs[t, h]
        assert vs[3, 0] == 0 and not vq[3, 0].any()
        assert np.abs(kq.astype(np.float32) * ks[..., None] - k).max() <= np.abs(k).max(-1).max() / 254 * 1.001
    else:
        with np.errstate(over="ignore"):                  # NumPy's cast rounds the same way (to nearest even)
            ref_k, ref_v = kv_write_ref(qkv, np.zeros(shape, kv_dtype), np.zeros(shape, kv_dtype), slots, H)
        np.testing.assert_array_equal(kc, ref_k)           # every slot written, nothing else touched
        np.testing.assert_array_equal(vc, ref_v)
    ref_k, ref_v = copy_blocks_ref([kc], [(1, 4), (5, 2)])[0], copy_blocks_ref([vc], [(1, 4), (5, 2)])[0]
    be.copy_blocks([kc], [vc], [(1, 4), (5, 2)])
    np.testing.assert_array_equal(kc, ref_k)               # whole tiles: an int8 cache's scales too
    np.testing.assert_array_equal(vc, ref_v)
    np.testing.assert_array_equal(kc[4], kc[1])
    np.testing.assert_array_equal(vc[2], vc[5])


@pytest.mark.parametrize("q_lens,ctx_lens,H,Hkv,D,BS", [
    ([1], [1], 2, 1, 8, 16),                             # first decode token
    ([5, 1, 1], [5, 40, 17], 4, 2, 16, 16),              # a prefill mixed with decodes
    ([37, 3, 1], [37, 50, 100], 9, 3, 64, 16),           # ragged, not multiples of the tile or block
    ([ATTN_QUERY_TILE * 2 + 3], [ATTN_QUERY_TILE * 2 + 10], 8, 8, 32, 5),   # chunk after a cached prefix
    ([7, 7], [7, 14], 6, 1, 8, 3),                       # multi-query (Hkv = 1)
    ([1, 1, 1], [1, 16, 33], 4, 2, 16, 16),              # pure decode batch (the two-pass decode kernel)
    ([1] * 20, list(range(3, 203, 10)), 9, 3, 64, 16),   # ... 60 work items: its parallel build
    ([130, 1, 40], [150, 60, 40], 9, 3, 64, 16),         # long prefill chunks: 64-query tiles (BLAS path)
])
@pytest.mark.parametrize("blas", [True, False])          # query runs >= 32 take the BLAS kernel if it can
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_paged_attention(q_lens, ctx_lens, H, Hkv, D, BS, blas, kv_dtype, monkeypatch):
    if blas and not be.blas_on_numba_pool:
        pytest.skip("NumPy's BLAS is not the OpenBLAS build cpu_blas can call")
    monkeypatch.setattr(be, "blas_on_numba_pool", blas)
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 7, kv_dtype=kv_dtype)
    T = qkv.shape[0]
    out = np.empty((T, H * D), np.float32)
    scale = D ** -0.5
    be.paged_attention(qkv, kc, vc, tables, ctx, qsl, scale, out, max(q_lens), max(ctx_lens))
    ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, scale, H)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_each_sequence_takes_its_own_attention_kernel(kv_dtype):
    """In a mixed batch (a decode row, a short prefill chunk, a long one), every sequence gets the bits
    it gets alone: its own query count picks its kernel, never the rest of the batch's."""
    q_lens, ctx_lens, H, Hkv, D, BS = [1, 5, 40, 1], [30, 9, 57, 17], 9, 3, 64, 16
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 3, kv_dtype=kv_dtype)
    scale = D ** -0.5
    out = np.empty((qkv.shape[0], H * D), np.float32)
    be.paged_attention(qkv, kc, vc, tables, ctx, qsl, scale, out, max(q_lens), max(ctx_lens))
    for b, n in enumerate(q_lens):
        rows = slice(qsl[b], qsl[b + 1])
        alone = np.empty((n, H * D), np.float32)
        be.paged_attention(np.ascontiguousarray(qkv[rows]), kc, vc, tables[b:b + 1].copy(), ctx[b:b + 1].copy(),
                           np.array([0, n], np.int32), scale, alone, n, ctx_lens[b])
        np.testing.assert_array_equal(out[rows], alone, err_msg=f"sequence {b} ({n} queries)")


@pytest.mark.parametrize("ctx_lens,H,Hkv,D,BS", [
    ([1, 7, 8, 9], 4, 2, 32, 8),                         # contexts around the 4-row groups and blocks
    ([1, 4, 5, 13], 14, 2, 32, 4),                       # 7 query heads per kv head (3 + 3 + 1), BS = 4
    ([11, 12, 25], 10, 2, 64, 12),                       # 5 heads per kv head (3 + 2), BS not a power of 2
    ([3, 16, 17, 100, 255], 9, 3, 64, 16),               # SmolLM2's heads
    ([33, 64, 65], 8, 2, 128, 32),                       # Llama's head size, larger blocks
    ([20] * 18, 6, 6, 32, 8),                            # Hkv = H; 108 work items (parallel build)
])
@pytest.mark.parametrize("kernel", ["avx2", "portable"])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_decode_attention_kernels(ctx_lens, H, Hkv, D, BS, kernel, kv_dtype):
    """Both pure-decode kernels (row b of qkv = sequence b's new token) against the reference; float16
    caches go in as their uint16 bits, as the backend passes them; int8 ones with their row scales
    (the AVX2 kernel applies them to the scores and the weights, not to the rows)."""
    fn = A.decode_attention_avx2_kernel if kernel == "avx2" else A.decode_attention_kernel
    if kernel == "avx2" and not cpu_llvm.available():
        pytest.skip("this CPU has no AVX2 + FMA")
    q_lens = [1] * len(ctx_lens)
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 3, kv_dtype=kv_dtype)
    scale = D ** -0.5
    ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, scale, H)
    if kv_dtype == np.float16:
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    assert A.decode_attention_avx2_fits(kc) == cpu_llvm.available()
    out = np.full((len(ctx_lens), H * D), np.nan, np.float32)
    fn(len(ctx_lens) * Hkv, qkv, kc, vc, tables, ctx, np.float32(scale), H, 0, out)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_decode_attention_avx2_fits_only_its_layouts():
    assert not A.decode_attention_avx2_fits(np.zeros((2, 1, 6, 32), np.float32))    # BS % 4
    assert not A.decode_attention_avx2_fits(np.zeros((2, 1, 16, 48), np.float32))   # D % 32
    assert not A.decode_attention_avx2_fits(np.zeros((2, 1, 16, 64), np.float64))
    assert A.decode_attention_avx2_fits(np.zeros(kv_cache_shape(2, 1, 16, 64, np.int8), np.int8)) == \
        cpu_llvm.available()
    assert not A.decode_attention_avx2_fits(np.zeros(kv_cache_shape(2, 1, 6, 64, np.int8), np.int8))


def test_paged_attention_block_table_layout_does_not_matter():
    """The same sequences through two different physical layouts give the same output."""
    args = ([9, 1], [30, 33], 4, 2, 16, 4)
    outs = []
    for seed in (1, 2):   # same K/V/Q values, different block permutation
        qkv, kc, vc, tables, ctx, qsl = paged_case(*args, shuffle_seed=seed, value_seed=99)
        out = np.empty((qkv.shape[0], 4 * 16), np.float32)
        be.paged_attention(qkv, kc, vc, tables, ctx, qsl, 0.25, out, 9, 33)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_shape_and_dtype_checks():
    with pytest.raises(ValueError, match="shape"):
        be.rmsnorm(rand(2, 8), rand(8), 1e-5, np.empty((3, 8), np.float32))
    with pytest.raises(TypeError, match="int32"):
        be.kv_write(rand(1, 32), np.zeros((1, 1, 4, 8), np.float32), np.zeros((1, 1, 4, 8), np.float32),
                    np.zeros(1, np.int64), 2)
    with pytest.raises(ValueError, match="contiguous"):
        be.rmsnorm(rand(8, 4).T, rand(8), 1e-5, np.empty((4, 8), np.float32))


def test_serial_and_parallel_builds_cache_apart():
    """Numba names disk-cache files after the function (not its compile options): the two builds of a
    kernel must carry different names, or one loads the other's machine code from the cache."""
    from rawinfer.backend.cpu import attention as A
    from rawinfer.backend.cpu import kernels as K
    kernels = [v for mod in (K, A) for v in vars(mod).values() if isinstance(v, K.Kernel)]
    assert len(kernels) >= 8
    names = set()
    for k in kernels:
        names |= {k.serial.py_func.__qualname__, k.parallel.py_func.__qualname__}
    assert len(names) == 2 * len(kernels)


def test_kernel_cache_folder_follows_the_sources_not_the_checkout(tmp_path):
    """Kernels inline code from every module of the CPU package, and a new clone of the same sources
    should not compile again: the cache folder is keyed by all the package's sources, not by where
    they live, and only this package's kernels go there."""
    from rawinfer.backend.cpu import cache as cpu_cache
    a, b = tmp_path / "checkout-a", tmp_path / "checkout-b"
    for d in (a, b):
        d.mkdir()
        (d / "x.py").write_text("X = 1\n")
        (d / "y.py").write_text("Y = 1\n")
    root = str(tmp_path / "cache")
    assert cpu_cache.kernel_dir(root, str(a)) == cpu_cache.kernel_dir(root, str(b))   # same sources, any path
    (b / "y.py").write_text("Y = 2\n")                                                   # one file edited
    assert cpu_cache.kernel_dir(root, str(a)) != cpu_cache.kernel_dir(root, str(b))
    installed = cpu_cache.install(root)
    try:
        assert installed == cpu_cache.kernel_dir(root) and os.path.isdir(installed)
        for k in (K.rmsnorm_kernel.serial, K.rmsnorm_kernel.parallel, A.paged_attention_kernel.parallel):
            assert k._cache._cache_path == installed
        import numpy.linalg
        locator = cpu_cache.locator_classes()[0]
        assert locator.from_function(numpy.linalg.norm, numpy.linalg.__file__) is None   # other code: untouched
        assert cpu_cache.install(root) == installed                                        # idempotent
        for i in range(cpu_cache.KEEP_FOLDERS + 2):                                        # old folders pruned
            os.makedirs(os.path.join(root, "kernels", f"old-{i}"))
        cpu_cache.install(root)
        assert len(os.listdir(os.path.join(root, "kernels"))) == cpu_cache.KEEP_FOLDERS
    finally:
        from rawinfer.config import EngineConfig
        cpu_cache.install(EngineConfig().cache_dir)                                        # back to the suite's


@pytest.mark.parametrize("q_lens,ctx_lens,H,Hkv,D,BS", [
    ([5, 1, 1], [5, 40, 17], 4, 2, 16, 16),
    ([37, 3, 1], [37, 50, 100], 9, 3, 64, 16),
    ([130, 1, 40], [150, 60, 40], 9, 3, 64, 16),
    ([7, 7], [7, 14], 6, 1, 8, 3),
])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16, np.int8])
def test_one_attention_kernel_gives_a_query_the_same_bits_however_many_queries_run(q_lens, ctx_lens, H, Hkv, D,
                                                                                  BS, kv_dtype, monkeypatch):
    """--batch-invariant (one_attention): every query through the decode kernel, so the last k queries of
    a sequence computed alone (after a prefix-cache hit, a chunk boundary, a preemption's recompute) get
    exactly the bits they get inside the whole run; and the values match the reference."""
    monkeypatch.setattr(be, "one_attention", True)
    qkv, kc, vc, tables, ctx, qsl = paged_case(q_lens, ctx_lens, H, Hkv, D, BS, 11, kv_dtype=kv_dtype)
    scale = D ** -0.5
    out = np.empty((qkv.shape[0], H * D), np.float32)
    be.paged_attention(qkv, kc, vc, tables, ctx, qsl, scale, out, max(q_lens), max(ctx_lens))
    ref = paged_attention_ref(qkv, float_cache(kc, BS), float_cache(vc, BS), tables, ctx, qsl, scale, H)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for b, n in enumerate(q_lens):
        for k in sorted({1, min(n, 5), max(1, n - 3)}):
            rows = slice(qsl[b + 1] - k, qsl[b + 1])
            tail = np.empty((k, H * D), np.float32)
            be.paged_attention(np.ascontiguousarray(qkv[rows]), kc, vc, tables[b:b + 1].copy(), ctx[b:b + 1].copy(),
                               np.array([0, k], np.int32), scale, tail, k, ctx_lens[b])
            np.testing.assert_array_equal(out[rows], tail, err_msg=f"sequence {b}: its last {k} of {n} queries")
