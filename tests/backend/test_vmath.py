"""The LLVM IR elementwise math (rawinfer/backend/cpu/vmath.py) against NumPy: exp16 over the float32
range it serves, including the clamps and 0 / -inf inputs, and silu_tile over every row count of a
tile, with a row stride other than 16."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu.llvm import F32, _ptr, _vload, _vstore, i64, keep_alive
from rawinfer.backend.cpu.vmath import V16F32, exp16, silu_tile

RNG = np.random.default_rng(5)


@intrinsic
def _exp_lanes(typingctx, xp, op):
    # op[0:16] = exp16(xp[0:16])
    def codegen(context, builder, signature, args):
        xb, ob = _ptr(builder, args[0], F32), _ptr(builder, args[1], F32)
        _vstore(builder, exp16(builder, _vload(builder, xb, i64(0), V16F32)), ob, i64(0))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@nb.njit
def exp_all(x, out):
    for i in range(0, x.shape[0], 16):
        _exp_lanes(np.int64(x[i:].ctypes.data), np.int64(out[i:].ctypes.data))
    keep_alive(x)
    keep_alive(out)


@nb.njit
def silu_all(g, u, out, rows):
    silu_tile(np.int64(g.ctypes.data), np.int64(u.ctypes.data), np.int64(out.ctypes.data), out.shape[1], rows)
    keep_alive(g)
    keep_alive(u)
    keep_alive(out)


def test_exp16_matches_numpy():
    x = np.concatenate([np.linspace(-87, 88, 16 * 400, dtype=np.float32), RNG.uniform(-20, 20, 16 * 40),
                        np.float32([0.0, -0.0, 1.0, -1.0, 100.0, -100.0, -np.inf, np.inf] * 2)]).astype(np.float32)
    out = np.empty_like(x)
    exp_all(x, out)
    want = np.exp(np.clip(x.astype(np.float64), -87, 88))
    assert np.all(np.abs(out - want) <= 1e-6 * want)
    assert out[x == 0].tolist() == [1.0] * int((x == 0).sum())
    assert np.all(out[x == -np.inf] > 0) and np.all(out[x == -np.inf] < 2e-38)     # exp(-87): 0 in any sum


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6])
def test_silu_tile_matches_numpy(rows):
    g = (RNG.standard_normal((6, 16)) * 6).astype(np.float32)
    g[0, :4] = [0.0, -120.0, 120.0, -0.5]
    u = RNG.standard_normal((6, 16)).astype(np.float32)
    out = np.full((6, 40), np.nan, np.float32)          # a row stride of 40 floats; columns 16+ untouched
    silu_all(g, u, out, rows)
    g64 = g.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u
    np.testing.assert_allclose(out[:rows, :16], want[:rows], rtol=2e-6, atol=1e-30)
    assert np.isnan(out[rows:]).all() and np.isnan(out[:, 16:]).all()
