"""The `rawinfer` command line: its parser (one module per command group registers its commands) and main(),
which turns every error a user can act on into one line and an exit status that says what happened."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from rawinfer.backend.select import DeviceUnavailableError
from rawinfer.config import VERSION, ModelFormatError
from rawinfer.frontends.cli import bench, chat, convert, fetch, generate, models, serve, warmup
from rawinfer.frontends.options import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CLIError, Parser,
                                        size_cpu_pool)
from rawinfer.frontends.client.core import RequestError

# the server's error codes for a request refused because of what the user sent (exit status 2, not 1)
REFUSED_INPUT = ("rejected", "invalid_params", "invalid_prompt", "invalid_message", "duplicate_request_id")

EPILOG = """exit status: 0 done; 1 the run failed (no server answered, a request was aborted or failed, a
benchmark request failed); 2 bad usage or input (a flag, a model path, a prompt); 130 interrupted.
-q and -v may also follow the command. `rawinfer COMMAND --help` describes a command's flags."""


# every command group: the names of its commands, and what adds them to the parser
COMMANDS = ((("generate",), generate.add_parser), (("chat",), chat.add_parser),
            (("serve", "client", "keygen", "scale"), serve.add_parsers), (("models",), models.add_parser),
            (("fetch",), fetch.add_parser), (("convert",), convert.add_parser), (("bench",), bench.add_parser),
            (("warmup",), warmup.add_parser))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command`'s group alone: adding the others' options imports what
    they run (ZeroMQ, the disaggregation link, the benchmarks), which a one-shot command would wait for."""
    parser = Parser(prog="rawinfer", description="A readable LLM inference engine.", epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rawinfer {VERSION}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and a traceback on errors")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="only warnings and errors on stderr: no progress bars, no summary line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for names, add in COMMANDS:
        if command is None or command in names:
            add(sub)
    return parser


def named_command(argv: list[str]) -> str | None:
    """The command argv names (its first word that is not an option; the options before a command take no
    value), or None when that is no command's name (the whole parser then says what is wrong)."""
    words = [a for a in argv if not a.startswith("-")]
    known = {name for names, _ in COMMANDS for name in names}
    return words[0] if words and words[0] in known else None


def main(argv: list[str] | None = None) -> int:
    # What the imports made (modules, classes) lives as long as the process: out of the collector's sight,
    # so that its full collections, set off again and again by a start's allocations, stop walking it
    gc.freeze()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(named_command(argv))
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="rawinfer: %(message)s", stream=sys.stderr)
    size_cpu_pool(getattr(args, "num_threads", None))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\nrawinfer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:              # the reader of stdout went away (`| head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as e:
        if args.verbose:
            raise
        code = error_status(e)
        if code is None:
            raise
        if isinstance(e, MemoryError):
            e = f"not enough memory ({e or 'an allocation failed'}); lower --kv-cache-memory or --max-num-batched-tokens"
        print(f"rawinfer: error: {e}", file=sys.stderr)
        return code


def error_status(e: BaseException) -> int | None:
    """The exit status of an error a user can act on; None for a bug (its traceback is printed)."""
    if isinstance(e, CLIError):
        return e.code
    if isinstance(e, MemoryError):       # the memory pool catches its own; this is any other allocation
        return EXIT_USAGE
    if isinstance(e, (ModelFormatError, ValueError, OSError, DeviceUnavailableError)):
        return EXIT_USAGE
    if isinstance(e, RequestError) and e.code in REFUSED_INPUT:   # the server refused what the user gave
        return EXIT_USAGE
    if isinstance(e, RuntimeError):      # the client library's errors (ClientError), a failed engine step
        return EXIT_FAILED
    return None


if __name__ == "__main__":
    sys.exit(main())
