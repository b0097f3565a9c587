"""Log-probabilities in OpenAI's two shapes, from the protocol's Logprobs records: completions' parallel
lists (tokens, token_logprobs, top_logprobs, text_offset; with echo the prompt's tokens first, the very
first with no log-probability) and chat's `content` list of {token, logprob, bytes, top_logprobs}.

Token strings come from the model's own tokenizer, loaded once per worker from the folder the engine
reports (model_info's model_path); without one, a token shows as "token_id:N"."""

from __future__ import annotations

from rawinfer.frontends.server import protocol as P


class TokenTexts:
    """Each token id's bytes and text (cached): the text is the bytes read as UTF-8, U+FFFD for a token that
    holds part of a character."""

    def __init__(self, model_path: str | None):
        self._tok = None
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        if model_path:
            try:
                from rawinfer.config import ModelConfig
                from rawinfer.engine.tokenizer import Tokenizer
                self._tok = Tokenizer.from_dir(model_path, ModelConfig.from_dir(model_path))
            except Exception:           # no tokenizer, or unreadable here: ids stand in for texts
                self._tok = None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids) if self._tok is not None else "".join(self(t) for t in ids)

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own bytes: those of a token holding part of a character join with its neighbours'."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._tok.token_bytes(token_id) if self._tok is not None else f"token_id:{token_id}".encode()
            self._bytes[token_id] = raw
        return raw

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.bytes_of(token_id).decode("utf-8", errors="replace")
            self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """One choice's completions-style logprobs, built up message by message; `offset` is where the next
    token's text starts in the choice's text."""

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts, self.offset = texts, offset

    def prompt(self, prompt_ids: list[int], record: P.Logprobs | None) -> dict:
        """The echoed prompt's part: its first token has no distribution, the rest come from `record`."""
        out = self._block(record) if record is not None else _empty()
        first = self.texts(prompt_ids[0]) if prompt_ids else None
        if first is not None:
            out = {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
                   "top_logprobs": [None] + out["top_logprobs"],
                   "text_offset": [0] + [o + len(first) for o in out["text_offset"]]}
            self.offset += len(first)
        return out

    def add(self, record: P.Logprobs) -> dict:
        return self._block(record)

    def _block(self, record: P.Logprobs) -> dict:
        out = _empty()
        for tid, lp, top_ids, top_lps in zip(record.token_ids, record.logprobs, record.top_token_ids,
                                             record.top_logprobs):
            text = self.texts(tid)
            top = {self.texts(t): v for t, v in zip(top_ids, top_lps)}
            top.setdefault(text, lp)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _empty() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def merge(a: dict | None, b: dict) -> dict:
    """Two completions-style parts one after the other."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_content(texts: TokenTexts, record: P.Logprobs) -> list[dict]:
    """Chat's logprobs `content` entries of a record's tokens."""
    def entry(tid: int, lp: float) -> dict:
        return {"token": texts(tid), "logprob": lp, "bytes": list(texts.bytes_of(tid))}
    return [{**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in zip(top_ids, top_lps)]}
            for tid, lp, top_ids, top_lps in zip(record.token_ids, record.logprobs, record.top_token_ids,
                                                 record.top_logprobs)]
