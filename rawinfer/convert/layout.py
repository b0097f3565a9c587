"""The tensor layout of a converted model and the hand-off from checkpoint readers to the writer.

model.safetensors of a converted model holds, row-major [out, in] like Hugging Face:

    embed_tokens                [V, C]
    final_norm                  [C]
    lm_head                     [V, C]           only when the embeddings are not tied
    layers.{i}.input_norm       [C]
    layers.{i}.qkv_proj         [(H+2Hkv)*D, C]  q rows, then k rows, then v rows
    layers.{i}.qkv_bias         [(H+2Hkv)*D]     only when config.qkv_bias
    layers.{i}.q_norm           [D]              only when config.qk_norm (one weight shared by all heads)
    layers.{i}.k_norm           [D]              only when config.qk_norm
    layers.{i}.o_proj           [C, H*D]
    layers.{i}.attn_out_norm    [C]              only when config.sandwich_norms (on the attention output)
    layers.{i}.post_attn_norm   [C]              the norm before the MLP
    layers.{i}.gate_up_proj     [2F, C]          gate rows, then up rows
    layers.{i}.down_proj        [C, F]
    layers.{i}.mlp_out_norm     [C]              only when config.sandwich_norms (on the MLP output)

Every norm weight is the multiplier actually applied, x / rms(x) * w: a reader of a checkpoint whose
norm computes x / rms(x) * (1 + w) (Gemma's Hugging Face weights) hands out 1 + w. The order above is
the file order, the same as rawinfer/exec/weights.py:weight_shapes lists.

A checkpoint reader does not know this layout: it serves "parts" (one source tensor each, named by
the role it plays: "q", "gate", "input_norm", ...) and `fuse` stacks parts into the tensors above,
checking every part's shape against the config, and its values for NaN and Inf, on the way. Before
any part is read, the reader's `check_all_used` refuses source tensors no part of the plan reads
(layers past the config's count, unknown modules): converting without them would change the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rawinfer.config import ModelConfig

from rawinfer.convert.errors import ConversionError
from rawinfer.quant import non_finite_count

# Converted tensor (without its "layers.{i}." prefix) -> the parts stacked along axis 0, in order.
RECIPES: dict[str, tuple[str, ...]] = {
    "embed_tokens": ("embed",),
    "final_norm": ("final_norm",),
    "lm_head": ("lm_head",),
    "input_norm": ("input_norm",),
    "qkv_proj": ("q", "k", "v"),
    "qkv_bias": ("q_bias", "k_bias", "v_bias"),
    "q_norm": ("q_norm",),
    "k_norm": ("k_norm",),
    "o_proj": ("o",),
    "attn_out_norm": ("attn_out_norm",),
    "post_attn_norm": ("post_attn_norm",),
    "mlp_out_norm": ("mlp_out_norm",),
    "gate_up_proj": ("gate", "up"),
    "down_proj": ("down",),
}

# The parts that are RMSNorm weights (a reader with a (1 + w) norm adds the 1 to exactly these).
NORM_PARTS = frozenset({"final_norm", "input_norm", "post_attn_norm", "attn_out_norm", "mlp_out_norm",
                        "q_norm", "k_norm"})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of model.safetensors: its name, the layer it belongs to (None: model-wide), its shape."""

    name: str
    layer: int | None
    kind: str                 # a key of RECIPES
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TokenizerInfo:
    """What a source says about its tokenizer, before it is merged into the ModelConfig."""

    tokenizer_json: str | None = None      # tokenizer.json text (None: the source has no tokenizer)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    vocab_ids: int = 0                     # ids of the tokenizer's own vocabulary: its highest id + 1
    added_tokens: tuple[tuple[int, str], ...] = ()   # (id, text) of the tokens added on top of it


class CheckpointReader(Protocol):
    """What convert() needs from a source checkpoint (a Hugging Face folder or a GGUF file)."""

    config: ModelConfig            # architecture numbers and tokenizer ids; dtype is set by the writer
    tokenizer_json: str | None     # the tokenizer.json text to write, or None when the source has none

    def part(self, part: str, layer: int | None) -> np.ndarray:
        """The source tensor playing `part` in `layer`, as float32 in Hugging Face orientation."""

    def describe(self, part: str, layer: int | None) -> str:
        """Where that part comes from, for error messages ("tensor 'x' in file 'y'")."""

    def check_all_used(self, parts: list[tuple[str, int | None]]) -> None:
        """ConversionError naming the source's tensors that none of `parts` (part, layer) reads."""

    def close(self) -> None:
        """Release open files."""


def part_shape(config: ModelConfig, part: str) -> tuple[int, ...]:
    """The shape `part` must have under `config`."""
    C, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size          # H*D, Hkv*D
    shapes = {
        "embed": (V, C), "lm_head": (V, C), "final_norm": (C,),
        "input_norm": (C,), "post_attn_norm": (C,), "attn_out_norm": (C,), "mlp_out_norm": (C,),
        "q_norm": (config.head_dim,), "k_norm": (config.head_dim,),
        "q": (q, C), "k": (kv, C), "v": (kv, C),
        "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
        "o": (C, q), "gate": (F, C), "up": (F, C), "down": (C, F),
    }
    return shapes[part]


def tensor_plan(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of model.safetensors, in file order."""
    def spec(kind: str, layer: int | None) -> TensorSpec:
        parts = [part_shape(config, p) for p in RECIPES[kind]]
        shape = (sum(s[0] for s in parts),) + parts[0][1:]
        name = kind if layer is None else f"layers.{layer}.{kind}"
        return TensorSpec(name, layer, kind, shape)

    plan = [spec("embed_tokens", None)]
    for i in range(config.num_layers):
        kinds = ["input_norm", "qkv_proj"] + (["qkv_bias"] if config.qkv_bias else [])
        kinds += ["q_norm", "k_norm"] if config.qk_norm else []
        kinds += ["o_proj"] + (["attn_out_norm"] if config.sandwich_norms else [])
        kinds += ["post_attn_norm", "gate_up_proj", "down_proj"] + (["mlp_out_norm"] if config.sandwich_norms else [])
        plan += [spec(kind, i) for kind in kinds]
    plan.append(spec("final_norm", None))
    if not config.tie_word_embeddings:
        plan.append(spec("lm_head", None))
    return plan


def plan_parts(plan: list[TensorSpec]) -> list[tuple[str, int | None]]:
    """Every (part, layer) the tensors of `plan` are built from."""
    return [(part, spec.layer) for spec in plan for part in RECIPES[spec.kind]]


def some_names(names: list[str], most: int = 5) -> str:
    """The first `most` names, and how many more there are: for errors that list a checkpoint's tensors."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_finite(x: np.ndarray, where: str) -> None:
    """ConversionError if float32 x holds a NaN or an infinity."""
    bad = non_finite_count(x)
    if bad:
        raise ConversionError(f"{where} holds {bad} NaN or Inf value(s), so the source checkpoint is damaged; "
                              "download it again or export it again from a model with finite weights")


def fuse(spec: TensorSpec, reader: CheckpointReader) -> np.ndarray:
    """Build one converted tensor from its source parts (float32), checking each part's shape and values."""
    pieces = []
    for part in RECIPES[spec.kind]:
        x = reader.part(part, spec.layer)
        want = part_shape(reader.config, part)
        if tuple(x.shape) != want:
            raise ConversionError(
                f"{reader.describe(part, spec.layer)} has shape {tuple(x.shape)} but the model config implies "
                f"{want}; the checkpoint and its config do not match (re-download or re-export the model)")
        x = np.asarray(x, dtype=np.float32)
        check_finite(x, reader.describe(part, spec.layer))
        pieces.append(x)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
