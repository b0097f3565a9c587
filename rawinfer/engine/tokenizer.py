"""Text <-> token ids: the model's tokenizer.json, its chat template, and streaming detokenization.

Three pieces, all reading the same `tokenizers` object:

- `Tokenizer`: encode / decode, BOS handling from ModelConfig, and `apply_chat_template`, which renders a
  chat the way Hugging Face transformers does (same Jinja2 environment, filters and variables), so that a
  prompt built here tokenizes to the ids the model was trained on.
- `IncrementalDetokenizer`: turns generated ids into text one token at a time without printing broken
  UTF-8 and without re-decoding the whole output on every step.
- Stop strings live in rawinfer/stop.py; they work on the text this module produces.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rawinfer.config import ModelConfig, ModelFormatError
from rawinfer.engine.chat_messages import check_tools, template_messages

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT_CHAR = "\ufffd"   # what a lossy UTF-8 decode yields for bytes that do not (yet) form a character
CONTEXT_TOKENS = 5            # prompt tokens decoded ahead of the output (keeps a first output token's space)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character: the printable Latin-1 bytes as
    themselves, the other 68 (controls, space, soft hyphen) as U+0100 onwards, in byte order."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)}
    moved = (b for b in range(256) if b not in kept)
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_LEVEL = _byte_level_alphabet()      # character of a byte-level vocabulary entry -> the byte it spells


class NoTokenizerError(ModelFormatError):
    """The model folder has no tokenizer.json: the model can only be driven with token ids."""


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or rejected the messages."""


class Tokenizer:
    """One model's tokenizer: a `tokenizers.Tokenizer` plus the BOS/EOS ids and chat template of its config."""

    def __init__(self, hf: tokenizers.Tokenizer, config: ModelConfig, path: str = TOKENIZER_FILE):
        self._hf = hf
        self.config = config
        self.path = path
        self._template: jinja2.Template | None = None   # compiled on first use

    @classmethod
    def from_dir(cls, model_dir: str, config: ModelConfig) -> "Tokenizer":
        """Load `model_dir/tokenizer.json`; NoTokenizerError if the model was converted without one."""
        path = os.path.join(model_dir, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise NoTokenizerError(
                f"{path} does not exist: this model has no tokenizer; pass token ids instead of text, "
                "or re-convert the model from a source that includes a tokenizer")
        try:
            hf = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust loader raises a plain Exception for any malformed file
            raise ModelFormatError(
                f"cannot read {path} ({e}); the file is corrupt or not a Hugging Face tokenizers file: "
                "re-convert the model with `rawinfer convert SRC DST`") from e
        return cls(hf, config, path)

    # ---- ids <-> text -------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (can be below the model's V)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.config.eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.config.bos_token_id

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (as stored, e.g. 'Ġthe' or '<|im_end|>'); None if out of range."""
        return self._hf.id_to_token(token_id)

    @functools.cached_property
    def _spelling(self) -> str:
        """How the vocabulary entries spell bytes and spaces, as the decoder says: "byte_level" (GPT-2's
        alphabet), "metaspace" (SentencePiece's U+2581 for a space) or "" (neither)."""
        decoder = repr(self._hf.decoder)
        return "byte_level" if "ByteLevel" in decoder else "metaspace" if "\u2581" in decoder else ""

    @functools.cached_property
    def _added(self) -> set[int]:
        """The ids of added tokens (special ones included), whose entries are plain text."""
        return set(self._hf.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, read from its vocabulary entry, so that consecutive tokens' bytes
        join into the text (OpenAI's logprobs `bytes`, and each token's text). Decoding a token alone would
        give U+FFFD for one that holds part of a character (a byte-level BPE piece, a byte fallback such as
        <0xE2>) and, where the decoder strips a leading space (Llama 2's), drop the space of a word's first
        piece. Added tokens, and vocabularies of neither kind, are decoded."""
        piece = self._hf.id_to_token(int(token_id))
        if piece is None or int(token_id) in self._added:
            return self.decode([token_id]).encode()
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(m.group(1), 16)])
        if self._spelling == "byte_level" and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._spelling == "metaspace":
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. With add_special_tokens, BOS is prepended when the config asks for it, never twice."""
        if not isinstance(text, str):
            raise ValueError(f"can only encode a string, got {type(text).__name__}")
        try:
            ids = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:                   # lone surrogates: undecodable bytes read as text (argv, stdin)
            raise ValueError("the text is not valid UTF-8 (it holds undecodable bytes); give text in UTF-8, "
                             "or token ids") from None
        bos = self.config.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        # The tokenizer's own post-processor may add BOS (Llama 3 does) in front of a text that already
        # starts with it (a rendered chat template does): keep the text's BOS only.
        if ids[:2] == [bos, bos] and self._hf.encode(text, add_special_tokens=False).ids[:1] == [bos]:
            ids = ids[1:]
        if self.config.add_bos_token and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # int(): ids may arrive as a NumPy array; hand the Rust binding plain Python ints.
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat template ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render a chat into prompt text with the model's template (Hugging Face semantics): OpenAI's messages
        (assistant tool calls, tool results) and `tools` in the shapes templates read (chat_messages.py)."""
        messages = template_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts (or None)")
        if self._template is None:
            self._template = compile_chat_template(self.config.chat_template, self.path)
        variables: dict[str, Any] = {"messages": messages, "tools": tools or None, "documents": None,
                                     "add_generation_prompt": add_generation_prompt}
        # Special tokens are strings in the template; undefined (as in transformers) when the model has none.
        eos = self.config.eos_token_ids[0] if self.config.eos_token_ids else None
        for name, token_id in (("bos_token", self.config.bos_token_id), ("eos_token", eos),
                               ("pad_token", self.config.pad_token_id)):
            if token_id is not None and self.token_text(token_id) is not None:
                variables[name] = self.token_text(token_id)
        variables.update(kwargs)
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The chat of one user prompt (after an optional system message), as `rawinfer generate` and
    `rawinfer client` send it."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def has_chat_template(tokenizer: Tokenizer | None) -> bool:
    return tokenizer is not None and bool(tokenizer.config.chat_template)


RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                               "pad_token")


def render_chat(tokenizer: Tokenizer | None, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a chat, by default with the generation prompt appended: the one place a chat
    becomes text (the CLI, the server). continue_final_message (vLLM's option): the last message is the
    assistant's beginning, left open for the model to continue; the text ends with that message's content
    (whatever the template closes it with is cut). template_kwargs: more variables for the template (vLLM's
    chat_template_kwargs, e.g. Qwen3's enable_thinking). tools: OpenAI's `tools`, the template's `tools`.
    ChatTemplateError (a ValueError) when the model has no template, or when the options do not fit the chat;
    ValueError naming the field of a message or tool of the wrong shape."""
    if not has_chat_template(tokenizer):
        raise ChatTemplateError("this model has no chat template; send the prompt as text or token ids instead "
                                "of messages")
    tools = check_tools(tools)
    extra = dict(template_kwargs or {})
    taken = [k for k in extra if k in RESERVED_TEMPLATE_VARIABLES]
    if taken:
        raise ChatTemplateError(f"the template variable {taken[0]!r} is set by the server, not by template kwargs")
    if not continue_final_message:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **extra)
    if add_generation_prompt:
        raise ChatTemplateError("cannot both add a generation prompt and continue the final message: set "
                                "add_generation_prompt to false to continue it")
    messages = template_messages(messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools, **extra)
    last = messages[-1] if messages else {}
    end = text.rfind(last.get("content") or "\0") if last.get("role") == "assistant" else -1
    if end < 0:
        raise ChatTemplateError("continue_final_message needs the chat to end with an assistant message with some "
                                "content, which the template writes out as it is")
    return text[:end + len(last["content"])]


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (transformers marks assistant
    text with it for training masks; without this tag such templates would not even compile)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; transformers replaces it with plain
    # json.dumps (non-ASCII kept), and templates that embed tool schemas depend on that.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str | None, where: str = "the model") -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (sandboxed, trim/lstrip blocks)."""
    if not source:
        raise ChatTemplateError(
            f"{where} has no chat template; pass the prompt as plain text with --raw "
            "(or give the model a chat_template in its config.json)")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template of {where} is not valid Jinja2 (line {e.lineno}: {e.message}); "
            "pass the prompt as plain text with --raw") from e


def load_chat_template(path: str) -> str:
    """The text of a chat template file (EngineConfig.chat_template, --chat-template) that replaces the model's
    own, compiled here so that a bad file is refused in one sentence before a model loads."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template {path} ({e}); give a readable Jinja template file "
                                "in UTF-8") from None
    if not source.strip():
        raise ChatTemplateError(f"the chat template {path} is empty; give a Jinja chat template file")
    try:
        compile_chat_template(source, path)
    except ChatTemplateError as e:
        message = str(e).replace("; pass the prompt as plain text with --raw", "; fix the file")
        raise ChatTemplateError(message) from None
    return source


def _decode_stream(context: list[int], skip_special_tokens: bool):
    """A tokenizers DecodeStream seeded with the context ids, or None where the installed tokenizers has none
    (or cannot seed one)."""
    stream_type = getattr(tokenizers.decoders, "DecodeStream", None)
    if stream_type is None:
        return None
    try:
        return stream_type(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None


class IncrementalDetokenizer:
    """Streams the text of generated ids, one id at a time, as deltas.

    Each step decodes only a short window of ids, from `prefix` to the end:

        ids:   ... | prefix ...... read | new id(s) |
                     \\__ already shown __/\\_ delta _/

    text(prefix:read) was emitted already; delta = text(prefix:end)[len(text(prefix:read)):]. Decoding the
    shown tokens again keeps context-dependent text right: SentencePiece decoders drop the space of the
    *first* token they see, so decoding the new id alone would lose the space of "▁world".
    NOTE: when the window's text ends in U+FFFD the last id(s) hold an incomplete UTF-8 character (a byte
    token of a multi-byte character); nothing is emitted and the window grows until the character
    completes. Invariant: the emitted deltas concatenate to decode(output ids) whenever that decode
    does not end in U+FFFD; `finish()` releases whatever is still held.

    Where the tokenizers package has `DecodeStream` (seeded with ids), it runs these same windows in Rust, one
    call a token instead of two decodes and the Python around them; the windows are still tracked here, for
    `finish()` and for the one case the stream refuses (a window whose text does not extend the shown text, as
    a decoder's clean-up rules can make it), after which this sample decodes its windows here.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt ids seed the window so the first output token decodes as it would after the prompt
        # (its leading space kept); dropped if they themselves end mid-character.
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context           # context + output ids (only the window is ever decoded)
        self._prefix = 0                          # window start
        self._read = len(context)                 # ids before this were emitted
        self._num_output = 0
        self._stream = _decode_stream(context, skip_special_tokens)
        self._hf = tokenizer._hf

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the newly complete text (possibly "")."""
        token_id = int(token_id)
        self._ids.append(token_id)
        self._num_output += 1
        if self._stream is not None:
            try:
                text = self._stream.step(self._hf, token_id)
            except Exception:        # the stream's refusal (see the class docstring): this window is decoded below
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)
                return text
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(shown) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(shown):]

    def finish(self) -> str:
        """Release the held-back text at the end of generation (may contain U+FFFD for bytes never completed)."""
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(shown):]
