"""Paged-attention inputs for the kernel tests: random per-sequence K/V written into a KV pool of any
cache dtype through shuffled block tables, and the pool read back as floats for paged_attention_ref."""

from __future__ import annotations

import numpy as np

from rawinfer.exec.memory import kv_cache_shape
from reference_ops import quantize_rows_ref

RNG = np.random.default_rng(4321)


def rand(*shape, rng=None):
    return (rng or RNG).standard_normal(shape).astype(np.float32)


def tile_scales(cache, blk, h, BS):
    """The float32 row scales of an int8 cache's (block, kv head) tile (kv_cache_shape in rawinfer/exec/memory.py)."""
    D = cache.shape[3]
    return cache[blk, h].reshape(-1)[BS * D:BS * D + 4 * BS].view(np.float32)


def paged_case(q_lens, ctx_lens, H, Hkv, D, BS, shuffle_seed, value_seed=None, kv_dtype=np.float32):
    """Random per-sequence K/V written into a pool (of kv_dtype) through (shuffled) block tables:
    paged_attention's inputs (qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc)."""
    rng = np.random.default_rng(shuffle_seed)
    vrng = np.random.default_rng(value_seed) if value_seed is not None else RNG
    B = len(q_lens)
    nblocks = [-(-c // BS) for c in ctx_lens]
    NB = sum(nblocks) + 3
    perm = rng.permutation(NB).astype(np.int32)
    if kv_dtype == np.int8:                               # garbage rows and scales everywhere else
        shape = kv_cache_shape(NB, Hkv, BS, D, np.int8)
        kc, vc = (vrng.integers(-128, 128, shape).astype(np.int8) for _ in range(2))
        for c in (kc, vc):
            for blk in range(NB):
                for h in range(Hkv):
                    tile_scales(c, blk, h, BS)[:] = vrng.random(BS, np.float32)
    else:
        kc = rand(NB, Hkv, BS, D, rng=vrng)   # garbage everywhere a sequence does not own
        vc = rand(NB, Hkv, BS, D, rng=vrng)
    MB = max(nblocks)
    tables = np.full((B, MB), 0, np.int32)
    used = 0
    for b, c in enumerate(ctx_lens):
        tab = perm[used:used + nblocks[b]]
        used += nblocks[b]
        tables[b, :len(tab)] = tab
        k, v = rand(c, Hkv, D, rng=vrng), rand(c, Hkv, D, rng=vrng)
        if kv_dtype == np.int8:
            (kq, ks), (vq, vs) = quantize_rows_ref(k), quantize_rows_ref(v)
            for p in range(c):
                kc[tab[p // BS], :, p % BS], vc[tab[p // BS], :, p % BS] = kq[p], vq[p]
                for h in range(Hkv):
                    tile_scales(kc, tab[p // BS], h, BS)[p % BS] = ks[p, h]
                    tile_scales(vc, tab[p // BS], h, BS)[p % BS] = vs[p, h]
        else:
            for p in range(c):
                kc[tab[p // BS], :, p % BS] = k[p]
                vc[tab[p // BS], :, p % BS] = v[p]
    T = sum(q_lens)
    qkv = rand(T, (H + 2 * Hkv) * D, rng=vrng)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kc, vc = kc.astype(kv_dtype), vc.astype(kv_dtype)
    return qkv, kc, vc, tables, np.asarray(ctx_lens, np.int32), qsl


def float_cache(cache, BS):
    """The K (or V) values a cache holds, as float [NB, Hkv, BS, D] for paged_attention_ref: an int8
    cache's rows times their float32 scales (the tile layout of kv_cache_shape in rawinfer/exec/memory.py), any other
    cache as it is."""
    if cache.dtype != np.int8:
        return cache
    NB, Hkv, _, D = cache.shape
    tiles = cache.reshape(NB, Hkv, -1)
    scales = np.ascontiguousarray(tiles[..., BS * D:BS * D + 4 * BS]).view(np.float32)   # [NB, Hkv, BS]
    return tiles[..., :BS * D].reshape(NB, Hkv, BS, D).astype(np.float32) * scales[..., None]
