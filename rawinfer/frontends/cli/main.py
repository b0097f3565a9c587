"""The `rawinfer` command line: its parser (one module per command group registers its commands) and main()."""

from __future__ import annotations

import argparse
import logging
import sys

from rawinfer.config import ModelFormatError
from rawinfer.frontends.cli import bench, convert, generate, serve, warmup
from rawinfer.frontends.options import CLIError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rawinfer", description="A readable LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    convert.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parsers(sub)               # serve, client, keygen
    warmup.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="rawinfer: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("rawinfer: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ModelFormatError, ValueError, RuntimeError, OSError) as e:
        if args.verbose:
            raise
        print(f"rawinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
