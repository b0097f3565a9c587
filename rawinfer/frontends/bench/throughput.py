"""`rawinfer bench throughput`: offline throughput of N requests submitted at once (and the seeded workloads
that `bench serve` sends too); with --structured-output, the same workload unconstrained and then with every
request constrained by a JSON schema."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from rawinfer.engine.metrics import summarize
from rawinfer.frontends.bench import speculative
from rawinfer.frontends.options import nonnegative_int, positive_int
from rawinfer.sampling import SamplingParams
from rawinfer.settings import check_options, float_argument, is_int, is_number, option


# --structured-output's schema: product records with every kind of JSON value (bounded strings and numbers,
# enums, booleans, an optional nested object); at least BENCH_MIN_RECORDS of them, so that no output
# completes its grammar (and leaves the batch) before --output-len tokens
BENCH_MIN_RECORDS = 64
BENCH_RECORD = {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "price", "tags", "in_stock"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}, "name": {"type": "string", "maxLength": 24},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "gift"]}, "maxItems": 4},
        "supplier": {"type": "object", "additionalProperties": False, "required": ["country"],
                     "properties": {"country": {"type": "string", "maxLength": 2},
                                    "rating": {"type": "integer", "minimum": 1, "maximum": 5}}}}}
BENCH_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["records"],
                "properties": {"records": {"type": "array", "minItems": BENCH_MIN_RECORDS, "items": BENCH_RECORD}}}


def positive(v) -> bool:
    return is_int(v) and v > 0


def nonnegative(v) -> bool:
    return is_int(v) and v >= 0


def is_switch(v) -> bool:
    return isinstance(v, bool)


def range_ratio_argument(text: str) -> float:
    """--range-ratio's text: a number (its range is the option's check, said as "a number in [0, 1)")."""
    import argparse
    try:
        return float_argument(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}") from None


POSITIVE = {"parse": positive_int, "check": positive, "what": "a positive integer", "metavar": "N"}
NONNEGATIVE = {"parse": nonnegative_int, "check": nonnegative, "what": "an integer of 0 or more", "metavar": "N"}


@dataclass(frozen=True)
class WorkloadConfig:
    """The seeded random workload that `bench throughput` and `bench serve` send (the "workload" flags)."""

    num_requests: int = option(64, **POSITIVE, help="requests to send (default: 64)")
    input_len: int = option(128, **POSITIVE, help="prompt tokens per request, random ids (default: 128)")
    output_len: int = option(128, **POSITIVE, help="tokens to generate per request, end-of-sequence ignored "
                                                   "(default: 128)")
    range_ratio: float = option(0.0, parse=range_ratio_argument, metavar="R", what="a number in [0, 1)",
                                check=lambda v: is_number(v) and 0 <= v < 1,
                                help="draw lengths uniformly in len*(1-R) .. len*(1+R) (default: 0, fixed lengths)")
    seed: int = option(0, **NONNEGATIVE, help="seed of the random prompts and lengths (default: 0)")


WORKLOAD_FIELDS = ("num_requests", "input_len", "output_len", "range_ratio", "seed")


@dataclass(frozen=True)
class ThroughputConfig(WorkloadConfig):
    """The options of `rawinfer bench throughput` besides the engine's: its workload and what to measure."""

    shared_prefix: int = option(0, **NONNEGATIVE, help="tokens of a prefix common to every prompt (default: 0)")
    compare_single: bool = option(False, check=is_switch, what="True or False",
                                  help="first measure one request alone and report the batched/single ratio "
                                       "(default: off)")
    warmup: bool = option(True, flag="--no-warmup", check=is_switch, what="True or False",
                          help="measure from the first request (default: two short requests run first, unmeasured)")
    structured_output: bool = option(False, check=is_switch, what="True or False",
                                     help="run the workload twice: unconstrained, then every request constrained by "
                                          "a JSON schema (structured_outputs), and report the ratio, the grammar's "
                                          "compile and mask times (default: off)")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(num_requests: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int, shared_prefix: int = 0) -> Workload:
    """Seeded random token prompts. Lengths are uniform in [len*(1-r), len*(1+r)] (r = 0: fixed).
    Ids are drawn from the lower part of the vocabulary, away from the special tokens at either end."""
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> list[int]:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return [int(x) for x in rng.integers(lo, hi + 1, num_requests)]

    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    prefix = [int(x) for x in rng.integers(lo, hi, shared_prefix)]
    prompts = [prefix + [int(x) for x in rng.integers(lo, hi, n)] for n in lengths(input_len)]
    return Workload(prompts, lengths(output_len))


def check_lengths(args, limit: int, output_counts: bool = True) -> None:
    """A ValueError of one sentence when the longest request of the workload options cannot fit a context of
    `limit` tokens (the prompt alone when output_counts is False: `bench serve` shortens outputs to fit)."""
    r = args.range_ratio
    prompt = getattr(args, "shared_prefix", 0) + max(1, int(args.input_len * (1 + r)))
    output = max(1, int(args.output_len * (1 + r))) if output_counts else 1
    if prompt + output > limit:
        what = f"prompts of up to {prompt} tokens" + (f" and outputs of up to {output}" if output_counts else "")
        raise ValueError(f"{what} (--input-len, --output-len, --range-ratio) do not fit the context of {limit} "
                         "tokens; lower them")


def run_offline(engine, wl: Workload, progress: bool = False, desc: str = "requests",
                structured: dict | None = None) -> dict:
    """Submit everything at once, step until done; returns the benchmark's numbers. With progress, a bar
    of finished requests on stderr (when it is a terminal). structured: every request's structured_outputs."""
    from tqdm import tqdm
    base_preempt = engine.scheduler.num_preemptions
    bm = engine.block_manager
    q0, h0 = bm.stats.query_tokens, bm.stats.hit_tokens
    spec0 = speculative.totals(engine.stats())
    t0 = time.monotonic()
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        engine.add_request(f"bench-{t0}-{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                              structured_outputs=structured))
    finals = []
    peak_kv = 0.0
    with tqdm(total=len(wl.prompts), desc=desc, unit="req", leave=False, disable=None if progress else True) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals.append(out.metrics)
                    bar.update(1)
            peak_kv = max(peak_kv, bm.usage)
    elapsed = time.monotonic() - t0
    n_out = sum(m.generated_tokens for m in finals)
    n_in = sum(m.prompt_tokens for m in finals)
    q, h = bm.stats.query_tokens - q0, bm.stats.hit_tokens - h0
    return {
        "num_requests": len(finals), "elapsed_s": elapsed,
        "requests_per_s": len(finals) / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "prompt_tokens": n_in, "output_tokens": n_out,
        "ttft_ms": summarize([m.ttft_s for m in finals], 1000),
        "itl_ms": summarize([g for m in finals for g in m.itl_s], 1000),
        "e2e_ms": summarize([m.e2e_s for m in finals], 1000),
        "peak_kv_usage": peak_kv,
        "prefix_cache_hit_rate": (h / q) if q else 0.0,
        "preemptions": engine.scheduler.num_preemptions - base_preempt,
        "speculative": speculative.run_report(spec0, speculative.totals(engine.stats())),
    }


def _fmt(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    return f"mean {d['mean']:.1f} / p50 {d['p50']:.1f} / p99 {d['p99']:.1f} ms"


def print_report(r: dict, file=sys.stdout) -> None:
    print(f"requests:            {r['num_requests']} in {r['elapsed_s']:.2f} s", file=file)
    print(f"requests/s:          {r['requests_per_s']:.2f}", file=file)
    print(f"output tokens/s:     {r['output_tokens_per_s']:.1f}", file=file)
    print(f"total tokens/s:      {r['total_tokens_per_s']:.1f}", file=file)
    print(f"TTFT:                {_fmt(r['ttft_ms'])}", file=file)
    print(f"ITL:                 {_fmt(r['itl_ms'])}", file=file)
    print(f"peak KV utilisation: {r['peak_kv_usage'] * 100:.1f} %", file=file)
    print(f"prefix-cache hits:   {r['prefix_cache_hit_rate'] * 100:.1f} %", file=file)
    print(f"preemptions:         {r['preemptions']}", file=file)
    speculative.print_report(r.get("speculative"), file)


def run(engine, args: ThroughputConfig, progress: bool = False) -> dict:
    """The benchmark of `rawinfer bench throughput`'s options (a warm-up, optionally one request alone, then
    the batch), printing as it goes; returns the numbers without the config. A ValueError naming the field of a
    bad value."""
    check_options(args, "throughput option")
    check_lengths(args, engine.max_model_len)
    V = engine.model_config.vocab_size
    wl = make_workload(args.num_requests, args.input_len, args.output_len, args.range_ratio, V, args.seed,
                       args.shared_prefix)
    if args.warmup:
        run_offline(engine, make_workload(2, 16, 4, 0.0, V, args.seed + 1))
    result = {}
    if args.compare_single:
        single = run_offline(engine, make_workload(1, args.input_len, args.output_len, 0.0, V, args.seed + 2),
                             progress, "single stream")
        # the single stream's decode rate (1 / mean ITL), not its output tokens/s: those include its
        # prefill and would flatter the ratio
        single["decode_tokens_per_s"] = 1000.0 / single["itl_ms"]["mean"]
        result["single_stream"] = single
        print(f"single stream:       {single['decode_tokens_per_s']:.1f} decode tokens/s "
              f"(ITL {_fmt(single['itl_ms'])}; {single['output_tokens_per_s']:.1f} output tokens/s with its prefill)")
    if args.structured_output:
        result.update(run_structured(engine, wl, progress))
        return result
    r = run_offline(engine, wl, progress, "batch")
    result.update(r)
    print_report(r)
    if args.compare_single:
        ratio = r["output_tokens_per_s"] / result["single_stream"]["decode_tokens_per_s"]
        result["speedup_vs_single_stream"] = ratio
        print(f"batched / single:    {ratio:.1f}x")
    return result


def run_structured(engine, wl: Workload, progress: bool = False) -> dict:
    """The workload unconstrained, then every request constrained by BENCH_SCHEMA (its grammar compiled
    first, unmeasured; the prefix cache emptied before each run, so neither reuses the other's prompts): both
    reports, the constrained/unconstrained ratios of output tokens/s and of decode
    tokens/s (from the mean gap between tokens), the grammar's compile time and the mask time per step."""
    spec = {"json": BENCH_SCHEMA}
    so = engine.structured
    if so.compiler is None:
        raise ValueError("--structured-output needs a model with a tokenizer")
    t0 = time.perf_counter()
    so.compiler.tokenizer                                    # built once per engine, on first use
    tokenizer_s = time.perf_counter() - t0
    compile_s = so.compiler.compile(spec).result().compile_s
    print(f"grammar:             llguidance tokenizer {tokenizer_s * 1e3:.0f} ms (once), schema compiled in "
          f"{compile_s * 1e3:.1f} ms")
    engine.reset_state()
    plain = run_offline(engine, wl, progress, "unconstrained")
    print("unconstrained:")
    print_report(plain)
    engine.reset_state()
    steps0, mask0 = engine.stats_tracker.steps, so.mask_seconds
    constrained = run_offline(engine, wl, progress, "constrained", structured=spec)
    steps, mask_s = engine.stats_tracker.steps - steps0, so.mask_seconds - mask0
    print("constrained (JSON schema):")
    print_report(constrained)
    ratio = constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    decode_ratio = plain["itl_ms"]["mean"] / constrained["itl_ms"]["mean"]
    print(f"constrained / unconstrained: {ratio * 100:.1f} % of output tokens/s, {decode_ratio * 100:.1f} % of "
          f"decode tokens/s; mask {mask_s / steps * 1e3:.2f} ms per step (llguidance, {len(wl.prompts)} rows)")
    return {"unconstrained": plain, "constrained": constrained, "output_tokens_ratio": ratio,
            "decode_tokens_ratio": decode_ratio, "grammar_compile_ms": compile_s * 1e3,
            "llguidance_tokenizer_ms": tokenizer_s * 1e3, "mask_ms_per_step": mask_s / steps * 1e3,
            "schema": BENCH_SCHEMA}
