"""SamplingParams: how one request chooses its tokens and when it stops, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from rawinfer.config import is_int, is_number


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # nucleus: keep the smallest set whose probability reaches top_p
    top_k: int = 0                    # 0 (or -1) keeps every token
    min_p: float = 0.0                # drop tokens below min_p * p(most likely token)
    repetition_penalty: float = 1.0   # > 1 discourages tokens already in the prompt or output
    seed: int | None = None           # same seed, same output
    stop: list[str] = field(default_factory=list)   # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                        # independent samples of the same prompt
    min_tokens: int = 0               # EOS and stop strings are ignored before this many tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, what: str):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: it must be {what}")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "a number >= 0 (0 means greedy)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a number > 0 (1 disables it)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", "an integer in [0, 2**63) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "true or false")
        if not is_int(self.n) or not 1 <= self.n <= 64:
            bad("n", "an integer from 1 to 64")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a plain dict (CLI, protocol); unknown keys are an error that names them."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**d)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
