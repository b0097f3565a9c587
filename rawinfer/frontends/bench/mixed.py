"""The mixed workload of `rawinfer bench serve` and its service-level report.

A fraction of the requests (--long-fraction) are long prompts with short outputs (--long-input-len /
--long-output-len); the rest are the usual --input-len / --output-len requests. In one engine a long
prompt's prefill steps stall the decode steps of every running request, so the short requests' TTFT and
inter-token latency are reported on their own, with p90 beside p50 and p99.

Goodput counts the requests that meet both objectives: TTFT <= --slo-ttft-ms and every gap between two of
the request's token messages <= --slo-itl-ms (the worst gap, because a single prefill stall is what a
reader of a stream sees), divided by the run's duration.
"""

from __future__ import annotations

import numpy as np

from rawinfer.frontends.bench.throughput import Workload, check_lengths, make_workload

DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_ITL_MS = 200.0


def fraction_argument(text: str) -> float:
    """--long-fraction's text: a number (its range is the option's check, said as "a number in [0, 1]")."""
    try:
        return float(text)
    except ValueError:
        import argparse
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}") from None


def check_mixed_lengths(args, limit: int) -> None:
    """check_lengths for the short requests, and for the long ones when there are any: their prompt and
    output must fit the context (their output is what the long class is measured by)."""
    check_lengths(args, limit, output_counts=False)
    if getattr(args, "long_fraction", 0.0) > 0:
        r = args.range_ratio
        prompt, output = max(1, int(args.long_input_len * (1 + r))), max(1, int(args.long_output_len * (1 + r)))
        if prompt + output > limit:
            raise ValueError(f"long prompts of up to {prompt} tokens and outputs of up to {output} "
                             f"(--long-input-len, --long-output-len, --range-ratio) do not fit the context of "
                             f"{limit} tokens; lower them")


def make_mixed_workload(args, vocab_size: int) -> tuple[Workload, list[bool]]:
    """The seeded workload of the options and which of its requests are long. round(N * fraction) requests
    are long, at seeded random positions, so two runs with the same seed send the same sequence."""
    n = args.num_requests
    fraction = getattr(args, "long_fraction", 0.0)
    n_long = int(round(n * fraction)) if fraction > 0 else 0
    short = make_workload(n - n_long, args.input_len, args.output_len, args.range_ratio, vocab_size, args.seed)
    if n_long == 0:
        return short, [False] * n
    long = make_workload(n_long, args.long_input_len, args.long_output_len, args.range_ratio, vocab_size,
                         args.seed + 2)
    is_long = [False] * n
    for i in np.random.default_rng(args.seed + 3).choice(n, n_long, replace=False):
        is_long[int(i)] = True
    prompts, outs, si, li = [], [], 0, 0
    for flag in is_long:
        src, j = (long, li) if flag else (short, si)
        prompts.append(src.prompts[j])
        outs.append(src.output_lens[j])
        li, si = (li + 1, si) if flag else (li, si + 1)
    return Workload(prompts, outs), is_long


def percentiles(values, scale: float = 1000.0) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 of a list (None entries dropped), times scale (1000: seconds to ms)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64) * scale
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(rec, ttft_s: float, itl_s: float) -> bool:
    if not rec.ok or rec.ttft is None or rec.ttft > ttft_s:
        return False
    return max(rec.itls, default=0.0) <= itl_s


def class_report(records) -> dict:
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok),
            "ttft_ms": percentiles([r.ttft for r in ok]), "itl_ms": percentiles([g for r in ok for g in r.itls]),
            "tpot_ms": percentiles([r.tpot for r in ok]), "e2e_ms": percentiles([r.e2e for r in ok])}


def slo_report(records, duration: float, config: dict) -> dict:
    """Per-class latencies (short / long) and goodput under the objectives in config (defaults when absent)."""
    ttft_ms = float(config.get("slo_ttft_ms") or DEFAULT_SLO_TTFT_MS)
    itl_ms = float(config.get("slo_itl_ms") or DEFAULT_SLO_ITL_MS)
    good = [r for r in records if meets_slo(r, ttft_ms / 1000, itl_ms / 1000)]
    return {
        "slo": {"ttft_ms": ttft_ms, "itl_ms": itl_ms},
        "goodput_requests": len(good),
        "goodput_requests_per_s": len(good) / duration if duration > 0 else 0.0,
        "goodput_fraction": len(good) / len(records) if records else 0.0,
        "short": class_report([r for r in records if not r.long]),
        "long": class_report([r for r in records if r.long]),
    }


def _row(d: dict) -> str:
    if d.get("mean") is None:
        return "n/a"
    return " | ".join(f"{k} {d[k]:8.1f}" for k in ("p50", "p90", "p99"))


def print_slo_report(r: dict, file) -> None:
    slo = r["slo"]
    for cls in ("short", "long"):
        c = r[cls]
        if not c["requests"]:
            continue
        print(f"{cls} requests:{'':<10}{c['completed']} of {c['requests']} completed", file=file)
        for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT")):
            print(f"  {name + ' (ms):':<23}{_row(c[key])}", file=file)
    print(f"goodput:                 {r['goodput_requests_per_s']:.2f} req/s ({r['goodput_requests']} requests, "
          f"{100 * r['goodput_fraction']:.0f} %) with TTFT <= {slo['ttft_ms']:g} ms and every ITL <= "
          f"{slo['itl_ms']:g} ms", file=file)


# ---- prefill/decode disaggregation: what the decode side's connector did over the run ---------------------
_TRANSFER_KEYS = ("remote", "local", "fallbacks", "failed", "stale", "bytes", "transfer_s")


def _transfer_totals(stats: dict) -> dict | None:
    """The decode side's KV-transfer counters in a stats reply: a decode server's own, or summed over a
    router's replicas; None where nothing disaggregates."""
    parts = [stats.get("kv_transfer")] + [r.get("stats", {}).get("kv_transfer")
                                          for r in (stats.get("replicas") or {}).values()]
    parts = [p for p in parts if isinstance(p, dict)]
    if not parts:
        return None
    return {k: sum(p.get(k, 0) for p in parts) for k in _TRANSFER_KEYS}


def kv_transfer_report(before: dict, after: dict, duration: float) -> dict | None:
    """Prompts prefilled remotely and locally during the run, fallbacks, failures, K/V bytes moved, the
    mean time of one transfer and the rate over the run (None when the server does not disaggregate)."""
    a, b = _transfer_totals(before), _transfer_totals(after)
    if b is None:
        return None
    d = {k: b[k] - (a or {}).get(k, 0) for k in _TRANSFER_KEYS}
    d["mean_transfer_ms"] = 1000 * d["transfer_s"] / d["remote"] if d["remote"] else None
    d["mb_per_s"] = d["bytes"] / 1e6 / duration if duration > 0 else None
    return d


def print_kv_transfer(t: dict | None, file) -> None:
    if not t:
        return
    mean = "-" if t["mean_transfer_ms"] is None else f"{t['mean_transfer_ms']:.1f} ms"
    print(f"KV transfer:             {t['remote']} prompts remote, {t['local']} local, {t['fallbacks']} fallbacks, "
          f"{t['failed']} failed; {t['bytes'] / 1e6:.1f} MB ({t['mb_per_s']:.2f} MB/s over the run), "
          f"{mean} per transfer", file=file)
