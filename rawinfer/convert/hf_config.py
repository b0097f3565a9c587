"""A Hugging Face config.json as a ModelConfig: the supported families and how each spells its keys.

Families differ from Llama by data, not by code: `FAMILIES` says which optional parts of
rawinfer's layer a family has (q/k norms, Gemma's four norms, scaled embeddings) and which layers a
config's `sliding_window` applies to; `hf_model_config` reads the numbers.

    family   q/k norm  sandwich norms  norm weights  embeddings    sliding window on
    llama    -         -               w             as stored     (never)
    mistral  -         -               w             as stored     every layer, when sliding_window is set
    qwen2    -         -               w             as stored     layers >= max_window_layers, when
    qwen3    yes       -               w             as stored       use_sliding_window is true
    gemma3   yes       yes             1 + w         * sqrt(C)     per layer_types (or every
                                                                     sliding_window_pattern-th layer full)

Both RoPE spellings load. transformers 5 writes `rope_parameters`: {rope_theta, rope_type, ...}, or
for Gemma 3 one such dict per layer type, {"full_attention": {...}, "sliding_attention": {...}}.
transformers 4 wrote `rope_theta` + `rope_scaling`, and for Gemma 3 also `rope_local_base_freq`
(the theta of its sliding layers; `rope_scaling` applies to the full layers only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rawinfer.config import ModelConfig, RopeConfig

from rawinfer.convert.errors import ConversionError
from rawinfer.convert.layout import TokenizerInfo

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

# Activation names in config.json -> ModelConfig.hidden_act. Every GELU listed is the tanh approximation.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(frozen=True)
class Family:
    """What a family's layer has beyond Llama's, and the defaults its config class fills in."""

    qk_norm: bool = False             # RMSNorm over every q and k head before RoPE (q_norm, k_norm tensors)
    sandwich_norms: bool = False      # norms on the attention and MLP outputs too (four per layer)
    norm_offset: float = 0.0          # the checkpoint's norms compute x / rms(x) * (norm_offset + w)
    scaled_embeddings: bool = False   # embeddings multiplied by sqrt(hidden_size)
    windows: str = "none"             # "none" | "all" | "from_layer" | "pattern": see hf_layer_types
    default_theta: float = 10000.0    # rope_theta when config.json leaves it out
    default_window: int | None = None
    local_theta: float | None = None  # transformers 4's rope_local_base_freq default (sliding layers)
    tied: bool = False                # tie_word_embeddings when config.json leaves it out


FAMILIES = {
    "llama": Family(),
    "mistral": Family(windows="all"),
    "qwen2": Family(windows="from_layer"),
    "qwen3": Family(qk_norm=True, windows="from_layer"),
    "gemma3": Family(qk_norm=True, sandwich_norms=True, norm_offset=1.0, scaled_embeddings=True,
                     windows="pattern", default_theta=1_000_000.0, default_window=4096, local_theta=10000.0,
                     tied=True),
}


def hf_architecture(cfg: dict[str, Any], where: str) -> str:
    """The family key of config.json's architectures list (or, without one, of its model_type)."""
    names = cfg.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConversionError(f"{where} has architectures = {names!r}, which is not a list of class names; "
                              'write it as a JSON list of strings, e.g. ["LlamaForCausalLM"]')
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConversionError(f"{where} has model_type = {model_type!r}, which is not a string; "
                              'write it as a JSON string, e.g. "llama"')
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    shown = ", ".join(names) if names else f"model_type {model_type!r}"
    raise ConversionError(
        f"{where} describes a {shown} model, which rawinfer cannot run; supported architectures are "
        f"{', '.join(ARCHITECTURES)}")


def hf_tie_setting(cfg: dict[str, Any], fam: Family, where: str) -> bool:
    """config.json's tie_word_embeddings (the family's default when absent); only a JSON boolean is
    accepted, since a string such as "false" would otherwise read as true."""
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        return fam.tied
    if not isinstance(tied, bool):
        raise ConversionError(f"{where} has tie_word_embeddings = {tied!r}, which is not a boolean; "
                              "write it as JSON true or false, without quotes")
    return tied


def rope_from_params(params: dict[str, Any], theta: Any, where: str) -> RopeConfig:
    """One RoPE from a rope_parameters / rope_scaling dict and the theta that goes with it."""
    if not isinstance(params, dict):
        raise ConversionError(f"{where} has RoPE settings {params!r}, which are not a JSON object")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"{where} rotates only part of each head (partial_rotary_factor); rawinfer "
                              "rotates whole heads and cannot run this model")
    theta = float(params.get("rope_theta", theta))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "llama3":
        raise ConversionError(
            f"{where} uses RoPE scaling type {rope_type!r}, which rawinfer does not implement; supported are "
            "the default rotary embedding and 'llama3' scaling")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ConversionError(f"{where} has llama3 RoPE scaling without {', '.join(missing)}; "
                              "add the missing values from the model's original config.json")
    return RopeConfig(theta=theta, type="llama3", factor=float(params["factor"]),
                      low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def hf_ropes(cfg: dict[str, Any], fam: Family, where: str) -> tuple[RopeConfig, RopeConfig]:
    """(RoPE of full-attention layers, RoPE of sliding layers) from either transformers spelling."""
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"{where} rotates only part of each head (partial_rotary_factor); rawinfer "
                              "rotates whole heads and cannot run this model")
    theta = cfg.get("rope_theta", fam.default_theta)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ConversionError(f"{where} sets RoPE for layer type(s) {', '.join(map(repr, unknown))}, which "
                                  "rawinfer does not know (it knows full_attention and sliding_attention)")
        full = params.get("full_attention", params.get("sliding_attention"))
        rope = rope_from_params(full, theta, where)
        local = rope_from_params(params["sliding_attention"], theta, where) if "sliding_attention" in params else rope
        return rope, local
    if params is not None:
        rope = rope_from_params(params, theta, where)
        return rope, rope
    rope = rope_from_params(cfg.get("rope_scaling") or {}, theta, where)
    if fam.local_theta is None:
        return rope, rope
    return rope, RopeConfig(theta=float(cfg.get("rope_local_base_freq", fam.local_theta)))


def hf_layer_types(cfg: dict[str, Any], fam: Family, num_layers: int, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as ModelConfig keeps them: (None, ()) when every layer is full.

    A window needs a sliding_window value (Qwen's also use_sliding_window: true); which layers it
    covers comes from config.json's layer_types when present, else from the family's rule."""
    window = cfg.get("sliding_window", fam.default_window)
    if fam.windows == "none" or (fam.windows == "from_layer" and not cfg.get("use_sliding_window", False)):
        window = None
    if window is None:
        return None, ()
    listed = cfg.get("layer_types")
    if listed is not None:
        if (not isinstance(listed, list) or len(listed) != num_layers
                or any(not isinstance(t, str) or t not in LAYER_TYPES for t in listed)):
            raise ConversionError(f"{where} has layer_types {listed!r}; rawinfer needs one of "
                                  f"{', '.join(LAYER_TYPES)} for each of the {num_layers} layers")
        types = tuple(LAYER_TYPES[t] for t in listed)
    elif fam.windows == "all":
        types = ("sliding",) * num_layers
    elif fam.windows == "from_layer":
        first = int(cfg.get("max_window_layers", 0))
        types = tuple("sliding" if i >= first else "full" for i in range(num_layers))
    else:   # "pattern": every pattern-th layer is full, as transformers 4's Gemma3TextConfig derived it
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    if "sliding" not in types:
        return None, ()
    return int(window), types


def _gemma_checks(cfg: dict[str, Any], where: str) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConversionError(f"{where} sets {key} = {cfg[key]}, a logit soft-cap rawinfer does not "
                                  "implement; this model cannot be converted")
    if cfg.get("use_bidirectional_attention"):
        raise ConversionError(f"{where} sets use_bidirectional_attention (an embedding model); rawinfer runs "
                              "causal language models only")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _first(*values: Any) -> int | None:
    for v in values:
        if v is not None:
            return int(v[0]) if isinstance(v, (list, tuple)) else int(v)
    return None


def hf_model_config(cfg: dict[str, Any], gen: dict[str, Any], tok: TokenizerInfo, *, tied: bool,
                    qkv_bias: bool, where: str, source: str) -> ModelConfig:
    """ModelConfig from config.json, generation_config.json and the tokenizer's special tokens."""
    arch = hf_architecture(cfg, where)
    fam = FAMILIES[arch]
    act = _hf_activation(cfg, where)
    if arch == "gemma3":
        _gemma_checks(cfg, where)
    try:
        C, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        L = int(cfg["num_hidden_layers"])
        window, layer_types = hf_layer_types(cfg, fam, L, where)
        rope, local = hf_ropes(cfg, fam, where)
        attn_scale = None
        if arch == "gemma3":
            attn_scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
        eos = dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id")) + tok.eos_token_ids)
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=C,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=L,
            num_heads=H,
            num_kv_heads=int(cfg.get("num_key_value_heads") or H),
            head_dim=int(cfg.get("head_dim") or C // H),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=rope,
            tie_word_embeddings=tied,
            qkv_bias=qkv_bias,
            bos_token_id=_first(cfg.get("bos_token_id"), gen.get("bos_token_id"), tok.bos_token_id),
            eos_token_ids=tuple(eos),
            pad_token_id=_first(cfg.get("pad_token_id"), gen.get("pad_token_id"), tok.pad_token_id),
            add_bos_token=tok.add_bos_token,
            chat_template=tok.chat_template,
            source=source,
            hidden_act=ACTIVATIONS[act],
            qk_norm=fam.qk_norm,
            sandwich_norms=fam.sandwich_norms,
            embed_scale=math.sqrt(C) if fam.scaled_embeddings else 1.0,
            attn_scale=attn_scale,
            sliding_window=window,
            layer_types=layer_types,
            rope_local=local if local != rope and "sliding" in layer_types else None,
        )
    except ConversionError:
        raise
    except KeyError as e:
        raise ConversionError(f"{where} has no {e.args[0]!r} entry; it is not a complete model config") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"{where} has an invalid value ({e}); fix the file or download it again") from e
    _check_special_ids(config, where)
    return config


def _hf_activation(cfg: dict[str, Any], where: str) -> str:
    """The MLP's gate activation named by config.json (hidden_activation, else hidden_act), checked."""
    act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(act_key) or "silu"
    if not isinstance(act, str):
        raise ConversionError(f"{where} has {act_key} = {act!r}, which is not a string; write the activation's "
                              f"name as a JSON string, one of {', '.join(ACTIVATIONS)}")
    if act not in ACTIVATIONS:
        raise ConversionError(f"{where} uses activation {act!r}; rawinfer's MLP gates with "
                              f"{', '.join(ACTIVATIONS)} (SwiGLU or tanh-approximated GeGLU)")
    return act


def _check_special_ids(config: ModelConfig, where: str) -> None:
    """Refuse a bos, pad or eos token id that is outside the vocabulary."""
    ids = [i for i in (config.bos_token_id, config.pad_token_id, *config.eos_token_ids) if i is not None]
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ConversionError(f"{where}: special token id {bad[0]} is outside the vocabulary of "
                              f"{config.vocab_size}; fix the token ids in the config files")
