"""`rawinfer warmup`: compile (or load from the user's kernel cache) everything a model and configuration
run, ahead of the first `generate` or `serve` on this machine."""

from __future__ import annotations

import time

from rawinfer.frontends.options import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("warmup", help="compile the kernels a model will use, ahead of time (cached per machine)")
    add_engine_args(p)
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args) -> int:
    from rawinfer.engine.engine import LLMEngine
    t0 = time.monotonic()
    engine = LLMEngine(args.model, engine_config_from_args(args))
    where = getattr(engine.backend, "kernel_cache", None)
    print(f"{engine.backend.name} kernels for {args.model} ready in {time.monotonic() - t0:.1f} s"
          + (f" (cached in {where})" if where else ""))
    return 0
