"""`rawinfer convert`: a Hugging Face folder or a GGUF file into rawinfer's model format."""

from __future__ import annotations

from rawinfer.quant import QUANT_TYPES


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face folder or a GGUF file into rawinfer's format")
    p.add_argument("src", help="Hugging Face model folder or .gguf file")
    p.add_argument("dst", help="output folder (e.g. weights/NAME)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quant", default=None, choices=QUANT_TYPES,
                   help="weight-only quantization: int8 rows, or q4 blocks for the layers (rawinfer/quant.py)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from rawinfer.convert import convert
    cfg = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant, progress=not args.quiet,
                  overwrite=args.force)
    print(f"converted {args.src} -> {args.dst} ({cfg.architecture}, {cfg.num_layers} layers, "
          f"{cfg.num_params() / 1e6:.1f}M parameters, {cfg.dtype}{', ' + cfg.quant if cfg.quant else ''})")
    return 0
