"""A model that cannot hold a conversation (no chat template, no tokenizer) is refused by `rawinfer chat`,
and `--system` by `rawinfer generate`, from the model's files: before the model loads and warms up."""

from __future__ import annotations

import json
import os

import pytest

from cli_util import ROOT, make_chat_model, rawinfer, user_cache  # noqa: E402

ENGINE = ("--device", "cpu", "--kv-cache-memory", "16MiB")
STARTED = "starting the engine"          # open_engine's log line: the model began to load


@pytest.fixture(scope="module")
def no_template(tmp_path_factory):
    """A converted tiny chat model whose config.json lost its chat template (a base model), its template
    file, and a user cache of its own."""
    from rawinfer.convert import convert
    tmp = tmp_path_factory.mktemp("base")
    src = make_chat_model(str(tmp / "hf"))
    dst = str(tmp / "base")
    convert(src, dst, progress=False)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    template = str(tmp / "template.jinja")
    with open(template, "w") as f:
        f.write(cfg["chat_template"])
    cfg["chat_template"] = None
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst, template, user_cache(tmp)


def test_chat_refuses_a_model_without_a_chat_template_before_loading_it(no_template):
    model, _, cache = no_template
    r = rawinfer("chat", "--model", model, *ENGINE, stdin="hello\n", RAWINFER_CACHE=cache)
    assert r.returncode == 2 and STARTED not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"rawinfer: error: the model in {model} has no chat template, so it cannot hold a conversation; give one "
        "with --chat-template FILE, or use `rawinfer generate --raw` instead")
    r = rawinfer("chat", "--model", model, *ENGINE, "--system", "Be brief.", stdin="hello\n", RAWINFER_CACHE=cache)
    assert r.returncode == 2 and STARTED not in r.stderr and "has no chat template" in r.stderr


def test_chat_without_a_tokenizer_is_refused_before_loading(tiny_llama_dir):
    r = rawinfer("chat", "--model", tiny_llama_dir, *ENGINE, stdin="hello\n")
    assert r.returncode == 2 and STARTED not in r.stderr
    assert "has no tokenizer, so it cannot hold a conversation" in r.stderr


def test_a_chat_template_file_stands_in_for_the_missing_one(no_template):
    model, template, cache = no_template
    r = rawinfer("chat", "--model", model, *ENGINE, "--chat-template", template, "--max-tokens", "3",
                 "--ignore-eos", stdin="hello\n", RAWINFER_CACHE=cache)
    assert r.returncode == 0, r.stderr
    assert STARTED in r.stderr and "[prompt " in r.stderr


def test_generate_refuses_system_for_a_model_without_a_template_before_loading(no_template, tiny_llama_dir):
    model, _, cache = no_template
    r = rawinfer("generate", "hello", "--model", model, *ENGINE, "--system", "Be brief.", RAWINFER_CACHE=cache)
    assert r.returncode == 2 and STARTED not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("rawinfer: error: --system needs a chat template and ")
    r = rawinfer("generate", "hello", "--model", tiny_llama_dir, *ENGINE)
    assert r.returncode == 2 and STARTED not in r.stderr and "has no tokenizer, so it cannot read text" in r.stderr


def test_gemma3_without_its_chat_template_is_refused_at_once():
    """Gemma 3 270M as `rawinfer fetch` converts it: its GGUF carries no chat template."""
    gemma = os.path.join(ROOT, "weights", "gemma3-270m")
    if not os.path.isfile(os.path.join(gemma, "config.json")):
        pytest.skip("weights/gemma3-270m is not fetched (`rawinfer fetch gemma3-270m`)")
    with open(os.path.join(gemma, "config.json")) as f:
        if json.load(f).get("chat_template"):
            pytest.skip("this conversion of Gemma 3 has a chat template")
    r = rawinfer("chat", "--model", gemma, *ENGINE, stdin="hello\n")
    assert r.returncode == 2 and STARTED not in r.stderr and "has no chat template" in r.stderr
