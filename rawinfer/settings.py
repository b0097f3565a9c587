"""Settings declared once: an option field's default, help text, value check and command-line flag
(`option`), which the config's check (`check_options`), the argument parsers (`add_options`) and the
readers of parsed arguments (`options_from_args`) all take from the field; and the environment switches,
read here and nowhere else.

A dataclass of settings (EngineConfig) declares each field with `option(...)`; a command adds the fields
with a flag to its parser, and turns the parsed arguments back into the dataclass, so that no default,
range or help text is written twice. Processes that run an engine elsewhere (Ray actors, a compile
helper) are handed the dataclass, never the parsed arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

def is_int(v: Any) -> bool:
    """An integer argument: int, but not bool (which Python counts as an int)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float argument, bool excluded."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A check that also accepts None."""
    return lambda v: v is None or ok(v)


# ---- option fields --------------------------------------------------------------------------------------

AS_API = object()       # Spec.cli_default when the command line takes the Python API's default


@dataclass(frozen=True)
class Spec:
    """How one option field is checked and offered on the command line."""

    help: str
    check: Callable[[Any], bool]   # the values the field accepts...
    what: str                      # ... said as the end of "it must be ..."
    flag: str | None               # "--block-size"; None: not a command-line option
    parse: Callable[[str], Any] | None = None    # the flag's text -> value (None: a switch without a value)
    choices: tuple | None = None
    metavar: str | None = None
    cli_default: Any = AS_API      # where the command line's default differs from the Python API's (said in
                                   # help); a function: called when the parser is built (an environment switch)
    nargs: str | None = None       # "+": the flag takes one or more values, the field a list of them
    repeat: bool = False           # the flag may be given again and again, the field the list of its values


def option(default: Any = MISSING, *, help: str, check: Callable[[Any], bool], what: str, flag: str | None = "",
           parse: Callable[[str], Any] | None = None, choices: tuple | None = None, metavar: str | None = None,
           default_factory: Any = MISSING, cli_default: Any = AS_API, nargs: str | None = None,
           repeat: bool = False) -> Any:
    """A dataclass field with its Spec. flag "" derives --field-name; a bool field True by default is offered as
    the switch `flag` (--no-...) that turns it off, one False by default as a switch that turns it on."""
    spec = Spec(help, check, what, flag, parse, choices, metavar, cli_default, nargs, repeat)
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


def specs(cls) -> list[tuple[str, Spec]]:
    return [(f.name, f.metadata["spec"]) for f in fields(cls) if "spec" in f.metadata]


def flag_of(name: str, spec: Spec) -> str | None:
    return None if spec.flag is None else spec.flag or "--" + name.replace("_", "-")


def check_options(config: Any, what: str) -> None:
    """ValueError naming the first field whose value its Spec refuses: "<what> block_size=0 is invalid: it
    must be ..." (a field without a Spec fails here too, so none goes unchecked)."""
    for f in fields(config):
        spec = f.metadata.get("spec")
        if spec is None:
            raise TypeError(f"{type(config).__name__}.{f.name} is declared without option(): it has no check")
        value = getattr(config, f.name)
        if not spec.check(value):
            raise ValueError(f"{what} {f.name}={value!r} is invalid: it must be {spec.what}")


def _default_text(f, spec: Spec) -> str:
    value = spec.cli_default if spec.cli_default is not AS_API else f.default
    if isinstance(value, bool) or value is None or value is MISSING or callable(value) or "(default:" in spec.help:
        return ""                   # the help text says what happens by default, or how to read it (1MiB)
    return f" (default: {value})"


def _checked(spec: Spec) -> Callable[[str], Any]:
    """The flag's argparse type: its text parsed, then the option's check (of a one-value list where the flag
    takes several), so that a bad value is argparse's one line naming the flag."""
    def parse(text: str) -> Any:
        value = spec.parse(text)
        if not spec.check([value] if spec.nargs or spec.repeat else value):
            what = re.split(r",? or None\b", spec.what)[0]        # a flag cannot give None: left out
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    parse.__name__ = getattr(spec.parse, "__name__", "value")
    return parse


def add_options(group, cls, skip: tuple[str, ...] = (), dest_prefix: str = "") -> None:
    """Every field of cls with a flag, as an argument of `group` (an argparse parser or group); the parsed
    value lands under the field's name, after dest_prefix (two configs of one command may share a field name:
    the prefill role's `bind` beside the server's)."""
    for f in fields(cls):
        spec = f.metadata.get("spec")
        flag = flag_of(f.name, spec) if spec else None
        if flag is None or f.name in skip:
            continue
        if spec.parse is None:       # a switch: it flips the field's default
            group.add_argument(flag, dest=dest_prefix + f.name, action="store_false" if f.default else "store_true",
                               help=spec.help)
            continue
        default = spec.cli_default if spec.cli_default is not AS_API else (
            f.default if f.default is not MISSING else None)
        # a repeated flag: argparse appends to a given default, so such a field's default is None
        kind = {"action": "append"} if spec.repeat else {"nargs": spec.nargs}
        group.add_argument(flag, dest=dest_prefix + f.name, type=_checked(spec), choices=spec.choices, **kind,
                           default=default() if callable(default) else default,
                           metavar=None if spec.choices else spec.metavar or "N",
                           help=spec.help + _default_text(f, spec))


def options_from_args(cls, args: argparse.Namespace, what: str, dest_prefix: str = "", **given) -> Any:
    """cls from the parsed arguments of add_options (a field whose flag the parser lacks keeps its default),
    checked; a bad value's error names its flag: "--block-size=0 is invalid: it must be ..."."""
    values = dict(given)
    for name, spec in specs(cls):
        dest = dest_prefix + name
        if flag_of(name, spec) is not None and hasattr(args, dest) and name not in values:
            values[name] = getattr(args, dest)
    config = cls(**values)
    try:
        check_options(config, what)
    except ValueError as e:
        name = str(e).removeprefix(what + " ").partition("=")[0]
        spec = dict(specs(cls)).get(name)
        flag = flag_of(name, spec) if spec else None
        raise ValueError(str(e).replace(f"{what} {name}", flag or name, 1)) from None
    return config


# ---- values ---------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TIB": 1024**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024. Raises ValueError naming the format."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"memory size must be positive, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write it like 2GiB, 512MiB or 1500000000")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def int_argument(text: str) -> int:
    """A whole number given to a flag (its range is the option's check)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def float_argument(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def size_argument(text: str) -> int:
    """parse_size for a flag: its error as argparse's one line."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SECONDS = {"parse": float_argument, "metavar": "SECONDS", "check": lambda v: is_number(v) and v > 0,
           "what": "a positive number of seconds"}      # option(...) arguments of a duration flag


TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
TEMPLATES = ("smollm2-tools",)      # the chat templates shipped in rawinfer/templates/, by name


def chat_template_file(text: str) -> str:
    """--chat-template: a file, or the name of a template shipped with rawinfer (its path)."""
    if os.path.isfile(text):
        return text
    if text in TEMPLATES:
        return os.path.join(TEMPLATES_DIR, text + ".jinja")
    raise argparse.ArgumentTypeError(f"no file {text!r}; give a Jinja chat template file, or one of the templates "
                                     f"shipped with rawinfer: {', '.join(TEMPLATES)}")


# ---- environment switches -------------------------------------------------------------------------------

ENV_SWITCHES = {
    "RAWINFER_CPU_INT_GEMM": "0 runs int8 and q4 models' products on their older kernels: dequantized float32 "
                             "weights for BLAS, matrix-vector kernels for a few rows (EngineConfig.cpu_int_gemm)",
    "RAWINFER_CACHE": "the user cache: compiled CPU kernels, the benchmarks' reports, the tools' downloads; "
                      "default ~/.cache/rawinfer (EngineConfig.cache_dir, user_cache_dir())",
    "RAWINFER_API_KEY": "the API key `rawinfer serve` requires and `rawinfer bench serve` sends, where --api-key "
                        "is not given (api_key_default())",
}
DEFAULT_CACHE_DIR = "~/.cache/rawinfer"


def _env(name: str) -> str | None:
    if name not in ENV_SWITCHES:
        raise KeyError(f"{name} is not a documented switch (settings.ENV_SWITCHES)")
    return os.environ.get(name)


def env_flag(name: str, default: bool) -> bool:
    """An ENV_SWITCHES flag: unset means `default`, "0" / "false" / "no" / "off" mean False."""
    value = _env(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off")


def user_cache_dir() -> str:
    """The user cache folder (RAWINFER_CACHE, else ~/.cache/rawinfer), ~ expanded."""
    return os.path.expanduser(_env("RAWINFER_CACHE") or DEFAULT_CACHE_DIR)


def api_key_default() -> str | None:
    return _env("RAWINFER_API_KEY")
