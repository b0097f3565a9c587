"""Weight conversion: a Hugging Face model folder or a GGUF file -> a rawinfer model folder.

    convert(src, dst, dtype="float32") writes, all at once or not at all:
        dst/config.json        ModelConfig.to_json() (keys documented in rawinfer/config.py)
        dst/model.safetensors  fused tensors, names and shapes in layout.py, stored in `dtype`
        dst/tokenizer.json     when the source has a tokenizer (GGUF: rebuilt from its metadata)

Module map: hf.py + hf_tokenizer.py read Hugging Face folders; gguf_source.py + gguf_tokenizer.py
read GGUF files; layout.py turns the parts a reader serves into rawinfer's fused tensors; writer.py
stages the folder and streams model.safetensors. `python -m rawinfer.convert SRC DST` runs `main`.

Quantized storage (rawinfer/quant.py): quant="int8" stores every matrix of the plan as an int8 tensor
plus `<name>.scale` (one float32 per output row); quant="q4" stores the decoder layers' matrices as
4-bit blocks (`<name>` nibbles + `<name>.q4dm`) and the others as int8; quant="fp8" stores every matrix
as float8 e4m3fn codes (uint8) plus `<name>.fp8_scale` (one float32 per output row); vectors keep the
float dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

import numpy as np

from rawinfer.config import DTYPES, FORMAT_NAME, FORMAT_VERSION, ModelConfig
from rawinfer.quant import QUANT_TYPES, quantize, storage_kind, stored_parts

from rawinfer.convert.errors import ConversionError, ConversionWarning
from rawinfer.convert.hf import HFReader
from rawinfer.convert.layout import CheckpointReader, TensorSpec, fuse, plan_parts, tensor_plan
from rawinfer.convert.writer import StoredTensor, check_destination, staged_folder, storage_dtype, write_json, \
    write_safetensors, write_text

__all__ = ["ConversionError", "ConversionWarning", "convert", "main", "open_source"]

QUANTS = QUANT_TYPES


def open_source(src: str) -> CheckpointReader:
    """Open SRC as a Hugging Face folder or a GGUF file (recognised by its magic bytes, not its name)."""
    if not os.path.exists(src):
        raise ConversionError(f"source {src!r} does not exist; give a Hugging Face model folder or a .gguf file")
    if os.path.isdir(src):
        return HFReader(src)
    try:
        with open(src, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConversionError(f"cannot read {src!r} ({e}); check the path and its permissions") from e
    if magic == b"GGUF":
        from rawinfer.convert.gguf_source import GGUFSource   # lazy: the `gguf` package is only needed for GGUF sources
        return GGUFSource(src)
    hint = (" (for a Hugging Face checkpoint give the folder that holds config.json, not the weights file)"
            if src.endswith(".safetensors") else "")
    raise ConversionError(f"{src!r} is neither a model folder nor a GGUF file{hint}")


def _check_request(src: str, dst: str, dtype: str, quant: str | None, overwrite: bool) -> None:
    if dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quant is not None and quant not in QUANTS:
        raise ConversionError(f"unknown quantization {quant!r}; leave it out or choose {', '.join(QUANTS)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ConversionError("SRC and DST are the same path; write the converted model to another folder")
    check_destination(dst, overwrite)


def _stored_tensors(plan: list[TensorSpec], config: ModelConfig) -> list[StoredTensor]:
    out = []
    for spec in plan:
        kind = storage_kind(spec.name, spec.shape, config.quant)
        if kind is None:
            out.append(StoredTensor(spec.name, spec.shape, config.dtype))
        else:
            out.extend(StoredTensor(name, shape, dt.name) for name, shape, dt in
                       stored_parts(spec.name, spec.shape, kind, np.float32))
    return out


def _to_storage(x: np.ndarray, dtype: str, name: str) -> np.ndarray:
    """Cast float32 x to the storage dtype; float16 overflow is an error, not a silent inf."""
    with np.errstate(over="ignore"):
        y = x.astype(storage_dtype(dtype))
    if dtype == "float16" and not np.isfinite(y).all() and np.isfinite(x).all():
        raise ConversionError(f"tensor {name!r} has values beyond the float16 range (65504); "
                              "convert with --dtype bfloat16 or float32 instead")
    return y


def convert(src: str, dst: str, dtype: str = "float32", quant: str | None = None, progress: bool = True,
            overwrite: bool = False) -> ModelConfig:
    """Convert SRC (Hugging Face folder or GGUF file) into the rawinfer model folder DST.

    Raises ConversionError with one sentence naming the problem and the fix; DST is then left as it was.
    A non-empty DST is replaced only when overwrite is True (the CLI's --force)."""
    _check_request(src, dst, dtype, quant, overwrite)
    reader = open_source(src)
    try:
        config = dataclasses.replace(reader.config, dtype=dtype, quant=quant)
        plan = {spec.name: spec for spec in tensor_plan(config)}
        reader.check_all_used(plan_parts(list(plan.values())))   # no source tensor may be dropped silently

        later: dict[str, np.ndarray] = {}     # a quantized matrix's second part, written right after it

        def produce(t: StoredTensor) -> np.ndarray:
            if t.name in later:
                return later.pop(t.name)
            spec = plan[t.name]
            kind = storage_kind(spec.name, spec.shape, config.quant)
            if kind is None:
                return _to_storage(fuse(spec, reader), t.dtype, t.name)
            try:
                first, second = quantize(fuse(spec, reader), kind)
            except ValueError as e:
                raise ConversionError(f"cannot quantize {t.name} as {kind} ({e})") from e
            later[stored_parts(spec.name, spec.shape, kind, np.float32)[1][0]] = second
            return first

        metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}
        with staged_folder(dst, overwrite) as stage:
            write_safetensors(os.path.join(stage, "model.safetensors"), _stored_tensors(list(plan.values()), config),
                              produce, metadata, progress)
            if reader.tokenizer_json is not None:
                write_text(os.path.join(stage, "tokenizer.json"), reader.tokenizer_json)
            write_json(os.path.join(stage, "config.json"), config.to_json())
    finally:
        reader.close()
    return config


def main(argv: list[str] | None = None) -> int:
    """`python -m rawinfer.convert SRC DST [--dtype D] [--force]`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m rawinfer.convert",
                                     description="Convert a Hugging Face folder or a GGUF file to a rawinfer model.")
    parser.add_argument("src", help="Hugging Face model folder or .gguf file")
    parser.add_argument("dst", help="folder to write the converted model to")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="storage dtype (default float32)")
    parser.add_argument("--quant", default=None, choices=QUANTS, help="weight-only quantization of the matrices")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        try:
            config = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant, progress=not args.quiet,
                             overwrite=args.force)
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            for w in caught:
                print(f"warning: {w.message}", file=sys.stderr)
    print(f"converted {args.src} -> {args.dst}: {config.architecture}, {config.num_layers} layers, "
          f"{config.num_params() / 1e6:.1f}M parameters, {config.dtype}{' + ' + config.quant if config.quant else ''}")
    return 0
