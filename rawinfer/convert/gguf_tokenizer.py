"""Rebuilding a Hugging Face tokenizer.json from the tokenizer.ggml.* metadata of a GGUF file.

Two tokenizer models are rebuilt: byte-level BPE ("gpt2" in GGUF terms) and SentencePiece BPE
("llama": Gemma, Llama 2, Mistral v0.1).

Byte-level BPE: llama.cpp keeps the vocabulary and merges but replaces the pre-tokenizer by a name
(tokenizer.ggml.pre); PRE_TOKENIZERS maps each supported name back to what the original tokenizer.json
of that model family does:

    smollm          Digits(individual) + ByteLevel(GPT-2 regex)          SmolLM / SmolLM2, StarCoder
    gpt2            ByteLevel(GPT-2 regex)
    llama-bpe       Split(Llama 3 regex, digits in runs of 1-3) + ByteLevel, ignore_merges   Llama 3.x
    qwen2           NFC + Split(Qwen2 regex, single digits) + ByteLevel                      Qwen2 / 2.5

Token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control tokens become special added tokens, user-defined ones plain added tokens, so that
text like "<|im_start|>" is matched as one token, as the Hugging Face tokenizer does.

SentencePiece BPE: the file has pieces with scores but no merges. SentencePiece encodes a text by
cutting out user-defined pieces whole (longest match first), writing spaces as "▁" (after a leading
"▁" when tokenizer.ggml.add_space_prefix is set: at the start and after every cut-out piece, as
llama.cpp does), splitting the rest into characters, and merging,
again and again, the adjacent pair whose concatenation is the best-scoring normal piece (the leftmost
on a tie); a character that is no piece becomes its UTF-8 bytes (<0x..> pieces). `tokenizers`' BPE
does the same given every split (left, right) of every normal piece, with both halves pieces, as a
merge, ranked by the piece's score; user-defined and control pieces become added tokens, matched in
the raw text before the BPE runs.
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

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
SPACE = "\u2581"
# End-of-turn tokens: also stop generation when they are control tokens (and the chat template, if
# there is one, emits them; llama.cpp goes by these names alone).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
                      "<end_of_turn>")


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
    post = _prepend_bos(bos) or _byte_level(use_regex=True, trim_offsets=False)
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


def _prepend_bos(bos: tuple[str, int] | None) -> dict[str, Any] | None:
    """A post-processor that puts BOS (text, id) before the text, or None."""
    if bos is None:
        return None
    text, i = bos
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text: {"id": text, "ids": [i], "tokens": [text]}}}


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[list[str]]:
    """Every split of every normal piece into two normal pieces, best-scoring piece first (ties: by id)."""
    pieces = {tok for tok, kind in zip(tokens, token_types) if kind == NORMAL}
    ranked = sorted((i for i, kind in enumerate(token_types) if kind == NORMAL), key=lambda i: -scores[i])
    merges = []
    for i in ranked:
        w = tokens[i]
        merges.extend([w[:j], w[j:]] for j in range(1, len(w)) if w[:j] in pieces and w[j:] in pieces)
    return merges


def spm_tokenizer_json(tokens: list[str], scores: list[float], token_types: list[int], unk: int | None,
                       bos: tuple[str, int] | None, add_space_prefix: bool) -> dict[str, Any]:
    """The tokenizer.json object of a SentencePiece BPE vocabulary (see the module docstring)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind != USER_DEFINED}
             for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind in (UNKNOWN, CONTROL, USER_DEFINED)]
    # The normalizer runs on each stretch of text between added tokens: it writes spaces as SPACE and,
    # with add_space_prefix, puts one SPACE before every stretch (llama.cpp does so at the start and
    # after every special or user-defined token, even where the text already starts with a space).
    steps = [{"type": "Prepend", "prepend": SPACE}] if add_space_prefix else []
    steps.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "pre_tokenizer": None,
        "post_processor": _prepend_bos(bos),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk is None else tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": spm_merges(tokens, scores, token_types)},
    }


def _bpe_rule(meta: Callable[[str], Any], where: str) -> PreTokenizerRule:
    pre = meta("tokenizer.ggml.pre")
    if pre is None:
        warnings.warn(f"{where} does not name its pre-tokenizer (tokenizer.ggml.pre); assuming GPT-2 rules, "
                      "which may split digits and punctuation differently from the original",
                      ConversionWarning, stacklevel=4)
        pre = "gpt2"
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"{where} uses pre-tokenizer {pre!r}, which rawinfer cannot rebuild (supported: "
            f"{', '.join(PRE_TOKENIZERS)}); convert the model's Hugging Face folder instead")
    return PRE_TOKENIZERS[pre]


def gguf_tokenizer(meta: Callable[[str], Any], where: str) -> TokenizerInfo:
    """TokenizerInfo from GGUF metadata; meta(key) returns a field's value or None when absent."""
    model = meta("tokenizer.ggml.model")
    tokens = meta("tokenizer.ggml.tokens")
    chat_template = meta("tokenizer.chat_template")
    if model is None or tokens is None:
        warnings.warn(f"{where} carries no tokenizer, so the converted model gets none: it can only be driven "
                      "with token ids", ConversionWarning, stacklevel=3)
        return TokenizerInfo(chat_template=chat_template)
    if model not in ("gpt2", "llama"):
        raise ConversionError(
            f"{where} uses tokenizer model {model!r}; rawinfer rebuilds byte-level BPE ('gpt2') and SentencePiece "
            "BPE ('llama') tokenizers from GGUF, so convert the model's Hugging Face folder (which ships "
            "tokenizer.json) instead")
    rule = _bpe_rule(meta, where) if model == "gpt2" else None
    types = list(meta("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))

    def token_id(key: str) -> int | None:
        value = meta(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ConversionError(f"{where}: {key} = {value!r} is not a token id of the vocabulary of {len(tokens)} "
                                  "tokens; the file is damaged")
        return value

    bos_id = token_id("tokenizer.ggml.bos_token_id")
    add_bos = meta("tokenizer.ggml.add_bos_token")
    if add_bos is None:   # llama.cpp's defaults: SentencePiece models and Llama 3 add BOS, other BPE ones do not
        add_bos = rule is None or rule.ignore_merges
    add_bos = bool(add_bos)
    eos = [i for i in (token_id("tokenizer.ggml.eos_token_id"), token_id("tokenizer.ggml.eot_token_id"),
                       token_id("tokenizer.ggml.eom_token_id")) if i is not None]
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and tok in END_OF_TURN_TOKENS and (not chat_template or tok in chat_template):
            eos.append(i)
    bos = (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None
    if rule is not None:
        obj = tokenizer_json(tokens, list(meta("tokenizer.ggml.merges") or []), types, rule, bos)
    else:
        scores = meta("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ConversionError(f"{where} has a SentencePiece vocabulary without one score per piece "
                                  "(tokenizer.ggml.scores); the file is damaged")
        space = meta("tokenizer.ggml.add_space_prefix")
        obj = spm_tokenizer_json(tokens, list(scores), types, token_id("tokenizer.ggml.unknown_token_id"), bos,
                                 add_space_prefix=True if space is None else bool(space))
    text = json.dumps(obj, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ConversionError(f"the tokenizer rebuilt from {where} does not load ({e}); the tokenizer "
                              "metadata is damaged, convert the Hugging Face folder instead") from e
    return TokenizerInfo(tokenizer_json=text, chat_template=chat_template, bos_token_id=bos_id,
                         eos_token_ids=tuple(dict.fromkeys(eos)),
                         pad_token_id=token_id("tokenizer.ggml.padding_token_id"), add_bos_token=add_bos,
                         vocab_ids=len(tokens))
