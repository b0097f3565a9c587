"""Converting the Qwen3, Mistral (sliding window) and Gemma 3 Hugging Face checkpoints in tests/data.

References: the checkpoint's own tensors (mapped by hand here, Gemma's norms + 1), transformers'
logits in reference.npz reproduced by tests/reference_model.py (a float64 NumPy forward pass that
shares no code with the engine), and config.json rewritten in transformers 4.x spelling, which must
give the same ModelConfig as the transformers 5 file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from rawinfer.config import ModelConfig, RopeConfig
from rawinfer.convert import ConversionError, convert
from rawinfer.convert.hf_config import hf_model_config
from rawinfer.convert.layout import TokenizerInfo

from conftest import DATA  # noqa: E402
from reference_model import ReferenceModel  # noqa: E402

FAMILIES = ["tiny-qwen3", "tiny-mistral-swa", "tiny-gemma3"]
# transformers ran float32; the float64 reference differs from it by float32 rounding, which the
# larger logits of tiny-mistral-swa (up to ~15) amplify to a few 1e-4. Twice that noise floor,
# and still 100x below the smallest greedy margin of these checkpoints (0.05).
REF_ATOL = 5e-4


def _convert(src: str, dst: str, **kw) -> ModelConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "no tokenizer": these checkpoints have none
        return convert(src, dst, progress=False, **kw)


def _config_json(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _rewrite_config(src: str, dst: str, cfg: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[str, ModelConfig]]:
    root = tmp_path_factory.mktemp("families")
    return {name: (str(root / name), _convert(os.path.join(DATA, name), str(root / name))) for name in FAMILIES}


def test_configs(converted):
    qwen3, mistral, gemma = (converted[n][1] for n in FAMILIES)
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.sandwich_norms, qwen3.hidden_act) == ("qwen3", True, False, "silu")
    assert qwen3.sliding_window is None and qwen3.layer_types == () and qwen3.tie_word_embeddings
    assert qwen3.rope == RopeConfig(theta=1e6) and qwen3.rope_local is None and not qwen3.qkv_bias

    assert (mistral.architecture, mistral.qk_norm, mistral.sandwich_norms) == ("mistral", False, False)
    assert mistral.sliding_window == 24 and mistral.layer_types == ("sliding", "sliding")
    assert mistral.kv_window == 24 and not mistral.tie_word_embeddings

    assert (gemma.architecture, gemma.hidden_act, gemma.qk_norm, gemma.sandwich_norms) == \
        ("gemma3", "gelu_tanh", True, True)
    assert gemma.embed_scale == pytest.approx(8.0) and gemma.scale == pytest.approx(16 ** -0.5)
    assert gemma.sliding_window == 24 and gemma.layer_types == ("sliding", "sliding", "full")
    assert gemma.kv_window == 0                       # one layer is global: no block can be given back
    assert gemma.rope == RopeConfig(theta=1e6) and gemma.rope_local == RopeConfig(theta=1e4)
    assert [gemma.layer_rope(i).theta for i in range(3)] == [1e4, 1e4, 1e6]
    assert (gemma.bos_token_id, gemma.eos_token_ids, gemma.pad_token_id) == (1, (2,), 0)


def _expected(name: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The converted tensors built by hand from the checkpoint's tensors."""
    hf = load_file(os.path.join(DATA, name, "model.safetensors"))
    one = 1.0 if name == "tiny-gemma3" else 0.0          # Gemma's norms compute x / rms * (1 + w)
    out = {"embed_tokens": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"] + one}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        x = {"input_norm": hf[p + "input_layernorm.weight"] + one,
             "qkv_proj": np.concatenate([hf[a + f"{c}_proj.weight"] for c in "qkv"]),
             "o_proj": hf[a + "o_proj.weight"],
             "gate_up_proj": np.concatenate([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]]),
             "down_proj": hf[m + "down_proj.weight"]}
        if cfg.qk_norm:
            x |= {"q_norm": hf[a + "q_norm.weight"] + one, "k_norm": hf[a + "k_norm.weight"] + one}
        if cfg.sandwich_norms:      # Gemma: post_attention_layernorm is on the attention output
            x |= {"attn_out_norm": hf[p + "post_attention_layernorm.weight"] + one,
                  "post_attn_norm": hf[p + "pre_feedforward_layernorm.weight"] + one,
                  "mlp_out_norm": hf[p + "post_feedforward_layernorm.weight"] + one}
        else:
            x["post_attn_norm"] = hf[p + "post_attention_layernorm.weight"]
        out |= {f"layers.{i}.{k}": v for k, v in x.items()}
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_tensors(converted, name):
    dst, cfg = converted[name]
    want = _expected(name, cfg)
    with safe_open(os.path.join(dst, "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(want)
        for k, v in want.items():
            np.testing.assert_array_equal(f.get_tensor(k), v.astype(np.float32), err_msg=k)


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_forward_reproduces_transformers(converted, name):
    """The converted folder read by the independent NumPy forward pass gives transformers' logits and
    greedy path: the tensors are right and the config keys mean what the reference assumes."""
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    model = ReferenceModel.from_dir(converted[name][0])
    np.testing.assert_allclose(model.logits(ref["seq_ids"]), ref["seq_logits"], atol=REF_ATOL, rtol=0)
    assert model.greedy(ref["prompt_ids"], 40) == ref["greedy_ids"].tolist()


# ---- transformers 4.x spellings ------------------------------------------------------------------

def _transformers4(name: str, cfg: dict, variant: str) -> dict:
    """config.json as transformers 4.x wrote it for this family."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters")
    cfg.pop("transformers_version", None)
    if name != "tiny-gemma3":
        cfg |= {"rope_theta": rope["rope_theta"], "rope_scaling": None}
        if name == "tiny-qwen3" and variant == "old":
            cfg.pop("layer_types")                      # before transformers 4.53 there was none
        return cfg
    cfg |= {"rope_theta": rope["full_attention"]["rope_theta"], "rope_scaling": None,
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    cfg.pop("_sliding_window_pattern")
    if variant == "old":                                # transformers 4.50: a period, no layer_types
        cfg.pop("layer_types")
        cfg["sliding_window_pattern"] = 3               # layers 0, 1 slide, layer 2 is global
    return cfg


@pytest.mark.parametrize("variant", ["old", "layer_types"])
@pytest.mark.parametrize("name", FAMILIES)
def test_transformers4_config_gives_the_same_model(converted, tmp_path, name, variant):
    src = os.path.join(DATA, name)
    folder = _rewrite_config(src, str(tmp_path / "src"), _transformers4(name, _config_json(src), variant))
    cfg = _convert(folder, str(tmp_path / "out"))
    assert dataclasses.replace(cfg, source="") == dataclasses.replace(converted[name][1], source="")


def _config(cfg: dict) -> ModelConfig:
    return hf_model_config(cfg, {}, TokenizerInfo(), tied=True, qkv_bias=False, where="config.json", source="")


def test_which_layers_slide():
    base = _config_json(os.path.join(DATA, "tiny-qwen3"))
    # Qwen: the window applies only with use_sliding_window, to layers from max_window_layers on
    on = _config({**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                  "layer_types": None})
    assert (on.sliding_window, on.layer_types) == (8, ("full", "sliding"))
    off = _config({**base, "use_sliding_window": False, "sliding_window": 8})
    assert (off.sliding_window, off.layer_types, off.kv_window) == (None, (), 0)
    # Mistral: every layer, and none when sliding_window is null
    mistral = _config_json(os.path.join(DATA, "tiny-mistral-swa"))
    assert _config({**mistral, "sliding_window": None}).layer_types == ()
    # Gemma 3 without any window keys: transformers' defaults (4096, every sixth layer global)
    gemma = _config_json(os.path.join(DATA, "tiny-gemma3"))
    for key in ("layer_types", "sliding_window", "_sliding_window_pattern"):
        gemma.pop(key)
    g = _config({**gemma, "num_hidden_layers": 7})
    assert g.sliding_window == 4096 and g.layer_types == ("sliding",) * 5 + ("full", "sliding")
    # gelu spellings: all the tanh approximation
    assert _config({**gemma, "hidden_activation": None, "hidden_act": "gelu_pytorch_tanh"}).hidden_act == "gelu_tanh"


# ---- bad inputs: one ConversionError that names the problem, nothing written ----------------------

BAD_CONFIGS = [
    ("tiny-qwen3", {"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM model, which rawinfer cannot run"),
    ("tiny-qwen3", {"architectures": None, "model_type": "phi3"}, "model_type 'phi3'"),
    ("tiny-qwen3", {"num_hidden_layers": None}, "no 'num_hidden_layers' entry"),
    ("tiny-mistral-swa", {"hidden_size": None}, "no 'hidden_size' entry"),
    ("tiny-gemma3", {"hidden_activation": "relu"}, "activation 'relu'"),
    ("tiny-gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0, a logit soft-cap"),
    ("tiny-gemma3", {"layer_types": ["sliding_attention", "full_attention"]}, "one of full_attention"),
    ("tiny-gemma3", {"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "yarn"}}},
     "RoPE scaling type 'yarn'"),
    ("tiny-qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("tiny-mistral-swa", {"vocab_size": "many"}, "invalid value"),
]


@pytest.mark.parametrize("name, changes, words", BAD_CONFIGS)
def test_bad_config(tmp_path, name, changes, words):
    cfg = _config_json(os.path.join(DATA, name))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    folder = _rewrite_config(os.path.join(DATA, name), str(tmp_path / "src"), cfg)
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=words) as info:
        _convert(folder, dst)
    assert "\n" not in str(info.value)
    assert not os.path.exists(dst)


def test_checkpoint_missing_a_family_tensor(tmp_path):
    """A Gemma config over weights without the q/k norms: the missing tensor is named."""
    from safetensors.numpy import save_file
    folder = str(tmp_path / "src")
    shutil.copytree(os.path.join(DATA, "tiny-gemma3"), folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if "k_norm" not in k}
    save_file(tensors, path)
    with pytest.raises(ConversionError, match=r"no tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"):
        _convert(folder, str(tmp_path / "out"))
