"""The op interface: every array operation the model and the pool need, one method per kernel.

`rawinfer.exec.model` is written against this interface only; `cpu.CPUBackend` (NumPy + Numba) and
`cuda.CUDABackend` (CuPy RawKernels + cuBLAS) implement it one for one. Each op writes into an output
buffer the caller passes in (a view of the memory pool's workspace), so no op allocates on the hot path.

Shape letters (docs/architecture.md): T tokens in the flat batch, B sequences, H query heads, Hkv key/value heads,
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
    k_cache[NB, Hkv, BS + E, D], kv_cache_shape in rawinfer/exec/memory.py.)

Attention metadata of a flat batch of B sequences:

    query_start_loc[B+1] int32   tokens of sequence b are rows query_start_loc[b] : query_start_loc[b+1]
    context_lens[B]      int32   tokens of sequence b in the cache once this step's K/V are written
                                 (so its queries sit at positions context_lens[b] - q_len_b ... context_lens[b]-1)
    block_tables[B, MB]  int32   physical block ids; entries past the sequence's blocks are ignored
    slot_mapping[T]      int32   destination slot of each token's K/V
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rawinfer.backend import shapes
from rawinfer.backend.logprobs import LogprobRows, logprob_rows


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the ops every backend has. The memory pool, the runner and the
    sampler read these instead of probing the backend for methods."""

    on_gpu: bool = False                     # arrays live in device memory: size the pool from free memory
    graphs: bool = False                     # capture_graph(): pure decode steps replayed as captured graphs
    device_sampling: bool = False            # sample(): filtered draws on the device (cuda/sampling.cu)
    quantized_weights: tuple[str, ...] = ()  # weight formats of rawinfer/quant.py that linear() takes

    def conversions(self) -> str:
        """How to convert a model this backend runs, for a refusal's fix: "with --quant int8, with --quant fp8
        or without --quant"."""
        return "".join(f"with --quant {q}, " for q in self.quantized_weights[:-1]) + "".join(
            f"with --quant {q} or " for q in self.quantized_weights[-1:]) + "without --quant"


@dataclass(frozen=True)
class FlatBatch:
    """Device-side inputs of one forward pass: B sequences' new tokens as one flat batch of T rows
    (the attention metadata below), S of whose rows need logits."""

    token_ids: Any             # [T] int32
    positions: Any             # [T] int32
    slot_mapping: Any          # [T] int32
    block_tables: Any          # [B, MB] int32
    context_lens: Any          # [B] int32
    query_start_loc: Any       # [B+1] int32
    logits_indices: Any        # [S] int32: rows whose logits are returned
    num_tokens: int            # T
    max_query_len: int
    max_context_len: int


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the ops take them (float arrays, or quant.Int8Weight /
    quant.Q4Weight for a quantized model's matrices) and its attention settings. The optional
    tensors are None where the model's family has no such op (config.py's v2 keys)."""

    input_norm: Any            # [C]
    qkv_proj: Any              # [(H + 2Hkv) * D, C]
    qkv_bias: Any              # [(H + 2Hkv) * D], or None
    o_proj: Any                # [C, H * D]
    post_attn_norm: Any        # [C]   the norm before the MLP
    gate_up_proj: Any          # [2F, C]
    down_proj: Any             # [C, F]
    q_norm: Any = None         # [D]   per-head RMSNorm of q and k before RoPE (qk_norm)
    k_norm: Any = None         # [D]
    attn_out_norm: Any = None  # [C]   RMSNorm of the attention and MLP outputs before their residual
    mlp_out_norm: Any = None   # [C]   adds (sandwich_norms)
    cos_sin: Any = None        # [P, D] float32: this layer's RoPE table (Backend.rope)
    window: int = 0            # sliding window in tokens (0: full attention)

    MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    TENSORS = ("input_norm", "qkv_proj", "qkv_bias", "o_proj", "post_attn_norm", "gate_up_proj", "down_proj",
               "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


@dataclass(frozen=True)
class Activations:
    """The activation buffers a forward pass writes, each with room for T_max rows (views of the
    memory pool's workspace; a step uses rows [:T])."""

    hidden: Any                # [T_max, C]  attention / MLP output, input of the next residual add
    residual: Any              # [T_max, C]  the residual stream (float32)
    normed: Any                # [T_max, C]  RMSNorm output
    qkv: Any                   # [T_max, (H + 2Hkv) * D]
    attn: Any                  # [T_max, H * D]
    gate_up: Any               # [T_max, 2F]
    act: Any                   # [T_max, F]


class Backend(ABC):
    """One device's implementation of the ops. Arrays are NumPy arrays on the CPU, CuPy arrays on CUDA."""

    name: str = "abstract"
    xp: Any = np                      # the array module (numpy or cupy)
    capabilities = Capabilities()
    kernel_cache: str | None = None   # the folder its compiled kernels are kept in across runs (None: none)

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

    def prepare_weight(self, w, head: bool = False):
        """A quantized matrix (quant.Int8Weight, quant.Q4Weight) as this backend computes with it (called
        once per matrix at load; head: the LM head, outside the decoder layers): the same object, or a
        copy carrying a repacked layout in `packed`."""
        return w

    @abstractmethod
    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Copy host array src (same shape, castable dtype) into the pool view dst."""

    @abstractmethod
    def to_host(self, x: Any) -> np.ndarray:
        """A NumPy copy (or view) of x."""

    def begin_step(self) -> None:
        """Called by the runner before each step's first op: a backend may adapt to the machine here (the
        CPU backend picks its thread count)."""

    def after_warm_up(self) -> None:
        """Called when the engine's warm-up is done: what the backend measured of the machine during it
        (the CPU backend: the compile helper's load, as another program's) no longer holds."""

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
    def embedding(self, ids, table, out, scale: float = 1.0) -> None:
        """out[T, C] = table[V, C][ids[T]] * scale (out is the float32 residual stream; the table may be
        fp16/bf16, or a quant.Int8Weight)."""

    @abstractmethod
    def rmsnorm(self, x, weight, eps: float, out) -> None:
        """out[T, C] = x / sqrt(mean(x^2) + eps) * weight[C]   (statistics in float32)."""

    @abstractmethod
    def add_rmsnorm(self, x, residual, weight, eps: float, out) -> None:
        """residual[T, C] += x[T, C]; out[T, C] = rmsnorm(residual) * weight   (fused, in place)."""

    def norm_add_rmsnorm(self, x, x_weight, residual, weight, eps: float, out) -> None:
        """residual[T, C] += rmsnorm(x) * x_weight; out[T, C] = rmsnorm(residual) * weight (sandwich norms:
        the attention or MLP output normalised before its residual add). x's contents afterwards are
        unspecified. By default rmsnorm() in place on x, then add_rmsnorm(); a backend may fuse the two."""
        self.rmsnorm(x, x_weight, eps, x)
        self.add_rmsnorm(x, residual, weight, eps, out)

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

    def head_rmsnorm(self, qkv, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int) -> None:
        """In place on qkv[T, (H+2Hkv)*D]: every q head x = x / sqrt(mean(x^2) + eps) * q_weight[D], every
        k head the same with k_weight[D]; v heads unchanged (Qwen3's and Gemma 3's q/k norm, before RoPE)."""
        raise NotImplementedError(f"the {self.name} backend has no per-head RMSNorm (models with qk_norm)")

    def gelu_tanh_mul(self, gate_up, out) -> None:
        """out[T, F] = gelu_tanh(gate_up[:, :F]) * gate_up[:, F:] (GeGLU; gelu with the tanh approximation:
        0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))))."""
        raise NotImplementedError(f"the {self.name} backend has no GeGLU (models with hidden_act gelu_tanh)")

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

    def fused_rope_kv_write(self, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads: int,
                            num_kv_heads: int, q_norm=None, k_norm=None, eps: float = 0.0) -> None:
        """Everything between the QKV product and attention: head_rmsnorm(q_norm, k_norm) when given (qk_norm
        families), rope() with cos_sin, kv_write() at slot_mapping, so qkv, k_cache and v_cache end as the
        three ops leave them. By default the three in turn; a backend may do them in one pass."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("fused_rope_kv_write: give both q_norm and k_norm (qk_norm) or neither")
        if q_norm is not None:
            self.head_rmsnorm(qkv, q_norm, k_norm, eps, num_heads, num_kv_heads)
        self.rope(qkv, positions, cos_sin, num_heads, num_kv_heads)
        self.kv_write(qkv, k_cache, v_cache, slot_mapping, num_heads)

    def paged_attention(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                        scale: float, out, max_query_len: int, max_context_len: int, window: int = 0) -> None:
        """Causal grouped-query attention of every query in the flat batch against its sequence's
        cached K/V, read only through block_tables.  Query head h uses KV head h // (H // Hkv).
        out[T, H*D].  max_query_len / max_context_len are host-side bounds for launch sizing.

        A pure decode batch (one query per sequence, row b = sequence b) takes paged_attention_decode,
        anything else (prefill, chunked prefill, mixed batches) paged_attention_prefill. window W > 0 (a
        sliding-window layer): a query at position p attends to positions p - W + 1 .. p only."""
        T, B, _, _, _ = shapes.attention("paged_attention", qkv, k_cache, v_cache, block_tables, context_lens,
                                         query_start_loc, out)
        if max_query_len == 1 and T == B:
            self.paged_attention_decode(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                        out, max_context_len, window)
        else:
            self.paged_attention_prefill(qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                         out, max_query_len, window)

    @abstractmethod
    def paged_attention_decode(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                               scale: float, out, max_context_len: int, window: int = 0) -> None:
        """paged_attention of a pure decode batch: T = B, row b is sequence b's one new token."""

    @abstractmethod
    def paged_attention_prefill(self, qkv, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale: float, out, max_query_len: int, window: int = 0) -> None:
        """paged_attention of any batch (sequences with several queries each: prefill chunks)."""

    @abstractmethod
    def copy_blocks(self, k_caches, v_caches, pairs: list[tuple[int, int]]) -> None:
        """For copy-on-write: for every layer, copy block src to block dst in both caches."""

    @abstractmethod
    def take_rows(self, x, indices, out) -> None:
        """out[B, C] = x[T, C][indices[B]]."""

    def kv_blocks_to_host(self, kv, block_ids: list[int]) -> list[np.ndarray]:
        """Every layer's K and V of block_ids as host arrays (KVCache.read_blocks' [2, n, Hkv, R, D], storage
        dtype), for a KV transfer to another engine. A GPU backend stages them through pinned memory."""
        return [kv.read_blocks(self.xp, layer, block_ids) for layer in range(len(kv.k))]

    # ---- optional fused path ------------------------------------------------------------------
    def fused_max_tokens(self, quant: str | None) -> int:
        """Batches of at most this many tokens use decoder_layers() (0: never) for a model quantized as quant."""
        return 0

    def fused_limits(self, plan) -> tuple[int, int]:
        """(T, D): once the plan is built, batches of at most T tokens and pure decode batches (one new
        token per sequence) of at most D tokens take decoder_layers() (0: none)."""
        return 0, 0

    def fused_plan(self, layers: list[LayerWeights], k_caches: list, v_caches: list, gelu: bool = False):
        """Optional: whatever decoder_layers() needs prepared once (called when fused_max_tokens > 0);
        gelu: the MLP is GeGLU (hidden_act gelu_tanh), not SwiGLU."""
        raise NotImplementedError

    def decoder_layers(self, plan, acts: Activations, T: int, batch: FlatBatch, cos_sin, eps: float, scale: float,
                       num_heads: int, num_kv_heads: int) -> None:
        """Optional: every decoder layer (the same ops as exec/model.py's per-op path, in the same order,
        over the rows [:T] of `acts`) in one call, for small decode batches where per-op dispatch costs
        more than the work. Only called for the batches fused_limits(plan) admits, and only for models of
        the Llama layer shape (no qk_norm, sandwich norms or GeGLU; one RoPE table, cos_sin; each layer's
        window is LayerWeights.window)."""
        raise NotImplementedError

    # ---- capabilities beyond the ops (see Capabilities) ----------------------------------------
    def device_memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory; only where capabilities.on_gpu."""
        raise NotImplementedError(f"the {self.name} backend has no device memory")

    def attention_workspace_bytes(self, max_num_seqs: int, num_heads: int, head_dim: int, block_size: int,
                                  max_context_len: int, itemsize: int, num_kv_heads: int) -> int:
        """Bytes of scratch decode attention needs for up to max_num_seqs sequences of up to
        max_context_len tokens (0: none). The memory pool carves them and binds them once."""
        return 0

    def bind_attention_workspace(self, buffer) -> None:
        """Use `buffer` (a flat uint8 carve of the pool of attention_workspace_bytes()) as decode
        attention's scratch."""

    def capture_graph(self, fn: Callable[[], Any]):
        """Where capabilities.graphs: run fn once, then capture it; the result's replay() repeats it."""
        raise NotImplementedError(f"the {self.name} backend cannot capture graphs")

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform) -> np.ndarray:
        """Where capabilities.device_sampling: host int64[S], one token per logits row (engine/sampler.py
        states the rule)."""
        raise NotImplementedError(f"the {self.name} backend has no device sampler")

    def argmax(self, logits) -> np.ndarray:
        """Host int64[B]: the index of the largest logit of each row (first one on ties)."""
        return np.argmax(self.to_host(logits), axis=-1)

    def grammar_mask(self, logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
        """Structured output, in place: logits[rows[i], v] = -inf for every token v that bitmask row i forbids
        (bit v % 32 of word v // 32 clear). bitmask [R, W] int32 and rows [R] are host arrays; 32 W >= V."""
        R, V, _ = shapes.grammar_mask(logits, bitmask, rows)
        # little-endian words and little bit order: bit j of byte b is token 8 b + j
        allowed = np.unpackbits(np.ascontiguousarray(bitmask, np.int32).view(np.uint8), axis=1, bitorder="little")
        for i in range(R):
            np.putmask(logits[int(rows[i])], allowed[i, :V] == 0, -np.inf)

    def logprobs(self, logits, rows: np.ndarray, token_ids: np.ndarray, k: int) -> LogprobRows:
        """Log-probabilities of token_ids[i] under logits row rows[i] and the k most likely alternatives,
        computed where the logits are; only [R] and [R, k] results come to the host (backend/logprobs.py)."""
        return logprob_rows(self.xp, self.to_host, logits, np.asarray(rows), np.asarray(token_ids), k)

    def as_index_array(self, host: np.ndarray) -> Any:
        """Move small int32 metadata (ids, positions, block tables) to the device."""
        return np.ascontiguousarray(host, dtype=np.int32)
