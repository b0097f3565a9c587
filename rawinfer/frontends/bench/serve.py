"""`rawinfer bench serve`: an open-loop load generator against a running `rawinfer serve`, with vLLM-style metrics.

Requests leave on a Poisson schedule (exponential gaps at --request-rate, or all at once for inf), whatever
the server's state: that is what "open loop" means, and why TTFT grows once the rate passes what the server
sustains. Each request streams its tokens; the client clock gives

    TTFT  send -> first token              TPOT  (e2e - TTFT) / (output tokens - 1), per request
    ITL   gaps between token messages (pooled over all requests)      e2e  send -> final message

A side task polls `stats` for the KV-pool utilisation and the server's generation rate over time. With
--long-fraction some requests are long prompts; the short and long classes and the goodput under the
stated objectives are reported on their own (mixed.py). With --conversations the requests are the turns of
multi-turn conversations that resend their history, and the server's prefix-cache hit rate is reported
(multiturn.py).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from rawinfer.engine.metrics import summarize
from rawinfer.frontends.bench import mixed, multiturn, speculative
from rawinfer.frontends.bench.throughput import NONNEGATIVE, POSITIVE, WorkloadConfig, is_switch
from rawinfer.frontends.options import positive_float
from rawinfer.frontends.server.protocol import DEFAULT_ADDR
from rawinfer.settings import api_key_default, check_options, is_number, optional, option


def _text(v) -> bool:
    return isinstance(v, str) and v != ""


def _positive_number(v) -> bool:       # inf included: --request-rate inf sends everything at once
    return is_number(v) and v > 0 or v == float("inf")


POSITIVE_NUMBER = {"parse": positive_float, "check": _positive_number, "what": "a positive number"}


@dataclass(frozen=True)
class ServeBenchConfig(WorkloadConfig):
    """The options of `rawinfer bench serve`: the server to load, the workload (WorkloadConfig's, a mixed
    one of long prompts: mixed.py, or multi-turn conversations: multiturn.py), the arrivals and the polling."""

    num_requests: int = option(200, **POSITIVE, help="requests to send (default: 200)")
    backend: str = option("zmq", parse=str, choices=("zmq", "openai"), check=lambda v: v in ("zmq", "openai"),
                          what="zmq or openai", help="zmq: the ZeroMQ protocol at --addr; openai: the OpenAI HTTP "
                                                     "API at --base-url (default: zmq)")
    addr: str = option(DEFAULT_ADDR, parse=str, metavar="ENDPOINT", check=_text, what="a ZeroMQ endpoint",
                       help=f"server endpoint of --backend zmq (default: {DEFAULT_ADDR})")
    base_url: str = option("http://127.0.0.1:8000", parse=str, metavar="URL", check=_text, what="a URL",
                           help="server of --backend openai, without /v1 (default: http://127.0.0.1:8000)")
    api_key: str | None = option(None, parse=str, metavar="KEY", check=optional(_text), what="a key or None",
                                 cli_default=api_key_default,
                                 help="API key of --backend openai (default: $RAWINFER_API_KEY, else none)")
    server_key: str | None = option(None, parse=str, metavar="FILE", check=optional(_text), what="a file or None",
                                    help="the server's public key when it uses CurveZMQ (default: none)")
    request_rate: float = option(float("inf"), **POSITIVE_NUMBER, metavar="RATE",
                                 help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    long_fraction: float = option(0.0, parse=mixed.fraction_argument, metavar="F", what="a number in [0, 1]",
                                  check=lambda v: is_number(v) and 0 <= v <= 1,
                                  help="share of the requests that are long prompts, at seeded random places "
                                       "(default: 0)")
    long_input_len: int = option(2048, **POSITIVE, help="prompt tokens of a long request (default: 2048)")
    long_output_len: int = option(32, **POSITIVE, help="tokens to generate for a long request (default: 32)")
    slo_ttft_ms: float = option(mixed.DEFAULT_SLO_TTFT_MS, **POSITIVE_NUMBER, metavar="MS",
                                help="goodput counts requests whose first token came within this "
                                     f"(default: {mixed.DEFAULT_SLO_TTFT_MS:g})")
    slo_itl_ms: float = option(mixed.DEFAULT_SLO_ITL_MS, **POSITIVE_NUMBER, metavar="MS",
                               help="... and whose every gap between tokens stayed within this "
                                    f"(default: {mixed.DEFAULT_SLO_ITL_MS:g})")
    conversations: int = option(0, **{**NONNEGATIVE, "metavar": "C"},
                                help="send C conversations whose turns resend the growing history, and report the "
                                     "server's prefix-cache hit rate; C * --turns requests, --num-requests is "
                                     "ignored (default: 0, off)")
    turns: int = option(4, **{**POSITIVE, "metavar": "T"},
                        help="turns per conversation; turn 1 is --input-len tokens (default: 4)")
    turn_input_len: int = option(64, **POSITIVE, help="new user tokens of each turn after the first, after the "
                                                      "previous prompt and output (default: 64)")
    stats_interval: float = option(0.25, **POSITIVE_NUMBER, metavar="SECONDS",
                                   help="seconds between polls of the server's stats (default: 0.25)")
    timeout: float = option(120.0, **POSITIVE_NUMBER, metavar="SECONDS",
                            help="a request fails when the server stays silent this long (default: 120)")
    warmup: bool = option(True, flag="--no-warmup", check=is_switch, what="True or False",
                          help="measure from the first request (default: one short request runs first, unmeasured)")


MIXED_FIELDS = ("long_fraction", "long_input_len", "long_output_len", "slo_ttft_ms", "slo_itl_ms")
MULTITURN_FIELDS = ("conversations", "turns", "turn_input_len")


def run_config(cfg) -> dict:
    """The config a report carries: the options but the API key."""
    return {k: v for k, v in asdict(cfg).items() if k != "api_key"}


@dataclass
class RequestRecord:
    """What the client saw of one request (times on the client's monotonic clock, relative to the start)."""
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)    # one entry per token
    message_times: list[float] = field(default_factory=list)  # arrival of each message that carried tokens
    finished: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    long: bool = False                                          # of the long-prompt class (mixed.py)
    conversation: int | None = None                             # multi-turn workload (multiturn.py): which one
    turn: int | None = None                                     # ... and which of its turns, from 1

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.message_times
        return [b - a for a, b in zip(t, t[1:])]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process at `rate` requests/s (exponential gaps), or all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(x) for x in np.cumsum(gaps) - gaps[0]]       # the first request leaves at once


async def _one(client, rec: RequestRecord, prompt: list[int], delay: float, t0: float, bar) -> list[int]:
    """Send `prompt` at t0 + delay and fill `rec` from its stream; the token ids it generated."""
    from rawinfer.frontends.client.client import ClientError
    await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
    rec.sent = time.monotonic() - t0
    rec.prompt_tokens = len(prompt)
    params = {"max_tokens": rec.max_tokens, "temperature": 0.0, "ignore_eos": True}
    generated: list[int] = []
    try:
        async for msg in client.generate(prompt, params=params, stream=True):
            now = time.monotonic() - t0
            if msg.token_ids:
                generated.extend(msg.token_ids)
                rec.token_times.extend([now] * len(msg.token_ids))
                rec.message_times.append(now)
                rec.output_tokens += len(msg.token_ids)
            if msg.finished:
                rec.finished, rec.finish_reason = now, msg.finish_reason
                rec.error = msg.error
    except ClientError as e:
        rec.error = str(e)
        rec.finished = time.monotonic() - t0
    bar.update(1)
    return generated


async def _poll_stats(client, t0: float, interval: float, samples: list[dict], stop: asyncio.Event) -> None:
    from rawinfer.frontends.client.client import ClientError
    while not stop.is_set():
        try:
            s = await client.stats()
            samples.append({"t": time.monotonic() - t0, "kv_usage": s.get("kv_usage"),
                            "running": s.get("running"), "waiting": s.get("waiting"),
                            "server_tokens_per_s": s.get("recent_tokens_per_s")})
        except ClientError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def run_load(args: ServeBenchConfig, progress: bool = False) -> dict:
    """Send the workload of the options of `rawinfer bench serve`; with progress, a bar of finished
    requests on stderr (when it is a terminal). A ValueError naming the field of a bad value."""
    check_options(args, "bench serve option")
    multiturn.check_options(args)
    if getattr(args, "backend", "zmq") == "openai":
        return await run_http_load(args, progress)
    from tqdm import tqdm

    from rawinfer.frontends.client.client import AsyncClient
    client = AsyncClient(args.addr, server_key=args.server_key, timeout_s=args.timeout)
    stats_client = AsyncClient(args.addr, server_key=args.server_key, timeout_s=args.timeout)
    try:
        info = await client.model_info()
        V, limit = int(info["vocab_size"]), int(info["max_model_len"])
        turns = multiturn.enabled(args)
        if turns:
            multiturn.check_fits(args, limit)
            n = args.conversations * args.turns
            convs = multiturn.plan(args, V, arrival_times(n, args.request_rate, args.seed + 1), RequestRecord)
            records, prompts = [r for c in convs for r in c.records], [c.first_prompt for c in convs]
        else:
            mixed.check_mixed_lengths(args, limit)
            wl, is_long = mixed.make_mixed_workload(args, V)
            records, prompts = [RequestRecord(len(p), max(1, min(n, limit - len(p))), long=g)
                                for p, n, g in zip(wl.prompts, wl.output_lens, is_long)], wl.prompts
            delays = arrival_times(args.num_requests, args.request_rate, args.seed + 1)
        if args.warmup:
            await client.complete(list(prompts[0][:8]), params={"max_tokens": 4, "temperature": 0.0})
        first = await stats_client.stats()
        before = multiturn.cache_snapshot(first) if turns else None
        samples: list[dict] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        poller = asyncio.create_task(_poll_stats(stats_client, t0, args.stats_interval, samples, stop))
        with tqdm(total=len(records), desc="requests", unit="req", leave=False,
                  disable=None if progress else True) as bar:
            if turns:
                def send(rec, prompt, delay):
                    return _one(client, rec, prompt, delay, t0, bar)
                await asyncio.gather(*(multiturn.converse(c, send, bar) for c in convs))
            else:
                await asyncio.gather(*(_one(client, r, p, d, t0, bar) for r, p, d in zip(records, prompts, delays)))
        duration = time.monotonic() - t0
        stop.set()
        await poller
        last = await stats_client.stats()
        after = multiturn.cache_snapshot(last) if turns else None
    finally:
        client.close()
        stats_client.close()
    config = run_config(args)
    config.update(model=info.get("model"), device=info.get("device"), kv_blocks_total=info.get("kv_blocks_total"))
    result = summarize_run(records, duration, samples, config)
    if turns:
        result["multi_turn"] = multiturn.report(records, args.conversations, args.turns, before, after)
    result["kv_transfer"] = mixed.kv_transfer_report(first, last, duration)
    result["speculative"] = speculative.run_report(speculative.totals(first), speculative.totals(last))
    return result


async def run_http_load(args: ServeBenchConfig, progress: bool = False) -> dict:
    """run_load over the OpenAI HTTP API at args.base_url (http_load.py)."""
    import httpx
    from tqdm import tqdm

    from rawinfer.frontends.bench import http_load
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=args.base_url, headers=http_load.headers(args.api_key), limits=limits,
                               timeout=httpx.Timeout(args.timeout, connect=10.0))
    try:
        card = await http_load.model_card(client)
        V, limit = int(card["vocab_size"]), int(card["max_model_len"])
        mixed.check_mixed_lengths(args, limit)
        wl, is_long = mixed.make_mixed_workload(args, V)
        if args.warmup:
            r = await client.post("/v1/completions", json={"model": card["id"], "prompt": [int(t) for t in
                                  wl.prompts[0][:8]], "max_tokens": 4, "temperature": 0.0})
            r.raise_for_status()
        records = [RequestRecord(len(p), max(1, min(n, limit - len(p))), long=g)
                   for p, n, g in zip(wl.prompts, wl.output_lens, is_long)]
        delays = arrival_times(args.num_requests, args.request_rate, args.seed + 1)
        spec0 = await http_load.spec_totals(client)
        samples: list[dict] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        poller = asyncio.create_task(http_load.poll_metrics(client, t0, args.stats_interval, samples, stop))
        with tqdm(total=len(records), desc="requests", unit="req", leave=False,
                  disable=None if progress else True) as bar:
            sends = (http_load.one_request(client.base_url, args.api_key, card["id"], r, p, d, t0, bar, args.timeout)
                     for r, p, d in zip(records, wl.prompts, delays))
            await asyncio.gather(*sends)
        duration = time.monotonic() - t0
        stop.set()
        await poller
        spec = speculative.run_report(spec0, await http_load.spec_totals(client))
    finally:
        await client.aclose()
    config = run_config(args)
    config.update(model=card.get("id"), device=None, kv_blocks_total=None)
    return {**summarize_run(records, duration, samples, config), "speculative": spec}


def summarize_run(records: list[RequestRecord], duration: float, samples: list[dict], config: dict) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    # output tokens/s over time, from the client's token arrival times, in bins of --stats-interval: the
    # period the server's stats are sampled at, so that both lines of the figure's panel share it
    width = float(config.get("stats_interval") or max(duration / 40, 0.05))
    edges = np.arange(0.0, duration + width, width)
    counts, _ = np.histogram([t for r in ok for t in r.token_times], bins=edges)
    return {
        "config": config,
        "duration_s": duration,
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error or f"finish_reason {r.finish_reason}" for r in records if not r.ok})[:10],
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": summarize([r.ttft for r in ok], 1000), "tpot_ms": summarize([r.tpot for r in ok], 1000),
        "itl_ms": summarize([g for r in ok for g in r.itls], 1000), "e2e_ms": summarize([r.e2e for r in ok], 1000),
        "timeline": {"t": [float(x) for x in edges[:-1]], "output_tokens_per_s": [float(c / width) for c in counts],
                     "stats": samples},
        **mixed.slo_report(records, duration, config),
        "requests": [asdict(r) | {"ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot} for r in records],
    }


def _ms(d: dict) -> str:
    if d.get("mean") is None:
        return "n/a"
    return f"mean {d['mean']:8.1f} | p50 {d['p50']:8.1f} | p99 {d['p99']:8.1f}"


def print_report(r: dict, file=sys.stdout) -> None:
    rate = r["config"]["request_rate"]
    print(f"request rate:            {'all at once' if math.isinf(rate) else f'{rate:g} req/s (Poisson)'}", file=file)
    print(f"completed / failed:      {r['completed']} / {r['failed']}", file=file)
    for e in r["errors"]:
        print(f"  error: {e}", file=file)
    print(f"duration:                {r['duration_s']:.2f} s", file=file)
    print(f"requests/s:              {r['requests_per_s']:.2f}", file=file)
    print(f"output tokens/s:         {r['output_tokens_per_s']:.1f}", file=file)
    print(f"total tokens/s:          {r['total_tokens_per_s']:.1f}", file=file)
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")):
        print(f"{name + ' (ms):':<25}{_ms(r[key])}", file=file)
    mixed.print_slo_report(r, file)
    if r.get("multi_turn"):
        multiturn.print_report(r["multi_turn"], file)
    mixed.print_kv_transfer(r.get("kv_transfer"), file)
    speculative.print_report(r.get("speculative"), file, width=25)
