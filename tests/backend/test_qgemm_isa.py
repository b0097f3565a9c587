"""The integer GEMM's instruction-set paths (rawinfer/backend/cpu/isa.py, vnni.py, qgemm.py): which path a
CPU's features select, that the AVX-512 VNNI path gives the AVX2 path's bits, and that a build is only
ever taken on a CPU with the features it was compiled for. The reference tests of every path are in
test_cpu_qgemm.py."""

from __future__ import annotations

import numpy as np
import pytest

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu import qgemm as Q
from rawinfer.quant import quantize_int8

RNG = np.random.default_rng(23)
AVX2 = {"sse4.2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
needs_both = pytest.mark.skipif(not (isa.supports(isa.AVX2) and isa.supports(isa.AVX512_VNNI)),
                                reason="this CPU has no AVX-512 VNNI (only one path to compare)")


@pytest.mark.parametrize("features,want", [
    (set(), isa.PORTABLE),                                  # not x86-64, or no feature query
    ({"sse4.2", "avx"}, isa.PORTABLE),                      # no AVX2
    ({"avx2"}, isa.PORTABLE),                               # AVX2 without FMA
    (AVX2, isa.AVX2),
    (AVX512, isa.AVX2),                                     # AVX-512 without VNNI (Skylake-X)
    (AVX512 | {"avxvnni"}, isa.AVX2),                       # VEX VNNI only (256-bit): not this path
    (AVX512 | {"avx512vnni"}, isa.AVX512_VNNI),             # Cascade Lake, Ice Lake, Zen 4/5
    ((AVX512 - {"avx512bw"}) | {"avx512vnni"}, isa.AVX2),   # vpmovsxbw on zmm needs BW
])
def test_select_follows_the_features(features, want):
    assert isa.select(features) == want
    assert Q.path_for(features) == want
    assert all(isa.supports(p, features) == (p == isa.PORTABLE or p == want or (p, want) == (isa.AVX2, isa.AVX512_VNNI))
               for p in (isa.PORTABLE, isa.AVX2, isa.AVX512_VNNI))


def test_features_are_numba_target_features(monkeypatch):
    """NUMBA_CPU_FEATURES (a build for other machines) decides, not the host: code is never built with
    instructions its target lacks."""
    from numba.core import config
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f,-avx512vnni")
    assert isa.target_features() == {"avx2", "fma"}
    assert isa.select(isa.target_features()) == isa.AVX2
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert isa.select(isa.target_features()) == isa.PORTABLE
    monkeypatch.setattr(config, "CPU_FEATURES", None)            # the host's, with NUMBA_ENABLE_AVX=0
    monkeypatch.setattr(config, "ENABLE_AVX", False)
    assert not any(f.startswith("avx") for f in isa.target_features())


def test_the_cache_key_carries_the_features_the_paths_use():
    """Numba keys every cached build by its code generator's target (CPU name, feature string); the
    paths are chosen from the same features, so a build with AVX-512 instructions is never loaded
    where that key differs (a machine without them). Each path is its own compiled function."""
    from numba.core.registry import cpu_target
    triple, cpu, features = cpu_target.target_context.codegen().magic_tuple()
    assert isa.parse_features(features) == set(isa.FEATURES)
    assert Q.PATH == Q.path_for(isa.FEATURES)
    assert (Q.int8_matmul, Q.int8_matmul_silu) == Q.PATHS[Q.PATH]
    names = {f.py_func.__name__ for fs in Q.PATHS.values() for f in fs}
    assert names == {"int8_matmul_avx2", "int8_matmul_silu_avx2", "int8_matmul_avx512", "int8_matmul_silu_avx512"}
    assert Q.PATHS[isa.PORTABLE] == Q.PATHS[isa.AVX2]     # the AVX2 drivers, compiled for the portable target


@needs_both
@pytest.mark.parametrize("M,K,N", [(1, 576, 960), (2, 30, 16), (5, 1536, 576), (6, 576, 48), (11, 64, 80),
                                   (64, 576, 1536), (127, 100, 112)])
def test_avx512_gives_the_avx2_bits(M, K, N):
    """Exact int32 sums and the same float32 epilogue: the two paths agree bit for bit, the silu
    epilogue too, on every last-panel size and on odd block counts."""
    x = RNG.standard_normal((M, K)).astype(np.float32) * RNG.uniform(0.1, 10, (M, 1)).astype(np.float32)
    q, sw = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    wp = Q.pack_weights(q)
    nx, ns = Q.x_buffer_sizes(M, K)
    got = {}
    for path, (matmul, matmul_silu) in Q.PATHS.items():
        out, act = np.full((M, N), np.nan, np.float32), np.full((M, N // 2), np.nan, np.float32)
        matmul(x, wp, sw, out, np.empty(nx, np.int16), np.empty(ns, np.float32))
        if N % 32 == 0:
            matmul_silu(x, wp, sw, act, np.empty(nx, np.int16), np.empty(ns, np.float32))
        got[path] = (out, act)
    for a, b in zip(got[isa.AVX2], got[isa.AVX512_VNNI]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.skipif(not isa.supports(p), reason=f"this CPU has no {p}"))
                                  for p in (isa.AVX2, isa.AVX512_VNNI)])
def test_a_row_gets_the_same_bits_in_any_batch(path):
    """Batch invariance, which the engine relies on: a row's result does not depend on how many rows
    share the call or where it sits in its 6-row panel (tile builds of 1, 2, 4 and 6 rows)."""
    K, N = 576, 96
    q, sw = quantize_int8(RNG.standard_normal((N, K)).astype(np.float32))
    wp = Q.pack_weights(q)
    rows = RNG.standard_normal((40, K)).astype(np.float32)
    matmul, matmul_silu = Q.PATHS[path]

    def run(x, silu=False):
        nx, ns = Q.x_buffer_sizes(*x.shape)
        out = np.empty((x.shape[0], N // 2 if silu else N), np.float32)
        (matmul_silu if silu else matmul)(x, wp, sw, out, np.empty(nx, np.int16), np.empty(ns, np.float32))
        return out

    for silu in (False, True):
        alone = np.concatenate([run(rows[i:i + 1], silu) for i in range(len(rows))])
        for M in (2, 3, 5, 7, 13, 40):
            np.testing.assert_array_equal(np.concatenate([run(rows[i:i + M], silu) for i in range(0, 40, M)]),
                                          alone)
