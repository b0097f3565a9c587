"""The weights of a converted model: which tensors it holds, reading them into the pool, the RoPE table.

A converted folder's model.safetensors holds, per `weight_shapes` (the converter's contract):

    embed_tokens [V, C], final_norm [C], lm_head [V, C] (unless tied to the embedding),
    layers.{i}.input_norm [C], qkv_proj [(H+2Hkv)*D, C], qkv_bias [(H+2Hkv)*D] (Qwen2),
              q_norm [D], k_norm [D] (qk_norm: Qwen3, Gemma 3),
              o_proj [C, H*D], attn_out_norm [C] (sandwich_norms: Gemma 3),
              post_attn_norm [C] (the norm before the MLP), gate_up_proj [2F, C], down_proj [C, F],
              mlp_out_norm [C] (sandwich_norms)

A quantized model stores each matrix as its parts (rawinfer/quant.py: stored_parts).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from rawinfer.config import ModelConfig, ModelFormatError
from rawinfer.quant import non_finite_count, quantize, storage_kind, stored_parts


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
        if cfg.qk_norm:
            shapes[p + "q_norm"] = (cfg.head_dim,)
            shapes[p + "k_norm"] = (cfg.head_dim,)
        shapes[p + "o_proj"] = (C, cfg.q_size)
        if cfg.sandwich_norms:
            shapes[p + "attn_out_norm"] = (C,)
        shapes[p + "post_attn_norm"] = (C,)
        shapes[p + "gate_up_proj"] = (2 * F, C)
        shapes[p + "down_proj"] = (C, F)
        if cfg.sandwich_norms:
            shapes[p + "mlp_out_norm"] = (C,)
    return shapes


def weight_plan(cfg: ModelConfig, float_dtype) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every stored tensor: a quantized model's matrices as their parts
    (quant.stored_parts: int8 + float32 scales, q4 nibbles + float16 block scales, or fp8 codes + float32
    scales)."""
    plan = []
    for name, shape in weight_shapes(cfg).items():
        plan.extend(stored_parts(name, shape, storage_kind(name, shape, cfg.quant), float_dtype))
    return plan


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


_SAFETENSORS_TAGS = {"int8": "I8", "uint8": "U8", "float16": "F16", "float32": "F32"}


def load_weights(cfg: ModelConfig, model_dir: str, views: dict, upload) -> None:
    """Copy model_dir/model.safetensors into the pool's weight views tensor by tensor (upload(dst, host)),
    after checking every name, shape and storage type against config.json."""
    path = os.path.join(model_dir, "model.safetensors")
    shapes = {name: shape for name, shape, _ in weight_plan(cfg, np.float32)}
    header = read_safetensors_header(path)
    check_header(cfg, path, header, shapes)
    fp8_codes = {name for name, shape in weight_shapes(cfg).items() if storage_kind(name, shape, cfg.quant) == "fp8"}
    from safetensors import safe_open
    if any(header[name].get("dtype") == "BF16" for name in shapes):
        try:    # only then: its import takes seconds of every start
            import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy so bf16 checkpoints load)
        except ImportError:
            pass
    try:
        with safe_open(path, framework="numpy") as f:
            for name in shapes:
                host = f.get_tensor(name)
                check_finite(path, name, host)
                if name in fp8_codes:
                    check_fp8_codes(path, name, host)
                upload(views[name], host)
    except ModelFormatError:
        raise
    except Exception as e:  # safetensors raises its own error types on truncation/corruption
        raise ModelFormatError(f"cannot read {path} ({e}); the file is corrupt or truncated: re-convert the model") from e


def check_header(cfg: ModelConfig, path: str, header: dict, shapes: dict) -> None:
    """ModelFormatError unless the file's header holds exactly the tensors of config.json's plan (`shapes`),
    each with its shape and, for a quantized matrix's parts, its storage type (quant.stored_parts)."""
    quant_parts = {}        # name -> dtype of each stored part of a quantized matrix
    for name, shape in weight_shapes(cfg).items():
        kind = storage_kind(name, shape, cfg.quant)
        if kind is not None:
            quant_parts.update({n: d for n, _, d in stored_parts(name, shape, kind, np.float32)})
    missing = sorted(set(shapes) - set(header))
    if missing:
        raise ModelFormatError(f"{path} lacks tensor(s) {', '.join(missing[:5])}; re-convert the model")
    extra = sorted(set(header) - set(shapes))
    if extra:       # e.g. num_layers lowered in config.json: the other layers would be ignored silently
        raise ModelFormatError(f"{path} holds tensor(s) {', '.join(extra[:5])} that config.json does not describe "
                               f"(it says {cfg.num_layers} layers); the two disagree: re-convert the model")
    for name, shape in shapes.items():
        tag = header[name].get("dtype")
        want = _SAFETENSORS_TAGS[quant_parts[name].name] if name in quant_parts else None
        if (want is not None and tag != want) or (want is None and tag in ("I8", "U8")):
            raise ModelFormatError(f"{path}: tensor {name} is stored as {header[name].get('dtype')}, which "
                                   f"config.json (quant={cfg.quant}) does not expect; re-convert the model")
        if tuple(header[name]["shape"]) != shape:
            raise ModelFormatError(
                f"{path}: tensor {name} has shape {tuple(header[name]['shape'])}, config.json says {shape}; "
                "re-convert the model")


def check_finite(path: str, name: str, host: np.ndarray) -> None:
    """ModelFormatError if a floating-point tensor holds a NaN or an infinity (a damaged file that would
    otherwise run and print token 0 or changed text)."""
    if host.dtype.kind not in "fV" or host.size == 0:     # integer parts of quantized weights cannot be
        return                                           # non-finite ("V": bfloat16 without ml_dtypes)
    bad = non_finite_count(host.astype(np.float32) if host.dtype.kind == "V" else host)
    if bad:
        raise ModelFormatError(f"{path}: tensor {name} holds {bad} NaN or Inf value(s); the file is damaged: "
                               "re-convert the model")


def check_fp8_codes(path: str, name: str, host: np.ndarray) -> None:
    """ModelFormatError if an fp8 matrix holds the e4m3fn NaN codes (0x7F, 0xFF), which the converter
    never writes."""
    bad = int(np.count_nonzero((host & 0x7F) == 0x7F))
    if bad:
        raise ModelFormatError(f"{path}: fp8 tensor {name} holds {bad} NaN code(s); the file is damaged: "
                               "re-convert the model")


def init_random_weights(cfg: ModelConfig, views: dict, upload, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (norms = 1) for benchmarks and tests of models that have no checkpoint."""
    rng = np.random.default_rng(seed)
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm"):
            host = np.ones(shape, np.float32)
        else:
            host = (rng.standard_normal(shape, dtype=np.float32) * std)
        kind = storage_kind(name, shape, cfg.quant)
        if kind is None:
            upload(views[name], host)
            continue
        for (part, _, _), value in zip(stored_parts(name, shape, kind, np.float32), quantize(host, kind)):
            upload(views[part], value)


def rope_inv_freq(cfg: ModelConfig, rope=None) -> np.ndarray:
    """[D/2] float64 inverse frequencies of `rope` (default cfg.rope), with llama3 scaling when it asks."""
    D = cfg.head_dim
    r = rope or cfg.rope
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


def rope_cos_sin(cfg: ModelConfig, rope=None, rows: int | None = None) -> np.ndarray:
    """[P, D] float32: cos(p * inv_freq) in the first D/2 columns, sin in the last D/2 (of `rope`,
    default cfg.rope), for positions p < P = rows (default max_position_embeddings)."""
    inv = rope_inv_freq(cfg, rope).astype(np.float32)
    pos = np.arange(cfg.max_position_embeddings if rows is None else rows, dtype=np.float32)
    freqs = np.outer(pos, inv)  # float32, as transformers computes it
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32)
