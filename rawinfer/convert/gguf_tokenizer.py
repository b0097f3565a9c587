"""Rebuilding a Hugging Face tokenizer.json from the tokenizer.ggml.* metadata of a GGUF file.

Only byte-level BPE ("gpt2" in GGUF terms) is rebuilt. llama.cpp keeps the vocabulary and merges but
replaces the pre-tokenizer by a name (tokenizer.ggml.pre); PRE_TOKENIZERS maps each supported name back
to what the original tokenizer.json of that model family does:

    smollm          Digits(individual) + ByteLevel(GPT-2 regex)          SmolLM / SmolLM2, StarCoder
    gpt2            ByteLevel(GPT-2 regex)
    llama-bpe       Split(Llama 3 regex, digits in runs of 1-3) + ByteLevel, ignore_merges   Llama 3.x
    qwen2           NFC + Split(Qwen2 regex, single digits) + ByteLevel                      Qwen2 / 2.5

Token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control tokens become special added tokens, user-defined ones plain added tokens, so that
text like "<|im_start|>" is matched as one token, as the Hugging Face tokenizer does.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from rawinfer.convert.errors import ConversionError, ConversionWarning
from rawinfer.convert.layout import TokenizerInfo

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CONTROL, USER_DEFINED = 3, 4
# End-of-turn tokens: also stop generation when they are control tokens the chat template emits.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")


@dataclass(frozen=True)
class PreTokenizerRule:
    """How one tokenizer.ggml.pre family splits text before BPE."""

    split_regex: str | None      # an explicit Split step (then ByteLevel runs without its own regex)
    individual_digits: bool      # a Digits(individual_digits=True) step first
    nfc: bool                    # NFC normalizer
    ignore_merges: bool          # a whole pre-token found in the vocabulary is used as is


PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "gpt2": PreTokenizerRule(None, False, False, False),
    "smollm": PreTokenizerRule(None, True, False, False),
    "llama-bpe": PreTokenizerRule(LLAMA3_REGEX, False, False, True),
    "llama3": PreTokenizerRule(LLAMA3_REGEX, False, False, True),
    "qwen2": PreTokenizerRule(QWEN2_REGEX, False, True, False),
}


def _byte_level(use_regex: bool, trim_offsets: bool = True) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets, "use_regex": use_regex}


def tokenizer_json(tokens: list[str], merges: list[str], token_types: list[int], rule: PreTokenizerRule,
                   bos: tuple[str, int] | None) -> dict[str, Any]:
    """The tokenizer.json object of a byte-level BPE tokenizer; bos (text, id) is prepended when given."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)       # NOTE: keep the first id if a GGUF lists a token twice
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind in (CONTROL, USER_DEFINED)]
    steps: list[dict[str, Any]] = []
    if rule.individual_digits:
        steps.append({"type": "Digits", "individual_digits": True})
    if rule.split_regex is not None:
        steps.append({"type": "Split", "pattern": {"Regex": rule.split_regex}, "behavior": "Isolated",
                      "invert": False})
    steps.append(_byte_level(use_regex=rule.split_regex is None))
    if bos is None:
        post: dict[str, Any] = _byte_level(use_regex=True, trim_offsets=False)
    else:
        text, i = bos
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {text: {"id": text, "ids": [i], "tokens": [text]}}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if rule.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps},
        "post_processor": post,
        "decoder": _byte_level(use_regex=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": rule.ignore_merges, "vocab": vocab, "merges": list(merges)},
    }


def gguf_tokenizer(meta: Callable[[str], Any], where: str) -> TokenizerInfo:
    """TokenizerInfo from GGUF metadata; meta(key) returns a field's value or None when absent."""
    model = meta("tokenizer.ggml.model")
    tokens = meta("tokenizer.ggml.tokens")
    chat_template = meta("tokenizer.chat_template")
    if model is None or tokens is None:
        warnings.warn(f"{where} carries no tokenizer, so the converted model gets none: it can only be driven "
                      "with token ids", ConversionWarning, stacklevel=3)
        return TokenizerInfo(chat_template=chat_template)
    if model != "gpt2":
        raise ConversionError(
            f"{where} uses tokenizer model {model!r}; rawinfer rebuilds only byte-level BPE ('gpt2') tokenizers "
            "from GGUF, so convert the model's Hugging Face folder (which ships tokenizer.json) instead")
    pre = meta("tokenizer.ggml.pre")
    if pre is None:
        warnings.warn(f"{where} does not name its pre-tokenizer (tokenizer.ggml.pre); assuming GPT-2 rules, "
                      "which may split digits and punctuation differently from the original",
                      ConversionWarning, stacklevel=3)
        pre = "gpt2"
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"{where} uses pre-tokenizer {pre!r}, which rawinfer cannot rebuild (supported: "
            f"{', '.join(PRE_TOKENIZERS)}); convert the model's Hugging Face folder instead")
    rule = PRE_TOKENIZERS[pre]
    types = list(meta("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(meta("tokenizer.ggml.merges") or [])

    def token_id(key: str) -> int | None:
        value = meta(key)
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise ConversionError(f"{where}: {key} = {value} is outside the vocabulary of {len(tokens)} tokens; "
                                  "the file is damaged")
        return int(value)

    bos_id = token_id("tokenizer.ggml.bos_token_id")
    add_bos = meta("tokenizer.ggml.add_bos_token")
    add_bos = bool(rule.ignore_merges if add_bos is None else add_bos)   # llama.cpp: only Llama 3 defaults to BOS
    eos = [i for i in (token_id("tokenizer.ggml.eos_token_id"), token_id("tokenizer.ggml.eot_token_id"),
                       token_id("tokenizer.ggml.eom_token_id")) if i is not None]
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and tok in END_OF_TURN_TOKENS and chat_template and tok in chat_template:
            eos.append(i)
    obj = tokenizer_json(tokens, merges, types, rule,
                         (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None)
    text = json.dumps(obj, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ConversionError(f"the tokenizer rebuilt from {where} does not load ({e}); the tokenizer "
                              "metadata is damaged, convert the Hugging Face folder instead") from e
    return TokenizerInfo(tokenizer_json=text, chat_template=chat_template, bos_token_id=bos_id,
                         eos_token_ids=tuple(dict.fromkeys(eos)),
                         pad_token_id=token_id("tokenizer.ggml.padding_token_id"), add_bos_token=add_bos)
