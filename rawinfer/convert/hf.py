"""Reading a Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3, Gemma 3): safetensors to parts.

Accepted folder contents: config.json (read by hf_config.py, which lists the families); model.safetensors,
or shards listed by model.safetensors.index.json (or simply several *.safetensors files); optionally
generation_config.json and the tokenizer files read by hf_tokenizer.py.

Gemma's RMSNorm computes x / rms(x) * (1 + w); rawinfer stores the multiplier it applies, so every
norm weight of such a family is handed out as 1 + w (in float32, as Gemma adds it).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
from safetensors import safe_open

from rawinfer.convert.errors import ConversionError
from rawinfer.convert.hf_config import FAMILIES, hf_architecture, hf_model_config
from rawinfer.convert.hf_tokenizer import read_hf_tokenizer, read_json
from rawinfer.convert.layout import NORM_PARTS

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
    "q_norm": "layers.{i}.self_attn.q_norm.weight",
    "k_norm": "layers.{i}.self_attn.k_norm.weight",
    "o": "layers.{i}.self_attn.o_proj.weight",
    "gate": "layers.{i}.mlp.gate_proj.weight",
    "up": "layers.{i}.mlp.up_proj.weight",
    "down": "layers.{i}.mlp.down_proj.weight",
}
# With four norms per layer (Gemma 3) the names shift: post_attention_layernorm is applied to the
# attention output, and the norm before the MLP, Llama's post_attention_layernorm slot, is
# pre_feedforward_layernorm.
SANDWICH_NAMES = {
    "attn_out_norm": "layers.{i}.post_attention_layernorm.weight",
    "post_attn_norm": "layers.{i}.pre_feedforward_layernorm.weight",
    "mlp_out_norm": "layers.{i}.post_feedforward_layernorm.weight",
}
LM_HEAD = "lm_head.weight"
# Biases rawinfer's layer has no place for: refuse rather than silently drop them.
UNSUPPORTED_BIASES = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")


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
        family = FAMILIES[hf_architecture(cfg, where)]   # fail on the architecture before touching weights
        self._names = {**HF_NAMES, **SANDWICH_NAMES} if family.sandwich_norms else HF_NAMES
        self._norm_offset = family.norm_offset
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
        if part not in self._names:
            raise ConversionError(f"this checkpoint's layers have no {part!r}; the model config does not "
                                  "belong to these weights")
        return self._prefix + self._names[part].format(i=layer)

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
        x = x.astype(np.float32)
        return x + np.float32(self._norm_offset) if self._norm_offset and part in NORM_PARTS else x

    def close(self) -> None:
        self._files.clear()

