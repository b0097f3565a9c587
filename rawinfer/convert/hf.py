"""Reading a Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3, Gemma 3): safetensors to parts.

Accepted folder contents: config.json (read by hf_config.py, which lists the families); model.safetensors,
or shards listed by model.safetensors.index.json (or simply several *.safetensors files); optionally
generation_config.json and the tokenizer files read by hf_tokenizer.py.

Gemma's RMSNorm computes x / rms(x) * (1 + w); rawinfer stores the multiplier it applies, so every
norm weight of such a family is handed out as 1 + w (in float32, as Gemma adds it).

Every tensor of the folder must be used: the only ones left out are RoPE inverse-frequency buffers
and, when the embeddings are tied, a stored lm_head. A folder without lm_head whose config says the
embeddings are not tied is converted tied, with a ConversionWarning.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Any

import numpy as np
from safetensors import safe_open

from rawinfer.convert.errors import ConversionError, ConversionWarning
from rawinfer.convert.hf_config import FAMILIES, hf_architecture, hf_model_config, hf_tie_setting
from rawinfer.convert.hf_tokenizer import fit_to_vocab, read_hf_tokenizer, read_json
from rawinfer.convert.layout import NORM_PARTS, some_names

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
# Tensors a checkpoint may carry that are derived data, not weights (older exports save RoPE's
# inverse frequencies, which rawinfer computes from the config): not converted, and not an error.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        self._folder, self._config_path = folder, where
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
        tied = hf_tie_setting(cfg, family, where)
        if not tied and LM_HEAD not in self._files:
            # Tying is the only usable guess here (transformers would start an untrained output layer),
            # but it may be wrong, so it is not done silently.
            warnings.warn(f"{where} sets tie_word_embeddings false but {folder!r} has no {LM_HEAD!r}; the "
                          "converted model reuses the embeddings as its output layer (if that is wrong, add "
                          "the missing weights to the folder and convert again)", ConversionWarning, stacklevel=3)
            tied = True
        self._tied = tied
        qkv_bias = self._prefix + HF_NAMES["q_bias"].format(i=0) in self._files
        tok = read_hf_tokenizer(folder)
        self.config = hf_model_config(cfg, gen, tok, tied=tied, qkv_bias=qkv_bias, where=where,
                                      source=os.path.abspath(folder))
        self.tokenizer_json: str | None = fit_to_vocab(tok, self.config.vocab_size,
                                                       os.path.join(folder, "tokenizer.json"), where)

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

    def check_all_used(self, parts: list[tuple[str, int | None]]) -> None:
        """Refuse weights the config leaves out (extra layers, unknown modules) instead of dropping them."""
        used = {self._name(part, layer) for part, layer in parts}
        if self._tied:
            used.add(LM_HEAD)              # a tied checkpoint may still store its (identical) output layer
        extra = sorted(n for n in self._files if n not in used and not n.endswith(DERIVED_SUFFIXES))
        if extra:
            raise ConversionError(
                f"{self._folder!r} holds tensor(s) {some_names(extra)} (in {self._where[extra[0]]}) that "
                f"{self._config_path} does not describe (num_hidden_layers = {self.config.num_layers}), so they would "
                "be dropped; the weights and config.json disagree: use the config.json that came with these weights")

    def close(self) -> None:
        self._files.clear()

