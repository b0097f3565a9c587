"""Reading the tokenizer files of a Hugging Face model folder into a TokenizerInfo.

tokenizer.json is copied verbatim (after checking that `tokenizers` loads it). The special-token ids,
add_bos_token and the chat template come from tokenizer_config.json, chat_template.jinja or
chat_template.json (newer transformers versions move the template out of tokenizer_config.json).
Token ids from config.json / generation_config.json are merged in by hf.py, which knows the config.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from tokenizers import Tokenizer

from rawinfer.convert.errors import ConversionError, ConversionWarning
from rawinfer.convert.layout import TokenizerInfo


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from path, or ConversionError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path} ({e}); the file is damaged, download it again") from e
    if not isinstance(obj, dict):
        raise ConversionError(f"{path} does not hold a JSON object; the file is damaged, download it again")
    return obj


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as "text" or as {"content": "text", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: str, tok_config: dict[str, Any]) -> str | None:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    as_json = os.path.join(folder, "chat_template.json")
    template: Any = read_json(as_json).get("chat_template") if os.path.isfile(as_json) else None
    if template is None:
        template = tok_config.get("chat_template")
    if isinstance(template, list):       # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _post_processor_prepends(tok_json: dict[str, Any]) -> str | None:
    """The special token a TemplateProcessing post-processor puts before the text, if any."""
    proc = tok_json.get("post_processor") or {}
    procs = proc.get("processors", []) if proc.get("type") == "Sequence" else [proc]
    for p in procs:
        if isinstance(p, dict) and p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            if isinstance(first, dict) and "SpecialToken" in first:
                return first["SpecialToken"].get("id")
    return None


def read_hf_tokenizer(folder: str) -> TokenizerInfo:
    """The tokenizer of a Hugging Face folder; without tokenizer.json only the chat template survives."""
    tok_config_path = os.path.join(folder, "tokenizer_config.json")
    tok_config = read_json(tok_config_path) if os.path.isfile(tok_config_path) else {}
    chat_template = _chat_template(folder, tok_config)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        warnings.warn(
            f"{folder!r} has no tokenizer.json, so the converted model gets none: it can only be driven with "
            "token ids (add tokenizer.json to the source folder and convert again to get text in and out)",
            ConversionWarning, stacklevel=3)
        return TokenizerInfo(chat_template=chat_template)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tokenizer = Tokenizer.from_str(text)
        tok_json = json.loads(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ConversionError(f"cannot load {path} ({e}); the file is damaged, download it again") from e

    def token_id(key: str) -> int | None:
        text = _token_text(tok_config.get(key))
        return None if text is None else tokenizer.token_to_id(text)

    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        # NOTE: Llama 3 style folders leave add_bos_token out and let the post-processor add BOS.
        add_bos = _post_processor_prepends(tok_json) is not None
    eos = token_id("eos_token")
    return TokenizerInfo(
        tokenizer_json=text,
        chat_template=chat_template,
        bos_token_id=token_id("bos_token"),
        eos_token_ids=() if eos is None else (eos,),
        pad_token_id=token_id("pad_token"),
        add_bos_token=bool(add_bos),
        vocab_ids=max(tokenizer.get_vocab(with_added_tokens=False).values(), default=-1) + 1,
        added_tokens=tuple((i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items()),
    )


def fit_to_vocab(tok: TokenizerInfo, vocab_size: int, path: str, where: str) -> str | None:
    """The tokenizer.json text to write for a model of vocab_size embeddings (None: no tokenizer).

    A vocabulary with ids at or past vocab_size is refused: ordinary text would produce them. Added
    tokens past it are left out with a warning, since only their literal text produces them (Gemma 3's
    text-only checkpoints list <image_soft_token> one past their vocab_size); without them such text
    is encoded as ordinary text instead of as an id the model has no embedding for."""
    if tok.tokenizer_json is None:
        return None
    if tok.vocab_ids > vocab_size:
        raise ConversionError(f"{path} has a vocabulary of {tok.vocab_ids} tokens but {where} says vocab_size "
                              f"{vocab_size}, so it would produce ids the model has no embedding for; the "
                              "tokenizer does not belong to these weights: use the tokenizer.json that came with them")
    beyond = sorted((i, text) for i, text in tok.added_tokens if i >= vocab_size)
    if not beyond:
        return tok.tokenizer_json
    shown = ", ".join(f"{text!r} (id {i})" for i, text in beyond[:5]) + (" ..." if len(beyond) > 5 else "")
    warnings.warn(f"{path} adds {len(beyond)} token(s) past the model's vocab_size {vocab_size}: {shown}; the "
                  "converted tokenizer leaves them out, so their text is encoded as ordinary text",
                  ConversionWarning, stacklevel=3)
    obj = json.loads(tok.tokenizer_json)
    obj["added_tokens"] = [t for t in obj.get("added_tokens") or [] if t.get("id", 0) < vocab_size]
    text = json.dumps(obj, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ConversionError(f"{path} does not load once its tokens past vocab_size {vocab_size} are left out "
                              f"({e}); use the tokenizer.json that came with these weights") from e
    return text
