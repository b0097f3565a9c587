"""The shape contract of every op of the interface (backend/base.py), checked once for both backends.

Each function takes an op's array arguments, raises ValueError naming the op, the argument, the shape
it has and the shape it must have, and returns the sizes the op needs (shape letters of base.py).
Only shapes are checked here: dtypes and memory layout are each backend's own business (the CPU
kernels take float32 views, the CUDA launcher checks every argument against its kernel's signature).
"""

from __future__ import annotations

from typing import Any


def shape_error(op: str, name: str, got: Any, want: str) -> ValueError:
    return ValueError(f"{op}: {name} has shape {tuple(got)} but must be {want}")


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in a.shape)


def norm(op: str, x: Any, weight: Any, out: Any, residual: Any = None) -> tuple[int, int]:
    """rmsnorm / add_rmsnorm: x[T, C], weight[C], out[T, C] (and residual[T, C]) -> (T, C)."""
    if len(x.shape) != 2:
        raise shape_error(op, "x", x.shape, "(T, C)")
    T, C = _shape(x)
    if _shape(weight) != (C,):
        raise shape_error(op, "weight", weight.shape, f"(C,) = ({C},)")
    if residual is not None and _shape(residual) != (T, C):
        raise shape_error(op, "residual", residual.shape, f"like x, {(T, C)}")
    if _shape(out) != (T, C):
        raise shape_error(op, "out", out.shape, f"like x, {(T, C)}")
    return T, C


def linear(x: Any, w_shape: tuple[int, int], out: Any, bias: Any = None) -> tuple[int, int, int]:
    """out[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]) -> (T, K, N). w_shape: the matrix's logical shape
    (a quantized weight's too)."""
    if len(x.shape) != 2:
        raise shape_error("linear", "x", x.shape, "(T, K)")
    T, K = _shape(x)
    N, K_w = w_shape
    if K_w != K:
        raise shape_error("linear", "w", w_shape, f"(N, K) with K = {K} (x is {(T, K)})")
    if _shape(out) != (T, N):
        raise shape_error("linear", "out", out.shape, f"(T, N) = ({T}, {N})")
    if bias is not None and _shape(bias) != (N,):
        raise shape_error("linear", "bias", bias.shape, f"(N,) = ({N},)")
    return T, K, N


def linear_silu_mul(x: Any, w_shape: tuple[int, int], out: Any) -> tuple[int, int, int]:
    """out[T, F] = silu(x @ Wg^T) * (x @ Wu^T), w = [Wg; Wu] of shape [2F, K] -> (T, K, F)."""
    if len(x.shape) != 2:
        raise shape_error("linear_silu_mul", "x", x.shape, "(T, K)")
    T, K = _shape(x)
    N, K_w = w_shape
    if K_w != K or N % 2:
        raise shape_error("linear_silu_mul", "w", w_shape, f"(2F, K) with K = {K} (x is {(T, K)})")
    if _shape(out) != (T, N // 2):
        raise shape_error("linear_silu_mul", "out", out.shape, f"(T, F) = ({T}, {N // 2})")
    return T, K, N // 2


def silu_mul(gate_up: Any, out: Any, op: str = "silu_mul") -> tuple[int, int]:
    """out[T, F] = act(gate_up[:, :F]) * gate_up[:, F:] (silu_mul, gelu_tanh_mul) -> (T, F)."""
    if len(gate_up.shape) != 2 or gate_up.shape[1] % 2:
        raise shape_error(op, "gate_up", gate_up.shape, "(T, 2F)")
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    if _shape(out) != (T, F):
        raise shape_error(op, "out", out.shape, f"(T, F) = ({T}, {F}) for gate_up {_shape(gate_up)}")
    return T, F


def rope(qkv: Any, positions: Any, cos_sin: Any, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """qkv[T, (H + 2Hkv) * D] rotated at positions[T] with cos_sin[P, D] -> (T, D)."""
    heads = num_heads + 2 * num_kv_heads
    if len(qkv.shape) != 2 or qkv.shape[1] % heads or (qkv.shape[1] // heads) % 2:
        raise shape_error("rope", "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) with H + 2 Hkv = {heads}, D even")
    T, D = qkv.shape[0], qkv.shape[1] // heads
    if _shape(positions) != (T,):
        raise shape_error("rope", "positions", positions.shape, f"(T,) = ({T},)")
    if len(cos_sin.shape) != 2 or cos_sin.shape[1] != D:
        raise shape_error("rope", "cos_sin", cos_sin.shape, f"(P, D) with D = {D}")
    return T, D


def head_rmsnorm(qkv: Any, q_weight: Any, k_weight: Any, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """qkv[T, (H + 2Hkv) * D] with q_weight[D], k_weight[D] -> (T, D)."""
    D = q_weight.shape[0] if len(q_weight.shape) == 1 else 0
    if D == 0 or _shape(k_weight) != (D,):
        raise shape_error("head_rmsnorm", "k_weight", k_weight.shape, f"like q_weight, ({D},)")
    if len(qkv.shape) != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise shape_error("head_rmsnorm", "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) = (T, {(num_heads + 2 * num_kv_heads) * D})")
    return qkv.shape[0], D


def caches(op: str, k_cache: Any, v_cache: Any) -> tuple[int, int, int, int]:
    """One layer's K and V caches, alike: (NB, Hkv, rows, D) (rows = BS, or more for the CPU's int8
    cache, whose tiles end in their rows' scales)."""
    if len(k_cache.shape) != 4:
        raise shape_error(op, "k_cache", k_cache.shape, "(NB, Hkv, BS, D)")
    if _shape(v_cache) != _shape(k_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: v_cache {_shape(v_cache)} {v_cache.dtype} must match k_cache "
                         f"{_shape(k_cache)} {k_cache.dtype}")
    return _shape(k_cache)


def kv_write(qkv: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, num_heads: int) -> tuple[int, int, int]:
    """k/v heads of qkv[T, (H + 2Hkv) * D] into the caches at slot_mapping[T] -> (T, Hkv, D)."""
    _, Hkv, _, D = caches("kv_write", k_cache, v_cache)
    T = qkv.shape[0]
    if _shape(qkv) != (T, (num_heads + 2 * Hkv) * D):
        raise shape_error("kv_write", "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) = (T, {(num_heads + 2 * Hkv) * D})")
    if _shape(slot_mapping) != (T,):
        raise shape_error("kv_write", "slot_mapping", slot_mapping.shape, f"(T,) = ({T},)")
    return T, Hkv, D


def attention(op: str, qkv: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any,
              query_start_loc: Any, out: Any) -> tuple[int, int, int, int, int]:
    """paged_attention's arguments -> (T, B, H, Hkv, D)."""
    _, Hkv, _, D = caches(op, k_cache, v_cache)
    T = qkv.shape[0]
    H = out.shape[1] // D if len(out.shape) == 2 else 0
    if len(out.shape) != 2 or out.shape[0] != T or H * D != out.shape[1] or H == 0 or H % Hkv:
        raise shape_error(op, "out", out.shape, f"(T, H * D) with T = {T}, D = {D}, H a multiple of Hkv = {Hkv}")
    if _shape(qkv) != (T, (H + 2 * Hkv) * D):
        raise shape_error(op, "qkv", qkv.shape, f"(T, (H + 2 Hkv) * D) = ({T}, {(H + 2 * Hkv) * D})")
    if len(context_lens.shape) != 1:
        raise shape_error(op, "context_lens", context_lens.shape, "(B,)")
    B = context_lens.shape[0]
    if _shape(query_start_loc) != (B + 1,):
        raise shape_error(op, "query_start_loc", query_start_loc.shape, f"(B + 1,) = ({B + 1},)")
    if len(block_tables.shape) != 2 or block_tables.shape[0] != B:
        raise shape_error(op, "block_tables", block_tables.shape, f"(B, MB) with B = {B}")
    return T, B, H, Hkv, D


def take_rows(x: Any, indices: Any, out: Any) -> tuple[int, int]:
    """out[S, C] = x[T, C][indices[S]] -> (S, C)."""
    if len(x.shape) != 2:
        raise shape_error("take_rows", "x", x.shape, "(T, C)")
    if len(indices.shape) != 1:
        raise shape_error("take_rows", "indices", indices.shape, "(S,)")
    S, C = indices.shape[0], x.shape[1]
    if _shape(out) != (S, C):
        raise shape_error("take_rows", "out", out.shape, f"(S, C) = ({S}, {C})")
    return S, C


def embedding(ids: Any, table_shape: tuple[int, int], out: Any) -> tuple[int, int]:
    """out[T, C] = table[V, C][ids[T]] -> (T, C). table_shape: the logical shape (quantized tables too)."""
    if len(ids.shape) != 1:
        raise shape_error("embedding", "ids", ids.shape, "(T,)")
    T, C = ids.shape[0], table_shape[1]
    if _shape(out) != (T, C):
        raise shape_error("embedding", "out", out.shape, f"(T, C) = ({T}, {C})")
    return T, C


def grammar_mask(logits: Any, bitmask: Any, rows: Any) -> tuple[int, int, int]:
    """logits[S, V] masked in place by bitmask[R, W] (32 W >= V) at host rows[R], each in [0, S) -> (R, V, W)."""
    if len(logits.shape) != 2:
        raise shape_error("grammar_mask", "logits", logits.shape, "(S, V)")
    S, V = _shape(logits)
    if len(bitmask.shape) != 2 or bitmask.shape[1] * 32 < V:
        raise shape_error("grammar_mask", "bitmask", bitmask.shape, f"(R, W) with W >= ceil(V / 32) = {-(-V // 32)}")
    R, W = _shape(bitmask)
    if _shape(rows) != (R,):
        raise shape_error("grammar_mask", "rows", rows.shape, f"(R,) = ({R},)")
    if R and not all(0 <= int(r) < S for r in rows):
        raise ValueError(f"grammar_mask: rows must index the {S} logits rows, got {list(map(int, rows))}")
    return R, V, W
