"""The op interface: every array operation the model and the pool need, one method per kernel.

`rawinfer.model` is written against this interface only; `cpu.CPUBackend` (NumPy + Numba) and
`cuda.CUDABackend` (CuPy RawKernels + cuBLAS) implement it one for one. Each op writes into an output
buffer the caller passes in (a view of the memory pool's workspace), so no op allocates on the hot path.

Shape letters (DESIGN.md): T tokens in the flat batch, B sequences, H query heads, Hkv key/value heads,
D head_dim, C hidden, F FFN width, V vocab, NB blocks, BS block size, MB max blocks per sequence.

The fused QKV row layout (one row per token, as the QKV GEMM writes it):

    qkv[t] = | q head 0 | q head 1 | ... | q head H-1 | k head 0 | ... | k head Hkv-1 | v head 0 | ... |
               <-- D -->                               <-- D -->                      <-- D -->

The paged KV cache of one layer (one tensor for K, one for V):

    k_cache[NB, Hkv, BS, D]   block b holds, per KV head, BS consecutive positions of D values.
    A token at logical position p of a sequence lives in physical block block_table[p // BS], row
    p % BS; its "slot" is block_table[p // BS] * BS + p % BS.  Keeping a head's BS x D tile contiguous
    lets one GPU thread block (or one CPU loop) stream a whole tile for all the query heads that share it.
    (The CPU's int8 cache appends each tile's BS float32 row scales as ceil(4 BS / D) more rows:
    k_cache[NB, Hkv, BS + E, D], memory.kv_cache_shape.)

Attention metadata of a flat batch of B sequences:

    query_start_loc[B+1] int32   tokens of sequence b are rows query_start_loc[b] : query_start_loc[b+1]
    context_lens[B]      int32   tokens of sequence b in the cache once this step's K/V are written
                                 (so its queries sit at positions context_lens[b] - q_len_b ... context_lens[b]-1)
    block_tables[B, MB]  int32   physical block ids; entries past the sequence's blocks are ignored
    slot_mapping[T]      int32   destination slot of each token's K/V
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np


class Backend(ABC):
    """One device's implementation of the ops. Arrays are NumPy arrays on the CPU, CuPy arrays on CUDA."""

    name: str = "abstract"
    xp: Any = np                      # the array module (numpy or cupy)

    # ---- memory -------------------------------------------------------------------------------
    @abstractmethod
    def alloc_arena(self, nbytes: int) -> Any:
        """One flat uint8 buffer of nbytes: the whole memory pool. Called once per engine."""

    def prefault(self, arena: Any, offset: int, nbytes: int) -> None:
        """Make arena[offset : offset + nbytes] resident ahead of use, without changing its bytes (a GPU
        pool is resident already)."""

    def carve(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A typed, C-contiguous view of arena[offset : offset + prod(shape) * itemsize]."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return arena[offset:offset + n].view(dtype).reshape(shape)

    def prepare_int8(self, w):
        """A quant.Int8Weight as this backend computes with it (called once per matrix at load): the
        same object, or a copy carrying a repacked layout in `packed`."""
        return w

    @abstractmethod
    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Copy host array src (same shape, castable dtype) into the pool view dst."""

    @abstractmethod
    def to_host(self, x: Any) -> np.ndarray:
        """A NumPy copy (or view) of x."""

    def synchronize(self) -> None:
        """Wait until every queued op has finished (a no-op on the CPU)."""

    def weight_dtype(self, model_dtype: str) -> np.dtype:
        """The dtype weights are stored in on this device for a model converted as model_dtype."""
        return np.dtype(np.float32)

    def kv_dtype(self, model_dtype: str, choice: str = "auto", quant: str | None = None) -> np.dtype:
        """The element type of the KV cache for a model of model_dtype (quantized as quant) when the
        user asked for `choice` (EngineConfig.kv_cache_dtype); raises ValueError for one this backend
        cannot run."""
        return np.dtype(np.float32 if choice == "auto" else choice)

    def activation_dtype(self, model_dtype: str) -> np.dtype:
        return np.dtype(np.float32)

    # ---- layer ops ----------------------------------------------------------------------------
    @abstractmethod
    def embedding(self, ids, table, out) -> None:
        """out[T, C] = table[V, C][ids[T]] (out is the float32 residual stream; the table may be fp16/bf16)."""

    @abstractmethod
    def rmsnorm(self, x, weight, eps: float, out) -> None:
        """out[T, C] = x / sqrt(mean(x^2) + eps) * weight[C]   (statistics in float32)."""

    @abstractmethod
    def add_rmsnorm(self, x, residual, weight, eps: float, out) -> None:
        """residual[T, C] += x[T, C]; out[T, C] = rmsnorm(residual) * weight   (fused, in place)."""

    @abstractmethod
    def linear(self, x, w, out, bias=None, scratch=None) -> None:
        """out[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]).  w is row-major (out features x in features),
        or a quant.Int8Weight (int8 rows + one scale per row), in which case `scratch` (a flat float32
        workspace buffer) may hold dequantized row tiles."""

    @abstractmethod
    def rope(self, qkv, positions, cos_sin, num_heads: int, num_kv_heads: int) -> None:
        """Rotate the q and k heads of qkv[T, (H+2Hkv)*D] in place (Hugging Face "rotate_half" layout:
        element i pairs with i + D/2).  cos_sin[P, D] float32 holds cos in [:, :D/2] and sin in [:, D/2:]
        for every position < P; positions[T] int32."""

    @abstractmethod
    def silu_mul(self, gate_up, out) -> None:
        """out[T, F] = silu(gate_up[:, :F]) * gate_up[:, F:]   (gate_up is [T, 2F])."""

    def linear_silu_mul(self, x, w, gate_up, out, scratch=None) -> None:
        """out[T, F] = silu(x @ Wg^T) * (x @ Wu^T) for the gate_up weight w = [Wg; Wu] ([2F, K]); gate_up
        [T, 2F] is workspace a backend may skip. By default linear() into gate_up, then silu_mul()."""
        self.linear(x, w, gate_up, scratch=scratch)
        self.silu_mul(gate_up, out)

    @abstractmethod
    def kv_write(self, qkv, k_cache, v_cache, slot_mapping, num_heads: int) -> None:
        """Scatter the k and v heads of qkv[T, (H+2Hkv)*D] into k_cache/v_cache[NB, Hkv, BS, D] at
        slot_mapping[T] (slot = block * BS + row)."""

    @abstractmethod
    def paged_attention(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                        scale: float, out, max_query_len: int, max_context_len: int) -> None:
        """Causal grouped-query attention of every query in the flat batch against its sequence's
        cached K/V, read only through block_tables.  Query head h uses KV head h // (H // Hkv).
        out[T, H*D].  max_query_len / max_context_len are host-side bounds for launch sizing."""

    @abstractmethod
    def copy_blocks(self, k_caches, v_caches, pairs: list[tuple[int, int]]) -> None:
        """For copy-on-write: for every layer, copy block src to block dst in both caches."""

    @abstractmethod
    def take_rows(self, x, indices, out) -> None:
        """out[B, C] = x[T, C][indices[B]]."""

    # ---- optional fused path ------------------------------------------------------------------
    def fused_max_tokens(self, quant: str | None) -> int:
        """Batches of at most this many tokens use decoder_layer() (0: never) for a model quantized as quant."""
        return 0

    def fused_decode_max_tokens(self, plan) -> int:
        """Pure decode batches (one new token per sequence) of up to this many tokens also use
        decoder_layers() (0: only batches within fused_max_tokens do)."""
        return 0

    def fused_plan(self, layers: list[dict], k_caches: list, v_caches: list):
        """Optional: whatever decoder_layers() needs prepared once (called when fused_max_tokens > 0)."""
        raise NotImplementedError

    def decoder_layers(self, plan, ws, T: int, batch, cos_sin, eps: float, scale: float, num_heads: int,
                       num_kv_heads: int) -> None:
        """Optional: every decoder layer (the same ops as model.py's per-op path, in the same order, over
        the workspace `ws` rows [:T]) in one call, for small decode batches where per-op dispatch costs
        more than the work. Only called when T <= fused_max_tokens(quant), or for a pure decode batch
        of T <= fused_decode_max_tokens(plan)."""
        raise NotImplementedError

    def argmax(self, logits) -> np.ndarray:
        """Host int64[B]: the index of the largest logit of each row (first one on ties)."""
        return np.argmax(self.to_host(logits), axis=-1)

    def as_index_array(self, host: np.ndarray) -> Any:
        """Move small int32 metadata (ids, positions, block tables) to the device."""
        return np.ascontiguousarray(host, dtype=np.int32)
