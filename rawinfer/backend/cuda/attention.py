"""Paged attention on CUDA: launch geometry of the decode and prefill kernels and the decode split-K scratch.

CUDABackend owns one `PagedAttention` and forwards its paged_attention_decode / _prefill (Backend.paged_attention,
base.py, checks the shapes and sends a pure decode batch to the first, anything else to the second) to
`decode` / `prefill` here; the kernels' own comments (cuda/paged_attention_decode.cu,
cuda/paged_attention_prefill.cu) give their layouts and shared memory.

Prefill on f16 / bf16 with a head dim of `kernel_specs.FLASH_HEAD_DIMS` runs on tensor cores
(cuda/flash_attention_prefill.cu: 64 (query, head) rows of one KV head's query heads per block,
mma.sync, cp.async K/V tiles); float32, other head dims and caches not 16-byte aligned run
cuda/paged_attention_prefill.cu, which takes the same arguments (`flash_prefill = False` sends
everything there).

Decode splits each sequence's context into partitions of P positions, P a whole number of KV blocks
(split-K, one thread block per split, KV head and sequence: the block serves all G query heads of the
KV head from one read of each K/V row), and merges the splits in a second kernel.  P is each
sequence's own (decode_split_len: about its context / decode_target_splits, between the shortest and
the longest split), so a long context of a lone sequence spreads over every SM (flash-decoding) and
no sequence's rounding depends on the rest of the batch.
On a sliding-window layer (window W > 0) the partitions cover the window only, from its first position:
the positions before it are never read, and the grid needs ceil(min(bound, W) / P) splits.  Both
kernels take the window as an argument (0: full causal attention).  The partial results live in a
float32 scratch buffer: a private, growing one by default, or a carve of the memory pool bound with
`bind_attention_workspace` (sized by `attention_workspace_bytes`), so that a decode step allocates nothing
and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.cuda import kernel_specs as ks
from rawinfer.backend.cuda.launch import MAX_SHARED_BYTES, Launches, address, round_up

DECODE_THREADS = 128           # DECODE_THREADS in cuda/paged_attention_decode.cu
DECODE_REDUCE_HEADS = 4        # DECODE_REDUCE_HEADS (GR) in cuda/paged_attention_decode.cu
PREFILL_ROWS = 16              # PREFILL_ROWS in cuda/paged_attention_prefill.cu
PREFILL_THREADS = 128          # PREFILL_THREADS in cuda/paged_attention_prefill.cu
MAX_HEAD_DIM = 256             # both kernels; PREFILL_MAX_D sizes the prefill kernel's per-lane accumulators
FLASH_ROWS = 64                # FLASH_ROWS in cuda/flash_attention_prefill.cu: query rows per block
FLASH_THREADS = 128            # FLASH_THREADS
FLASH_PAD = 8                  # FLASH_PAD: elements of padding per shared-memory row


class PagedAttention:
    """CUDABackend's paged attention: the decode and prefill launches, their tuning and the decode scratch."""

    def __init__(self, launches: Launches, xp: Any, *, decode_partition: int):
        """launches: the backend's (launch.py); xp: numpy or cupy, for the private scratch buffer;
        decode_partition: the longest decode split, positions, before rounding to whole blocks."""
        self.launches, self.xp = launches, xp
        self.decode_partition = decode_partition
        self.decode_min_partition = 64     # the shortest decode split (capped at decode_partition), likewise
        self.decode_target_splits = 16     # splits a sequence's context is cut into, between those two lengths
        self.decode_heads_per_pass = 8     # GC of the decode kernel (4: the baseline tools/gpu_decode_bench.py times)
        self.flash_prefill = True          # tensor-core prefill where it applies; False: always the paged kernel
        self._workspace: Any = None        # float32 [n]: split-K partial results of decode attention
        self._workspace_bound = False      # the workspace is a carve of the pool (never grown)

    # ---- shapes -------------------------------------------------------------------------------------
    @staticmethod
    def _attention_sizes(op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                         out) -> tuple[int, int, int, int, int]:
        """The shape contract (shapes.attention) plus what only these kernels require -> (B, H, Hkv, BS, D)."""
        _, batch, num_heads, num_kv_heads, head_dim = shapes.attention(
            op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim {head_dim} is larger than the kernels support ({MAX_HEAD_DIM})")
        if qkv.dtype != k_cache.dtype or out.dtype != qkv.dtype:
            raise ValueError(f"{op}: qkv ({qkv.dtype}), the caches ({k_cache.dtype}) and out ({out.dtype}) "
                             "must share one dtype")
        return batch, num_heads, num_kv_heads, int(k_cache.shape[2]), head_dim

    # ---- decode: split-K and merge ------------------------------------------------------------------
    def decode_partition_size(self, group: int, head_dim: int, block_size: int, itemsize: int) -> int:
        """The longest split of the decode kernel (its shared memory holds a score per position and head):
        whole KV blocks, near decode_partition, and small enough that the block's shared memory fits."""
        partition = max(block_size, self.decode_partition // block_size * block_size)
        while partition > block_size and self._decode_smem(group, head_dim, partition, itemsize) > MAX_SHARED_BYTES:
            partition -= block_size
        return partition

    def decode_split_range(self, group: int, head_dim: int, block_size: int, itemsize: int) -> tuple[int, int]:
        """(shortest, longest) split of the decode kernel, whole KV blocks, shortest <= longest."""
        longest = self.decode_partition_size(group, head_dim, block_size, itemsize)
        shortest = min(longest, max(block_size, self.decode_min_partition // block_size * block_size))
        return shortest, longest

    def decode_split_len(self, span: int, block_size: int, split_range: tuple[int, int]) -> int:
        """Positions per split of a sequence whose query sees `span` positions (decode_split_len in
        cuda/paged_attention_decode.cu): about span / decode_target_splits in whole blocks, within
        split_range.  A function of the sequence alone, so its result never depends on the batch."""
        shortest, longest = split_range
        length = -(-(-(-span // self.decode_target_splits)) // block_size) * block_size
        return min(longest, max(shortest, length))

    def decode_splits(self, bound: int, split_range: tuple[int, int]) -> int:
        """The grid's split count: at least ceil(span / decode_split_len(span)) for every span <= bound.
        A split is never shorter than span / target (at most target splits) unless it is the longest
        (then ceil(bound / longest)), nor shorter than the shortest (at most ceil(bound / shortest))."""
        shortest, longest = split_range
        return min(-(-bound // shortest), max(self.decode_target_splits, -(-bound // longest)))

    @staticmethod
    def _decode_smem(group: int, head_dim: int, partition: int, itemsize: int) -> int:
        """Dynamic shared memory of the decode kernel, bytes: q_s [G, D] | p_s [G, P] | red_s [NG, GR, D]
        floats, NG = DECODE_THREADS / (threads per 16-byte-vector row of D)."""
        token_groups = DECODE_THREADS // (head_dim * itemsize // 16)
        return 4 * (group * head_dim + group * partition + token_groups * DECODE_REDUCE_HEADS * head_dim)

    def attention_workspace_bytes(self, max_num_seqs: int, num_heads: int, head_dim: int, block_size: int,
                                  max_context_len: int, itemsize: int, num_kv_heads: int) -> int:
        """Bytes of split-K scratch a decode step of up to max_num_seqs sequences needs: per sequence,
        query head and split, D partial outputs, a max and a sum (float32)."""
        split_range = self.decode_split_range(num_heads // num_kv_heads, head_dim, block_size, itemsize)
        splits = self.decode_splits(max_context_len, split_range)
        return 4 * max_num_seqs * num_heads * splits * (head_dim + 2)

    def bind_attention_workspace(self, buffer) -> None:
        """Use `buffer` (a flat uint8 carve of the pool, 4-byte aligned) as the decode split-K scratch, so
        decoding allocates nothing (required for CUDA graph capture).  None returns to a private,
        growing scratch buffer."""
        self._workspace = None if buffer is None else buffer.view(np.float32)
        self._workspace_bound = buffer is not None

    def _scratch(self, nfloats: int):
        if self._workspace is None or self._workspace.size < nfloats:
            if self._workspace_bound:
                raise RuntimeError(f"the bound attention workspace holds {self._workspace.size} floats but this "
                                   f"decode step needs {nfloats}; size it with attention_workspace_bytes()")
            self._workspace = self.xp.empty(nfloats, np.float32)
        return self._workspace

    def decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
               scale: float, out, max_context_len: int, window: int = 0) -> None:
        """Grid (S, Hkv, B), S = decode_splits(min(max_context_len, window)) (window 0: max_context_len):
        max_context_len is a bound, not the batch's longest context, so a captured graph may fix it at the
        longest context the engine allows.  The splits start at each sequence's window, so a sliding layer
        needs only the splits its window spans."""
        op = "paged_attention_decode"
        window = _check_window(op, window)
        batch, num_heads, num_kv_heads, block_size, head_dim = self._attention_sizes(
            op, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
        itemsize = np.dtype(k_cache.dtype).itemsize
        if head_dim * itemsize % 16:
            raise ValueError(f"{op}: head_dim {head_dim} x {itemsize} bytes is not a multiple of 16 bytes, "
                             "which the kernel's vector loads need")
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if address(a) % 16:
                raise ValueError(f"{op}: {name} is not 16-byte aligned; carve it at an aligned offset")
        if batch == 0 or max_context_len < 1:
            return
        group = num_heads // num_kv_heads
        shortest, longest = self.decode_split_range(group, head_dim, block_size, itemsize)
        span = min(max_context_len, window) if window else max_context_len    # the most positions a query sees
        splits = self.decode_splits(span, (shortest, longest))
        stats = batch * num_heads * splits
        scratch = self._scratch(stats * (head_dim + 2))
        part_out = scratch[:stats * head_dim]                          # [B, H, S, D]
        part_max = scratch[stats * head_dim:stats * (head_dim + 1)]    # [B, H, S]
        part_sum = scratch[stats * (head_dim + 1):stats * (head_dim + 2)]
        targs = (ks.element_type(qkv.dtype),)
        self.launches.launch("paged_attention_decode_kernel", targs + (str(self.decode_heads_per_pass),),
                             (splits, num_kv_heads, batch), (DECODE_THREADS,),
                             self._decode_smem(group, head_dim, longest, itemsize),
                             part_out, part_max, part_sum, qkv, k_cache, v_cache, block_tables, context_lens,
                             query_start_loc, scale, num_heads, num_kv_heads, head_dim, block_size,
                             block_tables.shape[1], shortest, longest, self.decode_target_splits, splits, window)
        self.launches.launch("paged_attention_merge_kernel", targs, (num_heads, batch),
                             (min(1024, round_up(head_dim, 32)),), 0,
                             out, part_out, part_max, part_sum, context_lens, query_start_loc, num_heads, head_dim,
                             block_size, shortest, longest, self.decode_target_splits, splits, window)

    # ---- prefill: query tiles x key tiles -----------------------------------------------------------
    @staticmethod
    def prefill_kv_tile(head_dim: int, itemsize: int) -> tuple[int, int]:
        """(key positions per tile, shared memory bytes) of the prefill kernel: the largest tile that
        fits.  Shared memory: q_s [16, D + 1] and p_s [16, 32] floats, then k_s and v_s [tile, D + pad]
        of the storage type, pad one 32-bit word."""
        kv_stride = head_dim + 4 // itemsize
        for tile in (32, 16, 8):
            smem = 4 * (PREFILL_ROWS * (head_dim + 1) + PREFILL_ROWS * 32) + 2 * tile * kv_stride * itemsize
            if smem <= MAX_SHARED_BYTES:
                return tile, smem
        raise ValueError(f"paged_attention_prefill: head_dim {head_dim} does not fit in shared memory")

    @staticmethod
    def flash_kv_tile(head_dim: int) -> tuple[int, int]:
        """(key positions per tile, shared memory bytes) of the tensor-core prefill kernel (FlashTile in
        cuda/flash_attention_prefill.cu): k_s and v_s [tile, D + 8] of a 2-byte type, then the block's 64
        FlashRow records of 24 bytes."""
        tile = 64 if head_dim <= 128 else 32
        return tile, 2 * tile * (head_dim + FLASH_PAD) * 2 + FLASH_ROWS * 24

    def uses_flash_prefill(self, qkv, k_cache, v_cache, out, head_dim: int) -> bool:
        """Whether paged_attention_prefill runs on tensor cores for these arrays: f16 / bf16, an
        instantiated head dim, caches 16-byte aligned (cp.async copies 16 bytes at a time), qkv and out
        4-byte aligned (pairs of elements)."""
        return (self.flash_prefill and ks.element_type(qkv.dtype) in ks.FLASH_TYPES
                and head_dim in ks.FLASH_HEAD_DIMS and address(k_cache) % 16 == 0 and address(v_cache) % 16 == 0
                and address(qkv) % 4 == 0 and address(out) % 4 == 0)

    def prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                scale: float, out, max_query_len: int, window: int = 0) -> None:
        """Tensor cores (`uses_flash_prefill`): grid (ceil(max_query_len * G / 64), Hkv, B), one block per 64
        (query, head) rows of the G = H / Hkv heads that share a KV head.  Else grid
        (ceil(max_query_len / 16), H, B), one block per 16 query rows of one head."""
        window = _check_window("paged_attention_prefill", window)
        batch, num_heads, num_kv_heads, block_size, head_dim = self._attention_sizes(
            "paged_attention_prefill", qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
        if batch == 0 or max_query_len < 1:
            return
        if self.uses_flash_prefill(qkv, k_cache, v_cache, out, head_dim):
            tile, smem = self.flash_kv_tile(head_dim)
            self.launches.launch("flash_attention_prefill_kernel", (ks.element_type(qkv.dtype), str(head_dim)),
                                 (-(-max_query_len * (num_heads // num_kv_heads) // FLASH_ROWS), num_kv_heads, batch),
                                 (FLASH_THREADS,), smem,
                                 out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                 num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], tile, window)
            return
        tile, smem = self.prefill_kv_tile(head_dim, np.dtype(k_cache.dtype).itemsize)
        self.launches.launch("paged_attention_prefill_kernel", (ks.element_type(qkv.dtype),),
                             (-(-max_query_len // PREFILL_ROWS), num_heads, batch), (PREFILL_THREADS,), smem,
                             out, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                             num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], tile, window)


def _check_window(op: str, window) -> int:
    """The sliding window as the kernels take it: W >= 1 tokens, or 0 for full causal attention."""
    if int(window) != window or window < 0:
        raise ValueError(f"{op}: window must be 0 (full attention) or a positive number of tokens, got {window!r}")
    return int(window)
