"""`rawinfer warmup`: compile (or load from the user's kernel cache) everything a model and configuration
run, ahead of the first `generate` or `serve` on this machine."""

from __future__ import annotations

import time

from rawinfer.frontends.cli.models import open_engine
from rawinfer.frontends.options import add_command, add_engine_args


def add_parser(sub) -> None:
    p = add_command(sub, "warmup", "compile the kernels a model will use, ahead of time (cached per machine)")
    add_engine_args(p)
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args) -> int:
    t0 = time.monotonic()
    engine = open_engine(args)
    where = engine.backend.kernel_cache
    print(f"{engine.backend.name} kernels for {engine.model_dir} ready in {time.monotonic() - t0:.1f} s"
          + (f" (cached in {where})" if where else ""))
    return 0
