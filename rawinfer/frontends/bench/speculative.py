"""The benchmarks' speculative-decoding report: how many drafts the engine verified over a run and how many of
their tokens it kept, from its spec_decode counters (PROTOCOL.md's `stats.metrics`, or /metrics over HTTP).

The counters are cumulative since the engine started, so a run's numbers are the difference of two readings,
one before the run and one after it; behind a replica router the counters of every replica are added up.
acceptance_rate is accepted / proposed tokens; mean_acceptance_length the tokens a verifying step yields per
draft (the accepted ones plus the one the model gives itself), vLLM's meaning of both.
"""

from __future__ import annotations

import re

_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r'^rawinfer:(spec_decode_\w+_total)\{([^}]*)\}\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def totals(stats: dict | None) -> dict | None:
    """The spec_decode counters of a stats reply (an engine's, a server's or a router's merged one):
    {"methods", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"}; None when the
    engine does not speculate."""
    counters = ((stats or {}).get("metrics") or {}).get("counters") or {}
    if not isinstance(counters.get("spec_decode_num_drafts_total"), dict):
        return None
    out: dict = {"methods": sorted(str(m) for m in counters["spec_decode_num_drafts_total"])}
    for name in _COUNTERS:
        by_method = counters.get(f"spec_decode_{name}_total")
        out[name] = int(sum(_number(v) for v in by_method.values())) if isinstance(by_method, dict) else 0
    out["accepted_per_pos"] = _positions(counters.get(_PER_POS))
    return out


def _positions(by_position) -> list[int]:
    """{"0": n0, "1": n1, ...} (keys strings or integers) as [n0, n1, ...]."""
    if not isinstance(by_position, dict):
        return []
    pos = {int(k): int(_number(v)) for k, v in by_position.items() if str(k).isdigit()}
    return [pos.get(i, 0) for i in range(max(pos) + 1)] if pos else []


def totals_from_metrics(text: str) -> dict | None:
    """totals() read from a /metrics page (the samples of every replica added up); None without the series."""
    counters: dict[str, dict] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2))), m.group(3)
        key = labels.get("position" if name == _PER_POS else "method")
        if key is None:
            continue
        try:
            x = float(value)
        except ValueError:
            continue
        acc = counters.setdefault(name, {})
        acc[key] = acc.get(key, 0.0) + x
    return totals({"metrics": {"counters": counters}})


def run_report(before: dict | None, after: dict | None) -> dict | None:
    """What the run added to the counters (totals() before and after it), with the acceptance rate and the
    mean acceptance length; None when the engine does not speculate."""
    if after is None:
        return None
    b = before or {}
    d = {name: after[name] - b.get(name, 0) for name in _COUNTERS}
    base = b.get("accepted_per_pos", [])
    per_pos = [n - (base[i] if i < len(base) else 0) for i, n in enumerate(after["accepted_per_pos"])]
    return {"method": ", ".join(after["methods"]), **d,
            "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0,
            "accepted_per_pos": per_pos}


def print_report(s: dict | None, file, width: int = 21) -> None:
    """Two lines: the method, drafts, tokens and acceptance, then the share of drafts kept up to each position."""
    if not s:
        return
    print(f"{'speculative:':<{width}}{s['method']}: {s['num_drafts']} drafts of {s['num_draft_tokens']} tokens, "
          f"{s['num_accepted_tokens']} accepted ({100 * s['acceptance_rate']:.1f} %), mean acceptance length "
          f"{s['mean_acceptance_length']:.2f}", file=file)
    if s["num_drafts"] and s["accepted_per_pos"]:
        rates = " / ".join(f"{100 * n / s['num_drafts']:.0f}" for n in s["accepted_per_pos"])
        print(f"{'':<{width}}kept at draft position 1..{len(s['accepted_per_pos'])}: {rates} % of drafts", file=file)
