"""One Numba call per decode step: the CPU's answer to launch overhead.

A decode step of one token does microseconds of work per op but pays Python and Numba dispatch for
each of the ~11 ops of every layer, a large share of a small model's step (docs/kernels.md).
`decoder_stack_kernel` walks every layer of a pure decode batch of a few sequences (quantized weights
without packed copies: no AVX2, or RAWINFER_CPU_INT_GEMM=0) and `decoder_layer_kernel` runs the same
kernels as the per-op path, in the same order, from inside one compiled function: the serial builds for
the elementwise ops (a few rows), the parallel builds for the row-invariant products (silu * up fused
into the gate/up one, as CPUBackend.linear_silu_mul does) and the decode attention. It reads and
writes the same workspace buffers, and its products sum in the kernels' fixed orders (the int8 rows'
dot products are reductions.py's dot_i8), so it gives the per-op path's tokens (tests/backend/test_quant.py).

`decoder_stack_batched_kernel` does the same for pure decode batches when the weights have packed
copies for the integer GEMMs (int8: qgemm.py, or a8gemm.py on 8-bit activations, q4: q4gemm.py; silu *
up in the gate/up GEMM's epilogue, as CPUBackend.linear_silu_mul) or are float32 (the row-invariant
GEMM, fgemm.py, which the per-op path takes for these row counts too; then silu_mul apart, as there),
for every family the engine runs (q/k head norms, sandwich norms, GeGLU, a RoPE table per layer:
Qwen3, Gemma 3), where the few-row kernel runs the Llama layer only. Dispatch is a large share of a
single-stream step and small next to a big batch's GEMMs, but it comes at no cost.

NOTE: the compiled kernels here carry copies of the kernels.py, attention.py, q4.py, q4gemm.py, qgemm.py and
a8gemm.py kernels they call, and Numba's disk cache only checks this file's timestamp; cache.refresh() drops
the cached builds whenever any source in rawinfer/backend/cpu/ changed.

    first layer:  x = rmsnorm(res)           other layers: res += h; x = rmsnorm(res)
    qkv = x @ Wqkv^T * scales (+ bias); rope(q, k); kv_write(k, v)
    attn = paged_attention(q, cache)
    h = attn @ Wo^T;  res += h; x = rmsnorm(res)
    h = (silu(x @ Wg^T) * (x @ Wu^T)) @ Wdown^T
"""

from __future__ import annotations

import numba as nb
import numpy as np

from numba import types
from numba.extending import overload

from rawinfer.backend.cpu import a8gemm as cpu_a8gemm
from rawinfer.backend.cpu import attention as A
from rawinfer.backend.cpu import fgemm as cpu_fgemm
from rawinfer.backend.cpu import kernels as K
from rawinfer.backend.cpu import q4 as cpu_q4
from rawinfer.backend.cpu import q4gemm as cpu_q4gemm
from rawinfer.backend.cpu import qgemm as cpu_qgemm
from rawinfer.backend.cpu import variants as V

# Module-level names for the compiled builds, so the jitted function below can call them.
_rmsnorm = K.rmsnorm_kernel.serial
_add_rmsnorm = K.add_rmsnorm_kernel.serial
_rope = K.rope_kernel.serial
_kv_write = K.kv_write_kernel.serial


def weight_matvec(x, w, s, out):
    """out = x @ W^T for a few rows x: W int8 (w = q, s = scales) or q4 (w = nibbles, s = block scales
    as uint16 bits). Compiled code only (an overload on w's element type)."""


@overload(weight_matvec)
def _weight_matvec(x, w, s, out):
    if w.dtype == types.uint8:
        return lambda x, w, s, out: cpu_q4.q4_matvec(x, w, s, out)
    return lambda x, w, s, out: K.rows_matmul_kernel(x, w, s, out)


def weight_matvec_silu(x, w, s, out):
    """silu(x @ Wg^T) * (x @ Wu^T) for a gate_up W = [Wg; Wu] of either kind (as weight_matvec)."""


@overload(weight_matvec_silu)
def _weight_matvec_silu(x, w, s, out):
    if w.dtype == types.uint8:
        return lambda x, w, s, out: cpu_q4.q4_matvec_silu(x, w, s, out)
    return lambda x, w, s, out: K.rows_matmul_silu_kernel(x, w, s, out)


_matmul, _matmul_silu = weight_matvec, weight_matvec_silu


@nb.njit(inline="always")
def add_rows(x, b):
    # x[t] += b for every row t, element by element (kernels.py's NOTE)
    for t in range(x.shape[0]):
        row = x[t]
        for j in range(b.shape[0]):
            row[j] += b[j]


@nb.njit(cache=True)
def decoder_layer_kernel(first, h, res, x, qkv, attn, gu, act,
                         in_norm, w_qkv, s_qkv, b_qkv, w_o, s_o, post_norm, w_gu, s_gu, w_down, s_down,
                         positions, slot_mapping, block_tables, context_lens,
                         avx2, k_cache, v_cache, cos_sin, eps, scale, num_heads, num_kv_heads, window):
    # Shapes as in rawinfer/backend/base.py; w_* are int8 rows with per-row scales s_* (or q4 nibbles
    # with their block scales: weight_matvec), b_qkv is the QKV bias (empty when the model has none).
    if first:
        _rmsnorm(res, in_norm, eps, x)
    else:
        _add_rmsnorm(h, res, in_norm, eps, x)
    _matmul(x, w_qkv, s_qkv, qkv)
    if b_qkv.shape[0] > 0:
        add_rows(qkv, b_qkv)
    _rope(qkv, positions, cos_sin, num_heads, num_kv_heads, cos_sin.shape[1])
    _kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)
    # the decode kernel the per-op path runs for one query per sequence (a batch's rows round alike)
    decode_attention(avx2, qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, attn)
    _matmul(attn, w_o, s_o, h)
    _add_rmsnorm(h, res, post_norm, eps, x)
    _matmul_silu(x, w_gu, s_gu, act)               # silu(gate) * up (gu: unused workspace here)
    _matmul(act, w_down, s_down, h)


@nb.njit(cache=True)
def decoder_stack_kernel(h, res, x, qkv, attn, gu, act,
                         in_norms, w_qkvs, s_qkvs, b_qkvs, w_os, s_os, post_norms, w_gus, s_gus, w_downs,
                         s_downs, positions, slot_mapping, block_tables, context_lens,
                         k_caches, v_caches, cos_sin, eps, scale, num_heads, num_kv_heads, avx2, windows):
    # Every layer of a pure decode batch (one query per sequence) in one call: the per-layer tensors come
    # as typed lists of L arrays each, the layers' sliding windows as windows[L] (0: full attention).
    for i in range(len(in_norms)):
        decoder_layer_kernel(i == 0, h, res, x, qkv, attn, gu, act,
                             in_norms[i], w_qkvs[i], s_qkvs[i], b_qkvs[i], w_os[i], s_os[i], post_norms[i],
                             w_gus[i], s_gus[i], w_downs[i], s_downs[i], positions, slot_mapping,
                             block_tables, context_lens, avx2,
                             k_caches[i], v_caches[i], cos_sin, eps, scale, num_heads, num_kv_heads, windows[i])


# ---- batched decode (int8 / q4 models with packed weights, float32 models; any number of sequences) --
_rmsnorm_p = K.rmsnorm_kernel.parallel
_add_rmsnorm_p = K.add_rmsnorm_kernel.parallel
_rope_p = K.rope_kernel.parallel
_silu_mul_p = K.silu_mul_kernel.parallel
_kv_write_p = K.kv_write_kernel.parallel
_silu_mul = K.silu_mul_kernel.serial
_gelu_mul = V.gelu_tanh_mul_kernel.serial
_gelu_mul_p = V.gelu_tanh_mul_kernel.parallel
_head_rmsnorm = V.head_rmsnorm_kernel.serial
_head_rmsnorm_p = V.head_rmsnorm_kernel.parallel
_PARALLEL_ROWS = K.rmsnorm_kernel.min_parallel_rows   # fewer rows: the serial builds (same bits per row)
_decode_attention_avx2 = A.decode_attention_avx2_kernel.parallel
_decode_attention = A.decode_attention_kernel.parallel
_int8_matmul = cpu_qgemm.int8_matmul
_int8_matmul_silu = cpu_qgemm.int8_matmul_silu
_q4_matmul = cpu_q4gemm.q4_matmul
_q4_matmul_silu = cpu_q4gemm.q4_matmul_silu
_fgemm = cpu_fgemm.matmul_nt
_a8_matmul = cpu_a8gemm.a8_matmul
_a8_matmul_silu = cpu_a8gemm.a8_matmul_silu


def packed_matmul(x, p, s, out, xbuf, sbuf, bbuf, threads):
    """out = x @ W^T on a packed copy p: int8 (qgemm.pack_weights, 4-d int8, s = row scales), int8 or q4 for
    8-bit activations (a8gemm.pack_weights, 4-d uint8, s = row scales, or a8q4tile.pack_q4, 2-d uint8, s
    unused; xbuf int8, sbuf float32, bbuf int32: a8gemm's buffers) or q4 (q4gemm.pack_weights, 3-d uint8, s
    unused; bbuf its block sums), or on a float32 W itself (p = W, [N, K], fgemm split over `threads` as
    CPUBackend.linear splits it; s and the buffers unused). Compiled code only (an overload)."""


def _fgemm_matmul(x, p, s, out, xbuf, sbuf, bbuf, threads):
    _fgemm(x, p, out, max(1, min(threads, p.shape[0] // 64)))


@overload(packed_matmul)
def _packed_matmul(x, p, s, out, xbuf, sbuf, bbuf, threads):
    if p.dtype == types.float32:
        return _fgemm_matmul
    if p.dtype == types.uint8 and p.ndim != 3:
        return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _a8_matmul(x, p, s, out, xbuf, sbuf, bbuf)
    if p.dtype == types.uint8:
        return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _q4_matmul(x, p, out, xbuf, sbuf, bbuf)
    return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _int8_matmul(x, p, s, out, xbuf, sbuf)


def packed_matmul_silu(x, p, s, out, xbuf, sbuf, bbuf, threads):
    """silu(x @ Wg^T) * (x @ Wu^T) on a packed gate_up copy (as packed_matmul)."""


@overload(packed_matmul_silu)
def _packed_matmul_silu(x, p, s, out, xbuf, sbuf, bbuf, threads):
    if p.dtype == types.uint8 and p.ndim != 3:
        return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _a8_matmul_silu(x, p, s, out, xbuf, sbuf, bbuf)
    if p.dtype == types.uint8:
        return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _q4_matmul_silu(x, p, out, xbuf, sbuf, bbuf)
    return lambda x, p, s, out, xbuf, sbuf, bbuf, threads: _int8_matmul_silu(x, p, s, out, xbuf, sbuf)


def gate_up_act(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu):
    """act = silu(x @ Wg^T) * (x @ Wu^T), or gelu_tanh(...) * ... where `gelu` is True (None: silu):
    silu in the integer GEMM's epilogue where its packed gate_up copy pairs the halves (an even count of
    column blocks), else the product into gu and the activation apart (the serial build for `small` row
    counts), as CPUBackend.linear_silu_mul and the per-op GeGLU do. Compiled code only."""


def act_after(gu, act, small, gelu):
    """act = silu(g) * u, or gelu_tanh(g) * u where `gelu` is True, of gu = [g | u]."""


@overload(act_after, inline="always")
def _act_after(gu, act, small, gelu):
    serial, parallel = (_silu_mul, _silu_mul_p) if isinstance(gelu, types.NoneType) else (_gelu_mul, _gelu_mul_p)

    def apply(gu, act, small, gelu):
        if small:
            serial(gu, act)
        else:
            parallel(gu, act)
    return apply


@nb.njit(inline="always")
def _gate_up_then_act(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu):
    packed_matmul(x, p, s, gu, xbuf, sbuf, bbuf, threads)
    act_after(gu, act, small, gelu)


@overload(gate_up_act)
def _gate_up_act(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu):
    def fused_if_paired(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu):
        if p.shape[0] % 2 == 0:
            packed_matmul_silu(x, p, s, act, xbuf, sbuf, bbuf, threads)
        else:
            _gate_up_then_act(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu)
    if p.dtype == types.float32 or not isinstance(gelu, types.NoneType):
        return lambda x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu: \
            _gate_up_then_act(x, p, s, gu, act, xbuf, sbuf, bbuf, small, threads, gelu)
    return fused_if_paired


def decode_attention(avx2, qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out):
    """attention.py's AVX2 decode attention kernel where `avx2` is True, its portable one where None."""


@overload(decode_attention, inline="always")
def _decode_attention_of(avx2, qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out):
    if isinstance(avx2, types.NoneType):
        return lambda avx2, qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out: \
            _decode_attention(qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out)
    return lambda avx2, qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out: \
        _decode_attention_avx2(qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out)


def head_norms(q_norms, k_norms, i, qkv, eps, num_heads, num_kv_heads, small):
    """Layer i's RMSNorm of its q and k heads (Qwen3, Gemma 3) where it has them; nothing where the model
    has none (q_norms None)."""


@overload(head_norms, inline="always")
def _head_norms(q_norms, k_norms, i, qkv, eps, num_heads, num_kv_heads, small):
    if isinstance(q_norms, types.NoneType):
        return lambda q_norms, k_norms, i, qkv, eps, num_heads, num_kv_heads, small: None

    def norms(q_norms, k_norms, i, qkv, eps, num_heads, num_kv_heads, small):
        if q_norms[i].shape[0] > 0:
            if small:
                _head_rmsnorm(qkv, q_norms[i], k_norms[i], eps, num_heads, num_kv_heads)
            else:
                _head_rmsnorm_p(qkv, q_norms[i], k_norms[i], eps, num_heads, num_kv_heads)
    return norms


@nb.njit(inline="always")
def _norm(x, w, eps, out, small):
    if small:
        _rmsnorm(x, w, eps, out)
    else:
        _rmsnorm_p(x, w, eps, out)


@nb.njit(inline="always")
def _add_norm(h, res, w, eps, out, small):
    if small:
        _add_rmsnorm(h, res, w, eps, out)
    else:
        _add_rmsnorm_p(h, res, w, eps, out)


@nb.njit(cache=True)
def decoder_stack_batched_kernel(h, res, x, qkv, attn, gu, act,
                                 in_norms, p_qkvs, s_qkvs, b_qkvs, p_os, s_os, post_norms, p_gus, s_gus, p_downs,
                                 s_downs, positions, slot_mapping, block_tables, context_lens, k_caches, v_caches,
                                 cos_sins, eps, scale, num_heads, num_kv_heads, xbuf, sbuf, bbuf, avx2_attention,
                                 windows, threads, q_norms, k_norms, attn_out_norms, mlp_out_norms, gelu):
    # Every layer of a pure decode batch (row b = sequence b's new token) in one call: the per-op path's
    # kernels in its order (exec/model.py's _layer; the serial builds of the elementwise ops for a few
    # rows, where waking the pool costs more than the work), the matrix products on the integer GEMMs
    # (p_* = packed weights, int8 or q4; bbuf: the q4 GEMM's block sums) or, for float32 weights (p_* =
    # the weights), fgemm. The family ops where a layer has them: q/k head norms, norms of the attention
    # and MLP outputs (empty arrays where absent), its own RoPE table (cos_sins[i]), GeGLU (gelu).
    # avx2_attention, gelu and q_norms are None where the machine or model has no use for them (else True,
    # or the norms' list): their type picks the kernels at compile time, so that a model compiles only
    # the kernels it runs (a False would still compile the other branch's kernels).
    small = x.shape[0] < _PARALLEL_ROWS
    for i in range(len(in_norms)):
        if i == 0:
            _norm(res, in_norms[i], eps, x, small)
        else:
            _add_norm(h, res, in_norms[i], eps, x, small)
        packed_matmul(x, p_qkvs[i], s_qkvs[i], qkv, xbuf, sbuf, bbuf, threads)
        if b_qkvs[i].shape[0] > 0:
            add_rows(qkv, b_qkvs[i])
        head_norms(q_norms, k_norms, i, qkv, eps, num_heads, num_kv_heads, small)
        D = cos_sins[i].shape[1]
        if small:
            _rope(qkv, positions, cos_sins[i], num_heads, num_kv_heads, D)
            _kv_write(qkv, k_caches[i], v_caches[i], slot_mapping, num_heads)
        else:
            _rope_p(qkv, positions, cos_sins[i], num_heads, num_kv_heads, D)
            _kv_write_p(qkv, k_caches[i], v_caches[i], slot_mapping, num_heads)
        decode_attention(avx2_attention, qkv, k_caches[i], v_caches[i], block_tables, context_lens, scale,
                         num_heads, windows[i], attn)
        packed_matmul(attn, p_os[i], s_os[i], h, xbuf, sbuf, bbuf, threads)
        if attn_out_norms[i].shape[0] > 0:
            _norm(h, attn_out_norms[i], eps, h, small)
        _add_norm(h, res, post_norms[i], eps, x, small)
        gate_up_act(x, p_gus[i], s_gus[i], gu, act, xbuf, sbuf, bbuf, small, threads, gelu)
        packed_matmul(act, p_downs[i], s_downs[i], h, xbuf, sbuf, bbuf, threads)
        if mlp_out_norms[i].shape[0] > 0:
            _norm(h, mlp_out_norms[i], eps, h, small)


NO_BIAS = np.zeros(0, np.float32)   # stands in for a missing QKV bias or family norm


@nb.njit(cache=True)
def list_of(a):
    """A typed list holding a: the kernels' per-layer lists are built by this and push, cached builds
    per array type, since numba.typed.List's own methods called from Python compile at every start."""
    out = nb.typed.List()
    out.append(a)
    return out


@nb.njit(cache=True)
def push(out, a):
    out.append(a)
