"""The option groups every command shares (engine, sampling, the prompt), the parser they live in, and
CLIError, the one-line user error.

A leaf of the front-end layer: it imports only the shared vocabulary (config, sampling), so the command
modules in cli/ and the benchmarks in bench/ can both use it without importing each other.

Conventions every command follows: each flag has help text that states its default once (the parser
adds none of its own); sizes and counts are checked by the argparse `type` functions below, so a bad
value is one line naming the flag; -q / -v work before or after the subcommand (`common` is a parent
of every subcommand's parser).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rawinfer.config import DEFAULT_MODEL, EngineConfig
from rawinfer.settings import add_options, options_from_args, parse_size
from rawinfer.sampling import SamplingParams

log = logging.getLogger("rawinfer")

# Exit statuses of the `rawinfer` command (main.py; listed in `rawinfer --help`).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CLIError(Exception):
    """A user error reported as one line; `code` is the exit status (EXIT_USAGE for bad input or usage,
    EXIT_FAILED for a run that went wrong: no server, an aborted or failed request)."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `rawinfer: error: ...`, exit status 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"rawinfer: error: {message} (see `{self.prog} --help`)\n")


def common_flags() -> argparse.ArgumentParser:
    """-q / -v, accepted after any subcommand as well as before it."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="only warnings and errors on stderr: no progress bars, no summary line")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging, and a traceback on errors")
    return p


COMMON = common_flags()


def add_command(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser, with -q / -v."""
    return sub.add_parser(name, help=help, description=description or help, parents=[COMMON])


# ---- argparse types: one sentence per bad value ---------------------------------------------------------

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a positive number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def size_cpu_pool(threads: int | None) -> None:
    """With --threads N, make Numba's thread pool N workers (NUMBA_NUM_THREADS, read when Numba is
    imported), not every core narrowed to N: a pool with idle workers makes each parallel region several
    times slower whenever another process keeps the spare cores busy, e.g. two single-thread replicas on
    two cores (docs/kernels.md). A no-op once Numba is imported, and where the user set the variable."""
    if threads and "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))


# ---- the engine ------------------------------------------------------------------------------------------

def add_model_arg(p: argparse.ArgumentParser, group=None) -> None:
    (group or p).add_argument(
        "--model", default=None, metavar="MODEL",
        help="a converted model folder, a Hugging Face model folder or a .gguf file (the last two are converted "
             "once into the user cache), or a model name from `rawinfer models` "
             f"(default: {DEFAULT_MODEL}-q4 on the CPU, {DEFAULT_MODEL} elsewhere; tools/fetch_default_model.sh "
             "fetches both)")


def add_engine_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The engine's options, each as EngineConfig declares it (settings.option), and --model."""
    g = p.add_argument_group("engine")
    if model:
        add_model_arg(p, g)
    add_options(g, EngineConfig)


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig of add_engine_args's options; a bad value is a CLIError naming its flag."""
    if isinstance(getattr(args, "kv_cache_memory", None), str):     # set by a caller that skipped the parser
        try:
            args.kv_cache_memory = parse_size(args.kv_cache_memory)
        except ValueError as e:
            raise CLIError(f"--kv-cache-memory: {e}") from None
    try:
        return options_from_args(EngineConfig, args, "engine option")
    except ValueError as e:
        raise CLIError(str(e)) from None


# ---- sampling --------------------------------------------------------------------------------------------

def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                   help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="randomness of sampling; 0 picks the most likely token, greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of tokens whose probability reaches P (default: 1, off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens (default: 0, off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely one (default: 0, off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="above 1 discourages tokens already in the prompt or output (default: 1, off)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of the sampler: the same seed gives the same output (default: none, a fresh draw)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT, which is left out (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence up to --max-tokens (default: stop there)")


def sampling_params_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e).replace("SamplingParams.", "--").replace("_", "-")) from None


def read_prompt(args) -> str:
    """The positional prompt, else stdin (not a terminal, not empty)."""
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError("no prompt: give it as an argument or on stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("the prompt on stdin is empty")
    return text


def check_system_flag(args) -> None:
    """--system goes into the chat template, which --raw and --token-ids skip: refused before the model loads."""
    flag = "--raw" if args.raw else "--token-ids" if args.token_ids else None
    if args.system is not None and flag:
        raise CLIError(f"--system goes into the chat template, which {flag} skips: write the system text into "
                       f"the prompt instead, or leave out {flag}")


def plain_text_prompt(args, model: str) -> None:
    """A prompt for a model without a chat template (a base model) goes to it as plain text, as with --raw:
    said once, so that a user who expected the template knows; --system then has nowhere to go."""
    if args.system is not None:
        raise CLIError(f"--system needs a chat template and {model} has none (a base model): write the system "
                       "text into the prompt instead")
    if not args.raw:
        log.info("%s has no chat template (a base model): the prompt goes to it as plain text, as with --raw",
                 model)


def is_quiet(args) -> bool:
    return bool(getattr(args, "quiet", False))
