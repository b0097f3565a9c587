"""SamplingParams: how one request chooses its tokens, when it stops and what it reports (log-probabilities),
validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from rawinfer.config import is_int, is_number

MAX_LOGPROBS = 20          # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0     # |bias| per token, as OpenAI allows
# structured_outputs: exactly one of these keys (vLLM's StructuredOutputsParams), what its value must be
STRUCTURED_OUTPUT_KINDS = {
    "json": "a JSON schema (a map, or a string holding one)",
    "json_object": "true (any JSON object)",
    "regex": "a non-empty regular expression string",
    "choice": "a non-empty list of non-empty strings",
    "grammar": "a non-empty Lark (or GBNF) grammar string",
}


@dataclass
class SamplingParams:
    max_tokens: int = 256             # 0: only the prompt is computed (for prompt_logprobs), nothing generated
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
    presence_penalty: float = 0.0     # OpenAI's: subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0    # OpenAI's: subtracted once per time a token was already generated
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: int | None = None       # per generated token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None   # the same for every prompt token after the first
    structured_outputs: dict | None = None   # one of STRUCTURED_OUTPUT_KINDS -> its value: the output follows it

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):       # lists (or tuples); anything else is _check's to name
            v = getattr(self, name)
            if v is None or isinstance(v, (list, tuple)):
                setattr(self, name, list(v or []))
        bias = _token_keys(self.logit_bias)
        if bias is not None:               # else _check names the value as given
            self.logit_bias = bias
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, what: str):
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 200 else f"{shown[:200]}... ({len(shown)} characters)"
            raise ValueError(f"SamplingParams.{name}={shown} is invalid: it must be {what}")

        if not is_int(self.max_tokens) or self.max_tokens < 0:
            bad("max_tokens", "an integer >= 0 (0 computes the prompt only)")
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
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "true or false")
        if not is_int(self.n) or not 1 <= self.n <= 64:
            bad("n", "an integer from 1 to 64")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer from 0 to max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "a number in [-2, 2] (0 disables it)")
        if not isinstance(self.logit_bias, dict) or not all(is_int(t) and t >= 0 and is_number(b) and abs(b) <= MAX_LOGIT_BIAS
                                              for t, b in self.logit_bias.items()):
            bad("logit_bias", f"a map of token ids (integers >= 0, or their decimal strings) to numbers in "
                              f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"an integer from 0 to {MAX_LOGPROBS} (alternatives per token) or None")
        if self.structured_outputs is not None and (problem := structured_outputs_problem(self.structured_outputs)):
            bad("structured_outputs", problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, biases): such rows
        are chosen on the host, where the token history is."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

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
        """Plain values for JSON and msgpack: logit_bias keys become decimal strings (maps there key by string)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return d


def structured_outputs_problem(spec) -> str | None:
    """None when spec is a valid structured_outputs map, else what it must be (the end of one sentence)."""
    kinds = ", ".join(STRUCTURED_OUTPUT_KINDS)
    if not isinstance(spec, dict) or len(spec) != 1:
        return f"a map with exactly one of the keys {kinds}"
    (kind, value), = spec.items()
    if kind not in STRUCTURED_OUTPUT_KINDS:
        return f"a map with exactly one of the keys {kinds}, not {str(kind)[:40]!r}"
    if kind == "json":
        try:
            if isinstance(value, str):
                value = json.loads(value)
            else:
                json.dumps(value)            # a schema of JSON values only (it is compiled from its JSON)
        except (TypeError, ValueError) as e:
            return f"a map whose 'json' is a JSON schema; the value given is not JSON ({e})"
    ok = {"json": isinstance(value, dict), "json_object": value is True,
          "regex": isinstance(value, str) and bool(value), "grammar": isinstance(value, str) and bool(value),
          "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)}
    return None if ok[kind] else f"a map whose {kind!r} is {STRUCTURED_OUTPUT_KINDS[kind]}"


def is_decimal_id(k) -> bool:
    """Whether k is a token id written as a decimal string (how JSON and msgpack maps carry integer keys):
    ASCII digits only, at most 20 of them (longer is no token id, and int() of thousands of digits fails)."""
    return isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 20


def _token_keys(bias) -> dict | None:
    """logit_bias with its keys as integers (JSON and msgpack maps carry them as decimal strings); None when
    it is not a map of such keys, for _check to name."""
    if not isinstance(bias, dict):
        return None if bias is not None else {}
    out = {}
    for k, v in bias.items():
        if is_decimal_id(k):
            k = int(k)
        if not is_int(k):
            return None
        out[k] = v
    return out
