"""Stop strings on streamed text: where output ends, and which text is safe to show before that is known.

The engine feeds every text delta of a sequence (from IncrementalDetokenizer) to its StopChecker:

    update = checker.add(delta)      # -> StopUpdate(text, stopped)
    show(update.text)
    if update.stopped: finish the sequence (finish reason "stop", checker.matched says which string)
    ...
    show(checker.flush())            # at a finish for any other reason (EOS, length)

NOTE: invariant: no stop string can begin in text that was already emitted. The checker holds back the
longest suffix of the text that is still the beginning of some stop string, so a stop string always lies
entirely in `held + delta`, and only that short buffer is ever searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopUpdate(NamedTuple):
    text: str        # text that may be shown now (never any part of a stop string)
    stopped: bool    # a stop string completed; nothing after it is shown


class StopChecker:
    """Finds the earliest occurrence of any stop string in a growing text; holds back possible beginnings."""

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop: tuple[str, ...] = tuple(stop)
        self._held = ""
        self.matched: str | None = None   # the stop string that ended the text, once stopped

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text withheld because it may be the start of a stop string."""
        return self._held

    def add(self, delta: str) -> StopUpdate:
        """Take the next piece of output text; return what can be shown now and whether a stop string hit."""
        if self.stopped:
            return StopUpdate("", True)
        buf = self._held + delta
        # Earliest start wins; on a tie, the stop string listed first.
        hits = [(i, k) for k, s in enumerate(self.stop) if (i := buf.find(s)) >= 0]
        if hits:
            start, k = min(hits)
            self.matched = self.stop[k]
            self._held = ""
            return StopUpdate(buf[:start], True)
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:]
        return StopUpdate(buf[:len(buf) - keep], False)

    def flush(self) -> str:
        """At a finish that is not a stop string: release the held-back text."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stop), default=1)
        for n in range(min(len(buf), longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
