"""Configuration: ModelConfig (the architecture numbers of a converted model) and EngineConfig.

A converted model folder (written by `rawinfer convert`) holds config.json in rawinfer's own format,
version FORMAT_VERSION. Its keys:

    format            "rawinfer"
    format_version    2 (1: the same without the keys marked v2, which then take their defaults)
    architecture      "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"   (informational: the keys
                      below describe the model; the forward pass reads them, not the name)
    vocab_size        V
    hidden_size       C
    intermediate_size F
    num_layers        L
    num_heads         H
    num_kv_heads      Hkv
    head_dim          D
    rms_norm_eps      float
    max_position_embeddings  int
    rope              {"theta": float, "type": "default" | "llama3", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"}   (the last four for llama3 only)
    tie_word_embeddings  bool   (no lm_head tensor; the embedding table is reused)
    qkv_bias          bool
    hidden_act        "silu" | "gelu_tanh"   (v2: the MLP's gate activation, SwiGLU or GeGLU)
    qk_norm           bool   (v2: RMSNorm over every q and k head before RoPE: Qwen3, Gemma 3)
    sandwich_norms    bool   (v2: RMSNorm on the attention and MLP outputs before their residual adds)
    embed_scale       float  (v2: the embeddings are multiplied by it: Gemma's sqrt(hidden_size))
    attn_scale        float | null   (v2: the softmax scale; null: head_dim ** -0.5)
    sliding_window    int | null     (v2: W: a sliding layer's query sees itself and W - 1 tokens back)
    layer_types       ["full" | "sliding", ...]   (v2: one per layer; [] means every layer full)
    rope_local        null | rope    (v2: the RoPE of sliding layers where it differs from `rope`)
    dtype             "float32" | "bfloat16" | "float16"   (storage dtype of model.safetensors)
    quant             null | "int8" | "q4" | "fp8"   (rawinfer/quant.py)
    bos_token_id      int | null
    eos_token_ids     [int, ...]
    pad_token_id      int | null
    add_bos_token     bool   (prepend BOS when encoding a prompt)
    chat_template     str | null (Jinja2, Hugging Face semantics)
    source            str    (where it was converted from; informational)
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rawinfer.settings import (TEMPLATES, check_options, chat_template_file, env_flag, float_argument, int_argument,
                               is_int, is_number, option, optional, parse_size, size_argument, user_cache_dir)

VERSION = "0.1.0"                                   # rawinfer's version (pyproject.toml says the same)
DEFAULT_MODEL = "weights/smollm2-135m-instruct"   # where tools/fetch_default_model.sh converts SmolLM2
FORMAT_NAME = "rawinfer"
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = (1, 2)
HIDDEN_ACTS, LAYER_TYPES = ("silu", "gelu_tanh"), ("full", "sliding")
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")
SPECULATIVE_METHODS = ("ngram", "draft")


class ModelFormatError(ValueError):
    """A converted model folder is missing, corrupt, or of an unknown format version."""


def _has_type(value: Any, annotation: str) -> bool:
    """Whether a value has the type its field's annotation names ('int', 'float | None', 'tuple[int, ...]',
    'RopeConfig'); NumPy scalars count as numbers, bools never do."""
    if " | " in annotation or annotation.startswith("tuple["):
        inner = annotation[len("tuple["):].split(",")[0] if annotation.startswith("tuple[") else None
        return (isinstance(value, (tuple, list)) and all(_has_type(v, inner) for v in value) if inner else
                any(value is None if a == "None" else _has_type(value, a) for a in annotation.split(" | ")))
    if annotation in ("int", "float"):
        kind = numbers.Integral if annotation == "int" else numbers.Real
        return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    return type(value).__name__ == annotation or (annotation == "str" and isinstance(value, str))


def _check_fields(config: Any, ranges: dict[str, tuple[Any, str]]) -> None:
    """ModelFormatError naming the first field of the wrong type or outside its range (field -> (predicate,
    what it must be)): config.json is data from disk, nothing in it is trusted."""
    kinds = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
    for f in fields(config):
        value, (ok, what) = getattr(config, f.name), ranges.get(f.name, (None, None))
        if _has_type(value, f.type) and (ok is None or ok(value)):
            continue
        raise ModelFormatError(f"{f.name}={value!r} is invalid: it must be "
                               f"{what or kinds.get(f.type, 'of type ' + f.type)}; re-convert the model")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        positive = (lambda v: v > 0, "a positive number")
        _check_fields(self, {"theta": positive, "factor": positive, "low_freq_factor": positive,
                             "high_freq_factor": positive,
                             "original_max_position_embeddings": (lambda v: v >= 1, "a positive integer")})
        if self.type not in ("default", "llama3"):
            raise ModelFormatError(f"unsupported RoPE type {self.type!r}: rawinfer supports 'default' and 'llama3'")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype: str = "float32"
    quant: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    source: str = ""
    hidden_act: str = "silu"
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None

    def __post_init__(self):
        self._check_values()
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelFormatError(f"hidden_act {self.hidden_act!r} is not one rawinfer runs "
                                   f"({', '.join(HIDDEN_ACTS)}); re-convert the model or upgrade rawinfer")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ModelFormatError(f"layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                                   f"{self.num_layers} layers; re-convert the model")
        if "sliding" in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ModelFormatError("sliding layers need a sliding_window of at least 1 token; re-convert the model")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.dtype not in DTYPES:
            raise ModelFormatError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")

    def _check_values(self) -> None:
        """Every field's type; sizes and scales positive, token ids inside the vocabulary."""
        V = self.vocab_size if _has_type(self.vocab_size, "int") else 0
        size, positive = (lambda v: v >= 1, "a positive integer"), (lambda v: v > 0, "a positive number")
        token = (lambda v: v is None or 0 <= v < V, f"null or a token id below vocab_size {V}")
        _check_fields(self, {**{k: size for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")},
                             "rms_norm_eps": positive, "embed_scale": positive,
                             **dict.fromkeys(("attn_scale", "sliding_window"),
                                             (lambda v: v is None or v > 0, "null or a positive number")),
                             "bos_token_id": token, "pad_token_id": token,
                             "eos_token_ids": (lambda v: all(0 <= t < V for t in v),
                                               f"a list of token ids below vocab_size {V}"),
                             "rope": (None, "a map of RoPE settings")})

    # Derived sizes, named with the shape letters of docs/architecture.md.
    @property
    def q_size(self) -> int:  # H*D
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # Hkv*D
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:  # (H + 2*Hkv)*D
        return self.q_size + 2 * self.kv_size

    @property
    def scale(self) -> float:   # the attention softmax scale
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_window(self, i: int) -> int:   # layer i's sliding window in tokens, 0: full attention
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding" else 0

    def layer_rope(self, i: int) -> RopeConfig:   # rope_local for sliding layers where it is given
        return self.rope_local if self.rope_local is not None and self.layer_window(i) else self.rope

    @property
    def kv_window(self) -> int:
        """The window every layer shares (older KV blocks can be given back), 0 if any layer is full."""
        windowed = bool(self.layer_types) and all(t == "sliding" for t in self.layer_types)
        return self.sliding_window if windowed else 0

    def num_params(self) -> int:
        C, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = self.qkv_size * C + C * self.q_size + 2 * F * C + F * C + 2 * C
        if self.qkv_bias:
            per_layer += self.qkv_size
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * C * self.sandwich_norms
        return V * C * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + C

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ModelFormatError(f"{where} must hold a JSON object of model settings, not a JSON "
                                   f"{type(d).__name__}; re-convert the model")
        if d.get("format") != FORMAT_NAME:
            raise ModelFormatError(
                f"{where} is not a rawinfer model config (no \"format\": \"rawinfer\"); "
                "convert the model first with `rawinfer convert SRC DST`")
        version = d.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise ModelFormatError(
                f"{where} has format_version {version!r} but this rawinfer reads "
                f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}; re-convert the model with this version "
                "(`rawinfer convert SRC DST`) or upgrade rawinfer")
        d = {k: v for k, v in d.items() if k not in ("format", "format_version")}
        from rawinfer.quant import QUANT_TYPES
        if d.get("quant") is not None and d["quant"] not in QUANT_TYPES:
            raise ModelFormatError(
                f"{where} has quant {d['quant']!r}, which this rawinfer does not read ({', '.join(QUANT_TYPES)}); "
                "re-convert the model (`rawinfer convert SRC DST --quant ...`) or upgrade rawinfer")
        try:
            d["rope"] = RopeConfig(**d["rope"]) if isinstance(d.get("rope"), dict) else d.get("rope")
            if isinstance(d.get("eos_token_ids", ()), list):
                d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
            d["layer_types"] = tuple(d.get("layer_types", ()))
            if d.get("rope_local") is not None:
                d["rope_local"] = RopeConfig(**d["rope_local"])
            return cls(**d)
        except TypeError as e:
            raise ModelFormatError(f"{where} has unexpected or missing keys ({e}); re-convert the model") from e
        except ModelFormatError as e:
            raise ModelFormatError(f"{where}: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        if not isinstance(model_dir, (str, os.PathLike)):   # os.path would take an int for a file descriptor
            raise ValueError(f"model folder {model_dir!r} is invalid: it must be a string path to a converted model")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise ModelFormatError(
                f"model folder {model_dir!r} does not exist; convert a model into it with "
                "`rawinfer convert SRC DST` (or run tools/fetch_default_model.sh for the default model)")
        if not os.path.isfile(path):
            raise ModelFormatError(
                f"{model_dir!r} has no config.json; it is not a converted rawinfer model "
                "(convert one with `rawinfer convert SRC DST`)")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except UnicodeDecodeError as e:
            raise ModelFormatError(f"cannot read {path}: it is not UTF-8 text ({e.reason} at byte {e.start}); "
                                   "re-convert the model") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ModelFormatError(f"cannot read {path}: {e}; re-convert the model") from e
        return cls.from_json(d, where=path)


def resolve_max_model_len(model: ModelConfig, engine: "EngineConfig") -> int:
    """The longest sequence (prompt + output) an engine allows: max_model_len, else the model's context
    (its RoPE table ends there); a max_model_len beyond the model's context is refused."""
    if engine.max_model_len and engine.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {engine.max_model_len} exceeds the model's context of "
                         f"{model.max_position_embeddings} tokens; give --max-model-len "
                         f"{model.max_position_embeddings} or less")
    return engine.max_model_len or model.max_position_embeddings


def _cores() -> int:
    return os.cpu_count() or 1


_positive = (lambda v: is_int(v) and v >= 1)
_switch = {"check": lambda v: isinstance(v, bool), "what": "true or false"}


@dataclass
class EngineConfig:
    """Knobs of one engine instance, each declared once (settings.option): its default, check and flag.
    `validate()` checks every field."""

    device: str = option("cpu", flag="--device", parse=str, choices=("auto", "cpu", "cuda"), cli_default="auto",
                         check=lambda v: v in ("auto", "cpu", "cuda"), what="one of auto, cpu, cuda",
                         help="where to run; auto takes CUDA when CuPy finds a GPU (the Python API's default: cpu)")
    kv_cache_memory: int | None = option(
        None, parse=size_argument, metavar="SIZE", check=optional(_positive),
        what="a positive size such as 2GiB, or None (sized automatically)",
        help="memory for KV blocks, e.g. 2GiB (default: 1GiB on the CPU; on CUDA what --gpu-memory-utilization "
             "of the free GPU memory leaves after weights and workspace)")
    kv_cache_dtype: str = option(
        "auto", parse=str, choices=KV_CACHE_DTYPES, check=lambda v: v in KV_CACHE_DTYPES,
        what="one of " + ", ".join(KV_CACHE_DTYPES),
        help="element type of the KV cache: auto = the model's dtype on CUDA; on the CPU int8 for int8 models, "
             "float16 for q4 models, float32 for float models; int8 is CPU only, with a float32 scale per token "
             "and kv head")
    block_size: int = option(16, parse=int_argument, check=lambda v: is_int(v) and 1 <= v <= 1024,
                             what="an integer from 1 to 1024", help="tokens per KV block")
    max_num_batched_tokens: int = option(2048, parse=int_argument, check=_positive, what="a positive integer",
                                         help="token budget of one step; also sizes the activation workspace")
    max_num_seqs: int = option(128, parse=int_argument, check=_positive, what="a positive integer",
                               help="sequences in one step at most")
    long_prefill_token_threshold: int | None = option(
        None, parse=int_argument, check=optional(_positive), what="a positive integer or None",
        help="while other requests wait, prefill a prompt at most N tokens per step, so that short prompts start "
             "beside a long one instead of after it (default: none, a chunk fills the step's budget)")
    itl_target_ms: float | None = option(
        None, parse=float_argument, metavar="MS", check=optional(lambda v: is_number(v) and v >= 0),
        what="a number of milliseconds >= 0 (0: off) or None (auto)",
        help="a step that carries decoding streams takes only the prompt tokens that keep it within MS "
             "milliseconds, as estimated from the engine's measured steps, so that no stream waits behind a whole "
             "prompt; 0 turns this off (prompts fill the step's token budget) (default: twice the estimated decode "
             "step of the requests running and waiting, counted as at least half of --max-num-seqs)")
    max_model_len: int | None = option(None, parse=int_argument, check=optional(_positive),
                                       what="a positive integer or None",
                                       help="cap on prompt + output tokens (default: the model's context length)")
    enable_prefix_caching: bool = option(True, flag="--no-prefix-caching", **_switch,
                                         help="turn prefix caching off (default: on, identical prompt prefixes "
                                              "share KV blocks)")
    batch_invariant: bool = option(False, **_switch,
                                   help="CPU: every query through one attention kernel, so that a request's greedy "
                                        "output does not depend on prefix-cache hits, chunking or preemption; "
                                        "prefill is slower (docs/kernels.md) (default: off, each sequence's query "
                                        "count picks its kernel)")
    int8_activations: bool = option(False, **_switch,
                                    help="CPU, int8 and q4 models: quantize the activations to 8 bits per block of "
                                         "32 (as llama.cpp's q8_0) for GEMMs with twice the products per "
                                         "instruction (vpdpbusd on AVX-512 VNNI, vpmaddubsw for q4 on AVX2): faster "
                                         "prefill and batches, coarser numerics (docs/kernels.md) (default: off, "
                                         "16-bit activations)")
    num_threads: int | None = option(
        None, flag="--threads", parse=int_argument, check=optional(lambda v: _positive(v) and v <= _cores()),
        what=f"a positive integer up to the {_cores()} CPU cores of this machine, or None (all of them)",
        help="CPU threads (default: all cores, fewer while other processes keep cores busy)")
    gpu_memory_utilization: float = option(0.9, parse=float_argument, metavar="F",
                                           check=lambda v: is_number(v) and 0 < v <= 1, what="a number in (0, 1]",
                                           help="CUDA: share of the free device memory for the pool")
    use_cuda_graphs: bool = option(True, flag="--no-cuda-graphs", **_switch,
                                   help="CUDA: run decode steps eagerly (default: replay them as CUDA graphs)")
    chat_template: str | None = option(
        None, parse=chat_template_file, metavar="FILE",
        check=optional(lambda v: isinstance(v, str) and os.path.isfile(v)), what="an existing file",
        help="a Jinja chat template used instead of the model's own, for a model whose template lacks tools or "
             f"that has none; or the name of one shipped with rawinfer ({', '.join(TEMPLATES)}: SmolLM2's with "
             "Hermes-style tool calls) (default: the model's own)")
    speculative_method: str | None = option(
        None, parse=str, choices=SPECULATIVE_METHODS, check=optional(lambda v: v in SPECULATIVE_METHODS),
        what="one of " + ", ".join(SPECULATIVE_METHODS) + ", or None",
        help="speculative decoding: ngram proposes the tokens that followed the latest earlier occurrence of the "
             "sequence's last tokens, draft those a smaller model (--speculative-model) predicts; the model checks "
             "them in one step and keeps the agreeing ones, so outputs are unchanged (default: none)")
    speculative_model: str | None = option(
        None, parse=str, metavar="PATH", check=optional(lambda v: isinstance(v, str) and os.path.isdir(v)),
        what="an existing model folder", help="the draft model's converted folder (implies --speculative-method "
                                              "draft); it must share the model's tokenizer")
    num_speculative_tokens: int = option(5, parse=int_argument, check=lambda v: is_int(v) and 1 <= v <= 16,
                                         what="an integer from 1 to 16", metavar="K",
                                         help="tokens proposed per step when speculating")
    seed: int = option(0, flag=None, check=lambda v: is_int(v) and 0 <= v < 2**63, what="an integer in [0, 2**63)",
                       help="the seed of requests that set none")
    cpu_int_gemm: bool = option(default_factory=lambda: env_flag("RAWINFER_CPU_INT_GEMM", True), flag=None, **_switch,
                                help="CPU, int8 and q4 models: integer GEMMs on int16-quantized activations for "
                                     "every row count (False: dequantized weights on BLAS, few rows: GEMV)")
    cache_dir: str | None = option(default_factory=user_cache_dir, flag=None,
                                   check=optional(lambda v: isinstance(v, str)), what="a folder path or None",
                                   help="user cache for compiled kernels (None: Numba's own places)")
    warmup: bool = option(True, flag=None, **_switch,
                          help="compile every step shape at start (no request waits for it)")

    def validate(self) -> "EngineConfig":
        """Every field's type and range checked; a ValueError names the first bad one (bools are no integers)."""
        if isinstance(self.kv_cache_memory, str):
            with contextlib.suppress(ValueError):   # left a string: the check names the option
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        check_options(self, "engine option")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_method 'draft' and speculative_model come together: give the draft model's "
                             "folder with --speculative-model, or use --speculative-method ngram")
        return self
