"""Reading a Hugging Face model folder (Llama, Mistral, Qwen2): config.json to ModelConfig, safetensors to parts.

Accepted folder contents: config.json; model.safetensors, or shards listed by
model.safetensors.index.json (or simply several *.safetensors files); optionally generation_config.json
and the tokenizer files read by hf_tokenizer.py. Both RoPE spellings load: transformers 5 writes
`rope_parameters` = {rope_theta, rope_type, ...}, transformers 4 wrote `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Any

import numpy as np
from safetensors import safe_open

from rawinfer.config import ModelConfig, RopeConfig

from rawinfer.convert.errors import ConversionError, ConversionWarning
from rawinfer.convert.hf_tokenizer import read_hf_tokenizer, read_json
from rawinfer.convert.layout import TokenizerInfo

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}

# part -> tensor name in the checkpoint (after the "model." prefix of the decoder stack).
HF_NAMES = {
    "embed": "embed_tokens.weight",
    "final_norm": "norm.weight",
    "input_norm": "layers.{i}.input_layernorm.weight",
    "post_attn_norm": "layers.{i}.post_attention_layernorm.weight",
    "q": "layers.{i}.self_attn.q_proj.weight",
    "k": "layers.{i}.self_attn.k_proj.weight",
    "v": "layers.{i}.self_attn.v_proj.weight",
    "q_bias": "layers.{i}.self_attn.q_proj.bias",
    "k_bias": "layers.{i}.self_attn.k_proj.bias",
    "v_bias": "layers.{i}.self_attn.v_proj.bias",
    "o": "layers.{i}.self_attn.o_proj.weight",
    "gate": "layers.{i}.mlp.gate_proj.weight",
    "up": "layers.{i}.mlp.up_proj.weight",
    "down": "layers.{i}.mlp.down_proj.weight",
}
LM_HEAD = "lm_head.weight"
# Biases rawinfer's layer has no place for: refuse rather than silently drop them.
UNSUPPORTED_BIASES = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")


def hf_architecture(cfg: dict[str, Any], where: str) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and cfg.get("model_type") in ARCHITECTURES.values():
        return cfg["model_type"]
    shown = ", ".join(names) if names else f"model_type {cfg.get('model_type')!r}"
    raise ConversionError(
        f"{where} describes a {shown} model, which rawinfer cannot run; supported architectures are "
        f"{', '.join(ARCHITECTURES)}")


def hf_rope(cfg: dict[str, Any], where: str) -> RopeConfig:
    """RoPE settings from either the transformers 5 or the transformers 4 spelling."""
    if cfg.get("rope_parameters") is not None:
        params = dict(cfg["rope_parameters"])
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    if "rope_type" not in params and "type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(f"{where} sets RoPE per layer type, which rawinfer does not support")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConversionError(f"{where} rotates only part of each head (partial_rotary_factor); rawinfer "
                              "rotates whole heads and cannot run this model")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "llama3":
        raise ConversionError(
            f"{where} uses RoPE scaling type {rope_type!r}, which rawinfer does not implement; supported are "
            "the default rotary embedding and 'llama3' scaling")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ConversionError(f"{where} has llama3 RoPE scaling without {', '.join(missing)}; "
                              "add the missing values from the model's original config.json")
    return RopeConfig(theta=float(theta), type="llama3", factor=float(params["factor"]),
                      low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]))


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
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{where} uses activation {act!r}; rawinfer's MLP is SwiGLU (silu) only")
    try:
        C, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if window is not None and cfg.get("use_sliding_window", arch == "mistral") and int(window) < max_pos:
            warnings.warn(f"{where} uses sliding-window attention ({window} tokens), which rawinfer does not "
                          f"implement; the context is capped at {window} tokens, where both agree",
                          ConversionWarning, stacklevel=3)
            max_pos = int(window)
        eos = dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id")) + tok.eos_token_ids)
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=C,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=H,
            num_kv_heads=int(cfg.get("num_key_value_heads") or H),
            head_dim=int(cfg.get("head_dim") or C // H),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=hf_rope(cfg, where),
            tie_word_embeddings=tied,
            qkv_bias=qkv_bias,
            bos_token_id=_first(cfg.get("bos_token_id"), gen.get("bos_token_id"), tok.bos_token_id),
            eos_token_ids=tuple(eos),
            pad_token_id=_first(cfg.get("pad_token_id"), gen.get("pad_token_id"), tok.pad_token_id),
            add_bos_token=tok.add_bos_token,
            chat_template=tok.chat_template,
            source=source,
        )
    except KeyError as e:
        raise ConversionError(f"{where} has no {e.args[0]!r} entry; it is not a complete model config") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConversionError(f"{where} has an invalid value ({e}); fix the file or download it again") from e
    ids = [i for i in (config.bos_token_id, config.pad_token_id, *config.eos_token_ids) if i is not None]
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ConversionError(f"{where}: special token id {bad[0]} is outside the vocabulary of "
                              f"{config.vocab_size}; fix the token ids in the config files")
    return config


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index} has no weight_map; the file is damaged, download it again")
        files = sorted({os.path.join(folder, f) for f in weight_map.values()})
        for f in files:
            if not os.path.isfile(f):
                raise ConversionError(f"shard {os.path.basename(f)} listed in {index} is missing; "
                                      "download every shard of the checkpoint")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    bins = glob.glob(os.path.join(folder, "*.bin"))
    hint = ("it only has PyTorch .bin weights; download the .safetensors version of the model" if bins else
            "download the model's *.safetensors files into it")
    raise ConversionError(f"{folder!r} has no safetensors weights; {hint}")


class HFReader:
    """A Hugging Face folder opened for conversion: config, tokenizer, and the parts on demand."""

    def __init__(self, folder: str):
        where = os.path.join(folder, "config.json")
        if not os.path.isfile(where):
            raise ConversionError(f"{folder!r} has no config.json, so it is not a Hugging Face model folder; "
                                  "point SRC at the folder that holds config.json and the *.safetensors files")
        cfg = read_json(where)
        hf_architecture(cfg, where)                    # fail on the architecture before touching weights
        gen_path = os.path.join(folder, "generation_config.json")
        gen = read_json(gen_path) if os.path.isfile(gen_path) else {}
        self._files: dict[str, Any] = {}               # tensor name -> open safe_open handle
        self._where: dict[str, str] = {}               # tensor name -> file name, for messages
        for path in _weight_files(folder):
            try:
                handle = safe_open(path, framework="numpy")
                names = list(handle.keys())
            except Exception as e:  # safetensors raises SafetensorError (an Exception) on a bad header
                raise ConversionError(f"cannot read {path} ({e}); the file is truncated or corrupt, "
                                      "download it again") from e
            for name in names:
                self._files[name] = handle
                self._where[name] = os.path.basename(path)
        self._prefix = "model." if "model." + HF_NAMES["embed"] in self._files else ""
        for name in self._files:
            if name.endswith(UNSUPPORTED_BIASES):
                raise ConversionError(f"tensor {name!r} is a bias that rawinfer's Llama layer has no place for; "
                                      "this checkpoint cannot be converted")
        # NOTE: a missing lm_head means the output layer reuses the embeddings, whatever the config says.
        tied = bool(cfg.get("tie_word_embeddings", False)) or LM_HEAD not in self._files
        qkv_bias = self._prefix + HF_NAMES["q_bias"].format(i=0) in self._files
        tok = read_hf_tokenizer(folder)
        self.tokenizer_json: str | None = tok.tokenizer_json
        self.config = hf_model_config(cfg, gen, tok, tied=tied, qkv_bias=qkv_bias, where=where,
                                      source=os.path.abspath(folder))

    def _name(self, part: str, layer: int | None) -> str:
        if part == "lm_head":
            return LM_HEAD
        return self._prefix + HF_NAMES[part].format(i=layer)

    def describe(self, part: str, layer: int | None) -> str:
        name = self._name(part, layer)
        return f"tensor {name!r} in {self._where.get(name, 'the checkpoint')}"

    def part(self, part: str, layer: int | None) -> np.ndarray:
        name = self._name(part, layer)
        if name not in self._files:
            raise ConversionError(f"the checkpoint has no tensor {name!r}, which the config requires; "
                                  "the download is incomplete or the config does not belong to these weights")
        try:
            x = self._files[name].get_tensor(name)
        except Exception as e:
            raise ConversionError(f"cannot read {self.describe(part, layer)} ({e}); the file is corrupt, "
                                  "download it again") from e
        if str(x.dtype) not in ("float32", "float16", "bfloat16", "float64"):
            raise ConversionError(f"{self.describe(part, layer)} has dtype {x.dtype}, not a float type; "
                                  "quantized Hugging Face checkpoints are not supported, use the unquantized one")
        return x.astype(np.float32)

    def close(self) -> None:
        self._files.clear()

