"""Weight-only int8 quantization: symmetric, one float32 scale per output channel (row).

    W[N, K] float32  ->  q[N, K] int8 in [-127, 127],  scale[N] float32,  W ~= q * scale[:, None]

A quantized model (config.quant == "int8") stores every matrix this way: `name` holds q and
`name.scale` holds the scales; vectors (norms, biases) stay in the model's float dtype. The embedding
table is quantized per row too, which is per output channel of the LM head when the two are tied.
Decode is memory-bound on a CPU: int8 weights quarter the bytes each token must stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SCALE_SUFFIX = ".scale"
QUANT_TYPES = ("int8",)


@dataclass(frozen=True)
class Int8Weight:
    """A quantized matrix as the backends see it (device arrays)."""
    q: Any         # [N, K] int8
    scale: Any     # [N] float32
    packed: Any = None   # the backend's own copy of q for its GEMMs (Backend.prepare_int8), or None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def is_quantized(name: str, shape: tuple[int, ...], quant: str | None) -> bool:
    """Which tensors of a converted model are stored quantized: every matrix."""
    return quant == "int8" and len(shape) == 2


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32) with w ~= q * scale."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]
