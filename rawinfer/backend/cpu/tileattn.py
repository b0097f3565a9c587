"""Causal attention of long query runs (prefill) on AVX-512: one LLVM IR kernel per tile of 4 query rows,
float32 throughout.

Why: on blas.py a long prompt's attention is two sgemms and a softmax pass over the stored scores S
between them; the softmax is a sixth of the time, and S (query tile x keys) round-trips through L2.
Here a tile of rows takes two passes over its keys, with the scores of its 4 rows (a few KiB) staying
in cache between them: pass 1 computes them and each row's max, pass 2 turns them into weights
exp(s - max) and adds P V into the rows' outputs. Neither pass needs a running rescale or a
horizontal reduction per block of keys, which is what an online (one-pass) softmax costs per block.

Operands: K and V of every (sequence, kv head), packed once per call from the KV cache (pack_kv), in
blocks of 32 keys; keys past the sequence are zero (their weights are 0, and 0 * 0 keeps sums finite):
    K: [blocks, D, 2, 16] float32   lanes = keys (two halves of 16): one zmm per (head dim, half)
    V: [blocks, 32, D] float32      the rows
    Q: [rows, D] float32            the scaled queries, rows ordered (query, head of the kv group)

    attend_rows   one tile of 4 rows: per block of 32 keys, pass 1 = per head dim 2 K loads, 4
                  broadcasts, 8 FMAs; pass 2, per 32 columns of O = per key 2 V loads, 4 broadcast
                  weights, 8 FMAs

Every tile runs the same steps whatever the batch, so a sequence's bits do not depend on what else
runs. Built where the CPU Numba compiles for has AVX-512 F/BW (`available()`; on AVX2 the 16-lane
vectors would be split in two and the 16 accumulators spill); elsewhere long query runs stay on
blas.py.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from rawinfer.backend.cpu import isa
from rawinfer.backend.cpu.attention import attention_work_item, query_heads_into
from rawinfer.backend.cpu.kernels import copy_row, kv_dims, kv_row_into, kv_scale_table
from rawinfer.backend.cpu.llvm import F32, I32, I64, _fma, _ptr, counted_loop, i64, keep_alive, splat
from rawinfer.backend.cpu.vmath import V16F32, V16I32, const16, exp16

ROWS = 4          # query rows per tile
KEYS = 32         # keys per block (two zmm of scores per row)


def available() -> bool:
    """AVX-512 F/BW on the CPU Numba compiles for (isa.py)."""
    return {"avx512f", "avx512bw"} <= isa.FEATURES


def supports(head_dim: int, window: int) -> bool:
    """Whether a layer's attention fits these tiles: head dims in whole pairs of 16-column chunks, no
    sliding window (its layers keep blas.py's kernel)."""
    return head_dim % 32 == 0 and window == 0


def _scores(builder, qb, D, kp):
    # S[r, 0:32] of 4 query rows (float32, stride D) against one K block [D, 2, 16] float32, as 8 vectors
    # (row r: 2 r, 2 r + 1): per head dim 2 K loads, 4 broadcasts, 8 fused multiply-adds
    kb, fma = _ptr(builder, kp, V16F32), _fma(builder, V16F32)

    def step(d, accs):
        kv = [builder.load(builder.gep(kb, [builder.add(builder.mul(d, i64(2)), i64(h))]), align=4) for h in range(2)]
        new = []
        for r in range(ROWS):
            qv = splat(builder, builder.load(builder.gep(qb, [builder.add(builder.mul(i64(r), D), d)]), align=4),
                       V16F32)
            new += [builder.call(fma, [kv[h], qv, accs[2 * r + h]]) for h in range(2)]
        return new
    return counted_loop(builder, D, [const16(0.0)] * (2 * ROWS), step)


def _weights_of(builder, s, m, pb_row):
    """One row's 32 scores s (2 vectors, masked keys at -inf) -> the weights exp(s - m) (masked keys 0),
    stored at pb_row (float32 [32]); returns their lane sums."""
    total = const16(0.0)
    for h in range(2):
        e = exp16(builder, builder.fsub(s[h], m))
        e = builder.select(builder.fcmp_ordered("==", s[h], const16(float("-inf"))), const16(0.0), e)
        total = builder.fadd(total, e)
        builder.store(e, builder.bitcast(builder.gep(pb_row, [i64(16 * h)]), V16F32.as_pointer()), align=4)
    return total


def _weights(builder, ob, D, pb, vp):
    # O[r, :] += P[r] (float32 [4, 32]) . V block (float32 [32, D]), two 16-column chunks at a time
    vb, fma = _ptr(builder, vp, F32), _fma(builder, V16F32)
    vec = V16F32.as_pointer()

    def chunk_pair(c, _):
        cols = [builder.add(builder.mul(c, i64(32)), i64(16 * h)) for h in range(2)]
        optr = [[builder.bitcast(builder.gep(ob, [builder.add(builder.mul(i64(r), D), cols[h])]), vec)
                 for h in range(2)] for r in range(ROWS)]
        acc = [builder.load(optr[r][h], align=4) for r in range(ROWS) for h in range(2)]
        for j in range(KEYS):
            vv = [builder.load(builder.bitcast(builder.gep(vb, [builder.add(builder.mul(i64(j), D), cols[h])]), vec),
                               align=4) for h in range(2)]
            for r in range(ROWS):
                pv = splat(builder, builder.load(builder.gep(pb, [i64(KEYS * r + j)]), align=4), V16F32)
                for h in range(2):
                    acc[2 * r + h] = builder.call(fma, [vv[h], pv, acc[2 * r + h]])
        for r in range(ROWS):
            for h in range(2):
                builder.store(acc[2 * r + h], optr[r][h], align=4)
        return []
    counted_loop(builder, builder.sdiv(D, i64(32)), [], chunk_pair)


@intrinsic
def attend_rows(typingctx, qp, D, kp, vp, nblocks, limp, sp, lds, op, pp, lp):
    """4 query rows over key blocks 0 .. nblocks - 1: O[r] = sum_j exp(s_rj - max_r) V_j, unnormalized,
    into op (float32 [4, D], zero on entry), the sums of the weights into lp (float32 [4]). Two passes:
    the scores of every block into sp (float32 [4, lds], lds >= 32 nblocks) and each row's max, then
    the weights and their products with V. qp -> float32 Q rows (stride D); kp / vp -> the first K / V
    block (128 D bytes each, consecutive); limp -> int64 [4]: the last key each row sees; pp: float32
    scratch [4, 32] for a block's weights."""
    def codegen(context, builder, signature, args):
        qp, D, kp, vp, nblocks, limp, sp, lds, op, pp, lp = args
        qb, ob, pb = _ptr(builder, qp, F32), _ptr(builder, op, F32), _ptr(builder, pp, F32)
        sb = _ptr(builder, sp, F32)
        fmax = builder.module.declare_intrinsic("llvm.maxnum.v16f32", (), ir.FunctionType(V16F32, [V16F32] * 2))
        rmax = builder.module.declare_intrinsic("llvm.vector.reduce.fmax.v16f32", (),
                                                ir.FunctionType(F32, [V16F32]))
        radd = builder.module.declare_intrinsic("llvm.vector.reduce.fadd.v16f32", (),
                                                ir.FunctionType(F32, [F32, V16F32]))
        lims = [builder.trunc(builder.load(builder.gep(_ptr(builder, limp, I64), [i64(r)]), align=8), I32)
                for r in range(ROWS)]
        block_bytes = builder.mul(D, i64(128))        # of K and of V

        def srow(r, blk, h):               # address of scores [r, 32 blk + 16 h]
            col = builder.add(builder.mul(blk, i64(KEYS)), i64(16 * h))
            return builder.bitcast(builder.gep(sb, [builder.add(builder.mul(i64(r), lds), col)]),
                                   V16F32.as_pointer())

        def scores_pass(blk, vmax):
            s = _scores(builder, qb, D, builder.add(kp, builder.mul(blk, block_bytes)))
            base = builder.trunc(builder.mul(blk, i64(KEYS)), I32)
            new = []
            for r in range(ROWS):
                lim = splat(builder, builder.sub(lims[r], base), V16I32)
                row = vmax[r]
                for h in range(2):
                    masked = builder.icmp_signed(">", ir.Constant(V16I32, list(range(16 * h, 16 * h + 16))), lim)
                    v = builder.select(masked, const16(float("-inf")), s[2 * r + h])
                    builder.store(v, srow(r, blk, h), align=4)
                    row = builder.call(fmax, [row, v])
                new.append(row)
            return new
        vmax = counted_loop(builder, nblocks, [const16(float("-inf"))] * ROWS, scores_pass)
        m = [splat(builder, builder.call(rmax, [v]), V16F32) for v in vmax]

        def weights_pass(blk, sums):
            new = []
            for r in range(ROWS):
                s = [builder.load(srow(r, blk, h), align=4) for h in range(2)]
                new.append(builder.fadd(sums[r], _weights_of(builder, s, m[r], builder.gep(pb, [i64(KEYS * r)]))))
            _weights(builder, ob, D, pb, builder.add(vp, builder.mul(blk, block_bytes)))
            return new
        sums = counted_loop(builder, nblocks, [const16(0.0)] * ROWS, weights_pass)
        lb = _ptr(builder, lp, F32)
        for r in range(ROWS):
            total = builder.call(radd, [ir.Constant(F32, 0.0), sums[r]], fastmath=("reassoc",))
            builder.store(total, builder.gep(lb, [i64(r)]), align=4)
        return context.get_dummy_value()
    return types.void(*([types.int64] * 11)), codegen


# ---- packing -----------------------------------------------------------------------------------------
@nb.njit(parallel=True, cache=True)
def pack_kv(k_cache, v_cache, block_tables, context_lens, blk_seq, blk_head, blk_index, kbuf, vbuf):
    """Packed block n (n < len(blk_seq)) = keys 32 blk_index[n] .. + 31 of sequence blk_seq[n], kv head
    blk_head[n], from the paged cache (any cache dtype): K into kbuf[n] ([D, 2, 16] float32), V into
    vbuf[n] (rows [32, D]); keys past the sequence's end are zero."""
    Hkv, BS, D = kv_dims(k_cache)
    k_table, v_table = kv_scale_table(k_cache), kv_scale_table(v_cache)
    for n in nb.prange(blk_seq.shape[0]):
        b, h, k0 = blk_seq[n], blk_head[n], blk_index[n] * KEYS
        kf = np.zeros((KEYS, D), np.float32)
        vb = vbuf[n].reshape((KEYS, D))
        vb[:] = np.float32(0.0)
        for j in range(min(KEYS, context_lens[b] - k0)):
            blk = block_tables[b, (k0 + j) // BS]
            kv_row_into(k_cache, k_table, blk, h, (k0 + j) % BS, kf[j])
            kv_row_into(v_cache, v_table, blk, h, (k0 + j) % BS, vb[j])
        kb = kbuf[n]
        for d in range(D):
            for j in range(KEYS):
                kb[(2 * d + j // 16) * 16 + j % 16] = kf[j, d]


# ---- attention ---------------------------------------------------------------------------------------
@nb.njit(parallel=True, cache=True, fastmath={"contract", "nsz"})
def prefill_attention(qkv, kbuf, vbuf, seq_block0, context_lens, query_start_loc, work_seq, work_q0, work_q1,
                      scale, num_heads, num_kv_heads, out, parts):
    """Causal attention of the work items (query tile of one sequence, kv head; blas.prefill_attention's
    items, dealt to threads round-robin as there) on the blocks pack_kv made: sequence b's kv head h
    starts at packed block seq_block0[b] + h * ceil(context_lens[b] / 32). Rows (query, head) in tiles
    of 4, each over the key blocks up to its last query's position; out = O / sum of the weights."""
    Hkv = num_kv_heads
    G = num_heads // Hkv
    D = kbuf.shape[1] // 32
    W = work_seq.shape[0] * Hkv
    lds = (np.max(context_lens) + KEYS - 1) // KEYS * KEYS       # a row of the scores: every key of any item
    for part in nb.prange(parts):
        p = np.empty((ROWS, KEYS), np.float32)
        o = np.empty((ROWS, D), np.float32)
        l = np.empty(ROWS, np.float32)
        lim = np.empty(ROWS, np.int64)
        sc = np.empty((ROWS, lds), np.float32)
        sa = np.int64(sc.ctypes.data)
        pa, oa, la, ma = (np.int64(p.ctypes.data), np.int64(o.ctypes.data), np.int64(l.ctypes.data),
                          np.int64(lim.ctypes.data))
        for w in range(part, W, parts):
            b, kvh, q0, nq, first = attention_work_item(w, Hkv, work_seq, work_q0, work_q1, query_start_loc,
                                                        context_lens)
            rows = G * nq
            q = np.empty(((rows + ROWS - 1) // ROWS * ROWS, D), np.float32)    # row i G + g: head g of query i
            for i in range(nq):
                query_heads_into(qkv, q0 + i, kvh, scale, q[i * G:(i + 1) * G])
            for r in range(rows, q.shape[0]):
                copy_row(q[r], q[rows - 1])
            kb0 = seq_block0[b] + kvh * ((context_lens[b] + KEYS - 1) // KEYS)
            qa, ka, va = np.int64(q.ctypes.data), np.int64(kbuf[kb0:].ctypes.data), np.int64(vbuf[kb0:].ctypes.data)
            for rg in range(0, rows, ROWS):
                for r in range(ROWS):
                    lim[r] = first + min(rg + r, rows - 1) // G
                o[:] = np.float32(0.0)
                attend_rows(qa + rg * D * 4, D, ka, va, lim[ROWS - 1] // KEYS + 1, ma, sa, lds, oa, pa, la)
                for r in range(min(ROWS, rows - rg)):
                    i, g = (rg + r) // G, (rg + r) % G
                    inv = np.float32(1.0) / l[r]
                    h0 = (kvh * G + g) * D
                    for d in range(D):
                        out[q0 + i, h0 + d] = o[r, d] * inv
            keep_alive(q)
        keep_alive(p)
        keep_alive(o)
        keep_alive(l)
        keep_alive(lim)
        keep_alive(sc)


def attend(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, chosen, work_seq, work_q0, work_q1,
           scale, num_heads, out, parts):
    """Prefill attention of the sequences where `chosen` [B] is true (their work items work_*,
    blas.prefill_attention's): pack their K and V, then run the tiles into out."""
    seqs = np.flatnonzero(chosen)
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    nblk = (context_lens[seqs] + KEYS - 1) // KEYS
    starts = np.zeros(len(context_lens), np.int64)
    starts[seqs] = np.concatenate([[0], np.cumsum(nblk * Hkv)[:-1]])
    blk_seq = np.repeat(seqs, nblk * Hkv).astype(np.int64)
    blk_head = np.concatenate([np.repeat(np.arange(Hkv), n) for n in nblk]).astype(np.int64)
    blk_index = np.concatenate([np.tile(np.arange(n), Hkv) for n in nblk]).astype(np.int64)
    total = int(blk_seq.shape[0])
    kbuf = np.empty((total, 32 * D), np.float32)
    vbuf = np.empty((total, 32 * D), np.float32)
    pack_kv(k_cache, v_cache, block_tables, context_lens, blk_seq, blk_head, blk_index, kbuf, vbuf)
    prefill_attention(qkv, kbuf, vbuf, starts, context_lens, query_start_loc, work_seq, work_q0, work_q1,
                      np.float32(scale), num_heads, Hkv, out, parts)
