"""The memory pool: one arena allocated once, carved into weights, workspace and KV blocks.

    arena (one backend allocation, 256-byte aligned regions)
    +-----------------------------+------------------------------+---------------------------------+
    | weights                     | workspace                    | KV blocks                       |
    | embed, per-layer tensors,   | activation buffers sized for | per layer: k_cache, v_cache     |
    | final norm, lm head, RoPE   | max_num_batched_tokens rows  | each [NB (+1), Hkv, BS, D]      |
    | cos/sin table               | + logits rows; on CUDA also  |                                 |
    |                             | the decode split-K scratch   |                                 |
    |                             | and the decode-graph inputs  |                                 |
    +-----------------------------+------------------------------+---------------------------------+

Sizing.  The weights and the workspace have fixed sizes; the KV region gets `--kv-cache-memory` when
it is given.  Otherwise: on the CPU 1 GiB; on a GPU the whole pool is gpu_memory_utilization x the
free device memory at start (one cudaMalloc), and the KV region is what the weights and the workspace
leave of it.  With CUDA graphs on, the KV region holds one block more than the block manager hands
out: the padding block, which the padding rows of a decode graph write their K/V into.

KV layout of one layer's k_cache (v_cache is the same):

    block 0                          block 1
    | kv head 0: BS rows x D | kv head 1: BS rows x D | ... | kv head 0: BS rows x D | ...

A thread block of the decode kernel that owns (sequence, kv head) streams BS x D contiguous values per
block-table entry, which is the access pattern the GPU kernels are written for (see backend/base.py).

Nothing else allocates a large buffer while the engine runs: the model writes every activation into
the workspace views and every K/V into the KV region.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rawinfer.config import EngineConfig, ModelConfig, ModelFormatError
from rawinfer.quant import quantize, storage_kind, stored_parts

ALIGN = 256
CPU_KV_CACHE_BYTES = 1024**3        # the KV region on the CPU when --kv-cache-memory is not given


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a converted model.safetensors holds (the converter's contract)."""
    C, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (V, C), "final_norm": (C,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, C)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_norm"] = (C,)
        shapes[p + "qkv_proj"] = (cfg.qkv_size, C)
        if cfg.qkv_bias:
            shapes[p + "qkv_bias"] = (cfg.qkv_size,)
        shapes[p + "o_proj"] = (C, cfg.q_size)
        shapes[p + "post_attn_norm"] = (C,)
        shapes[p + "gate_up_proj"] = (2 * F, C)
        shapes[p + "down_proj"] = (C, F)
    return shapes


def weight_plan(cfg: ModelConfig, float_dtype) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every stored tensor: a quantized model's matrices as their parts
    (quant.stored_parts: int8 + float32 scales, or q4 nibbles + float16 block scales)."""
    plan = []
    for name, shape in weight_shapes(cfg).items():
        plan.extend(stored_parts(name, shape, storage_kind(name, shape, cfg.quant), float_dtype))
    return plan


DEQUANT_TILE_ROWS = 8192


def dequant_scratch_size(cfg: ModelConfig) -> int:
    """Floats of scratch for int8 GEMMs: the largest matrix, its rows capped at DEQUANT_TILE_ROWS."""
    if cfg.quant is None:
        return 0
    return max(min(s[0], DEQUANT_TILE_ROWS) * s[1] for s in weight_shapes(cfg).values() if len(s) == 2)


def model_len(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """The longest sequence (prompt + output) the engine allows."""
    return min(ecfg.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def max_blocks_per_seq(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """MB: the most KV blocks one sequence can own (the width of a decode graph's block table)."""
    return -(-model_len(cfg, ecfg) // ecfg.block_size)


def max_graph_batch(ecfg: EngineConfig) -> int:
    """The largest decode batch a CUDA graph is captured for (every decode batch fits in it)."""
    return min(ecfg.max_num_seqs, ecfg.max_num_batched_tokens)


def decode_input_words(batch: int, max_blocks: int) -> int:
    """int32 words of one padded decode step's inputs for `batch` rows (model_runner.decode_layout):
    five [B] fields, query_start_loc [B+1] and block_tables [B, MB]."""
    return batch * (6 + max_blocks) + 1


def uses_cuda_graphs(backend, ecfg: EngineConfig) -> bool:
    """Whether decode steps replay captured graphs: asked for, and the backend can capture."""
    return bool(ecfg.use_cuda_graphs) and backend.capabilities.graphs


def kv_region_bytes(ecfg: EngineConfig, fixed_bytes: int, free_device_bytes: int | None) -> tuple[int, str]:
    """(bytes for the KV region, how they were chosen).  fixed_bytes: weights + workspace;
    free_device_bytes: free GPU memory, or None on the CPU."""
    mib = 1024**2
    if ecfg.kv_cache_memory is not None:
        return ecfg.kv_cache_memory, "--kv-cache-memory"
    if free_device_bytes is None:
        return CPU_KV_CACHE_BYTES, "the CPU default"
    budget = int(float(ecfg.gpu_memory_utilization) * free_device_bytes)
    if budget <= fixed_bytes:
        raise ValueError(
            f"the model's weights and workspace need {fixed_bytes / mib:.0f} MiB but gpu_memory_utilization "
            f"{ecfg.gpu_memory_utilization} of the {free_device_bytes / mib:.0f} MiB free on the GPU is "
            f"{budget / mib:.0f} MiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens, or free "
            "the GPU")
    return budget - fixed_bytes, (f"gpu_memory_utilization {ecfg.gpu_memory_utilization} x "
                                  f"{free_device_bytes / mib:.0f} MiB free")


@dataclass
class Workspace:
    """Activation buffers for up to T = max_num_batched_tokens rows and S logits rows."""
    hidden: Any      # [T, C]  attention / MLP output, input of the next residual add
    residual: Any    # [T, C]  the residual stream
    normed: Any      # [T, C]  RMSNorm output
    qkv: Any         # [T, (H+2Hkv)*D]
    attn: Any        # [T, H*D]
    gate_up: Any     # [T, 2F]
    act: Any         # [T, F]
    last: Any        # [S, C]  hidden rows that need logits
    logits: Any      # [S, V]  float32
    dequant: Any     # flat float32: int8 weight rows dequantized for a BLAS GEMM (empty unless quantized)
    attention: Any = None      # flat uint8: split-K scratch of decode attention (backends that need one)
    decode_inputs: Any = None  # flat int32: a decode graph's fixed inputs (when CUDA graphs are on)


@dataclass
class KVCache:
    k: list[Any] = field(default_factory=list)   # L x [NB (+1), Hkv, BS, D]
    v: list[Any] = field(default_factory=list)   # L x [NB (+1), Hkv, BS, D]
    num_blocks: int = 0                          # NB: the blocks the block manager hands out
    block_size: int = 16
    padding_block: int | None = None             # block NB, written only by decode-graph padding rows

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype) -> tuple:
    """Shape of one layer's K (or V) cache: [blocks, kv heads, tokens, head_dim]. An int8 cache (CPU)
    adds ceil(4 * block_size / head_dim) rows to each (block, kv head) tile for its tokens' float32
    scales (backend/cpu_kernels.py: KV cache element access)."""
    rows = block_size
    if np.dtype(dtype) == np.int8:
        rows += -(-4 * block_size // head_dim)
    return (num_blocks, num_kv_heads, rows, head_dim)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    shape = kv_cache_shape(1, cfg.num_kv_heads, block_size, cfg.head_dim, dtype)
    return cfg.num_layers * 2 * int(np.prod(shape)) * np.dtype(dtype).itemsize


class MemoryPool:
    """Owns the arena and every typed view carved out of it."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, backend, logits_rows: int | None = None,
                 kv_bytes: int | None = None):
        self.cfg, self.ecfg, self.backend = cfg, ecfg, backend
        wdt = backend.weight_dtype(cfg.dtype)
        adt = backend.activation_dtype(cfg.dtype)
        kdt = backend.kv_dtype(cfg.dtype, ecfg.kv_cache_dtype, cfg.quant)
        T = ecfg.max_num_batched_tokens
        S = logits_rows or max(ecfg.max_num_seqs, 1)
        self.max_tokens, self.logits_rows = T, S

        # ---- plan every region: (name, shape, dtype) -----------------------------------------
        self._weight_plan = weight_plan(cfg, wdt)
        self._quant_parts = {}    # name -> dtype of each stored part of a quantized matrix
        for name, shape in weight_shapes(cfg).items():
            kind = storage_kind(name, shape, cfg.quant)
            if kind is not None:
                self._quant_parts.update({n: d for n, _, d in stored_parts(name, shape, kind, wdt)})
        self._weight_plan.append(("rope_cos_sin", (cfg.max_position_embeddings, cfg.head_dim), np.float32))
        C, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        MB = max_blocks_per_seq(cfg, ecfg)
        self.max_blocks_per_seq = MB
        self.max_context_len = MB * ecfg.block_size   # the decode grid bound of a graph
        self.uses_cuda_graphs = uses_cuda_graphs(backend, ecfg)
        ws_plan = [("hidden", (T, C), adt), ("residual", (T, C), np.float32), ("normed", (T, C), adt),
                   ("qkv", (T, cfg.qkv_size), adt), ("attn", (T, cfg.q_size), adt),
                   ("gate_up", (T, 2 * F), adt), ("act", (T, F), adt),
                   ("last", (S, C), adt), ("logits", (S, V), np.float32),
                   ("dequant", (dequant_scratch_size(cfg),), np.float32)]
        # every decode batch (B <= max_num_seqs, contexts <= MB * BS) fits: no allocation while serving
        attn_bytes = backend.attention_workspace_bytes(ecfg.max_num_seqs, cfg.num_heads, cfg.head_dim,
                                                       ecfg.block_size, self.max_context_len,
                                                       np.dtype(kdt).itemsize, cfg.num_kv_heads)
        if attn_bytes:
            ws_plan.append(("attention", (attn_bytes,), np.uint8))
        if self.uses_cuda_graphs:
            ws_plan.append(("decode_inputs", (decode_input_words(max_graph_batch(ecfg), MB),), np.int32))
        weight_bytes = sum(_align(int(np.prod(s)) * np.dtype(d).itemsize) for _, s, d in self._weight_plan)
        ws_bytes = sum(_align(int(np.prod(s)) * np.dtype(d).itemsize) for _, s, d in ws_plan)
        free = None
        if kv_bytes is None:
            if backend.capabilities.on_gpu:
                free = backend.device_memory_info()[0]
            kv_bytes, self.kv_sizing = kv_region_bytes(ecfg, weight_bytes + ws_bytes, free)
        else:
            self.kv_sizing = "the caller"
        per_block = kv_bytes_per_block(cfg, ecfg.block_size, kdt)
        spare = 1 if self.uses_cuda_graphs else 0
        num_blocks = kv_bytes // per_block - spare
        if num_blocks < 1:
            raise ValueError(
                f"the KV region ({kv_bytes} bytes, from {self.kv_sizing}) holds no KV block (one block of "
                f"{ecfg.block_size} tokens needs {per_block} bytes for this model"
                f"{', and CUDA graphs reserve one more' if spare else ''}); give --kv-cache-memory more, e.g. 1GiB")
        self.weight_bytes, self.workspace_bytes = weight_bytes, ws_bytes
        layer_bytes = _align((num_blocks + spare) * per_block // (2 * cfg.num_layers))   # one k or v tensor
        self.kv_bytes = 2 * cfg.num_layers * layer_bytes
        self.total_bytes = weight_bytes + ws_bytes + self.kv_bytes

        # ---- allocate once and carve --------------------------------------------------------
        self.arena = backend.alloc_arena(self.total_bytes)
        off = 0
        self.weights: dict[str, Any] = {}
        for name, shape, dt in self._weight_plan:
            self.weights[name] = backend.carve(self.arena, off, shape, dt)
            off += _align(int(np.prod(shape)) * np.dtype(dt).itemsize)
        bufs = {}
        for name, shape, dt in ws_plan:
            bufs[name] = backend.carve(self.arena, off, shape, dt)
            off += _align(int(np.prod(shape)) * np.dtype(dt).itemsize)
        self.workspace = Workspace(**bufs)
        self.kv = KVCache(num_blocks=num_blocks, block_size=ecfg.block_size,
                          padding_block=num_blocks if spare else None)
        kv_shape = kv_cache_shape(num_blocks + spare, cfg.num_kv_heads, ecfg.block_size, cfg.head_dim, kdt)
        self._kv_offset = off
        for _ in range(cfg.num_layers):
            for lst in (self.kv.k, self.kv.v):
                lst.append(backend.carve(self.arena, off, kv_shape, kdt))
                off += _align(int(np.prod(kv_shape)) * np.dtype(kdt).itemsize)
        assert off == self.total_bytes
        backend.upload(self.weights["rope_cos_sin"], rope_cos_sin(cfg))

    def prefault_kv(self) -> None:
        """Map the KV region in now, so that no kernel step pays for first-touch page faults. Called
        once the weights are in: the checkpoint's file mapping is gone by then, so the two never add
        up in resident memory."""
        self.backend.prefault(self.arena, self._kv_offset, self.kv_bytes)

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, model_dir: str, progress: bool = False) -> None:
        """Copy model.safetensors into the weight region tensor by tensor (checks names and shapes)."""
        path = os.path.join(model_dir, "model.safetensors")
        shapes = {name: shape for name, shape, _ in weight_plan(self.cfg, np.float32)}
        tags = {"int8": "I8", "uint8": "U8", "float16": "F16", "float32": "F32"}
        header = read_safetensors_header(path)
        missing = sorted(set(shapes) - set(header))
        if missing:
            raise ModelFormatError(f"{path} lacks tensor(s) {', '.join(missing[:5])}; re-convert the model")
        for name, shape in shapes.items():
            tag = header[name].get("dtype")
            want = tags[self._quant_parts[name].name] if name in self._quant_parts else None
            if (want is not None and tag != want) or (want is None and tag in ("I8", "U8")):
                raise ModelFormatError(f"{path}: tensor {name} is stored as {header[name].get('dtype')}, which "
                                       f"config.json (quant={self.cfg.quant}) does not expect; re-convert the model")
            if tuple(header[name]["shape"]) != shape:
                raise ModelFormatError(
                    f"{path}: tensor {name} has shape {tuple(header[name]['shape'])}, config.json says {shape}; "
                    "re-convert the model")
        from safetensors import safe_open
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy so bf16 checkpoints load)
        except ImportError:
            pass
        try:
            with safe_open(path, framework="numpy") as f:
                for name in shapes:
                    self.backend.upload(self.weights[name], f.get_tensor(name))
        except ModelFormatError:
            raise
        except Exception as e:  # safetensors raises its own error types on truncation/corruption
            raise ModelFormatError(f"cannot read {path} ({e}); the file is corrupt or truncated: re-convert the model") from e

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (norms = 1) for benchmarks and tests of models that have no checkpoint."""
        rng = np.random.default_rng(seed)
        for name, shape in weight_shapes(self.cfg).items():
            if name.endswith("norm"):
                host = np.ones(shape, np.float32)
            else:
                host = (rng.standard_normal(shape, dtype=np.float32) * std)
            kind = storage_kind(name, shape, self.cfg.quant)
            if kind is None:
                self.backend.upload(self.weights[name], host)
                continue
            for (part, _, _), value in zip(stored_parts(name, shape, kind, np.float32), quantize(host, kind)):
                self.backend.upload(self.weights[part], value)

    def describe(self) -> str:
        mib = 1024**2
        attn = self.workspace.attention
        extra = f", {attn.nbytes / mib:.0f} MiB of it decode attention scratch" if attn is not None else ""
        spare = " + 1 padding block for CUDA graphs" if self.kv.padding_block is not None else ""
        return (f"memory pool: {self.total_bytes / mib:.0f} MiB = weights {self.weight_bytes / mib:.0f} MiB + "
                f"workspace {self.workspace_bytes / mib:.0f} MiB{extra} + KV {self.kv_bytes / mib:.0f} MiB "
                f"sized by {self.kv_sizing} ({self.kv.num_blocks} blocks x {self.kv.block_size} tokens = "
                f"{self.kv.num_tokens} tokens of {np.dtype(self.kv.k[0].dtype).name} KV{spare})")


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The JSON header of a .safetensors file, with a clear error for a missing or corrupt file."""
    if not os.path.isfile(path):
        raise ModelFormatError(f"{path} does not exist; re-convert the model with `rawinfer convert SRC DST`")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size - 8:
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {size}")
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{path} is truncated or corrupt ({e}); re-convert the model") from e
    header.pop("__metadata__", None)
    return header


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] float64 inverse frequencies, with llama3 scaling when the config asks for it."""
    D = cfg.head_dim
    r = cfg.rope
    inv = 1.0 / (r.theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    if r.type == "llama3":
        old = r.original_max_position_embeddings
        low_wavelen = old / r.low_freq_factor
        high_wavelen = old / r.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(cfg: ModelConfig) -> np.ndarray:
    """[P, D] float32: cos(p * inv_freq) in the first D/2 columns, sin in the last D/2."""
    inv = rope_inv_freq(cfg).astype(np.float32)
    pos = np.arange(cfg.max_position_embeddings, dtype=np.float32)
    freqs = np.outer(pos, inv)  # float32, as transformers computes it
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32)
