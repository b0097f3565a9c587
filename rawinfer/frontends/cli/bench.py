"""`rawinfer bench throughput | serve | roofline`: their options, and running them with results to files.

The measuring lives in frontends/bench/ (which imports nothing from cli/); this module builds the engine
or reads the server's address from the options, calls it, and writes the JSON (and figure) it asks for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rawinfer.frontends.options import CLIError, add_engine_args, engine_config_from_args
from rawinfer.frontends.server.protocol import DEFAULT_ADDR


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, serve, roofline")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    t = bsub.add_parser("throughput", help="offline: N requests submitted at once",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in len*(1±r); 0 = fixed")
    t.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix common to every prompt")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--compare-single", action="store_true",
                   help="first measure one request alone and report the batched/single ratio")
    t.add_argument("--no-warmup", dest="warmup", action="store_false")
    t.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    add_engine_args(t)
    t.set_defaults(func=cmd_throughput)

    s = bsub.add_parser("serve", help="online: Poisson load against a running `rawinfer serve`",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--addr", default=DEFAULT_ADDR, help="server endpoint")
    s.add_argument("--server-key", default=None, metavar="FILE", help="server public key (CurveZMQ)")
    s.add_argument("--num-requests", type=int, default=200)
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson), or inf")
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    s.add_argument("--output-len", type=int, default=128, help="tokens to generate (EOS ignored)")
    s.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in len*(1±r); 0 = fixed")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stats-interval", type=float, default=0.25, help="seconds between `stats` polls")
    s.add_argument("--timeout", type=float, default=120.0, help="per-request silence limit in seconds")
    s.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the short warm-up request")
    s.add_argument("--json", default="bench-serve.json", metavar="PATH", help="result file")
    s.add_argument("--figure", default="bench-serve.png", metavar="PATH", help="PNG figure ('' for none)")
    s.set_defaults(func=cmd_serve_bench)

    r = bsub.add_parser("roofline", help="machine ceilings vs achieved prefill/decode FLOP/s and bytes/s")
    r.add_argument("--prompt-len", type=int, default=500, help="prefill length (default 500)")
    r.add_argument("--batch", type=int, action="append", default=None,
                   help="decode batch size (repeatable; default 1 and 64)")
    r.add_argument("--context", type=int, default=128, help="cached tokens per decoding sequence (default 128)")
    r.add_argument("--json", default=None, metavar="PATH")
    add_engine_args(r)
    r.set_defaults(func=cmd_roofline)


def cmd_throughput(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.frontends.bench import throughput
    engine = LLMEngine(args.model, engine_config_from_args(args))
    result = {"config": {k: v for k, v in vars(args).items() if k != "func"}}
    result.update(throughput.run(engine, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def cmd_serve_bench(args) -> int:
    import asyncio

    from rawinfer.frontends.bench import serve
    if args.num_requests < 1:
        raise CLIError("--num-requests must be at least 1")
    if not args.request_rate > 0:
        raise CLIError("--request-rate must be positive (or inf to send everything at once)")
    r = asyncio.run(serve.run_load(args))
    serve.print_report(r)
    with open(args.json, "w") as f:      # JSON has no infinity: an unbounded rate is written as "inf"
        rate = "inf" if math.isinf(args.request_rate) else args.request_rate
        json.dump({**r, "config": {**r["config"], "request_rate": rate}}, f, indent=1)
    print(f"wrote {args.json}")
    if args.figure:
        try:
            serve.plot(r, args.figure)
            print(f"wrote {args.figure}")
        except ImportError:
            print("rawinfer: no figure: install matplotlib (pip install matplotlib) to get one", file=sys.stderr)
    return 0 if r["completed"] else 1


def cmd_roofline(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.frontends.bench import roofline
    if not args.batch:
        args.batch = [1, 64]
    engine = LLMEngine(args.model, engine_config_from_args(args))
    r = roofline.report(engine, args.prompt_len, args.batch, args.context)
    roofline.print_report(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
