"""The fused CUDA kernels (cuda/fused_rope_kv_write.cu, rmsnorm.cu's norm_add_rmsnorm), on the CPU under
tests/cuda_shim, against the NumPy references of the ops they fuse (tests/reference_ops.py) and against
those ops' own kernels run one after another, which they must equal bit for bit.

Shapes are ragged (head dims and hidden sizes that are not multiples of the warp or of the four heads a
block takes), and cover every family's options: with and without the q/k norm (Qwen3, Gemma 3), norm
weights around 1 as Gemma's stored 1 + w are, the default, a local and a llama3-scaled RoPE table,
sliding-window models' slots (any slot of the pool, the padding block's included), and the residual
stream in float32 or in the storage dtype.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rawinfer.backend.base import Backend
from rawinfer.backend.cuda import kernel_specs as ks

harness = pytest.importorskip("cuda_shim.harness")

if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from ml_dtypes import bfloat16  # noqa: E402

from rawinfer.backend.cuda.backend import CUDABackend  # noqa: E402
from rawinfer.config import RopeConfig  # noqa: E402
from reference_ops import (DTYPE_IDS, DTYPES, add_rmsnorm_ref, assert_close, cos_sin_table, f64,  # noqa: E402
                           head_rmsnorm_ref, kv_write_ref, rand, rmsnorm_ref, rope_ref)

SOURCES = ["fused_rope_kv_write.cu", "rmsnorm.cu", "rope.cu", "head_rmsnorm.cu", "kv_write.cu"]


@pytest.fixture(scope="module")
def backend():
    return CUDABackend(launcher=harness.ShimLauncher(harness.build_all(SOURCES)))


def llama3_table(positions: int, head_dim: int) -> np.ndarray:
    """The llama3-scaled RoPE table as the engine builds it (rawinfer/exec/weights.py)."""
    from rawinfer.exec.weights import rope_cos_sin
    rope = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)
    return rope_cos_sin(SimpleNamespace(head_dim=head_dim), rope, positions)   # the one field it reads


def fused_rope_kv_write_ref(qkv, positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads, q_norm, k_norm, eps):
    """(qkv, k_cache, v_cache) after the three ops: each stored in the storage dtype, as the op stores it."""
    dtype = qkv.dtype
    if q_norm is not None:
        qkv = head_rmsnorm_ref(qkv, q_norm, k_norm, eps, heads, kv_heads).astype(np.float32).astype(dtype)
    qkv = rope_ref(qkv, positions, cos_sin, heads, kv_heads).astype(np.float32).astype(dtype)
    k_cache, v_cache = kv_write_ref(qkv, k_cache, v_cache, slots, heads)
    return qkv, k_cache, v_cache


CASES = [  # (tokens, H, Hkv, D, table)
    (3, 4, 1, 256, "local"),       # Gemma 3 270M's heads, its sliding layers' theta
    (1, 2, 2, 16, "default"),      # one token: one block of 4 warps for all 6 heads
    (17, 6, 2, 64, "llama3"),      # 10 heads: three blocks, the last with 2 idle warps
    (5, 5, 1, 128, "default"),     # Qwen-like GQA, 7 heads
    (2, 1, 1, 40, "default"),      # D not a multiple of the warp
    (4, 3, 3, 6, "llama3"),        # D / 2 = 3: most lanes idle
    (9, 32, 8, 128, "llama3"),     # Llama-3-8B's heads
]


def make_table(kind: str, positions: int, head_dim: int) -> np.ndarray:
    if kind == "llama3":
        return llama3_table(positions, head_dim)
    return cos_sin_table(positions, head_dim, theta=10000.0 if kind == "local" else 1000000.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("n,heads,kv_heads,head_dim,table", CASES)
def test_fused_rope_kv_write(backend, dtype, qk_norm, n, heads, kv_heads, head_dim, table):
    rng = np.random.default_rng(n * 31 + head_dim)
    nb, bs = 5, 4
    qkv = rand(rng, (n, (heads + 2 * kv_heads) * head_dim), dtype, 3.0)
    positions = rng.integers(0, 60, n).astype(np.int32)
    cos_sin = make_table(table, 60, head_dim)
    k_cache, v_cache = rand(rng, (nb, kv_heads, bs, head_dim), dtype), rand(rng, (nb, kv_heads, bs, head_dim), dtype)
    slots = rng.permutation(nb * bs)[:n].astype(np.int32)
    # Gemma stores its norms as 1 + w: multipliers around 1
    norms = (1.0 + rand(rng, (head_dim,), dtype, 0.3), 1.0 + rand(rng, (head_dim,), dtype, 0.3)) if qk_norm else (None, None)
    norms = tuple(None if w is None else w.astype(dtype) for w in norms)
    ref_qkv, ref_k, ref_v = fused_rope_kv_write_ref(qkv, positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads,
                                                    *norms, 1e-6)
    # the ops one after another (their own kernels), on copies
    sep = [a.copy() for a in (qkv, k_cache, v_cache)]
    Backend.fused_rope_kv_write(backend, sep[0], positions, cos_sin, sep[1], sep[2], slots, heads, kv_heads, *norms, 1e-6)
    backend.fused_rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads, *norms, 1e-6)
    for got, want in zip((qkv, k_cache, v_cache), sep):
        np.testing.assert_array_equal(f64(got), f64(want))
    assert_close(qkv, ref_qkv, dtype, "fused_rope_kv_write qkv")
    # K as stored matches the reference's to its rounding; V is copied exactly
    assert_close(k_cache, ref_k, dtype, "fused_rope_kv_write k_cache")
    np.testing.assert_array_equal(f64(v_cache), f64(ref_v))


def test_fused_rope_kv_write_checks_its_arguments(backend):
    qkv = np.zeros((2, 6 * 16), np.float32)
    pos, slots = np.zeros(2, np.int32), np.array([0, 1], np.int32)
    cos_sin = cos_sin_table(8, 16)
    k, v = np.zeros((2, 1, 4, 16), np.float32), np.zeros((2, 1, 4, 16), np.float32)
    w = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        backend.fused_rope_kv_write(qkv, pos, cos_sin, k, v, slots, 4, 1, w, None, 1e-6)
    wrong = np.zeros((2, 2, 4, 12), np.float32)          # the same row width as 2 KV heads of 12
    with pytest.raises(ValueError, match="fused_rope_kv_write: k_cache"):
        backend.fused_rope_kv_write(qkv, pos, cos_sin, wrong, wrong.copy(), slots, 4, 1)
    with pytest.raises(ValueError, match="head_rmsnorm: k_weight"):
        backend.fused_rope_kv_write(qkv, pos, cos_sin, k, v, slots, 4, 1, w, np.ones(8, np.float32), 1e-6)
    with pytest.raises(ks.KernelArgumentError, match="dtype"):
        backend.fused_rope_kv_write(qkv, pos, cos_sin, k, v, slots, 4, 1, w.astype(np.float16),
                                    w.astype(np.float16), 1e-6)
    with pytest.raises(ValueError, match="rope: positions"):
        backend.fused_rope_kv_write(qkv, pos[:1], cos_sin, k, v, slots, 4, 1)


RESIDUAL_CASES = [(np.float32, np.float32), (np.float16, np.float16), (bfloat16, bfloat16),
                  (np.float16, np.float32), (bfloat16, np.float32)]
RESIDUAL_IDS = ["f32", "f16", "bf16", "f16-res32", "bf16-res32"]


@pytest.mark.parametrize("dtype,res_dtype", RESIDUAL_CASES, ids=RESIDUAL_IDS)
@pytest.mark.parametrize("shape", [(4, 96), (3, 300), (1, 1000), (7, 640)])
def test_norm_add_rmsnorm(backend, dtype, res_dtype, shape):
    rng = np.random.default_rng(shape[1])
    x, residual = rand(rng, shape, dtype, 4.0), rand(rng, shape, res_dtype, 2.0)
    x_weight = (1.0 + rand(rng, shape[1:], dtype, 0.3)).astype(dtype)     # Gemma's 1 + w
    weight = (1.0 + rand(rng, shape[1:], dtype, 0.3)).astype(dtype)
    normed = rmsnorm_ref(x, x_weight, 1e-6).astype(np.float32).astype(dtype)   # stored in T by the first op
    ref_out, ref_residual = add_rmsnorm_ref(normed, residual, weight, 1e-6)

    sep_x, sep_res, sep_out = x.copy(), residual.copy(), np.zeros(shape, dtype)
    Backend.norm_add_rmsnorm(backend, sep_x, x_weight, sep_res, weight, 1e-6, sep_out)
    out, x_before = np.zeros(shape, dtype), x.copy()
    backend.norm_add_rmsnorm(x, x_weight, residual, weight, 1e-6, out)
    np.testing.assert_array_equal(f64(x), f64(x_before))                   # the fused kernel only reads x
    np.testing.assert_array_equal(f64(residual), f64(sep_res))             # the two ops' bits
    np.testing.assert_array_equal(f64(out), f64(sep_out))
    # the reference's residual can differ from the kernel's by the rounding of the normed x to T
    assert_close(residual, ref_residual, res_dtype if res_dtype is not np.float32 else dtype, "residual")
    assert_close(out, ref_out, dtype, "norm_add_rmsnorm")


def test_norm_add_rmsnorm_checks_shapes(backend):
    x, res, w = np.zeros((2, 32), np.float32), np.zeros((2, 32), np.float32), np.ones(32, np.float32)
    with pytest.raises(ValueError, match="norm_add_rmsnorm: x_weight"):
        backend.norm_add_rmsnorm(x, np.ones(16, np.float32), res, w, 1e-6, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="norm_add_rmsnorm"):
        backend.norm_add_rmsnorm(x, w, res, w, 1e-6, np.zeros((3, 32), np.float32))
