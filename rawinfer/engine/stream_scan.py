"""Incremental matching of a model's output text, for the parsers of tool calls and reasoning: tags that may be
cut between two deltas, a tool call's opening `{"name": "...", "arguments": `, the end of a JSON object.

Every answer here is a pure function of the text seen so far (MORE: undecided until more text comes), so a
parser built on them gives the same result however its input is split into deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MORE, NO, YES = "more", "no", "yes"
_WS = re.compile(r"[ \t\n\r]*")                               # JSON's whitespace
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_STRING_START = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*(?:\\(?:u[0-9a-fA-F]{0,3})?)?')
HEADER_LIMIT = 512                                            # a call's opening is decided within this many characters


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag` (but not all of it): the characters
    to hold back, as the tag may go on in the next delta."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def content_end(text: str, tag: str) -> int:
    """Where the text that can be released ends, when `tag` may follow: before a partial tag at the end and
    before the whitespace in front of it (whitespace next to a tool call or a reasoning block is dropped with it)."""
    cut = len(text) - partial_tag(text, tag)
    return len(text[:cut].rstrip())


@dataclass(frozen=True)
class Header:
    """A tool call's opening: state MORE (undecided), NO (not a call in the fast form) or YES, with the
    function's name and where its arguments object begins."""
    state: str
    name: str = ""
    end: int = 0


def match_header(text: str, keys: tuple[str, ...]) -> Header:
    """Whether `text` opens a call as `{"name": "<name>", "<key>": {` (JSON whitespace anywhere between, key one
    of `keys`); YES's end is the index of the arguments' `{`. Decided within HEADER_LIMIT characters."""
    head = text[:HEADER_LIMIT]
    pos, name = 0, ""
    steps = ("{", '"name"', ":", None, ",", tuple(f'"{k}"' for k in keys), ":")
    for step in steps:
        pos = _WS.match(head, pos).end()
        if pos == len(head):
            return _more(text)
        if step is None:                                      # the name: a JSON string
            m = _STRING.match(head, pos)
            if m is None:
                return _more(text) if _STRING_START.fullmatch(head, pos) else Header(NO)
            name, pos = json.loads(m.group()), m.end()
            if not name:
                return Header(NO)
            continue
        options = (step,) if isinstance(step, str) else step
        rest = head[pos:]
        done = next((o for o in options if rest.startswith(o)), None)
        if done is None:
            return _more(text) if any(o.startswith(rest) for o in options) else Header(NO)
        pos += len(done)
    pos = _WS.match(head, pos).end()
    if pos == len(head):
        return _more(text)
    return Header(YES, name, pos) if head[pos] == "{" else Header(NO)


def _more(text: str) -> Header:
    return Header(NO) if len(text) >= HEADER_LIMIT else Header(MORE)


class ObjectEnd:
    """Finds where a JSON object ends, fed its text from its `{` in pieces: counts brackets outside strings.
    It does not validate the JSON between (the arguments are what the model wrote)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the object's closing brace, or None if the object goes on."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def match_literals(text: str, parts: tuple[str | None, ...]) -> tuple[str, int]:
    """Match `parts` in turn at the start of `text` (None: JSON whitespace): (YES, length) when all matched,
    (MORE, 0) when the text ends inside them, (NO, length matched) at the first part that does not match."""
    pos = 0
    for part in parts:
        if part is None:
            pos = _WS.match(text, pos).end()
            if pos == len(text):
                return MORE, 0
            continue
        rest = text[pos:]
        if rest.startswith(part):
            pos += len(part)
        elif part.startswith(rest):
            return MORE, 0
        else:
            return NO, pos
    return YES, pos


class StreamParser:
    """The driver the streaming parsers share: text deltas go into a buffer of undecided text, `_step` (each
    parser's own) consumes what it can decide into OpenAI delta pieces and says whether it made progress, and
    each feed returns the pieces it decided."""

    def __init__(self):
        self._buf = ""
        self._out: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """One text delta in; the delta pieces it decides (perhaps none)."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The end of the output: everything still held is decided."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict[str, Any]]:
        while self._step(final):
            pass
        out, self._out = self._out, []
        return out

    def _step(self, final: bool) -> bool:
        raise NotImplementedError
