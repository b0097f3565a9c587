"""NumPy references of the backend ops (`<op>_ref`, one per op) and the helpers kernel tests compare with.

Each reference is named after the op it checks (rawinfer/backend/base.py: embedding, rmsnorm, add_rmsnorm,
linear, rope, silu_mul, kv_write, paged_attention, copy_blocks, take_rows, argmax, sample), plus the
CPU backend's row quantizer, the int8 products and random weight-only inputs (int8, fp8).  A reference
takes the op's inputs as the test stores them (float32, float16 or bfloat16; already rounded) and
computes in float64, or, where the op is exact, in the storage dtype; it returns its result rather than
writing an output.  None of them calls rawinfer: they are written from each op's definition so that a
kernel bug cannot hide in both.

Tests import them by name (tests/ is on sys.path through tests/conftest.py):

    from reference_ops import rmsnorm_ref, assert_close
    backend.rmsnorm(x, w, 1e-5, out)
    assert_close(out, rmsnorm_ref(x, w, 1e-5), dtype, "rmsnorm")

The CUDA kernel suites (tests/backend/test_cuda_shim.py on the host, test_gpu.py on a device) also
share the inputs and tolerances at the end of this module: DTYPES, rand, assert_close (about two
units in the last place of the storage dtype), cos_sin_table and make_paged_batch.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16


def f64(a):
    return np.asarray(a).astype(np.float64)


# ---- layer ops ------------------------------------------------------------------------------------
def embedding_ref(ids, table, scale=1.0):
    """table [V, C] rows at ids [T], times scale: [T, C] (the table's dtype when scale is 1, else float64)."""
    return table[ids] if scale == 1.0 else f64(table[ids]) * scale


def rmsnorm_ref(x, weight, eps):
    """x [T, C] / sqrt(mean(x^2) + eps) * weight [C], float64."""
    x = f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(weight)


def add_rmsnorm_ref(x, residual, weight, eps):
    """(rmsnorm of the new residual, the new residual): residual + x summed in float32 and stored in
    the residual's dtype, as the op updates it in place."""
    new_residual = (residual.astype(np.float32) + x.astype(np.float32)).astype(residual.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def linear_ref(x, w, bias=None):
    """x [T, K] @ w [N, K].T (+ bias [N]), float64."""
    out = f64(x) @ f64(w).T
    return out if bias is None else out + f64(bias)


def rope_ref(qkv, positions, cos_sin, num_heads, num_kv_heads):
    """qkv [T, (H + 2 Hkv) * D] with the Q and K heads rotated (rotate-half) by the angles of
    cos_sin [P, D] (cos | sin) at positions [T]; V unchanged. float64."""
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


def head_rmsnorm_ref(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads):
    """qkv [T, (H + 2Hkv) D] with every q head RMS-normalised with q_weight [D] and every k head with
    k_weight [D] (v heads unchanged), float64."""
    d = q_weight.shape[0]
    out = f64(qkv).copy()
    for h in range(num_heads + num_kv_heads):
        w = f64(q_weight if h < num_heads else k_weight)
        x = out[:, h * d:(h + 1) * d]
        out[:, h * d:(h + 1) * d] = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    return out


def gelu_tanh_mul_ref(gate_up):
    """gate_up [T, 2F] (gate | up) -> gelu(gate) * up [T, F] with the tanh approximation, float64."""
    f = gate_up.shape[1] // 2
    g, u = f64(gate_up[:, :f]), f64(gate_up[:, f:])
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * u


def silu_mul_ref(gate_up):
    """gate_up [T, 2F] (gate | up) -> silu(gate) * up [T, F], float64."""
    f = gate_up.shape[1] // 2
    g, u = f64(gate_up[:, :f]), f64(gate_up[:, f:])
    return g / (1.0 + np.exp(-g)) * u


# ---- the paged KV cache ---------------------------------------------------------------------------
def kv_write_ref(qkv, k_cache, v_cache, slot_mapping, num_heads):
    """Copies of the float caches [NB, Hkv, BS, D] with token t's K and V heads of qkv stored at slot
    slot_mapping[t] (block slot // BS, row slot % BS), cast to the cache dtype."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    _, hkv, bs, d = k_cache.shape
    for t, slot in enumerate(slot_mapping):
        k = qkv[t, num_heads * d:(num_heads + hkv) * d].reshape(hkv, d)
        v = qkv[t, (num_heads + hkv) * d:].reshape(hkv, d)
        k_cache[slot // bs, :, slot % bs] = k
        v_cache[slot // bs, :, slot % bs] = v
    return k_cache, v_cache


def paged_attention_ref(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, num_heads,
                        window=0):
    """Causal grouped-query attention [T, H * D], float64. Sequence b owns the query rows
    query_start_loc[b]:query_start_loc[b + 1] of qkv, the last of its context_lens[b] positions; its
    K/V rows are read from the float caches [NB, Hkv, BS, D] through block_tables [B, max blocks].
    window W > 0: a query at position p sees the keys at p - W + 1 .. p only."""
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
        if window:
            visible &= pos[None, :] > q_pos[:, None] - window
        for h in range(num_heads):
            q = f64(qkv[q0:q1, h * d:(h + 1) * d])
            s = np.where(visible, q @ keys[:, h // group].T * scale, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[q0:q1, h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ values[:, h // group]
    return out


def copy_blocks_ref(caches, pairs):
    """Copies of the caches with block dst set to block src for each (src, dst) pair."""
    caches = [c.copy() for c in caches]
    for c in caches:
        for src, dst in pairs:
            c[dst] = c[src]
    return caches


# ---- logits --------------------------------------------------------------------------------------
def take_rows_ref(x, indices):
    return x[indices]


def argmax_ref(logits):
    """Each row's first index of its largest value (ties: the lowest index)."""
    return np.argmax(logits.astype(np.float32), axis=-1)


def _order_key(x):
    """float32 -> uint32 whose unsigned order is the floats' order (the sampler compares these)."""
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
        keys = _order_key(x)
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


# ---- quantized products (CPU backend) ------------------------------------------------------------
def quantize_rows_ref(x, qmax=127):
    """x [..., K] float32 -> (q int64 [..., K], scale float32 [...]): per-row symmetric quantization
    to +-qmax as the CPU kernels do it (the int8 KV cache's rows at qmax 127, the integer GEMM's
    activations): x * (qmax / max|row|) in float32, rounded half to even; scale max|row| / qmax; an
    all-zero row gives zeros and scale 0."""
    amax = np.abs(x).max(-1).astype(np.float32)
    safe = np.where(amax > 0, amax, np.float32(1))
    q = np.clip(np.rint(x * (np.float32(qmax) / safe)[..., None]), -qmax, qmax)
    q[amax == 0] = 0
    return q.astype(np.int64), (amax / np.float32(qmax)).astype(np.float32)


def int8_linear_ref(x, q, scale, bias=None):
    """linear_ref with an int8 weight: x [T, K] @ q [N, K].T times the rows' scales [N] (+ bias),
    float64."""
    out = f64(x) @ f64(q).T * f64(scale)
    return out if bias is None else out + f64(bias)


def random_weight_only(rng, n, k, fmt):
    """Random weight-only matrix parts (q [N, K], scale [N] float32) of format "int8" (codes in [-127, 127])
    or "fp8" (e4m3fn bytes as uint8: every exponent, both signs, subnormals; the NaN codes replaced by 448's)."""
    if fmt == "int8":
        return rng.integers(-127, 128, (n, k)).astype(np.int8), rng.uniform(0.002, 0.03, n).astype(np.float32)
    q = rng.integers(0, 256, (n, k)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] -= 1
    return q, (rng.uniform(0.5, 2.0, n) / 448).astype(np.float32)


def weight_only_values(q):
    """float32 [N, K]: the values of a weight-only matrix's codes before the row scales (int8 as integers,
    uint8 or float8_e4m3fn as e4m3fn, decoded by ml_dtypes)."""
    from ml_dtypes import float8_e4m3fn
    return q.astype(np.float32) if q.dtype == np.int8 else q.view(float8_e4m3fn).astype(np.float32)


def int8_matmul_ref(x, q, scale, qmax):
    """The integer GEMM's exact result: x's rows quantized to +-qmax (quantize_rows_ref), their
    integer products with q [N, K] int8, times both scales, float64 [T, N]."""
    xq, sx = quantize_rows_ref(x, qmax)
    return (xq @ q.astype(np.int64).T) * f64(sx)[:, None] * f64(scale)[None, :]


# ---- inputs and tolerances the CUDA kernel suites share --------------------------------------------
DTYPES = [np.float32, np.float16, bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# Two units in the last place (relative) of each storage dtype, plus float32 noise for float32.
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2 * 2.0**-10, np.dtype(bfloat16): 2 * 2.0**-7}


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def assert_close(got, ref, dtype, what=""):
    got, ref = f64(got), f64(ref)
    tol = TOL[np.dtype(dtype)]
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    assert err.max() <= tol, f"{what}: max relative error {err.max():.3g} > {tol:.3g}"


def cos_sin_table(positions, head_dim, theta=10000.0):
    """[positions, D] float32: cos | sin of position * theta^(-2i / D), i < D / 2."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(positions)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def make_paged_batch(rng, dtype, q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, spare_blocks=3):
    """Random caches and a batch whose block tables are a shuffled assignment of physical blocks:
    (qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc), paged_attention's inputs."""
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
