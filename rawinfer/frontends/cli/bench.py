"""`rawinfer bench throughput | serve | roofline | step-overhead`: their options, and running them with results
to files.

The measuring lives in frontends/bench/ (which imports nothing from cli/); this module builds the engine
or reaches the server from the options, calls it, and writes the JSON (and figure) it makes into
--output-dir (default: the user cache's bench/ folder, outside any checkout), one file per run named by
the benchmark and the time, unless --json / --figure name a file.
"""

from __future__ import annotations

import json
import math
import os
import time

from rawinfer.frontends.cli.connect import ping_server
from rawinfer.frontends.cli.models import open_engine, resolve_model
from rawinfer.frontends.options import (EXIT_FAILED, CLIError, add_command, add_engine_args, engine_config_from_args,
                                        is_quiet, nonnegative_int, positive_float, positive_int)
from rawinfer.frontends.server.protocol import DEFAULT_ADDR
from rawinfer.settings import api_key_default, user_cache_dir


def default_output_dir() -> str:
    return os.path.join(user_cache_dir(), "bench")


def _range_ratio(text: str) -> float:
    import argparse
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def _workload_spec(text: str):
    """--workload NxP/O (e.g. 64x128/128) -> (N, P, O); "0" -> None."""
    import argparse
    import re
    if text.strip() == "0":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise argparse.ArgumentTypeError(f"expected N x P / O with positive integers, e.g. 64x128/128 (or 0 to skip); "
                                         f"got {text!r}")
    return tuple(int(g) for g in m.groups())


def _add_output(p, figure: bool = False) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="folder for the result files, named by the benchmark and the time "
                        "(default: bench/ in the user cache, ~/.cache/rawinfer/bench or $RAWINFER_CACHE/bench)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the JSON result here instead (default: none)")
    if figure:
        g.add_argument("--figure", default=None, metavar="PATH",
                       help="write the PNG figure here instead; '' for no figure (default: none)")


def _add_workload(p, num_requests: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=positive_int, default=num_requests, metavar="N",
                   help=f"requests to send (default: {num_requests})")
    g.add_argument("--input-len", type=positive_int, default=128, metavar="N",
                   help="prompt tokens per request, random ids (default: 128)")
    g.add_argument("--output-len", type=positive_int, default=128, metavar="N",
                   help="tokens to generate per request, end-of-sequence ignored (default: 128)")
    g.add_argument("--range-ratio", type=_range_ratio, default=0.0, metavar="R",
                   help="draw lengths uniformly in len*(1-R) .. len*(1+R) (default: 0, fixed lengths)")
    g.add_argument("--seed", type=nonnegative_int, default=0, metavar="N",
                   help="seed of the random prompts and lengths (default: 0)")


def _fraction(text: str) -> float:
    import argparse
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def _add_mixed(p) -> None:
    from rawinfer.frontends.bench.mixed import DEFAULT_SLO_ITL_MS, DEFAULT_SLO_TTFT_MS
    g = p.add_argument_group("mixed workload and service-level objectives")
    g.add_argument("--long-fraction", type=_fraction, default=0.0, metavar="F",
                   help="share of the requests that are long prompts, at seeded random places (default: 0)")
    g.add_argument("--long-input-len", type=positive_int, default=2048, metavar="N",
                   help="prompt tokens of a long request (default: 2048)")
    g.add_argument("--long-output-len", type=positive_int, default=32, metavar="N",
                   help="tokens to generate for a long request (default: 32)")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=DEFAULT_SLO_TTFT_MS, metavar="MS",
                   help=f"goodput counts requests whose first token came within this (default: {DEFAULT_SLO_TTFT_MS:g})")
    g.add_argument("--slo-itl-ms", type=positive_float, default=DEFAULT_SLO_ITL_MS, metavar="MS",
                   help="... and whose every gap between tokens stayed within this "
                        f"(default: {DEFAULT_SLO_ITL_MS:g})")


def _add_multiturn(p) -> None:
    g = p.add_argument_group("multi-turn conversations")
    g.add_argument("--conversations", type=nonnegative_int, default=0, metavar="C",
                   help="send C conversations whose turns resend the growing history, and report the server's "
                        "prefix-cache hit rate; C * --turns requests, --num-requests is ignored (default: 0, off)")
    g.add_argument("--turns", type=positive_int, default=4, metavar="T",
                   help="turns per conversation; turn 1 is --input-len tokens (default: 4)")
    g.add_argument("--turn-input-len", type=positive_int, default=64, metavar="N",
                   help="new user tokens of each turn after the first, after the previous prompt and output "
                        "(default: 64)")


def add_parser(sub) -> None:
    p = add_command(sub, "bench", "benchmarks: throughput, serve, roofline, step-overhead")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    t = add_command(bsub, "throughput", "offline: N requests submitted at once to a local engine")
    _add_workload(t, 64)
    t.add_argument("--shared-prefix", type=nonnegative_int, default=0, metavar="N",
                   help="tokens of a prefix common to every prompt (default: 0)")
    t.add_argument("--compare-single", action="store_true",
                   help="first measure one request alone and report the batched/single ratio (default: off)")
    t.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure from the first request (default: two short requests run first, unmeasured)")
    t.add_argument("--structured-output", action="store_true",
                   help="run the workload twice: unconstrained, then every request constrained by a JSON schema "
                        "(structured_outputs), and report the ratio, the grammar's compile and mask times (default: off)")
    _add_output(t)
    add_engine_args(t)
    t.set_defaults(func=cmd_throughput)

    s = add_command(bsub, "serve", "online: Poisson load against a running `rawinfer serve`")
    s.add_argument("--backend", choices=("zmq", "openai"), default="zmq",
                   help="zmq: the ZeroMQ protocol at --addr; openai: the OpenAI HTTP API at --base-url (default: zmq)")
    s.add_argument("--addr", default=DEFAULT_ADDR, metavar="ENDPOINT",
                   help=f"server endpoint of --backend zmq (default: {DEFAULT_ADDR})")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL",
                   help="server of --backend openai, without /v1 (default: http://127.0.0.1:8000)")
    s.add_argument("--api-key", default=api_key_default(), metavar="KEY",
                   help="API key of --backend openai (default: $RAWINFER_API_KEY, else none)")
    s.add_argument("--server-key", default=None, metavar="FILE",
                   help="the server's public key when it uses CurveZMQ (default: none)")
    _add_workload(s, 200)
    s.add_argument("--request-rate", type=positive_float, default=float("inf"), metavar="RATE",
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    _add_mixed(s)
    _add_multiturn(s)
    s.add_argument("--stats-interval", type=positive_float, default=0.25, metavar="SECONDS",
                   help="seconds between polls of the server's stats (default: 0.25)")
    s.add_argument("--timeout", type=positive_float, default=120.0, metavar="SECONDS",
                   help="a request fails when the server stays silent this long (default: 120)")
    s.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure from the first request (default: one short request runs first, unmeasured)")
    _add_output(s, figure=True)
    s.set_defaults(func=cmd_serve_bench)

    r = add_command(bsub, "roofline", "machine ceilings vs achieved prefill/decode FLOP/s and bytes/s")
    r.add_argument("--prompt-len", type=positive_int, default=500, metavar="N",
                   help="prefill length in tokens (default: 500)")
    r.add_argument("--batch", type=positive_int, action="append", default=None, metavar="B",
                   help="decode batch size, repeatable (default: 1 and 64)")
    r.add_argument("--context", type=positive_int, default=128, metavar="N",
                   help="cached tokens per decoding sequence (default: 128)")
    r.add_argument("--workload", type=_workload_spec, default=(64, 128, 128), metavar="NxP/O",
                   help="last, N requests of P prompt + O output tokens at once, timed whole and set against "
                        "the float32 GEMM ceiling; 0 skips it (default: 64x128/128)")
    _add_output(r)
    add_engine_args(r)
    r.set_defaults(func=cmd_roofline)

    _add_step_overhead(bsub)


def _add_step_overhead(bsub) -> None:
    about = ("The engine's host time per decode step (scheduling, the step plan, sampling, outputs), at each batch "
             "size, with a backend whose ops return at once: what overlapped scheduling must hide behind a GPU's "
             "step. The engine options shape the scheduler (block size, step budget, prefix caching); the device "
             "options have no effect. Without --model: the float32 default model, as a GPU engine runs it.")
    o = add_command(bsub, "step-overhead", "the engine's host time per decode step, over a backend whose ops do "
                                           "nothing", description=about)
    o.add_argument("--batch-sizes", type=_batch_sizes, default=(1, 64, 256), metavar="B,B,...",
                   help="decoding sequences per step, each measured in turn (default: 1,64,256; --max-num-seqs is "
                        "raised to the largest)")
    o.add_argument("--steps", type=positive_int, default=200, metavar="N",
                   help="timed steps per batch size (default: 200)")
    o.add_argument("--warmup-steps", type=nonnegative_int, default=20, metavar="N",
                   help="decode steps before the timed ones (default: 20)")
    o.add_argument("--prompt-len", type=positive_int, default=128, metavar="N",
                   help="prompt tokens per request, random ids (default: 128)")
    o.add_argument("--seed", type=nonnegative_int, default=0, metavar="N", help="seed of the prompts (default: 0)")
    _add_output(o)
    add_engine_args(o)
    o.set_defaults(func=cmd_step_overhead)


def _batch_sizes(text: str) -> tuple[int, ...]:
    import argparse
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. 1,64,256; got {text!r}")
    return sizes


def _output_path(args, kind: str, ext: str, given: str | None) -> str:
    """--json / --figure when given, else a fresh file in --output-dir."""
    if given:
        folder = os.path.dirname(os.path.abspath(given))
        path = given
        if os.path.isdir(given):      # checked before the run: a finished benchmark is not thrown away
            raise CLIError(f"{given!r} is a folder: name a file for --json / --figure, or give --output-dir")
    else:
        folder = args.output_dir or default_output_dir()
        path = os.path.join(folder, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.{ext}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot create the output folder {folder!r} ({e.strerror}); give a writable --output-dir")
    if not os.access(folder, os.W_OK):
        raise CLIError(f"the output folder {folder!r} is not writable; give a writable --output-dir or path")
    return path


def _write_json(args, kind: str, result: dict) -> str:
    path = _output_path(args, kind, "json", args.json)
    try:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    except OSError as e:              # the disk is full, ...: the results go to stdout rather than nowhere
        print(json.dumps(result, indent=1))
        raise CLIError(f"cannot write {path!r} ({e.strerror}); the results are printed above", EXIT_FAILED) from None
    print(f"wrote {path}")
    return path


def _config(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def cmd_throughput(args) -> int:
    from rawinfer.frontends.bench import throughput
    _output_path(args, "throughput", "json", args.json)          # a bad folder fails before the run
    engine = open_engine(args)
    result = {"config": _config(args)}
    result.update(throughput.run(engine, args, progress=not is_quiet(args)))
    _write_json(args, "throughput", result)
    return 0


def cmd_serve_bench(args) -> int:
    import asyncio

    from rawinfer.frontends.bench import figure, multiturn, serve
    multiturn.check_options(args)
    _output_path(args, "serve", "json", args.json)
    draw = args.figure != "" and figure.available()       # said before the run, not after it
    if args.backend == "openai":
        _check_http(args.base_url, args.api_key)
    else:
        ping_server(args.addr, args.server_key)
    r = asyncio.run(serve.run_load(args, progress=not is_quiet(args)))
    serve.print_report(r)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate   # JSON has no infinity
    path = _write_json(args, "serve", {**r, "config": {**r["config"], "request_rate": rate}})
    if draw:
        fig = args.figure or os.path.splitext(path)[0] + ".png"
        fig = fig if fig.lower().endswith(".png") else fig + ".png"     # what matplotlib writes
        figure.plot(r, _output_path(args, "serve", "png", fig))
        print(f"wrote {fig}")
    if r["failed"]:
        raise CLIError(f"{r['failed']} of {r['failed'] + r['completed']} requests failed; first error: "
                       f"{(r['errors'] or ['unknown'])[0]}", EXIT_FAILED)
    return 0


def _check_http(base_url: str, api_key: str | None) -> None:
    """CLIError (exit 1) unless an OpenAI-compatible server answers GET /v1/models at base_url within seconds."""
    import httpx
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=3.0,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise CLIError(f"no HTTP server answered at {base_url} ({type(e).__name__}): start one with `rawinfer serve`, "
                       "or check --base-url", EXIT_FAILED) from None
    if r.status_code != 200:
        raise CLIError(f"{base_url}/v1/models answered {r.status_code}: {r.text[:200]} (an API key? --api-key)",
                       EXIT_FAILED)


def cmd_roofline(args) -> int:
    from rawinfer.frontends.bench import roofline
    if not args.batch:
        args.batch = [1, 64]
    if max(args.batch) > args.max_num_seqs:
        raise CLIError(f"--batch {max(args.batch)} is more than --max-num-seqs {args.max_num_seqs}: a decode step "
                       "cannot hold it; raise --max-num-seqs or lower --batch")
    _output_path(args, "roofline", "json", args.json)
    engine = open_engine(args)
    if args.workload is not None and args.workload[0] > args.max_num_seqs:
        raise CLIError(f"--workload of {args.workload[0]} requests is more than --max-num-seqs {args.max_num_seqs}: "
                       "they would not run as one batch; raise --max-num-seqs or send fewer")
    r = roofline.report(engine, args.prompt_len, args.batch, args.context, progress=not is_quiet(args),
                        workload=args.workload)
    roofline.print_report(r)
    _write_json(args, "roofline", r)
    return 0


def cmd_step_overhead(args) -> int:
    from rawinfer.frontends.bench import step_overhead
    _output_path(args, "step-overhead", "json", args.json)
    # without --model the float32 default, which a GPU engine runs: its host work is what overlap must hide
    path = resolve_model(args.model, progress=not is_quiet(args), device="cuda")
    cfg = engine_config_from_args(args)
    try:
        cfg = step_overhead.engine_config(path, cfg, args.batch_sizes, args.prompt_len, args.warmup_steps + args.steps)
    except ValueError as e:
        raise CLIError(str(e)) from None
    r = step_overhead.run(path, cfg, args.batch_sizes, args.steps, args.warmup_steps, args.prompt_len, args.seed,
                          progress=not is_quiet(args), freeze=True)
    step_overhead.print_report(r)
    _write_json(args, "step-overhead", {**r, "config": _config(args)})
    return 0
