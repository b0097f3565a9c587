"""Reading a GGUF file of the llama or gemma3 architecture: metadata to ModelConfig, tensors to parts.

Three things differ from a Hugging Face checkpoint:
  * shapes are listed fastest-dimension first (ne0 = columns); the `gguf` reader already hands back
    arrays in NumPy order [rows, cols], i.e. Hugging Face's [out, in];
  * weights may be block-quantized; they are dequantized to float32 with gguf.quants;
  * for the llama architecture, llama.cpp's converter permutes the rows of attn_q / attn_k inside
    every head so that rotary pairs are adjacent (GPT-J "interleaved" layout); `unpermute_rows`
    restores the Hugging Face "rotate_half" layout that rawinfer's rope op expects:

        GGUF row 2*i + j  (i < D/2, j in {0, 1})   <-   HF row j*D/2 + i      within each head

    gemma3 rotates in the rotate_half ("NEOX") layout already and its rows are stored as they are.

gemma3 (`_gemma3` reads its metadata as llama.cpp does): four norms per layer, stored with Gemma's 1 + w already
added, so the norm weights are used as they are:

    GGUF blk.N.            part              GGUF blk.N.          part
    attn_norm              input_norm        ffn_norm             post_attn_norm (before the MLP)
    attn_q_norm            q_norm            post_ffw_norm        mlp_out_norm
    attn_k_norm            k_norm            post_attention_norm  attn_out_norm
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
from rawinfer.convert.layout import TokenizerInfo, some_names

SUPPORTED_TYPES = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q6_K})

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
GEMMA3_NAMES = {
    **GGUF_NAMES,
    "post_attn_norm": "blk.{i}.ffn_norm.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "attn_out_norm": "blk.{i}.post_attention_norm.weight",
    "mlp_out_norm": "blk.{i}.post_ffw_norm.weight",
}
ARCH_NAMES = {"llama": GGUF_NAMES, "gemma3": GEMMA3_NAMES}
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
        if arch not in ARCH_NAMES:
            raise ConversionError(f"{path!r} holds a {arch!r} model; rawinfer converts GGUF files of the 'llama' "
                                  "architecture (Llama, Mistral, SmolLM and their fine-tunes) and 'gemma3'")
        self.arch = arch
        self._names = ARCH_NAMES[arch]
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
        """A scalar metadata value of this architecture (key without the "llama." / "gemma3." prefix):
        `default` when absent, ConversionError when absent without a default."""
        key = f"{self.arch}.{key}"
        value = self._meta(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise ConversionError(f"{self._where} has no {key!r} metadata; it is not a complete {self.arch} GGUF file")
        if isinstance(value, list):
            raise ConversionError(f"{self._where} sets {key!r} per layer, which rawinfer does not support")
        return value

    def _count(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """A whole-number metadata value of this architecture, at least `minimum` (see _need)."""
        value = self._need(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ConversionError(f"{self._where} has {self.arch}.{key} = {value!r}, which is not a whole number "
                                  f"of at least {minimum}; the file is damaged: download it again or re-export it")
        return int(value)

    def _real(self, key: str, default: float | None = None) -> float:
        """A positive, finite float metadata value of this architecture (see _need), as float32 writes it."""
        value = self._need(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not 0 < value < math.inf:
            raise ConversionError(f"{self._where} has {self.arch}.{key} = {value!r}, which is not a positive "
                                  "number; the file is damaged: download it again or re-export it")
        return f32_value(value)

    def _rope(self, head_dim: int) -> RopeConfig:
        theta = self._real("rope.freq_base", 10000.0)
        kind = self._need("rope.scaling.type", "none")
        factor = self._meta(f"{self.arch}.rope.scaling.factor")
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
        orig = self._count("rope.scaling.original_context_length", 8192)
        params = dict(factor=float(freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=orig)
        if freqs.shape != (head_dim // 2,) or not np.allclose(
                llama3_rope_factors(theta, head_dim, **params), freqs, rtol=1e-4):
            raise ConversionError(f"{self._where} carries RoPE frequency factors (rope_freqs) that do not follow "
                                  "the llama3 schedule rawinfer implements; convert the Hugging Face folder instead")
        return RopeConfig(theta=theta, type="llama3", **params)

    def _gemma3(self, C: int, H: int, D: int, L: int) -> dict[str, Any]:
        """The ModelConfig keys of a gemma3 file beyond Llama's, the way llama.cpp reads them."""
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if self._meta(f"gemma3.{key}"):
                raise ConversionError(f"{self._where} sets gemma3.{key}, a logit soft-cap rawinfer does not "
                                      "implement; this model cannot be converted")
        window = self._count("attention.sliding_window", 0, minimum=0)      # 0: no sliding window
        pattern = self._meta("gemma3.attention.sliding_window_pattern")
        if not isinstance(pattern, list):
            pattern = self._count("attention.sliding_window_pattern", 6)
        if not window:
            types: tuple[str, ...] = ()
        elif isinstance(pattern, list):      # one flag per layer, true = sliding
            if len(pattern) != L:
                raise ConversionError(f"{self._where} lists a sliding-window flag for {len(pattern)} layers but "
                                      f"has {L}; the file is damaged")
            types = tuple("sliding" if p else "full" for p in pattern)
        else:                                # a period: the last layer of every `pattern` is global
            types = tuple("full" if i % pattern == pattern - 1 else "sliding" for i in range(L))
        # NOTE: llama.cpp hard-codes the sliding layers' theta (10000) when the file does not store one.
        local = RopeConfig(theta=self._real("rope.freq_base_swa", 10000.0))
        rope = self._rope(D)
        # NOTE: llama.cpp derives query_pre_attn_scalar from the model's size: head_dim, except for
        # the 27B model (62 layers), whose scalar is hidden_size / heads.
        scalar = C // H if L == 62 else D
        return dict(rope=rope, hidden_act="gelu_tanh", qk_norm=True, sandwich_norms=True, embed_scale=math.sqrt(C),
                    attn_scale=float(scalar) ** -0.5, sliding_window=window if "sliding" in types else None,
                    layer_types=types if "sliding" in types else (),
                    rope_local=local if local != rope and "sliding" in types else None)

    def _model_config(self, tok: TokenizerInfo) -> ModelConfig:
        if self._meta(f"{self.arch}.expert_count"):
            raise ConversionError(f"{self._where} is a mixture-of-experts model, which rawinfer cannot run")
        C = self._count("embedding_length")
        H = self._count("attention.head_count")
        Hkv = self._count("attention.head_count_kv", H)
        D = self._count("attention.key_length", C // H)
        L = self._count("block_count")
        for key in ("attention.value_length", "rope.dimension_count"):
            if self._meta(f"{self.arch}.{key}") not in (None, D):
                raise ConversionError(f"{self._where} has {self.arch}.{key} = {self._meta(f'{self.arch}.{key}')} "
                                      f"but head_dim {D}; rawinfer needs whole heads rotated and equal key/value "
                                      "head sizes")
        if GGUF_NAMES["embed"] not in self._tensors:
            raise ConversionError(f"{self._where} has no {GGUF_NAMES['embed']!r} tensor; it is not a complete model")
        V = int(self._tensors[GGUF_NAMES["embed"]].shape[-1])    # GGUF shape [C, V]: ne1 = rows
        if tok.vocab_ids > V:
            raise ConversionError(f"{self._where} has a tokenizer of {tok.vocab_ids} tokens but only {V} embeddings "
                                  f"({GGUF_NAMES['embed']}), so it would produce ids the model cannot embed; the "
                                  "file is damaged: download it again or re-export it")
        family = self._gemma3(C, H, D, L) if self.arch == "gemma3" else dict(rope=self._rope(D))
        try:
            return ModelConfig(
                architecture=self.arch, vocab_size=V, hidden_size=C,
                intermediate_size=self._count("feed_forward_length"),
                num_layers=L, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                rms_norm_eps=self._real("attention.layer_norm_rms_epsilon"),
                max_position_embeddings=self._count("context_length"),
                tie_word_embeddings=GGUF_NAMES["lm_head"] not in self._tensors,
                qkv_bias=GGUF_NAMES["q_bias"].format(i=0) in self._tensors,
                bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                add_bos_token=tok.add_bos_token, chat_template=tok.chat_template,
                source=os.path.abspath(self.path), **family)
        except ConversionError:
            raise
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
        if part not in self._names:
            raise ConversionError(f"{self._where} ({self.arch}) has no {part!r} tensors; rawinfer cannot convert it")
        return self._names[part].format(i=layer)

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
        if self.arch == "llama" and heads is not None and x.shape[0] == heads * self.config.head_dim:
            x = unpermute_rows(x, heads)     # a wrong shape is left for layout.fuse to report
        return x

    def check_all_used(self, parts: list[tuple[str, int | None]]) -> None:
        """Refuse tensors the metadata leaves out (blocks past block_count, unknown ones) instead of dropping them."""
        used = {self._name(part, layer) for part, layer in parts} | {ROPE_FREQS}   # rope_freqs: read by _rope
        extra = sorted(n for n in self._tensors if n not in used)
        if extra:
            raise ConversionError(
                f"{self._where} holds tensor(s) {some_names(extra)} that its metadata does not describe "
                f"({self.arch}.block_count = {self.config.num_layers}), so they would be dropped; the file is "
                "inconsistent: download it again or re-export it")

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None
