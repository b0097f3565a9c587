"""NumPy references <op>_ref for every CUDA kernel, and the inputs both kernel test suites share.

Used by tests/test_cuda_shim.py (kernels on the host under the shim) and tests/test_gpu.py (the same
kernels on a GPU).  References compute in float64 from the stored (already rounded) inputs.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

DTYPES = [np.float32, np.float16, bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# Two units in the last place (relative) of each storage dtype, plus float32 noise for float32.
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2 * 2.0**-10, np.dtype(bfloat16): 2 * 2.0**-7}


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def f64(a):
    return np.asarray(a).astype(np.float64)


def assert_close(got, ref, dtype, what=""):
    got, ref = f64(got), f64(ref)
    tol = TOL[np.dtype(dtype)]
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    assert err.max() <= tol, f"{what}: max relative error {err.max():.3g} > {tol:.3g}"


# ---- references -----------------------------------------------------------------------------------
def embedding_ref(ids, table):
    return table[ids]


def rmsnorm_ref(x, weight, eps):
    x = f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(weight)


def add_rmsnorm_ref(x, residual, weight, eps):
    new_residual = (residual.astype(np.float32) + x.astype(np.float32)).astype(residual.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def rope_ref(qkv, positions, cos_sin, num_heads, num_kv_heads):
    out = f64(qkv).copy()
    d = cos_sin.shape[1]
    half = d // 2
    cos, sin = f64(cos_sin[positions, :half]), f64(cos_sin[positions, half:])
    for h in range(num_heads + num_kv_heads):
        x1 = out[:, h * d:h * d + half].copy()
        x2 = out[:, h * d + half:(h + 1) * d].copy()
        out[:, h * d:h * d + half] = x1 * cos - x2 * sin
        out[:, h * d + half:(h + 1) * d] = x2 * cos + x1 * sin
    return out


def silu_mul_ref(gate_up):
    f = gate_up.shape[1] // 2
    g, u = f64(gate_up[:, :f]), f64(gate_up[:, f:])
    return g / (1.0 + np.exp(-g)) * u


def kv_write_ref(qkv, k_cache, v_cache, slot_mapping, num_heads):
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    _, hkv, bs, d = k_cache.shape
    for t, slot in enumerate(slot_mapping):
        k = qkv[t, num_heads * d:(num_heads + hkv) * d].reshape(hkv, d)
        v = qkv[t, (num_heads + hkv) * d:].reshape(hkv, d)
        k_cache[slot // bs, :, slot % bs] = k
        v_cache[slot // bs, :, slot % bs] = v
    return k_cache, v_cache


def paged_attention_ref(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, num_heads):
    _, hkv, bs, d = k_cache.shape
    group = num_heads // hkv
    out = np.zeros((qkv.shape[0], num_heads * d))
    for b, ctx in enumerate(context_lens):
        q0, q1 = query_start_loc[b], query_start_loc[b + 1]
        pos = np.arange(ctx)
        blocks, rows = block_tables[b, pos // bs], pos % bs
        keys = f64(k_cache[blocks, :, rows, :])      # [ctx, Hkv, D]
        values = f64(v_cache[blocks, :, rows, :])
        q_pos = ctx - (q1 - q0) + np.arange(q1 - q0)
        visible = pos[None, :] <= q_pos[:, None]
        for h in range(num_heads):
            q = f64(qkv[q0:q1, h * d:(h + 1) * d])
            s = np.where(visible, q @ keys[:, h // group].T * scale, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[q0:q1, h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ values[:, h // group]
    return out


def copy_blocks_ref(caches, pairs):
    caches = [c.copy() for c in caches]
    for c in caches:
        for src, dst in pairs:
            c[dst] = c[src]
    return caches


def take_rows_ref(x, indices):
    return x[indices]


def argmax_ref(logits):
    return np.argmax(logits.astype(np.float32), axis=-1)


def order_key(x):
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def sample_ref(logits, temperature, top_k, top_p, min_p, uniform):
    """(token ids, ambiguous): the rule of cuda/sampling.cu (top-k, then top-p over the top-k set,
    then min-p, then the inverse CDF in index order) in float64; a row is ambiguous when a threshold
    lies within float32 rounding of a decision (either answer would be right)."""
    ids, ambiguous = [], []
    for row, t, k, tp, mp, u in zip(logits, temperature, top_k, top_p, min_p, uniform):
        row = row.astype(np.float32)
        if t == 0:
            ids.append(int(np.argmax(row)))
            ambiguous.append(False)
            continue
        x = (row / np.float32(t)).astype(np.float32)
        keys = order_key(x)
        e = np.exp(f64((x - x.max()).astype(np.float32)))
        keep = np.ones(len(row), bool)
        if 0 < k < len(row):
            keep &= keys >= np.sort(keys)[::-1][k - 1]
        unsure = False
        if tp < 1:
            target = tp * e[keep].sum()
            kept_keys = np.unique(keys[keep])[::-1]
            mass = np.array([e[keep & (keys >= kk)].sum() for kk in kept_keys])
            cut = int(np.argmax(mass >= target))
            unsure |= bool(np.any(np.abs(mass - target) <= 1e-5 * target))
            keep &= keys >= kept_keys[cut]
        keep &= e >= mp
        unsure |= bool(mp > 0 and np.any(np.abs(e - mp) <= 1e-6))
        w = np.where(keep, e, 0.0)
        cdf = np.cumsum(w)
        goal = u * cdf[-1]
        ids.append(int(np.searchsorted(cdf, goal, side="right")))
        unsure |= bool(np.any(np.abs(cdf[w > 0] - goal) <= 1e-5 * cdf[-1]))
        ambiguous.append(unsure)
    return np.array(ids), np.array(ambiguous)


def cos_sin_table(positions, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(positions)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, spare_blocks=3):
    """Random caches and a batch whose block tables are a shuffled assignment of physical blocks."""
    per_seq = [-(-c // block_size) for c in ctx_lens]
    nb = sum(per_seq) + spare_blocks
    mb = max(per_seq) + 1
    order = rng.permutation(nb)
    block_tables = np.zeros((len(ctx_lens), mb), np.int32)
    used = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = order[used:used + n]
        block_tables[b, n:] = order[rng.integers(0, nb, mb - n)]  # junk past the end must be ignored
        used += n
    k_cache = rand(rng, (nb, kv_heads, block_size, head_dim), dtype)
    v_cache = rand(rng, (nb, kv_heads, block_size, head_dim), dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qkv = rand(rng, (int(query_start_loc[-1]), (heads + 2 * kv_heads) * head_dim), dtype)
    return qkv, k_cache, v_cache, block_tables, np.array(ctx_lens, np.int32), query_start_loc
