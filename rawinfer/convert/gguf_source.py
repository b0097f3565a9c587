"""Reading a GGUF file of the llama architecture: metadata to ModelConfig, tensors dequantized to parts.

Three things differ from a Hugging Face checkpoint:
  * shapes are listed fastest-dimension first (ne0 = columns); the `gguf` reader already hands back
    arrays in NumPy order [rows, cols], i.e. Hugging Face's [out, in];
  * weights may be block-quantized; they are dequantized to float32 with gguf.quants;
  * llama.cpp's converter permutes the rows of attn_q / attn_k inside every head so that rotary
    pairs are adjacent (GPT-J "interleaved" layout); `unpermute_rows` restores the Hugging Face
    "rotate_half" layout that rawinfer's rope op expects:

        GGUF row 2*i + j  (i < D/2, j in {0, 1})   <-   HF row j*D/2 + i      within each head
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from rawinfer.config import ModelConfig, RopeConfig

from rawinfer.convert.errors import ConversionError
from rawinfer.convert.gguf_tokenizer import gguf_tokenizer
from rawinfer.convert.layout import TokenizerInfo

SUPPORTED_TYPES = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K})

GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "input_norm": "blk.{i}.attn_norm.weight",
    "post_attn_norm": "blk.{i}.ffn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}
ROPE_FREQS = "rope_freqs.weight"


def f32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def unpermute_rows(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: x[n_heads*D, ...] interleaved -> rotate_half layout."""
    D = x.shape[0] // num_heads
    return x.reshape(num_heads, D // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """[D/2] divisors llama3 scaling applies to the rotary frequencies (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0,
                    np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, middle))


class GGUFSource:
    """A GGUF file opened for conversion: config, tokenizer, and dequantized parts on demand."""

    def __init__(self, path: str):
        self.path = path
        self._where = os.path.basename(path)
        try:
            self._reader = GGUFReader(path)
        except Exception as e:  # gguf raises ValueError, struct.error, ... on truncated or foreign files
            raise ConversionError(f"cannot read GGUF file {path!r} ({e}); it is truncated or corrupt, "
                                  "download it again") from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self._meta("general.architecture")
        if arch is None:
            raise ConversionError(f"{path!r} has no general.architecture metadata; it is not a complete GGUF model")
        if arch != "llama":
            raise ConversionError(f"{path!r} holds a {arch!r} model; rawinfer converts GGUF files of the 'llama' "
                                  "architecture only (Llama, Mistral, SmolLM and their fine-tunes)")
        for t in self._reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ConversionError(
                    f"tensor {t.name!r} in {self._where} is stored as {t.tensor_type.name}, which rawinfer cannot "
                    f"dequantize (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}); "
                    "use a GGUF file with another quantization")
        tok = gguf_tokenizer(self._meta, self._where)
        self.tokenizer_json = tok.tokenizer_json
        self.config = self._model_config(tok)

    def _meta(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as e:
            raise ConversionError(f"cannot read metadata {key!r} of {self._where} ({e}); the file is corrupt") from e

    def _need(self, key: str, default: Any = None) -> Any:
        """A scalar metadata value: `default` when absent, ConversionError when absent without a default."""
        value = self._meta(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise ConversionError(f"{self._where} has no {key!r} metadata; it is not a complete llama GGUF file")
        if isinstance(value, list):
            raise ConversionError(f"{self._where} sets {key!r} per layer, which rawinfer does not support")
        return value

    def _rope(self, head_dim: int) -> RopeConfig:
        theta = f32_value(self._meta("llama.rope.freq_base") or 10000.0)
        kind = self._meta("llama.rope.scaling.type") or "none"
        factor = self._meta("llama.rope.scaling.factor")
        if kind not in ("none", "linear") or (kind == "linear" and factor not in (None, 1.0)):
            raise ConversionError(f"{self._where} uses RoPE scaling type {kind!r}, which rawinfer does not "
                                  "implement; supported are the default rotary embedding and 'llama3' scaling")
        if ROPE_FREQS not in self._tensors:
            return RopeConfig(theta=theta)
        # llama.cpp bakes llama3 scaling into a rope_freqs tensor of per-frequency divisors; recover
        # the parameters by matching the Llama 3.1 / 3.2 schedule (low 1, high 4) against it.
        freqs = self._dequantized(ROPE_FREQS).astype(np.float64)
        if np.allclose(freqs, 1.0):
            return RopeConfig(theta=theta)
        orig = int(self._meta("llama.rope.scaling.original_context_length") or 8192)
        params = dict(factor=float(freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=orig)
        if freqs.shape != (head_dim // 2,) or not np.allclose(
                llama3_rope_factors(theta, head_dim, **params), freqs, rtol=1e-4):
            raise ConversionError(f"{self._where} carries RoPE frequency factors (rope_freqs) that do not follow "
                                  "the llama3 schedule rawinfer implements; convert the Hugging Face folder instead")
        return RopeConfig(theta=theta, type="llama3", **params)

    def _model_config(self, tok: TokenizerInfo) -> ModelConfig:
        if self._meta("llama.expert_count"):
            raise ConversionError(f"{self._where} is a mixture-of-experts model, which rawinfer cannot run")
        C = int(self._need("llama.embedding_length"))
        H = int(self._need("llama.attention.head_count"))
        Hkv = int(self._need("llama.attention.head_count_kv", H))
        D = int(self._need("llama.attention.key_length", C // H))
        for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
            if self._meta(key) not in (None, D):
                raise ConversionError(f"{self._where} has {key} = {self._meta(key)} but head_dim {D}; rawinfer "
                                      "needs whole heads rotated and equal key/value head sizes")
        if GGUF_NAMES["embed"] not in self._tensors:
            raise ConversionError(f"{self._where} has no {GGUF_NAMES['embed']!r} tensor; it is not a complete model")
        V = int(self._tensors[GGUF_NAMES["embed"]].shape[-1])    # GGUF shape [C, V]: ne1 = rows
        try:
            return ModelConfig(
                architecture="llama", vocab_size=V, hidden_size=C,
                intermediate_size=int(self._need("llama.feed_forward_length")),
                num_layers=int(self._need("llama.block_count")), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                rms_norm_eps=f32_value(self._need("llama.attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(self._need("llama.context_length")),
                rope=self._rope(D),
                tie_word_embeddings=GGUF_NAMES["lm_head"] not in self._tensors,
                qkv_bias=GGUF_NAMES["q_bias"].format(i=0) in self._tensors,
                bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                add_bos_token=tok.add_bos_token, chat_template=tok.chat_template,
                source=os.path.abspath(self.path))
        except ValueError as e:   # ModelConfig's own checks (heads not a multiple of kv heads, ...)
            raise ConversionError(f"{self._where} describes an invalid model ({e})") from e

    def _dequantized(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        try:
            x = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ConversionError(f"cannot dequantize tensor {name!r} ({t.tensor_type.name}) in {self._where} "
                                  f"({e}); the file is corrupt, download it again") from e
        want = tuple(int(n) for n in reversed(t.shape))            # ne0 first -> NumPy order
        return np.asarray(x, dtype=np.float32).reshape(want)

    def _name(self, part: str, layer: int | None) -> str:
        return GGUF_NAMES[part].format(i=layer)

    def describe(self, part: str, layer: int | None) -> str:
        return f"tensor {self._name(part, layer)!r} in {self._where}"

    def part(self, part: str, layer: int | None) -> np.ndarray:
        name = self._name(part, layer)
        if name not in self._tensors:
            raise ConversionError(f"{self._where} has no tensor {name!r}, which the model metadata requires; "
                                  "the file is incomplete")
        x = self._dequantized(name)
        heads = {"q": self.config.num_heads, "q_bias": self.config.num_heads,
                 "k": self.config.num_kv_heads, "k_bias": self.config.num_kv_heads}.get(part)
        if heads is not None and x.shape[0] == heads * self.config.head_dim:
            x = unpermute_rows(x, heads)     # a wrong shape is left for layout.fuse to report
        return x

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None
