"""Paged attention on the CPU: the Numba kernels that read the KV cache through block tables.

    paged_attention_kernel        any batch (prefill chunks, mixed steps): flash-style tiles with an
                                  online softmax (blas.prefill_attention takes long query runs)
    decode_attention_kernel       pure decode batches (one query per sequence): two passes, exact
                                  softmax, portable loops
    decode_attention_avx2_kernel  the same on llvm.py's AVX2 blocks, with the KV blocks prefetched

Work items are (query tile of one sequence, kv head) -- (sequence, kv head) for decode -- so that the
G = H / Hkv query heads sharing a kv head read its K and V rows once. Each kernel has a NumPy
reference test (tests/reference_ops.py: paged_attention_ref). Caches are float32, float16 bits (uint16) or
int8 with row scales; the KV helpers of kernels.py resolve the element type at compile time.
Which kernel runs for which batch: docs/kernels.md.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from rawinfer.backend.cpu import llvm as cpu_llvm
from rawinfer.backend.cpu.kernels import _JIT, Kernel, fast_exp, int8_kv_block_size, kv_dims, kv_scale_table, kv_tile
from rawinfer.backend.cpu.llvm import keep_alive, prefetch_l2
from rawinfer.backend.cpu.reductions import dot, row_max, row_sum


@nb.njit(inline="always")
def attention_work_item(w, num_kv_heads, work_seq, work_q0, work_q1, query_start_loc, context_lens):
    """Work item w of the attention kernels -> (sequence b, kv head, first query row q0, query count nq,
    position of the tile's first query), for items laid out as (query tile from attention_work_items,
    kv head)."""
    item = w // num_kv_heads
    b = work_seq[item]
    q0 = work_q0[item]
    qlen = query_start_loc[b + 1] - query_start_loc[b]
    first = context_lens[b] - qlen + (q0 - query_start_loc[b])
    return b, w % num_kv_heads, q0, work_q1[item] - q0, first


@nb.njit(inline="always")
def window_start(pos, window):
    """The first key position a query at `pos` sees: pos - window + 1 for a sliding-window layer
    (window > 0), else 0."""
    return max(0, pos - window + 1) if window > 0 else 0


@nb.njit(inline="always")
def softmax_numerators(row, n):
    """row[:n] <- exp(row[:n] - max(row[:n])) in place; returns 1 / their sum (the normalizer)."""
    m = row_max(row, n)
    for j in range(n):
        row[j] = fast_exp(row[j] - m)
    return np.float32(1.0) / row_sum(row, n)


@nb.njit(**_JIT)
def attention_work_items(query_start_loc, tile):
    """Split each sequence's queries into tiles of at most `tile` rows -> (seq[W], q0[W], q1[W]) int32."""
    B = query_start_loc.shape[0] - 1
    W = 0
    for b in range(B):
        W += (query_start_loc[b + 1] - query_start_loc[b] + tile - 1) // tile
    seqs = np.empty(W, np.int32)
    q0s = np.empty(W, np.int32)
    q1s = np.empty(W, np.int32)
    w = 0
    for b in range(B):
        for a in range(query_start_loc[b], query_start_loc[b + 1], tile):
            seqs[w] = b
            q0s[w] = a
            q1s[w] = min(a + tile, query_start_loc[b + 1])
            w += 1
    return seqs, q0s, q1s


# ---- float32 / float16 / int8 builds of the llvm.py attention blocks -------------------------------
def _by_cache_dtype(blocks, doc):
    """A function of (cache, heads, 8 addresses/counts) that calls the llvm.py block built for the
    cache's element type (blocks["f32"], blocks["f16"] for float16 caches held as uint16 bits,
    blocks["i8"] for int8 ones) and for `heads` query heads (1..llvm.HEADS_MAX)."""
    def block(cache, heads, a, b, c, d, e, f, g, h):
        pass
    block.__doc__ = doc
    assert cpu_llvm.HEADS_MAX == 3

    @overload(block, inline="always")
    def _block(cache, heads, a, b, c, d, e, f, g, h):
        _, b1, b2, b3 = blocks[{types.uint16: "f16", types.int8: "i8"}.get(cache.dtype, "f32")]

        def call(cache, heads, a, b, c, d, e, f, g, h):
            if heads >= 3:
                b3(a, b, c, d, e, f, g, h)
            elif heads == 2:
                b2(a, b, c, d, e, f, g, h)
            else:
                b1(a, b, c, d, e, f, g, h)
        return call
    return block


kv_dot_rows4 = _by_cache_dtype(cpu_llvm.dot_rows4, "llvm.dot_rows4 for this cache's rows")
kv_axpy_rows32 = _by_cache_dtype(cpu_llvm.axpy_rows32, "llvm.axpy_rows32 for this cache's rows")


def _paged_attention_kernel(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           work_seq, work_q0, work_q1, scale, num_heads, window, out):
    """Flash-style attention on the CPU. One work item = (query tile of one sequence, kv head).

    The item walks its sequence's KV blocks through the block table; each block's BS x D tiles of K
    and V are read once for every query of the tile and every query head of the kv head's group.
    Per (query, head) it keeps a running max m, denominator l and accumulator acc[D] (online softmax):
    scores of the visible keys of a block (causal: key position <= query position; window W > 0: and
    > query position - W), then one rescale of acc by exp(m_old - m_new) per block instead of per key.
    Blocks wholly before the tile's first window are not read (a sliding-window sequence may have
    returned them to the pool).
    """
    Hkv, BS, D = kv_dims(k_cache)
    G = num_heads // Hkv
    W = work_seq.shape[0]
    k_table, v_table = kv_scale_table(k_cache), kv_scale_table(v_cache)
    for w in nb.prange(W * Hkv):
        b, kvh, q0, nq, tile_first = attention_work_item(w, Hkv, work_seq, work_q0, work_q1, query_start_loc,
                                                         context_lens)
        last_pos = tile_first + nq - 1
        q = np.empty((nq, G, D), np.float32)
        for i in range(nq):
            query_heads_into(qkv, q0 + i, kvh, scale, q[i])
        m = np.full((nq, G), -np.inf, np.float32)
        l = np.zeros((nq, G), np.float32)
        acc = np.zeros((nq, G, D), np.float32)
        sc = np.empty(BS, np.float32)
        ktile = np.empty((BS, D), np.float32)            # float16 caches: the block's tiles converted
        vtile = np.empty((BS, D), np.float32)
        for page in range(window_start(tile_first, window) // BS, last_pos // BS + 1):
            kb = kv_tile(k_cache, k_table, block_tables[b, page], kvh, ktile)     # [BS, D]
            vb = kv_tile(v_cache, v_table, block_tables[b, page], kvh, vtile)
            j0 = page * BS
            nk = min(BS, last_pos + 1 - j0)
            for i in range(max(0, j0 - tile_first), nq):
                nvis = min(nk, tile_first + i - j0 + 1)
                r0 = max(0, window_start(tile_first + i, window) - j0)
                if r0 >= nvis:
                    continue                             # the block is wholly before this query's window
                for g in range(G):
                    qi = q[i, g]
                    mx = np.float32(-np.inf)
                    for r in range(r0, nvis):
                        s = dot(qi, kb[r])
                        sc[r] = s
                        mx = max(mx, s)
                    m_new = max(m[i, g], mx)
                    corr = fast_exp(m[i, g] - m_new)
                    a = acc[i, g]
                    for d in range(D):
                        a[d] *= corr
                    li = l[i, g] * corr
                    # NOTE: exp inside the key loop: over a block's <= BS scores, a separate
                    # (vectorized) exp pass costs more than it saves
                    for r in range(r0, nvis):
                        p = fast_exp(sc[r] - m_new)
                        li += p
                        for d in range(D):
                            a[d] += p * vb[r, d]
                    l[i, g] = li
                    m[i, g] = m_new
        inv = np.float32(1.0) / l
        for i in range(nq):
            write_heads(acc[i], inv[i], q0 + i, kvh, out)


@nb.njit(inline="always")
def tile_offset(block_tables, b, page, kvh, Hkv, tbytes):
    """Bytes from a cache's start [NB, Hkv, BS, D] to the tile [BS, D] of kv head kvh in sequence b's
    page-th block (tbytes = BS * D * itemsize; an int8 cache's tiles also hold their scale rows)."""
    return (np.int64(block_tables[b, page]) * Hkv + kvh) * tbytes


@nb.njit(inline="always")
def query_heads_into(qkv, t, kvh, scale, q):
    """q[G, D] <- the G query heads of qkv row t that share kv head kvh, times scale."""
    G, D = q.shape
    for g in range(G):
        base = (kvh * G + g) * D
        src, dst = qkv[t, base:base + D], q[g]           # row views: see kernels.py
        for d in range(D):
            dst[d] = src[d] * scale


@nb.njit(inline="always")
def write_heads(o, inv, t, kvh, out):
    """out[t] columns of kv head kvh's G query heads <- o[G, D] * inv[G] (softmax normalizers)."""
    G, D = o.shape
    for g in range(G):
        base = (kvh * G + g) * D
        src, dst = o[g], out[t, base:base + D]
        for d in range(D):
            dst[d] = src[d] * inv[g]


def _decode_attention_kernel(qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window, out):
    """Attention of one new token per sequence (a pure decode batch: row b of qkv is sequence b's token).

    One work item = (sequence, kv head), in two passes over the sequence's blocks instead of an online
    softmax: all scores of the item's G query heads into a [G, context] buffer, one exact softmax per
    head (its exps vectorize over the whole row), then P @ V with each V row read once for all G heads.
    window W > 0: only the last W positions, from the block that holds the first of them.
    """
    Hkv, BS, D = kv_dims(k_cache)
    G = num_heads // Hkv
    B = context_lens.shape[0]
    k_table, v_table = kv_scale_table(k_cache), kv_scale_table(v_cache)
    for w in nb.prange(B * Hkv):
        b = w // Hkv
        kvh = w % Hkv
        n = context_lens[b]
        lo = window_start(n - 1, window)                 # scores s[g, j - lo] of positions lo .. n-1
        q = np.empty((G, D), np.float32)
        query_heads_into(qkv, b, kvh, scale, q)
        s = np.empty((G, n - lo), np.float32)
        tile = np.empty((BS, D), np.float32)             # float16 caches: a block's tile converted
        for page in range(lo // BS, (n + BS - 1) // BS):
            kb = kv_tile(k_cache, k_table, block_tables[b, page], kvh, tile)     # [BS, D]
            j0 = page * BS
            for r in range(max(0, lo - j0), min(BS, n - j0)):
                for g in range(G):
                    s[g, j0 + r - lo] = dot(q[g], kb[r])
        inv = np.empty(G, np.float32)
        for g in range(G):
            inv[g] = softmax_numerators(s[g], n - lo)
        o = np.zeros((G, D), np.float32)
        for page in range(lo // BS, (n + BS - 1) // BS):
            vb = kv_tile(v_cache, v_table, block_tables[b, page], kvh, tile)
            j0 = page * BS
            for r in range(max(0, lo - j0), min(BS, n - j0)):
                for g in range(G):
                    p = s[g, j0 + r - lo]
                    for d in range(D):
                        o[g, d] += p * vb[r, d]
        write_heads(o, inv, b, kvh, out)


def _decode_attention_avx2_kernel(qkv, k_cache, v_cache, block_tables, context_lens, scale, num_heads, window,
                                  out):
    """The same two passes as _decode_attention_kernel with the inner loops as AVX2 blocks (llvm.py):
    scores 4 rows of a K block at a time for up to 3 query heads at once (dot_rows4), P @ V 32 dims at
    a time with the outputs in registers across a V block's rows (axpy_rows32), each K and V row loaded
    (and, for float16 caches, converted) once for the query heads it serves. The caches come from DRAM
    (every layer's blocks are read once per step): the K block two ahead, and this block's V, are
    prefetched while a K block is scored, a quarter of each before each 4-row group, and the next work
    item's first two K blocks a slice per V block of this item's second pass, all into L2 (prefetcht1):
    a block is 64 cache lines, prefetches into L1 stall on its few miss buffers, and a block's lines
    requested in one burst arrived slower than the same requests spread over the scoring (docs/kernels.md).
    Needs BS % 4 == 0, D % 32 == 0 (decode_attention_avx2_fits); the 4-row groups may read a block's
    rows past the context, which exist and whose scores are never used. int8 caches: the row scales
    are applied inside the blocks, once per row (to the 4 scores, to the weights p). window W > 0: the
    blocks from the one holding position n - W on; that block's rows before it get weight 0."""
    Hkv, BS, D = kv_dims(k_cache)
    G = num_heads // Hkv
    B = context_lens.shape[0]
    k0, v0 = np.int64(k_cache.ctypes.data), np.int64(v_cache.ctypes.data)
    isz = np.int64(k_cache.itemsize)
    tbytes = k_cache.shape[2] * D * isz                  # one (block, kv head) tile (int8: with its scales)
    part = tbytes * 4 // BS                              # the share of a tile prefetched per 4-row group
    HM = cpu_llvm.HEADS_MAX
    for w in nb.prange(B * Hkv):
        b = w // Hkv
        kvh = w % Hkv
        b1, h1, p1, n1 = b, kvh, 0, 0                     # the next item's first two K blocks
        if w + 1 < B * Hkv:
            b1, h1 = (w + 1) // Hkv, (w + 1) % Hkv
            p1 = window_start(context_lens[b1] - 1, window) // BS
            n1 = min(2, (context_lens[b1] + BS - 1) // BS - p1)
        n = context_lens[b]
        lo = window_start(n - 1, window)
        p0 = lo // BS                                    # s[g, (page - p0) * BS + r]: row r of a page
        pages = (n + BS - 1) // BS
        width = (pages - p0) * BS
        q = np.empty((G, D), np.float32)
        query_heads_into(qkv, b, kvh, scale, q)
        s = np.empty((G, width), np.float32)
        o = np.zeros((G, D), np.float32)
        qa, sa, oa = np.int64(q.ctypes.data), np.int64(s.ctypes.data), np.int64(o.ctypes.data)
        for page in range(p0, pages):
            tile = tile_offset(block_tables, b, page, kvh, Hkv, tbytes)
            ahead = tile_offset(block_tables, b, page + 2, kvh, Hkv, tbytes) if page + 2 < pages else -1
            rows = min(BS, n - page * BS)
            for g0 in range(0, G, HM):
                for r0 in range(0, rows, 4):
                    if g0 == 0:
                        if ahead >= 0:
                            prefetch_l2(k0 + ahead + r0 // 4 * part, part)
                        prefetch_l2(v0 + tile + r0 // 4 * part, part)
                    kv_dot_rows4(k_cache, G - g0, qa + g0 * D * 4, D, k0 + tile + r0 * D * isz, D, D // 8,
                                 sa + (g0 * width + (page - p0) * BS + r0) * 4, width,
                                 k0 + tile + BS * D + r0 * 4)     # int8: the rows' scales (else unused)
        skip = lo - p0 * BS                              # rows of the first page before the window
        inv = np.empty(G, np.float32)
        for g in range(G):
            inv[g] = softmax_numerators(s[g, skip:], n - lo)
            s[g, :skip] = np.float32(0.0)
        each = (n1 * tbytes // (pages - p0) + 63) // 64 * 64
        for page in range(p0, pages):
            tile = tile_offset(block_tables, b, page, kvh, Hkv, tbytes)
            at = (page - p0) * each
            while at < min((page - p0 + 1) * each, n1 * tbytes):     # (a slice may span two tiles)
                k = min((page - p0 + 1) * each, (at // tbytes + 1) * tbytes) - at
                prefetch_l2(k0 + tile_offset(block_tables, b1, p1 + at // tbytes, h1, Hkv, tbytes) + at % tbytes, k)
                at += k
            rows = min(BS, n - page * BS)
            for g0 in range(0, G, HM):
                for d0 in range(0, D, 32):
                    kv_axpy_rows32(v_cache, G - g0, sa + (g0 * width + (page - p0) * BS) * 4, width,
                                   v0 + tile + d0 * isz, rows, D, oa + (g0 * D + d0) * 4, D, v0 + tile + BS * D)
        keep_alive(q)                                    # q and s are read through qa and sa up to here
        keep_alive(s)
        write_heads(o, inv, b, kvh, out)


def decode_attention_avx2_fits(k_cache) -> bool:
    """Whether _decode_attention_avx2_kernel runs on this cache (and this CPU)."""
    rows, D = k_cache.shape[2:]
    BS = int8_kv_block_size(rows, D) if k_cache.dtype == np.int8 else rows
    return (cpu_llvm.available() and k_cache.dtype in (np.float32, np.uint16, np.int8)
            and k_cache.flags.c_contiguous and BS % 4 == 0 and D % 32 == 0)


# ---- entry points: (rows, *args) -> serial or parallel build --------------------------------------
# NOTE: fastmath is contract (fma) and nsz only, never reassociation: the dot products, sums and maxima
# are written in one fixed order (reductions.py's dot / row_sum / row_max, vector IR), so that the
# code a process compiles and runs and the copy it caches for the next process give the same bits
# (with reassoc + nsz LLVM reordered them differently in the two: docs/kernels.md).
# Rows here are work items x kv heads: a single decode sequence has only Hkv of them, too little work
# to pay for waking the thread pool, so the per-op path runs the serial build for it.
paged_attention_kernel = Kernel(_paged_attention_kernel, min_parallel_rows=16,
                                fastmath={"contract", "nsz"})
decode_attention_kernel = Kernel(_decode_attention_kernel, min_parallel_rows=16,
                                 fastmath={"contract", "nsz"})
decode_attention_avx2_kernel = Kernel(_decode_attention_avx2_kernel, min_parallel_rows=16,
                                      fastmath={"contract", "nsz"})
