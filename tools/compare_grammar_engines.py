#!/usr/bin/env python3
"""Grammar engines for structured output side by side: llguidance and, where it is installed, xgrammar,
on this machine's CPU with the default model's tokenizer (SmolLM2, V = 49152).

For each JSON schema (and json_object, i.e. {"type": "object"}) and each engine:
  compile   schema -> a matcher ready for its first mask, with every cache emptied ("cold"), then the
            first mask of that fresh matcher (an engine that builds lazily pays here), then a matcher
            from the engine's cache (xgrammar: its compiler cache; llguidance: a copy of a kept matcher)
  decode    B matchers (default 32) step together: each step fills the [B, ceil(V/32)] int32 bitmask for
            every row, once with the engine's parallel fill and once with a plain loop over the rows (the
            two must agree), then advances each row by its next token. The tokens follow fixed valid
            answers (the tokenizer's own encoding of a JSON document that the schema accepts, then EOS),
            and every token must be allowed by the row's mask. Rows start on different answers at
            different depths (--lockstep: all on the same answer, so a costly grammar state costs B times
            in one step); a row that has finished its answer (EOS consumed, the matcher terminated) is
            reset onto the next answer, so the batch stays full. Advancing alternates between one call per
            row and the engine's batched call. The "mixed" row gives each row a different schema.
Every measurement runs --reps times (the table shows the median and, in brackets, the spread).

Runs with llguidance alone (the repository's venv); xgrammar is skipped with a note where it is missing:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tools/compare_grammar_engines.py \
        [--out ~/.cache/rawinfer/bench/grammar-engines.json] [--steps 256] [--reps 3] [--batch 32] [--lockstep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.expanduser("~/.cache/rawinfer/bench/grammar-engines.json")


def obj(required: list[str] | None = None, **props) -> dict:
    """A closed object (OpenAI's strict mode: no properties beyond the listed ones)."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
ADDRESS = obj(street=STR, city=STR, postcode={"type": "string", "pattern": "^[0-9]{5}$"}, country=STR)
TOOLS = [  # the schema a required tool call is held to: one of several functions, each with its arguments
    obj(name={"const": "get_weather"}, arguments=obj(
        ["location"], location=STR, unit={"enum": ["celsius", "fahrenheit"]})),
    obj(name={"const": "search_flights"}, arguments=obj(
        ["origin", "destination", "date"], origin={"type": "string", "minLength": 3, "maxLength": 3},
        destination={"type": "string", "minLength": 3, "maxLength": 3}, date={"type": "string", "format": "date"},
        passengers={"type": "integer", "minimum": 1, "maximum": 9},
        cabin={"enum": ["economy", "premium", "business", "first"]})),
    obj(name={"const": "create_event"}, arguments=obj(
        ["title", "start", "attendees"], title=STR, start={"type": "string", "format": "date-time"},
        duration_minutes={"type": "integer", "minimum": 5, "maximum": 480},
        attendees={"type": "array", "items": obj(["email"], email={"type": "string", "format": "email"},
                                                  optional=BOOL)},
        reminders={"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3})),
    obj(name={"const": "send_email"}, arguments=obj(
        ["to", "subject", "body"], to={"type": "array", "items": STR, "minItems": 1}, subject=STR, body=STR,
        cc={"type": "array", "items": STR})),
]
# name -> (schema, example answers it accepts)
SCHEMAS = {
    "nested": (obj(name=STR, age=INT, address=ADDRESS, employer=obj(name=STR, address=ADDRESS)),
               [{"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "city": "London",
                 "postcode": "12345", "country": "UK"}, "employer": {"name": "Analytical Engines", "address": {
                 "street": "1 Main Street", "city": "Leeds", "postcode": "54321", "country": "UK"}}}]),
    "arrays": (obj(items={"type": "array", "items": obj(sku=STR, qty=INT, tags={"type": "array", "items": STR}),
                          "minItems": 1, "maxItems": 8}, matrix={"type": "array", "items": {
                              "type": "array", "items": {"type": "number"}}}),
               [{"items": [{"sku": "A-1", "qty": 2, "tags": ["red", "large"]}, {"sku": "B-22", "qty": 10,
                 "tags": []}], "matrix": [[1.5, -2], [0, 3.25e2]]}]),
    "enums": (obj(status={"enum": ["active", "inactive", "pending", "banned"]}, priority={"enum": [1, 2, 3]},
                  color={"type": "string", "enum": ["red", "green", "blue"]}, flag={"enum": [True, None, "x"]}),
              [{"status": "pending", "priority": 2, "color": "blue", "flag": None}]),
    "optional": (obj(["id"], id=INT, nickname=STR, email=STR, verified=BOOL, score={"type": "number"}),
                 [{"id": 7}, {"id": 8, "email": "a@b.c", "score": 0.5}]),
    "bounded": (obj(age={"type": "integer", "minimum": 0, "maximum": 130},
                    temperature={"type": "number", "minimum": -273.15, "maximum": 1000},
                    ratio={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                    count={"type": "integer", "minimum": 10}, code={"type": "string", "maxLength": 6}),
                [{"age": 42, "temperature": 21.5, "ratio": 0.25, "count": 12345, "code": "AB12"}]),
    "tool_calls": ({"type": "array", "items": {"anyOf": TOOLS}, "minItems": 1},
                   [[{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}],
                    [{"name": "create_event", "arguments": {"title": "Design review", "start":
                      "2025-03-04T10:30:00Z", "duration_minutes": 45, "attendees": [{"email": "ana@example.com"},
                      {"email": "bo@example.org", "optional": True}], "reminders": [10, 60]}},
                     {"name": "search_flights", "arguments": {"origin": "LHR", "destination": "SFO",
                      "date": "2025-05-01", "passengers": 2, "cabin": "economy"}}]]),
    "json_object": ({"type": "object"}, [{"answer": "yes", "confidence": 0.9, "sources": [1, 2, {"k": None}]}]),
}


class Llguidance:
    """llguidance: the matcher's constructor compiles; its lexer is built lazily as masks ask for it."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int], threads: int):
        import llguidance
        import llguidance.numpy as lln
        self.llg, self.lln = llguidance, lln
        self.version = version("llguidance")
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.tokenizer_ms = 1e3 * (time.perf_counter() - start)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.kept: dict[str, object] = {}

    def compile_cold(self, key: str, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance refused schema {key}: {matcher.get_error()}")
        self.kept[key] = matcher.deep_copy()
        return matcher

    def cached(self, key: str, schema: dict):
        return self.kept[key].deep_copy()

    def fill_batch(self, matchers, bitmask):
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one(self, matcher, bitmask, row):
        self.lln.fill_next_token_bitmask(matcher, bitmask, row)

    def advance(self, matcher, token):
        return matcher.consume_token(token)

    def advance_batch(self, matchers, tokens):
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def terminated(self, matcher):
        return matcher.is_stopped() and not matcher.is_error()


class Xgrammar:
    """xgrammar: compiles eagerly (token masks precomputed per grammar state) and caches by schema."""

    name = "xgrammar"

    def __init__(self, tokenizer_path: str, vocab: int, eos: list[int], threads: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr, self.version = xgrammar, version("xgrammar")
        start = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.tokenizer_ms = 1e3 * (time.perf_counter() - start)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def _compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def compile_cold(self, key: str, schema: dict):
        self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self._compile(schema))

    def cached(self, key: str, schema: dict):
        return self.xgr.GrammarMatcher(self._compile(schema))

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, matcher, token):
        return matcher.accept_token(token)

    def advance_batch(self, matchers, tokens):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def terminated(self, matcher):
        return matcher.is_terminated()


def answers(tokenizer, eos: int) -> dict[str, list[list[int]]]:
    """Every schema's answers as token ids (compact, spaced and indented JSON of each example), EOS last."""
    out = {}
    for key, (schema, examples) in SCHEMAS.items():
        texts = [dump(example) for example in examples for dump in (
            lambda x: json.dumps(x, separators=(",", ":")), json.dumps, lambda x: json.dumps(x, indent=2))]
        assert all(json.loads(text) in examples for text in texts)
        out[key] = [tokenizer.encode(text, add_special_tokens=False).ids + [eos] for text in texts]
    return out


def measure_compile(engine, key: str, schema: dict, vocab: int, batch: int) -> tuple[dict, list]:
    """Cold compile, the first mask after it, and the batch's matchers made from the cache."""
    one = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    start = time.perf_counter()
    fresh = engine.compile_cold(key, schema)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.fill_one(fresh, one, 0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    matchers = [engine.cached(key, schema) for _ in range(batch)]
    cached = (time.perf_counter() - start) / batch
    return {"compile_cold_ms": 1e3 * cold, "first_mask_ms": 1e3 * first, "from_cache_ms": 1e3 * cached}, matchers


def stagger(engine, matchers: list, docs: list[list[list[int]]], lockstep: bool) -> tuple[list[int], list[int]]:
    """Row r starts on its r-th answer, a few tokens in (untimed), so that the rows are in different states
    as the requests of a real batch are; returns each row's answer index and position."""
    which, pos = ([0] * len(matchers), [0] * len(matchers)) if lockstep else ([], [])
    for r, (matcher, answers_r) in enumerate([] if lockstep else zip(matchers, docs)):
        doc = answers_r[r % len(answers_r)]
        skip = (7 * (r // len(answers_r))) % (len(doc) - 1)
        if not all(engine.advance(matcher, t) for t in doc[:skip]):
            raise RuntimeError(f"{engine.name}: row {r} refused the first {skip} tokens of its answer")
        which, pos = which + [r % len(answers_r)], pos + [skip]
    return which, pos


def decode(engine, matchers: list, docs: list[list[list[int]]], vocab: int, steps: int, lockstep: bool) -> dict:
    """Step the batch `steps` times; row r follows docs[r], one answer after another."""
    batch = len(matchers)
    par = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    loop = np.zeros_like(par)
    which, pos = stagger(engine, matchers, docs, lockstep)
    t_par, t_loop, t_adv, t_adv_batch, allowed_counts, finished = [], [], [], [], [], 0
    for step in range(steps):
        for order in ((0, 1) if step % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            if order == 0:
                engine.fill_batch(matchers, par)
                t_par.append(time.perf_counter() - start)
            else:
                for r, m in enumerate(matchers):
                    engine.fill_one(m, loop, r)
                t_loop.append(time.perf_counter() - start)
        if not np.array_equal(par, loop):
            raise RuntimeError(f"{engine.name}: the parallel and the per-row masks differ at step {step}")
        allowed_counts.append(float(np.bitwise_count(par.view(np.uint32)).sum()) / batch)
        tokens = [docs[r][which[r] % len(docs[r])][pos[r]] for r in range(batch)]
        for r, token in enumerate(tokens):
            if not (int(par[r, token // 32]) >> (token % 32)) & 1:
                raise RuntimeError(f"{engine.name}: row {r}'s mask refuses token {token} at position {pos[r]}")
        start = time.perf_counter()
        if step % 2 == 0:
            ok = [engine.advance(m, t) for m, t in zip(matchers, tokens)]
            t_adv.append((time.perf_counter() - start) / batch)
        else:
            ok = engine.advance_batch(matchers, tokens)
            t_adv_batch.append((time.perf_counter() - start) / batch)
        if not all(ok):
            raise RuntimeError(f"{engine.name}: a matcher refused an allowed token at step {step}")
        for r in range(batch):
            pos[r] += 1
            if pos[r] == len(docs[r][which[r] % len(docs[r])]):
                if not engine.terminated(matchers[r]):
                    raise RuntimeError(f"{engine.name}: row {r} consumed its whole answer but did not terminate")
                matchers[r].reset()  # both engines' matchers: back to the grammar's start
                which[r], pos[r], finished = which[r] + 1, 0, finished + 1
    return {**summary("mask_par_ms", t_par), **summary("mask_loop_ms", t_loop), **summary("advance_us", t_adv, 1e6),
            **summary("advance_batched_us", t_adv_batch, 1e6),
            "allowed_tokens_per_row": float(np.mean(allowed_counts)), "answers_finished": finished}


def summary(name: str, seconds: list[float], unit: float = 1e3) -> dict:
    """Mean, median, p99 and max of per-step times; on a shared machine the scheduler's preemptions land in
    the mean and the tail, the median shrugs them off."""
    xs = np.array(seconds) * unit
    return {f"{name}_mean": float(xs.mean()), f"{name}_p50": float(np.median(xs)),
            f"{name}_p99": float(np.percentile(xs, 99)), f"{name}_max": float(xs.max())}


def one_rep(engine, docs: dict, vocab: int, batch: int, steps: int, lockstep: bool) -> dict:
    """Every schema's compile and decode numbers, then the mixed batch, for one engine."""
    out = {}
    for key, (schema, _) in SCHEMAS.items():
        compiled, matchers = measure_compile(engine, key, schema, vocab, batch)
        out[key] = {**compiled, **decode(engine, matchers, [docs[key]] * batch, vocab, steps, lockstep)}
    keys = list(SCHEMAS)
    rows = [keys[r % len(keys)] for r in range(batch)]
    matchers = [engine.cached(k, SCHEMAS[k][0]) for k in rows]
    out["mixed"] = decode(engine, matchers, [docs[k] for k in rows], vocab, steps, lockstep)
    return out


def machine() -> dict:
    """The CPU's name, its AVX-512 features, the core count and the load when the run starts."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    lscpu = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    name = lscpu.get("Model name", platform.processor())
    if "CPU family" in lscpu:
        name += f" (family {lscpu['CPU family']}, model {lscpu.get('Model', '?')})"
    flags = set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                flags.update(w for w in line.split() if w.startswith("avx512"))
    return {"cpu": name, "avx512": sorted(flags), "cores": os.cpu_count(), "loadavg": os.getloadavg(),
            "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")}}


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "runs": values}


def summarize(reps: list[dict]) -> dict:
    """Per schema and measurement: the median of the repetitions, their min and max."""
    return {key: {m: spread([rep[key][m] for rep in reps]) for m in reps[0][key]} for key in reps[0]}


COLUMNS = [("compile_cold_ms", "compile cold ms"), ("first_mask_ms", "first mask ms"),
           ("from_cache_ms", "from cache ms"), ("mask_par_ms_p50", "mask B rows, parallel: p50 ms"),
           ("mask_par_ms_mean", "mean ms"), ("mask_par_ms_p99", "p99 ms"), ("mask_loop_ms_p50", "loop: p50 ms"),
           ("mask_loop_ms_mean", "mean ms"), ("mask_loop_ms_p99", "p99 ms"), ("advance_us_p50", "advance µs/token"),
           ("advance_batched_us_p50", "batched advance µs/token")]


def cell(s: dict | None) -> str:
    if s is None:
        return "-"
    digits = 3 if s["median"] < 1 else 2 if s["median"] < 10 else 1
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(results: dict) -> str:
    lines = ["| engine | schema | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---|---|" + "---:|" * len(COLUMNS)]
    for engine, per_schema in results.items():
        for key, stats in per_schema.items():
            lines.append(f"| {engine} | {key} | " + " | ".join(cell(stats.get(m)) for m, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "weights", "smollm2-135m-instruct"),
                    help="a converted model folder (its tokenizer.json and config.json)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where the JSON results go")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=256, help="decode steps per schema and repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the parallel fills")
    ap.add_argument("--lockstep", action="store_true", help="every row on the same answer at the same token")
    args = ap.parse_args()
    import tokenizers
    tokenizer_path = os.path.join(args.model, "tokenizer.json")
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    vocab, eos = config["vocab_size"], config["eos_token_ids"]
    docs = answers(tokenizers.Tokenizer.from_file(tokenizer_path), eos[0])
    engines, notes = [], []
    for name in args.engines.split(","):
        try:
            if name == "llguidance":
                with open(tokenizer_path, encoding="utf-8") as f:
                    engines.append(Llguidance(f.read(), vocab, eos, args.threads))
            elif name == "xgrammar":
                engines.append(Xgrammar(tokenizer_path, vocab, eos, args.threads))
            else:
                ap.error(f"unknown engine {name!r}: choose from llguidance, xgrammar")
        except ImportError as e:
            notes.append(f"{name} skipped: it is not installed in this Python ({e.name} missing)")
    info = {"machine": machine(), "python": sys.version.split()[0], "batch": args.batch, "steps": args.steps,
            "reps": args.reps, "threads": args.threads, "lockstep": args.lockstep, "vocab": vocab, "notes": notes,
            "engines": {e.name: {"version": e.version, "tokenizer_info_ms": e.tokenizer_ms} for e in engines}}
    reps = {e.name: [] for e in engines}
    for rep in range(args.reps):
        for engine in engines:
            print(f"rep {rep + 1}/{args.reps}: {engine.name}", file=sys.stderr, flush=True)
            reps[engine.name].append(one_rep(engine, docs, vocab, args.batch, args.steps, args.lockstep))
    results = {name: summarize(r) for name, r in reps.items()}
    info["machine"]["loadavg_end"] = os.getloadavg()
    m = info["machine"]
    print(f"CPU: {m['cpu']}, {m['cores']} cores, {' '.join(m['avx512']) or 'no AVX-512'}; load {m['loadavg'][0]:.1f}; "
          f"batch {args.batch}{' in lockstep' if args.lockstep else ''}, {args.steps} steps, V = {vocab}, "
          f"{args.threads} threads; median (min-max) of {args.reps} runs")
    print("".join(f"{e.name} {e.version}: tokenizer info built in {e.tokenizer_ms:.0f} ms\n" for e in engines), end="")
    print("".join(f"note: {note}\n" for note in notes), end="")
    print(table(results))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({**info, "results": results}, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
