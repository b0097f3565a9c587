"""`rawinfer bench throughput | serve | roofline | step-overhead`: their options, and running them with results
to files.

The measuring lives in frontends/bench/ (which imports nothing from cli/), and so do the dataclasses whose
fields are each benchmark's own flags; this module builds the engine or reaches the server from the options, calls it, and writes the JSON (and figure) it makes into
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
                                        is_quiet)
from rawinfer.settings import add_options, options_from_args, specs, user_cache_dir


def default_output_dir() -> str:
    return os.path.join(user_cache_dir(), "bench")


def _add_output(p, figure: bool = False) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="folder for the result files, named by the benchmark and the time "
                        "(default: bench/ in the user cache, ~/.cache/rawinfer/bench or $RAWINFER_CACHE/bench)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the JSON result here instead (default: none)")
    if figure:
        g.add_argument("--figure", default=None, metavar="PATH",
                       help="write the PNG figure here instead; '' for no figure (default: none)")


def _add_fields(p, cls, names: tuple[str, ...], title: str | None = None) -> None:
    """The flags of cls's fields `names` (settings.option), in a group of their own when titled, else among the
    command's options; every other field is left to another call."""
    add_options(p.add_argument_group(title) if title else p, cls,
                skip=tuple(name for name, _ in specs(cls) if name not in names))


def _own_fields(cls, *groups: tuple[str, ...]) -> tuple[str, ...]:
    """cls's option fields in none of `groups`: the command's own options."""
    return tuple(name for name, _ in specs(cls) if not any(name in g for g in groups))


def add_parser(sub) -> None:
    """The bench commands; their own options are generated from the fields (settings.option) of
    ThroughputConfig, ServeBenchConfig, RooflineConfig and StepOverheadConfig, imported when the bench
    commands are built."""
    from rawinfer.frontends.bench.serve import MIXED_FIELDS, MULTITURN_FIELDS, ServeBenchConfig
    from rawinfer.frontends.bench.throughput import WORKLOAD_FIELDS, ThroughputConfig
    p = add_command(sub, "bench", "benchmarks: throughput, serve, roofline, step-overhead")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    t = add_command(bsub, "throughput", "offline: N requests submitted at once to a local engine")
    _add_fields(t, ThroughputConfig, WORKLOAD_FIELDS, "workload")
    _add_fields(t, ThroughputConfig, _own_fields(ThroughputConfig, WORKLOAD_FIELDS))
    _add_output(t)
    add_engine_args(t)
    t.set_defaults(func=cmd_throughput)

    s = add_command(bsub, "serve", "online: Poisson load against a running `rawinfer serve`")
    _add_fields(s, ServeBenchConfig, ("backend", "addr", "base_url", "api_key", "server_key"))
    _add_fields(s, ServeBenchConfig, WORKLOAD_FIELDS, "workload")
    _add_fields(s, ServeBenchConfig, ("request_rate",))
    _add_fields(s, ServeBenchConfig, MIXED_FIELDS, "mixed workload and service-level objectives")
    _add_fields(s, ServeBenchConfig, MULTITURN_FIELDS, "multi-turn conversations")
    _add_fields(s, ServeBenchConfig, ("stats_interval", "timeout", "warmup"))
    _add_output(s, figure=True)
    s.set_defaults(func=cmd_serve_bench)

    r = add_command(bsub, "roofline", "machine ceilings vs achieved prefill/decode FLOP/s and bytes/s")
    from rawinfer.frontends.bench.roofline import RooflineConfig
    _add_fields(r, RooflineConfig, _own_fields(RooflineConfig))
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
    from rawinfer.frontends.bench.step_overhead import StepOverheadConfig
    _add_fields(o, StepOverheadConfig, _own_fields(StepOverheadConfig))
    _add_output(o)
    add_engine_args(o)
    o.set_defaults(func=cmd_step_overhead)


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


def _bench_config(cls, args):
    """cls from the parsed arguments (settings.options_from_args): CLIError naming the flag of a bad value."""
    try:
        return options_from_args(cls, args, "bench option")
    except ValueError as e:
        raise CLIError(str(e)) from None


def cmd_throughput(args) -> int:
    from rawinfer.frontends.bench import throughput
    cfg = _bench_config(throughput.ThroughputConfig, args)
    _output_path(args, "throughput", "json", args.json)          # a bad folder fails before the run
    engine = open_engine(args)
    result = {"config": _config(args)}
    result.update(throughput.run(engine, cfg, progress=not is_quiet(args)))
    _write_json(args, "throughput", result)
    return 0


def cmd_serve_bench(args) -> int:
    import asyncio

    from rawinfer.frontends.bench import figure, multiturn, serve
    cfg = _bench_config(serve.ServeBenchConfig, args)
    multiturn.check_options(cfg)
    _output_path(args, "serve", "json", args.json)
    draw = args.figure != "" and figure.available()       # said before the run, not after it
    if cfg.backend == "openai":
        _check_http(cfg.base_url, cfg.api_key)
    else:
        ping_server(cfg.addr, cfg.server_key)
    r = asyncio.run(serve.run_load(cfg, progress=not is_quiet(args)))
    serve.print_report(r)
    rate = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate   # JSON has no infinity
    given = {k: v for k, v in _config(args).items() if k != "api_key"}     # the results' options too (--json)
    path = _write_json(args, "serve", {**r, "config": {**given, **r["config"], "request_rate": rate}})
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
    cfg = _bench_config(roofline.RooflineConfig, args)
    if max(cfg.batches) > args.max_num_seqs:
        raise CLIError(f"--batch {max(cfg.batches)} is more than --max-num-seqs {args.max_num_seqs}: a decode step "
                       "cannot hold it; raise --max-num-seqs or lower --batch")
    _output_path(args, "roofline", "json", args.json)
    engine = open_engine(args)
    if cfg.workload is not None and cfg.workload[0] > args.max_num_seqs:
        raise CLIError(f"--workload of {cfg.workload[0]} requests is more than --max-num-seqs {args.max_num_seqs}: "
                       "they would not run as one batch; raise --max-num-seqs or send fewer")
    r = roofline.report(engine, cfg, progress=not is_quiet(args))
    roofline.print_report(r)
    _write_json(args, "roofline", r)
    return 0


def cmd_step_overhead(args) -> int:
    from rawinfer.frontends.bench import step_overhead
    _output_path(args, "step-overhead", "json", args.json)
    # without --model the float32 default, which a GPU engine runs: its host work is what overlap must hide
    bench = _bench_config(step_overhead.StepOverheadConfig, args)
    path = resolve_model(args.model, progress=not is_quiet(args), device="cuda")
    cfg = engine_config_from_args(args)
    try:
        cfg = step_overhead.engine_config(path, cfg, bench.batch_sizes, bench.prompt_len,
                                          bench.warmup_steps + bench.steps)
    except ValueError as e:
        raise CLIError(str(e)) from None
    r = step_overhead.run(path, cfg, bench, progress=not is_quiet(args), freeze=True)
    step_overhead.print_report(r)
    _write_json(args, "step-overhead", {**r, "config": _config(args)})
    return 0
