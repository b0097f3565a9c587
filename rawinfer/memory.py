"""The memory pool: one arena allocated once, carved into weights, workspace and KV blocks.

    arena (one backend allocation, 256-byte aligned regions)
    +-----------------------------+------------------------------+---------------------------------+
    | weights                     | workspace                    | KV blocks                       |
    | embed, per-layer tensors,   | activation buffers sized for | per layer: k_cache, v_cache     |
    | final norm, lm head, RoPE   | max_num_batched_tokens rows  | each [NB, Hkv, BS, D]           |
    | cos/sin table               | + logits rows                |                                 |
    +-----------------------------+------------------------------+---------------------------------+

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

from .config import EngineConfig, ModelConfig, ModelFormatError
from .quant import SCALE_SUFFIX, is_quantized, quantize_int8

ALIGN = 256


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
    """(name, shape, dtype) of every stored tensor: matrices as int8 + float32 scales in a quantized model."""
    plan = []
    for name, shape in weight_shapes(cfg).items():
        if is_quantized(name, shape, cfg.quant):
            plan.append((name, shape, np.dtype(np.int8)))
            plan.append((name + SCALE_SUFFIX, shape[:1], np.dtype(np.float32)))
        else:
            plan.append((name, shape, np.dtype(float_dtype)))
    return plan


DEQUANT_TILE_ROWS = 8192


def dequant_scratch_size(cfg: ModelConfig) -> int:
    """Floats of scratch for int8 GEMMs: the largest matrix, its rows capped at DEQUANT_TILE_ROWS."""
    if cfg.quant is None:
        return 0
    return max(min(s[0], DEQUANT_TILE_ROWS) * s[1] for s in weight_shapes(cfg).values() if len(s) == 2)


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


@dataclass
class KVCache:
    k: list[Any] = field(default_factory=list)   # L x [NB, Hkv, BS, D]
    v: list[Any] = field(default_factory=list)   # L x [NB, Hkv, BS, D]
    num_blocks: int = 0
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, itemsize: int) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


class MemoryPool:
    """Owns the arena and every typed view carved out of it."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, backend, logits_rows: int | None = None,
                 kv_bytes: int | None = None):
        self.cfg, self.ecfg, self.backend = cfg, ecfg, backend
        wdt = backend.weight_dtype(cfg.dtype)
        adt = backend.activation_dtype(cfg.dtype)
        kdt = backend.kv_dtype(cfg.dtype)
        T = ecfg.max_num_batched_tokens
        S = logits_rows or max(ecfg.max_num_seqs, 1)
        self.max_tokens, self.logits_rows = T, S

        # ---- plan every region: (name, shape, dtype) -----------------------------------------
        self._weight_plan = weight_plan(cfg, wdt)
        self._int8_names = {n for n, _, d in self._weight_plan if d == np.int8}
        self._weight_plan.append(("rope_cos_sin", (cfg.max_position_embeddings, cfg.head_dim), np.float32))
        C, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        ws_plan = [("hidden", (T, C), adt), ("residual", (T, C), np.float32), ("normed", (T, C), adt),
                   ("qkv", (T, cfg.qkv_size), adt), ("attn", (T, cfg.q_size), adt),
                   ("gate_up", (T, 2 * F), adt), ("act", (T, F), adt),
                   ("last", (S, C), adt), ("logits", (S, V), np.float32),
                   ("dequant", (dequant_scratch_size(cfg),), np.float32)]
        weight_bytes = sum(_align(int(np.prod(s)) * np.dtype(d).itemsize) for _, s, d in self._weight_plan)
        ws_bytes = sum(_align(int(np.prod(s)) * np.dtype(d).itemsize) for _, s, d in ws_plan)
        if kv_bytes is None:
            kv_bytes = ecfg.kv_cache_memory
        per_block = kv_bytes_per_block(cfg, ecfg.block_size, np.dtype(kdt).itemsize)
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"--kv-cache-memory {kv_bytes} bytes holds no KV block (one block of {ecfg.block_size} tokens "
                f"needs {per_block} bytes for this model); give it more, e.g. 1GiB")
        self.weight_bytes, self.workspace_bytes = weight_bytes, ws_bytes
        self.kv_bytes = num_blocks * per_block
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
        self.kv = KVCache(num_blocks=num_blocks, block_size=ecfg.block_size)
        kv_shape = (num_blocks, cfg.num_kv_heads, ecfg.block_size, cfg.head_dim)
        for _ in range(cfg.num_layers):
            for lst in (self.kv.k, self.kv.v):
                lst.append(backend.carve(self.arena, off, kv_shape, kdt))
                off += _align(int(np.prod(kv_shape)) * np.dtype(kdt).itemsize)
        assert off <= self.total_bytes + ALIGN * (len(self._weight_plan) + 64)
        backend.upload(self.weights["rope_cos_sin"], rope_cos_sin(cfg))

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, model_dir: str, progress: bool = False) -> None:
        """Copy model.safetensors into the weight region tensor by tensor (checks names and shapes)."""
        path = os.path.join(model_dir, "model.safetensors")
        shapes = {name: shape for name, shape, _ in weight_plan(self.cfg, np.float32)}
        header = read_safetensors_header(path)
        missing = sorted(set(shapes) - set(header))
        if missing:
            raise ModelFormatError(f"{path} lacks tensor(s) {', '.join(missing[:5])}; re-convert the model")
        for name, shape in shapes.items():
            if (header[name].get("dtype") == "I8") != (name in self._int8_names):
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
            if is_quantized(name, shape, self.cfg.quant):
                q, scale = quantize_int8(host)
                self.backend.upload(self.weights[name], q)
                self.backend.upload(self.weights[name + SCALE_SUFFIX], scale)
            else:
                self.backend.upload(self.weights[name], host)

    def describe(self) -> str:
        mib = 1024**2
        return (f"memory pool: {self.total_bytes / mib:.0f} MiB = weights {self.weight_bytes / mib:.0f} MiB + "
                f"workspace {self.workspace_bytes / mib:.0f} MiB + KV {self.kv_bytes / mib:.0f} MiB "
                f"({self.kv.num_blocks} blocks x {self.kv.block_size} tokens = {self.kv.num_tokens} tokens of KV)")


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
