"""`rawinfer convert`: a Hugging Face folder or a GGUF file into rawinfer's model format."""

from __future__ import annotations

import logging
import warnings

from rawinfer.frontends.options import CLIError, add_command, is_quiet
from rawinfer.quant import QUANT_TYPES

log = logging.getLogger("rawinfer")


def add_parser(sub) -> None:
    p = add_command(sub, "convert", "convert a Hugging Face folder or a GGUF file into rawinfer's format")
    p.add_argument("src", help="Hugging Face model folder or .gguf file")
    p.add_argument("dst", help="output folder (e.g. weights/NAME)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="storage dtype of the weights (default: float32)")
    p.add_argument("--quant", default=None, choices=QUANT_TYPES,
                   help="weight-only quantization: int8 rows, q4 blocks for the layers, or fp8 (e4m3) rows "
                        "for GPUs with FP8 tensor cores (the CPU runs them as float32), rawinfer/quant.py "
                        "(default: none)")
    p.add_argument("--force", action="store_true", help="replace DST if it holds files (default: refuse)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from rawinfer.convert import ConversionError, ConversionWarning, convert
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        try:
            cfg = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant, progress=not is_quiet(args),
                          overwrite=args.force)
        except ConversionError as e:     # the library's message names its API argument beside the flag
            raise CLIError(str(e).replace("--force (overwrite=True)", "--force")) from None
        finally:
            for w in caught:
                text = str(w.message)
                if "driven with token ids" in text:
                    text += " (`rawinfer generate --token-ids`, `rawinfer client --token-ids`)"
                log.warning("warning: %s", text)
    print(f"converted {args.src} -> {args.dst} ({cfg.architecture}, {cfg.num_layers} layers, "
          f"{cfg.num_params() / 1e6:.1f}M parameters, {cfg.dtype}{', ' + cfg.quant if cfg.quant else ''})")
    return 0
