"""Stop strings on streamed text: where output ends, and which text is safe to show before that is known.

The engine feeds every text delta of a sequence (from IncrementalDetokenizer) to its StopChecker:

    update = checker.add(delta)      # -> StopUpdate(text, stopped)
    show(update.text)
    if update.stopped: finish the sequence (finish reason "stop", checker.matched says which string)
    ...
    show(checker.flush())            # at a finish for any other reason (EOS, length)

NOTE: invariant: no stop string can begin in text that was already emitted. The checker holds back the
longest suffix of the text that is still the beginning of some stop string, so a stop string always lies
entirely in `held + delta`.

The stop list of a request is compiled once (StopStrings) and shared by all its samples: an Aho-Corasick
automaton over the sorted strings, built lazily. A node is a prefix shared by some stop strings, i.e. a
range [lo, hi) of the sorted list and a depth; its child for a character is found by bisection inside
that range, its failure link is the node of the longest proper suffix that is also such a prefix. Only
the nodes and transitions the text actually visits are ever built, so the cost of a token is a few
dictionary lookups per character of its text (a bisection of the list the first time a transition is
taken), whatever the number of stop strings or of samples; the memory is the sorted list plus what the
text visited.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import NamedTuple

ROOT = 0


class StopUpdate(NamedTuple):
    text: str        # text that may be shown now (never any part of a stop string)
    stopped: bool    # a stop string completed; nothing after it is shown


class StopStrings:
    """One request's stop strings, compiled: the lazily built automaton its samples walk (one engine
    thread; not thread-safe)."""

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            stop = [stop]
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop = stop
        first: dict[str, int] = {}
        for k, s in enumerate(stop):
            first.setdefault(s, k)           # a repeated string reports its first position
        self._sorted = sorted(first)
        self._index = [first[s] for s in self._sorted]
        # per node: its range of the sorted list, its depth, its failure link, and the longest stop string
        # that ends there (length, position in `stop`; length 0 for none)
        self._lo, self._hi, self._depth, self._fail = [0], [len(self._sorted)], [0], [ROOT]
        self._hit_len, self._hit_index = [0], [0]
        self._goto: dict[tuple[int, str], int] = {}   # (node, char) -> node, failure links resolved

    def depth(self, node: int) -> int:
        return self._depth[node]

    def hit(self, node: int) -> tuple[int, int]:
        """(length, position in the stop list) of the longest stop string ending at this node; length 0: none."""
        return self._hit_len[node], self._hit_index[node]

    def step(self, node: int, ch: str) -> int:
        """The node after reading `ch` at `node`."""
        nxt = self._goto.get((node, ch))
        if nxt is not None:
            return nxt
        # Walk the failure links down to the first node that knows `ch` (or has a child for it, or is the
        # root), then settle the transitions of the walked nodes from the shallowest up: a new child's
        # failure link is the transition of its parent's failure link, which is settled by then.
        chain = [node]
        while chain[-1] != ROOT and (chain[-1], ch) not in self._goto:
            chain.append(self._fail[chain[-1]])
        result = self._goto.get((chain[-1], ch))
        for n in reversed(chain):
            if result is not None and (n, ch) in self._goto:
                continue
            child = self._child(n, ch)
            if child is not None:
                fail = ROOT if n == ROOT else result
                result = self._add_node(child, self._depth[n] + 1, fail)
            elif n == ROOT:
                result = ROOT
            self._goto[(n, ch)] = result
        return result

    def _child(self, node: int, ch: str) -> tuple[int, int] | None:
        """The range of the sorted strings that continue this node's prefix with `ch`, or None."""
        lo, hi, d = self._lo[node], self._hi[node], self._depth[node]

        def key(s: str) -> str:
            return s[d:d + 1]            # "" for the one string that ends at this depth: it sorts first
        a = bisect_left(self._sorted, ch, lo, hi, key=key)
        b = bisect_right(self._sorted, ch, a, hi, key=key)
        return (a, b) if a < b else None

    def _add_node(self, rng: tuple[int, int], depth: int, fail: int) -> int:
        lo, hi = rng
        node = len(self._lo)
        self._lo.append(lo)
        self._hi.append(hi)
        self._depth.append(depth)
        self._fail.append(fail)
        if len(self._sorted[lo]) == depth:         # a whole stop string ends here: the longest one
            self._hit_len.append(depth)
            self._hit_index.append(self._index[lo])
        else:                                     # else the longest one that ends at its failure node
            self._hit_len.append(self._hit_len[fail])
            self._hit_index.append(self._hit_index[fail])
        return node


class StopChecker:
    """Finds the earliest occurrence of any stop string in a growing text; holds back possible beginnings.
    `stop` is a list of strings, or the StopStrings of the request (shared by its samples)."""

    def __init__(self, stop: Sequence[str] | StopStrings):
        self.strings = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self.stop: tuple[str, ...] = self.strings.stop
        self._node = ROOT
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
        auto, node = self.strings, self._node
        best: tuple[int, int] | None = None        # (start in buf, position in the stop list)
        end = len(self._held)
        for ch in delta:
            node = auto.step(node, ch)
            end += 1
            length, k = auto.hit(node)
            # Earliest start wins; on a tie, the stop string listed first. The longest string ending here
            # has the earliest start among those ending here.
            if length and (best is None or (end - length, k) < best):
                best = (end - length, k)
            if best is not None and end - auto.depth(node) > best[0]:
                break                               # no later match can start at or before the best one
        if best is not None:
            self.matched = self.stop[best[1]]
            self._held = ""
            return StopUpdate(buf[:best[0]], True)
        self._node = node
        keep = auto.depth(node)                    # the longest suffix that begins some stop string
        self._held = buf[len(buf) - keep:]
        return StopUpdate(buf[:len(buf) - keep], False)

    def flush(self) -> str:
        """At a finish that is not a stop string: release the held-back text."""
        text, self._held = self._held, ""
        self._node = ROOT
        return "" if self.stopped else text
