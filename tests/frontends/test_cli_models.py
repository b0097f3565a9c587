"""What `--model` accepts as a user gives it (a converted folder, a name in weights/, a Hugging Face folder,
a .gguf file converted once into the cache), `rawinfer models`, and `rawinfer fetch` /
tools/fetch_model.sh with their failures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cli_util import DATA, ROOT, env, rawinfer, user_cache  # noqa: E402
from conftest import SMOLLM2_GGUF  # noqa: E402

ENGINE = ("--device", "cpu", "--kv-cache-memory", "64MiB")


def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path):
    if not os.path.isfile(SMOLLM2_GGUF):
        pytest.skip(f"{SMOLLM2_GGUF} is not cached (tools/fetch_default_model.sh puts it there)")
    cache = user_cache(tmp_path)
    ask = ("generate", "What is the capital of France?", "--model", SMOLLM2_GGUF, *ENGINE, "--max-tokens", "12")
    r = rawinfer(*ask, RAWINFER_CACHE=cache)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    converted = [d for d in os.listdir(os.path.join(cache, "models")) if not d.startswith(".") and
                 os.path.isdir(os.path.join(cache, "models", d))]
    assert converted == ["SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f"]          # name and digest
    assert f"converting {SMOLLM2_GGUF} once into " in r.stderr
    r = rawinfer(*ask, RAWINFER_CACHE=cache)                                     # the second time: the cache
    assert r.returncode == 0 and "Paris" in r.stdout and "converting" not in r.stderr
    r = rawinfer("models", RAWINFER_CACHE=cache)
    assert r.returncode == 0
    assert f"from {SMOLLM2_GGUF}" in r.stdout and "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f" in r.stdout


def test_models_lists_weights_and_a_name_is_enough(tmp_path, tiny_llama_dir):
    os.makedirs(tmp_path / "weights")
    shutil.copytree(tiny_llama_dir, tmp_path / "weights" / "tiny")
    os.makedirs(tmp_path / "weights" / "not-a-model")
    r = rawinfer("models", cwd=str(tmp_path), RAWINFER_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    assert "weights/tiny" in r.stdout and "llama, 2 layers, float32" in r.stdout
    assert "not-a-model" not in r.stdout and "fetchable with `rawinfer fetch NAME`" in r.stdout
    assert "smollm2-135m-instruct" in r.stdout
    r = rawinfer("generate", "5 6 7", "--token-ids", "--model", "tiny", *ENGINE, "--max-tokens", "3",
                 "--ignore-eos", "-q", cwd=str(tmp_path), RAWINFER_CACHE=user_cache(tmp_path))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3


def test_a_model_that_is_not_there_is_one_sentence(tmp_path):
    r = rawinfer("generate", "hi", "--model", "no-such-model", cwd=str(tmp_path))
    assert r.returncode == 2
    assert r.stderr == ("rawinfer: error: model 'no-such-model' does not exist: give --model a converted folder, a "
                        "Hugging Face folder or a GGUF file (`rawinfer convert` makes a converted folder), or a name "
                        "from `rawinfer models`\n")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = rawinfer("generate", "hi", "--model", str(bad), RAWINFER_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("rawinfer: error: ") and str(bad) in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_hugging_face_folder_without_weights_is_refused_before_hashing(tmp_path):
    src = tmp_path / "hf"
    os.makedirs(src)
    shutil.copy(os.path.join(DATA, "tiny-llama", "config.json"), src)
    r = rawinfer("generate", "hi", "--model", str(src), RAWINFER_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("rawinfer: error: ") and len(r.stderr.splitlines()) == 1
    assert not os.path.exists(tmp_path / "cache" / "models" / "digests.json")


def test_a_damaged_copy_in_the_cache_is_converted_again(tmp_path):
    """The cache's converted copy of a source the user gave (here a Hugging Face folder) is rawinfer's own:
    found truncated, it is converted again with a warning instead of an error telling the user to
    re-convert a model they never converted."""
    cache = user_cache(tmp_path)
    ask = ("generate", "--model", os.path.join(DATA, "tiny-llama"), "--token-ids", "--max-tokens", "3",
           "--temperature", "0", "--ignore-eos", *ENGINE, "1 2 3")
    first = rawinfer(*ask, RAWINFER_CACHE=cache)
    assert first.returncode == 0, first.stderr
    models = os.path.join(cache, "models")
    (entry,) = [d for d in os.listdir(models) if os.path.isdir(os.path.join(models, d)) and not d.startswith(".")]
    weights = os.path.join(models, entry, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    again = rawinfer(*ask, RAWINFER_CACHE=cache)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and "is damaged" in again.stderr and "converting it again" in again.stderr


def test_fetch_knows_its_catalog():
    from rawinfer.frontends.cli.fetch import fetchable
    known = ", ".join(m.name for m in fetchable())
    r = rawinfer("fetch", "llama-405b")
    assert r.returncode == 2
    assert r.stderr == f"rawinfer: error: rawinfer does not know a model named 'llama-405b'; it can fetch: {known}\n"
    r = rawinfer("fetch", "--help")
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout


def test_fetch_of_a_converted_model_does_nothing(tiny_llama_dir):
    r = rawinfer("fetch", "smollm2-135m-instruct", "--dst", tiny_llama_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"smollm2-135m-instruct is already converted in {tiny_llama_dir} (--force converts it "
                        "again)\n")


def test_fetch_model_script():
    script = os.path.join(ROOT, "tools", "fetch_model.sh")
    run = (lambda *a: subprocess.run(["bash", script, *a], capture_output=True, text=True, timeout=120,
                                     env=env(PYTHON=sys.executable)))
    r = run("--list")
    assert r.returncode == 0 and "fetchable with `rawinfer fetch NAME`" in r.stdout
    r = run("llama-405b")
    assert r.returncode == 2 and "rawinfer does not know a model named 'llama-405b'" in r.stderr


def _fake_weights(root, *names: str, model: str) -> None:
    for name in names:
        shutil.copytree(model, os.path.join(root, "weights", name))


def test_the_default_model_is_the_q4_copy_on_the_cpu_and_float32_elsewhere(tmp_path, monkeypatch, tiny_llama_dir,
                                                                            caplog):
    """Without --model: the q4 copy on the CPU, the float32 one on a GPU (it has no q4 kernels); the float32
    one on the CPU too, with a note, when only it was fetched; neither: one sentence naming the fetch."""
    from rawinfer.frontends.cli import models
    from rawinfer.frontends.options import CLIError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "CHECKOUT", str(tmp_path / "no-checkout"))   # only this folder's weights/
    monkeypatch.setenv("RAWINFER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CLIError, match=r"^the default model \(weights/smollm2-135m-instruct-q4\) is not there yet: "
                                       r"fetch it with `rawinfer fetch smollm2-135m-instruct-q4`"):
        models.resolve_model(None, device="cpu")
    _fake_weights(tmp_path, "smollm2-135m-instruct", model=tiny_llama_dir)
    with caplog.at_level("INFO", logger="rawinfer"):
        assert models.resolve_model(None, device="cpu") == "weights/smollm2-135m-instruct"
    assert "the faster q4 copy is not fetched (`rawinfer fetch smollm2-135m-instruct-q4` makes it)" in caplog.text
    _fake_weights(tmp_path, "smollm2-135m-instruct-q4", model=tiny_llama_dir)
    assert models.resolve_model(None, device="cpu") == "weights/smollm2-135m-instruct-q4"
    assert models.resolve_model(None, device="cuda") == "weights/smollm2-135m-instruct"
    assert models.resolve_model("smollm2-135m-instruct") == str(tmp_path / "weights" / "smollm2-135m-instruct")


def test_fetch_of_the_q4_default_converts_into_q4(tmp_path):
    """`rawinfer fetch smollm2-135m-instruct-q4` (what tools/fetch_default_model.sh runs first) keeps the
    GGUF's 4-bit blocks; --quant still overrides the catalog's format."""
    if not os.path.isfile(SMOLLM2_GGUF):
        pytest.skip(f"{SMOLLM2_GGUF} is not cached (tools/fetch_default_model.sh puts it there)")
    import json
    dst = tmp_path / "q4"
    r = rawinfer("fetch", "smollm2-135m-instruct-q4", "--dst", str(dst), "-q",
                 RAWINFER_CACHE=os.path.dirname(SMOLLM2_GGUF))
    assert r.returncode == 0, r.stderr
    assert "float32, q4)" in r.stdout
    with open(dst / "config.json") as f:
        assert json.load(f)["quant"] == "q4"
    r = rawinfer("models")
    assert "smollm2-135m-instruct-q4" in r.stdout and "default model on the CPU" in r.stdout


def test_the_default_model_is_served_by_its_name_whichever_copy_runs():
    """`rawinfer serve` without a model runs the q4 copy on the CPU and the float32 one on a GPU: both answer
    to the model's one name, so clients' `model` fields do not depend on the device."""
    from rawinfer.frontends.cli.main import build_parser
    from rawinfer.frontends.cli.serve import served_model_names
    parser = build_parser("serve")
    assert served_model_names(parser.parse_args(["serve"])) == ["smollm2-135m-instruct"]
    assert served_model_names(parser.parse_args(["serve", "--model", "weights/smollm2-135m-instruct-q4"])) == \
        ["smollm2-135m-instruct-q4"]                     # a model named by the user keeps its own name
