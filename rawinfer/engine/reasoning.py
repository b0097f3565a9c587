"""Reasoning in a model's output: the `<think>...</think>` block split off as reasoning_content (vLLM's field),
whole and streamed, by parser name.

    qwen3        Qwen3: the output opens with <think> (whitespace before it allowed); reasoning runs to </think>
                 (or to the end, if cut short). An output that does not open with <think> is all content, as Qwen3
                 writes with enable_thinking=false (its template puts the empty think block into the prompt; one
                 the model writes itself gives reasoning "").
    deepseek_r1  DeepSeek-R1 and models like it (QwQ, Qwen3's -Thinking-2507): the template opens the block in the
                 prompt, so the output starts inside it (a <think> it writes again is skipped); reasoning runs to
                 </think>, or is all of the output if that never comes.

Whitespace right inside the tags and right after </think> is dropped. A parser is fed text deltas and returns
OpenAI-style delta pieces, {"reasoning_content": str} and {"content": str}; `parse_reasoning` runs the same parser
over a whole text. Text that may be the start of a tag is held back until decided.
"""

from __future__ import annotations

from rawinfer.engine.stream_scan import StreamParser, content_end

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser(StreamParser):
    """Splits <think> reasoning from content; `starts_inside`: the output begins in the reasoning (DeepSeek-R1)."""

    starts_inside = False

    def __init__(self):
        super().__init__()
        self._state = "start"                # start -> reasoning -> content (or start -> content)
        self._opened = False                 # a reasoning block was seen (reasoning "" rather than none)
        self._fresh = False                  # just past a tag: leading whitespace is dropped

    @property
    def saw_reasoning(self) -> bool:
        """Whether the output had a reasoning block (an empty one included)."""
        return self._opened

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            return self._at_start(final)
        if self._fresh:                       # whitespace right after a tag goes with it
            self._buf = self._buf.lstrip()
            self._fresh = not self._buf
        if self._state == "reasoning":
            return self._in_reasoning(final)
        self._emit("content", self._buf)
        self._buf = ""
        return False

    def _at_start(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if not final and (not rest or (OPEN.startswith(rest) and rest != OPEN)):
            return False                      # nothing yet, or perhaps the start of <think>
        if rest.startswith(OPEN):
            self._buf, self._state = rest[len(OPEN):], "reasoning"
        else:
            self._state = "reasoning" if self.starts_inside else "content"
        self._opened = self._fresh = self._state == "reasoning"
        return True

    def _in_reasoning(self, final: bool) -> bool:
        i = self._buf.find(CLOSE)
        if i >= 0:
            self._emit("reasoning_content", self._buf[:i].rstrip())
            self._buf, self._state, self._fresh = self._buf[i + len(CLOSE):], "content", True
            return True
        j = len(self._buf.rstrip()) if final else content_end(self._buf, CLOSE)
        self._emit("reasoning_content", self._buf[:j])
        self._buf = self._buf[j:]
        return False

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if self._out and kind in self._out[-1]:
            self._out[-1][kind] += text
        else:
            self._out.append({kind: text})


class Qwen3ReasoningParser(ReasoningParser):
    starts_inside = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                        "deepseek_r1": DeepSeekR1ReasoningParser}


def reasoning_parser(name: str) -> ReasoningParser:
    """A fresh streaming parser by name; ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


def parse_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """A whole output: (its reasoning, None when it had no reasoning block; its content)."""
    p = reasoning_parser(parser)
    deltas = p.feed(text) + p.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    return (reasoning if p.saw_reasoning else None), "".join(d.get("content", "") for d in deltas)
