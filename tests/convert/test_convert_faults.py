"""Damaged or inconsistent sources: each is refused with one sentence naming the problem, or converted
with a warning where the converter has to guess. The bad inputs are built here from tests/data/tiny-llama
(a Hugging Face folder, and a GGUF file written from the same tensors)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models

from rawinfer.convert import ConversionError, ConversionWarning, convert

from conftest import DATA  # noqa: E402
from test_convert import edit_config  # noqa: E402
TINY_LLAMA = os.path.join(DATA, "tiny-llama")
V = 512                                   # tiny-llama's vocab_size


def hf_source(tmp_path, config: dict | None = None, tensors=None) -> str:
    """A copy of tiny-llama with config.json keys replaced (None: removed) and tensors edited by `tensors`."""
    src = str(tmp_path / "src")
    shutil.copytree(TINY_LLAMA, src)
    edit_config(src, **(config or {}))
    if tensors is not None:
        weights = load_file(os.path.join(src, "model.safetensors"))
        tensors(weights)
        save_file(weights, os.path.join(src, "model.safetensors"))
    return src


def refused(src: str, tmp_path, *words: str) -> str:
    """Convert src, expect a ConversionError holding every one of `words`; returns the message."""
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError) as info:
        convert(src, dst, progress=False)
    message = str(info.value)
    for w in words:
        assert w in message, message
    assert not os.path.exists(dst)
    return message


# ---- Hugging Face folders --------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("config, words", [
    ({"hidden_act": ["silu"]}, "hidden_act = ['silu'], which is not a string"),
    ({"architectures": [["LlamaForCausalLM"]]}, "architectures = [['LlamaForCausalLM']], which is not a list"),
    ({"architectures": "LlamaForCausalLM"}, "architectures = 'LlamaForCausalLM', which is not a list"),
    ({"architectures": None, "model_type": ["llama"]}, "model_type = ['llama'], which is not a string"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false', which is not a boolean"),
])
def test_config_value_of_the_wrong_type(tmp_path, config, words):
    refused(hf_source(tmp_path, config), tmp_path, "config.json", words)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_layers_beyond_num_hidden_layers_are_refused(tmp_path):
    src = hf_source(tmp_path, {"num_hidden_layers": 1})
    refused(src, tmp_path, "model.layers.1.", "num_hidden_layers = 1", "would be dropped")


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_unknown_tensor_is_refused(tmp_path):
    def add(w):
        w["model.extra.foo"] = np.zeros(3, np.float32)
    refused(hf_source(tmp_path, tensors=add), tmp_path, "model.extra.foo", "model.safetensors")


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_rotary_buffers_and_a_tied_lm_head_are_not_leftovers(tmp_path):
    def add(w):
        for i in range(2):
            w[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    cfg = convert(hf_source(tmp_path, {"tie_word_embeddings": True}, add), str(tmp_path / "out"), progress=False)
    assert cfg.tie_word_embeddings


@pytest.mark.filterwarnings("ignore:.*no tokenizer.json")
def test_missing_lm_head_of_an_untied_model_is_tied_with_a_warning(tmp_path):
    src = hf_source(tmp_path, tensors=lambda w: w.pop("lm_head.weight"))
    with pytest.warns(ConversionWarning, match="tie_word_embeddings false but .* has no 'lm_head.weight'"):
        cfg = convert(src, str(tmp_path / "out"), progress=False)
    assert cfg.tie_word_embeddings


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_hf_weights_are_refused(tmp_path, value):
    def spoil(w):
        w["model.layers.1.mlp.up_proj.weight"][3, 4] = value
    refused(hf_source(tmp_path, tensors=spoil), tmp_path, "'model.layers.1.mlp.up_proj.weight' in model.safetensors",
            "1 NaN or Inf", "damaged")


def word_level(size: int, added: list[str] = ()) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.add_special_tokens(list(added))
    return tok


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_tokenizer_larger_than_vocab_size_is_refused(tmp_path):
    src = hf_source(tmp_path)
    word_level(600).save(os.path.join(src, "tokenizer.json"))
    refused(src, tmp_path, "tokenizer.json has a vocabulary of 600 tokens", f"vocab_size {V}")


def test_tokenizer_smaller_than_vocab_size_is_fine(tmp_path):
    src = hf_source(tmp_path)
    word_level(300).save(os.path.join(src, "tokenizer.json"))
    convert(src, str(tmp_path / "out"), progress=False)


def test_added_token_past_vocab_size_is_left_out(tmp_path):
    src = hf_source(tmp_path)
    word_level(V, ["t5", "<image_soft_token>"]).save(os.path.join(src, "tokenizer.json"))
    with open(os.path.join(src, "tokenizer.json")) as f:     # t5 keeps its id, the new token gets id 512
        assert [t["id"] for t in json.load(f)["added_tokens"]] == [5, V]
    with pytest.warns(ConversionWarning, match=r"adds 1 token\(s\) past the model's vocab_size 512"):
        convert(src, str(tmp_path / "out"), progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.token_to_id("<image_soft_token>") is None and tok.encode("t5").ids == [5]
    assert [t.content for t in tok.get_added_tokens_decoder().values()] == ["t5"]


# ---- GGUF files ------------------------------------------------------------------------------

HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")                      # model.layers.{i}.<module...>.weight
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.weight"


def write_gguf(path: str, meta: dict | None = None, tokens: int = 0, spoil: str | None = None) -> str:
    """tiny-llama as a float32 llama GGUF; `meta` overrides llama.* keys (int, float or str values),
    `tokens` > 0 adds a byte-level BPE vocabulary of that many tokens, `spoil` names a tensor to get a NaN."""
    values = {"context_length": 1024, "embedding_length": 64, "block_count": 2, "feed_forward_length": 160,
              "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
              **(meta or {})}
    w = gguf.GGUFWriter(path, "llama")
    for key, value in values.items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"llama.{key}", value)
    if tokens:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list([chr(0x100 + i) for i in range(tokens)])
        w.add_token_merges([])
    for name, x in load_file(os.path.join(TINY_LLAMA, "model.safetensors")).items():
        x = x.astype(np.float32)
        if gguf_name(name) == spoil:
            x[0, 0] = np.nan
        w.add_tensor(gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_clean_gguf_converts(tmp_path):
    cfg = convert(write_gguf(str(tmp_path / "tiny.gguf"), tokens=300), str(tmp_path / "out"), progress=False)
    assert (cfg.num_layers, cfg.num_heads, cfg.vocab_size) == (2, 4, V)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("meta, words", [
    ({"attention.head_count": 0}, "llama.attention.head_count = 0, which is not a whole number of at least 1"),
    ({"attention.head_count": "four"}, "llama.attention.head_count = 'four', which is not a whole number"),
    ({"block_count": 1}, "tensor(s) blk.1.attn_k.weight"),
    ({"attention.layer_norm_rms_epsilon": -1.0}, "llama.attention.layer_norm_rms_epsilon = -1.0"),
])
def test_bad_gguf_metadata(tmp_path, meta, words):
    refused(write_gguf(str(tmp_path / "tiny.gguf"), meta), tmp_path, "tiny.gguf", words)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_non_finite_gguf_weights_are_refused(tmp_path):
    path = write_gguf(str(tmp_path / "tiny.gguf"), spoil="blk.0.ffn_up.weight")
    refused(path, tmp_path, "tensor 'blk.0.ffn_up.weight' in tiny.gguf holds 1 NaN or Inf", "damaged")


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_gguf_tokenizer_larger_than_embeddings_is_refused(tmp_path):
    path = write_gguf(str(tmp_path / "tiny.gguf"), tokens=600)
    refused(path, tmp_path, "tiny.gguf has a tokenizer of 600 tokens but only 512 embeddings")
