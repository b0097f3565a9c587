"""Stop strings at scale (issue 16, item 4): the same results as the plain search over every stop string,
at a cost per token that does not grow with the number of samples times the number of stop strings."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from rawinfer.core.sequence import Sequence
from rawinfer.engine.outputs import OutputRules
from rawinfer.engine.stop import StopChecker
from rawinfer.sampling import SamplingParams


class PlainStopChecker:
    """The definition (the algorithm before the automaton): search `held + delta` for every stop string,
    earliest start first, the string listed first on a tie; hold back the longest suffix that begins one."""

    def __init__(self, stop):
        self.stop, self.held, self.matched = tuple(stop), "", None

    def add(self, delta):
        if self.matched is not None:
            return "", True
        buf = self.held + delta
        hits = [(i, k) for k, s in enumerate(self.stop) if (i := buf.find(s)) >= 0]
        if hits:
            start, k = min(hits)
            self.matched, self.held = self.stop[k], ""
            return buf[:start], True
        keep = 0
        for n in range(min(len(buf), max(map(len, self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(buf[-n:]) for s in self.stop):
                keep = n
                break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self):
        text, self.held = self.held, ""
        return "" if self.matched is not None else text


def _split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("alphabet", ["ab", "abc\n", "aé😀 "])
def test_same_results_as_the_plain_search(alphabet):
    """Random stop lists (overlapping, nested, repeated, one string inside another) and random deltas:
    shown text, held text, the stop flag and the matched string all agree with the definition."""
    rng = random.Random(len(alphabet))
    for _ in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.2:
            stops.append(rng.choice(stops))                  # a repeat: the first listed is reported
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        new, old = StopChecker(stops), PlainStopChecker(stops)
        for d in _split(rng, text):
            got, want = new.add(d), old.add(d)
            assert (got.text, got.stopped) == want, (stops, text, d)
            assert new.held == old.held and new.matched == old.matched
            if got.stopped:
                break
        assert new.flush() == old.flush()


def _states(rules: OutputRules, stop: list[str], n: int) -> list:
    params = SamplingParams(max_tokens=1000, stop=stop, n=n)
    return [rules.new_state(Sequence("r" if i == 0 else f"r#{i}", "r", i, [1, 2, 3], params),
                            np.random.default_rng(i)) for i in range(n)]


def _time_tokens(rules: OutputRules, stop: list[str], tokens: list[int], n: int) -> float:
    states = _states(rules, stop, n)
    t0 = time.perf_counter()
    for tok in tokens:
        for st in states:
            rules.add_token(st, tok, 0.0)
    return time.perf_counter() - t0


def test_many_stop_strings_on_many_samples_cost_about_what_a_few_cost(smollm2_dir):
    """Issue 16: n = 64 and 10,000 stop strings (341 KB) slowed every step of the engine. Per token, the
    cost now depends on the text, not on the number of stop strings or on how many samples share them."""
    from rawinfer.config import ModelConfig
    from rawinfer.engine.tokenizer import Tokenizer
    cfg = ModelConfig.from_dir(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir, cfg)
    rules = OutputRules(tok, (), 100_000)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    many = ["".join(rng.choice(letters) for _ in range(34)) for _ in range(10_000)]
    tokens = tok.encode("The quick brown fox jumps over the lazy dog, and then " * 8)[:120]
    few_s = min(_time_tokens(rules, many[:10], tokens, 64) for _ in range(2))
    many_s = min(_time_tokens(rules, many, tokens, 64) for _ in range(2))
    assert many_s < 4 * few_s + 0.05, f"10,000 stops: {many_s:.3f} s; 10 stops: {few_s:.3f} s"


def test_the_samples_of_one_request_share_one_compiled_stop_list(smollm2_dir):
    from rawinfer.config import ModelConfig
    from rawinfer.engine.tokenizer import Tokenizer
    cfg = ModelConfig.from_dir(smollm2_dir)
    rules = OutputRules(Tokenizer.from_dir(smollm2_dir, cfg), (), 1000)
    states = _states(rules, ["x", "yz"], 8)
    assert len({id(st.stop.strings) for st in states}) == 1
    assert len({id(st.stop) for st in states}) == 8          # each sample keeps its own position
