"""A converted model that is damaged never runs (issue 16, item 5): every corruption of config.json or
model.safetensors below is refused at load with one sentence naming the file, the key or tensor, and the
fix; none ends in a traceback or in garbage output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rawinfer import LLMEngine
from rawinfer.config import ModelConfig, ModelFormatError

from conftest import ROOT


def copy_model(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


def edit_tensor(model_dir: str, name: str, edit) -> None:
    from safetensors.numpy import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    t = tensors[name].copy()
    edit(t)
    tensors[name] = t
    save_file(tensors, path)


def load(model_dir: str) -> LLMEngine:
    return LLMEngine(model_dir, device="cpu", kv_cache_memory="4MiB", warmup=False)


CONFIG_CASES = [
    ({"hidden_size": "64"}, ["hidden_size", "'64'", "integer"]),
    ({"vocab_size": -1}, ["vocab_size", "-1"]),
    ({"max_position_embeddings": 0}, ["max_position_embeddings", "0"]),
    ({"num_heads": 0}, ["num_heads"]),
    ({"rms_norm_eps": -1e-6}, ["rms_norm_eps"]),
    ({"eos_token_ids": [2, 5000]}, ["eos_token_ids", "5000", "512"]),
    ({"eos_token_ids": "2"}, ["eos_token_ids"]),
    ({"bos_token_id": 512}, ["bos_token_id", "512"]),
    ({"tie_word_embeddings": "no"}, ["tie_word_embeddings"]),
    ({"rope": {"theta": -5.0}}, ["theta"]),
    ({"rope": [1, 2]}, ["rope"]),
    ({"rope": None}, ["rope=None", "RoPE settings"]),
    ({"embed_scale": 0}, ["embed_scale=0", "positive"]),
    ({"attn_scale": -0.125}, ["attn_scale=-0.125"]),
    ({"sliding_window": 0}, ["sliding_window=0"]),
]


@pytest.mark.parametrize("changes, words", CONFIG_CASES, ids=[next(iter(c)) + "-" + str(i)
                                                                for i, (c, _) in enumerate(CONFIG_CASES)])
def test_bad_config_values_are_refused_by_name(tiny_llama_dir, tmp_path, changes, words):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_config(d, **changes)
    with pytest.raises(ModelFormatError) as e:
        load(d)
    msg = str(e.value)
    assert "config.json" in msg and "re-convert" in msg and all(w in msg for w in words), msg


def test_config_that_is_not_an_object_or_not_utf8_names_the_file(tiny_llama_dir, tmp_path):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        json.dump([1, 2, 3], f)
    with pytest.raises(ModelFormatError, match="config.json.*JSON object"):
        load(d)
    with open(path, "wb") as f:
        f.write(b'{"format": "rawinfer", "source": "\xff\xfe"}')
    with pytest.raises(ModelFormatError) as e:
        load(d)
    assert path in str(e.value) and "UTF-8" in str(e.value)


def test_fewer_layers_in_config_than_in_the_weights_is_refused(tiny_llama_dir, tmp_path):
    """num_layers lowered: the file's extra layers would be ignored and the model would print garbage."""
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_config(d, num_layers=1)
    with pytest.raises(ModelFormatError) as e:
        load(d)
    assert "layers.1." in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("name, edit", [
    ("final_norm", lambda t: t.__setitem__(3, np.nan)),
    ("embed_tokens", lambda t: t.__setitem__(slice(10, 12), np.inf)),
    ("layers.1.qkv_proj", lambda t: t.__setitem__((slice(0, 3), 5), -np.inf)),
    ("lm_head", lambda t: t.__setitem__((0, 0), np.nan)),
])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny_llama_dir, tmp_path, name, edit):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_tensor(d, name, edit)
    with pytest.raises(ModelFormatError) as e:
        load(d)
    assert f"tensor {name} " in str(e.value) and "NaN or Inf" in str(e.value) and "re-convert" in str(e.value)


def test_an_intact_model_still_loads_and_runs(tiny_llama_dir):
    from rawinfer import SamplingParams
    eng = load(tiny_llama_dir)
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert len(out) == 4


def test_model_config_from_json_checks_types_directly():
    good = ModelConfig(architecture="llama", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, max_position_embeddings=16)
    d = good.to_json()
    assert ModelConfig.from_json(d) == good
    for key, value in [("num_layers", 1.5), ("num_layers", True), ("head_dim", None), ("dtype", 3),
                       ("quant", 8), ("pad_token_id", -1), ("chat_template", 5), ("rms_norm_eps", "1e-5")]:
        with pytest.raises(ModelFormatError, match=key):
            ModelConfig.from_json({**d, key: value})
    # a config without RoPE settings once ran with theta 10,000, whatever the model was trained with
    with pytest.raises(ModelFormatError, match="rope=None is invalid"):
        ModelConfig.from_json({k: v for k, v in d.items() if k != "rope"})


def test_the_cli_prints_one_line_not_a_traceback(tiny_llama_dir, tmp_path):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    edit_tensor(d, "final_norm", lambda t: t.__setitem__(0, np.nan))
    r = subprocess.run([sys.executable, "-m", "rawinfer", "generate", "--model", d, "--device", "cpu",
                        "--kv-cache-memory", "4MiB", "--max-tokens", "2", "--token-ids", "5,6,7"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "final_norm" in r.stderr and "NaN or Inf" in r.stderr
