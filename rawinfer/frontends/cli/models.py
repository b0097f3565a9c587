"""What `--model` may name, and `rawinfer models`: the models on this machine.

`--model` takes a converted folder (used as it is), a Hugging Face folder or a .gguf file (converted
once into the user cache, convert/cache.py), or a bare name looked up in weights/ (of the current
folder, then of the checkout rawinfer runs from) and in the cache. open_engine is how every command
that runs a local model starts its engine.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import warnings

from rawinfer.config import DEFAULT_MODEL, FORMAT_NAME, EngineConfig, ModelFormatError
from rawinfer.frontends.cli.fetch import CATALOG, fetchable
from rawinfer.frontends.options import CLIError, add_command, engine_config_from_args, is_quiet
from rawinfer.settings import user_cache_dir

log = logging.getLogger("rawinfer")

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The default model on the CPU: SmolLM2 in its GGUF's own 4-bit blocks, the fastest format there that passes
# the golden tests (tests/backend/test_q4.py). DEFAULT_MODEL, the float32 copy, is the default of devices
# without q4 kernels and of the Python API; `--model smollm2-135m-instruct` picks it on the CPU too.
DEFAULT_CPU_MODEL = DEFAULT_MODEL + "-q4"


def add_parser(sub) -> None:
    p = add_command(sub, "models", "list the models in weights/ and the user cache, and those `rawinfer fetch` "
                                   "can download")
    p.set_defaults(func=cmd_models)


def weights_dirs() -> list[str]:
    """weights/ of the current folder, then of the checkout this rawinfer runs from (if it has one)."""
    out = []
    for d in (os.path.abspath("weights"), os.path.join(CHECKOUT, "weights")):
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def cache_models_dir() -> str | None:
    from rawinfer.convert.cache import MODELS_DIR
    return os.path.join(user_cache_dir(), MODELS_DIR)


def _read_config(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        return cfg if isinstance(cfg, dict) else None
    except (OSError, ValueError):
        return None


def conversation_lacks(folder: str, chat_template: str | None = None) -> str | None:
    """What the converted model in `folder` lacks to render a chat ("tokenizer", "chat template"), read from
    its files without loading it; None when it has both (a --chat-template file stands in for its own)."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return "tokenizer"
    return None if chat_template or (_read_config(folder) or {}).get("chat_template") else "chat template"


def is_converted(folder: str) -> bool:
    cfg = _read_config(folder)
    return cfg is not None and cfg.get("format") == FORMAT_NAME


def _by_name(name: str) -> str | None:
    places = [os.path.join(d, name) for d in weights_dirs()]
    if cache_models_dir():
        places.append(os.path.join(cache_models_dir(), name))
    return next((p for p in places if is_converted(p)), None)


def default_model(device: str = "auto") -> str:
    """The converted folder of the default model for `device`: on the CPU its q4 copy (the float32 one, with
    a note, when only that was fetched), elsewhere the float32 one."""
    from rawinfer.backend.select import cuda_usable
    on_cpu = device == "cpu" or (device == "auto" and not cuda_usable())
    wanted = [DEFAULT_CPU_MODEL, DEFAULT_MODEL] if on_cpu else [DEFAULT_MODEL]
    for want in wanted:
        found = want if is_converted(want) else _by_name(os.path.basename(want))
        if found is not None:
            if want != wanted[0]:
                log.info("running the float32 default model: the faster q4 copy is not fetched (`rawinfer fetch "
                         "%s` makes it)", os.path.basename(wanted[0]))
            return found
    name = os.path.basename(wanted[0])
    raise CLIError(f"the default model ({wanted[0]}) is not there yet: fetch it with `rawinfer fetch {name}` (or "
                   "tools/fetch_default_model.sh), or give --model")


def resolve_model(arg: str | None, progress: bool = True, device: str = "auto") -> str:
    """The converted model folder that `--model arg` means, converting a source into the cache first; without
    one, the default model for `device`."""
    if arg is None:
        return default_model(device)
    path = os.path.expanduser(arg)
    if os.path.isdir(path):
        if "format" in (_read_config(path) or {}):
            return path                      # a converted folder (the engine checks its format version)
        return _convert_into_cache(path, progress)   # a Hugging Face folder (the reader names what is missing)
    if os.path.isfile(path):
        return _convert_into_cache(path, progress)
    if os.sep not in arg and not os.path.exists(path):
        found = _by_name(arg)
        if found is not None:
            return found
        if arg in CATALOG and CATALOG[arg].ready:
            raise CLIError(f"model {arg!r} is not fetched yet; run `rawinfer fetch {arg}` first")
    raise CLIError(f"model {arg!r} does not exist: give --model a converted folder, a Hugging Face folder or a "
                   "GGUF file (`rawinfer convert` makes a converted folder), or a name from `rawinfer models`")


def _convert_into_cache(src: str, progress: bool) -> str:
    from rawinfer.convert import ConversionWarning
    from rawinfer.convert.cache import cached_conversion
    root = user_cache_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        dst = cached_conversion(src, root, progress=progress)
    for w in caught:
        log.warning("%s", w.message)
    return dst


def open_engine(args, one_shot: int | None = None):
    """The LLMEngine of the command's engine options (and its --model, resolved as above). one_shot=n: the
    engine runs one request of n samples (`rawinfer generate`), sized and warmed for it (one_shot_config)."""
    from rawinfer.engine.engine import LLMEngine
    from rawinfer.frontends.cli.progress import ticking
    cfg = engine_config_from_args(args)
    path = resolve_model(args.model, progress=not is_quiet(args), device=cfg.device)

    def start():
        log.info("starting the engine on %s", path)
        with ticking("starting the engine (loading the weights, compiling or loading the kernels)",
                     enabled=not is_quiet(args)):
            return LLMEngine(path, cfg if one_shot is None else one_shot_config(cfg, path, one_shot))
    try:
        engine = start()
    except ModelFormatError as e:
        if not _converted_into_cache(args.model, path):
            raise
        # rawinfer's own copy, damaged (a full disk, an interrupted copy): the user never converted anything,
        # so it is converted again rather than left for them to find and delete
        log.warning("the converted copy of %s in the cache (%s) is damaged (%s); converting it again", args.model,
                    path, e)
        shutil.rmtree(path, ignore_errors=True)
        path = resolve_model(args.model, progress=not is_quiet(args), device=cfg.device)
        engine = start()
    # the engine's objects (kernels, Numba's types, the model) live as long as the process: after one
    # collection of the start's garbage, out of the collector's sight, so that neither the rest of a one-shot
    # command nor a server's requests pay for walking them again
    gc.collect()
    gc.freeze()
    return engine


def one_shot_config(cfg: EngineConfig, path: str, n: int) -> EngineConfig:
    """The engine config of one request of n samples on the model in `path`: no warm-up (the caller warms
    the engine for its request alone: engine/warmup.py, warm_up_like) and, on the CPU without
    --kv-cache-memory, a KV region of n contexts of max_model_len (in float32, the widest KV dtype) where
    that is less than the CPU default: every page of it is mapped in at start."""
    from rawinfer.backend.select import cuda_usable
    from rawinfer.config import ModelConfig, resolve_max_model_len
    from rawinfer.exec.memory import CPU_KV_CACHE_BYTES, kv_bytes_per_block
    kv = cfg.kv_cache_memory
    if kv is None and (cfg.device == "cpu" or (cfg.device == "auto" and not cuda_usable())):
        model = ModelConfig.from_dir(path)
        context = resolve_max_model_len(model, cfg)
        kv = min(CPU_KV_CACHE_BYTES, -(-context // cfg.block_size) * n * kv_bytes_per_block(model, cfg.block_size,
                                                                                            "float32"))
        log.info("a KV region for this one request: %d MiB, %d context(s) of %d tokens (--kv-cache-memory sets "
                 "another size)", kv >> 20, n, context)
    return dataclasses.replace(cfg, warmup=False, kv_cache_memory=kv)


def _converted_into_cache(arg: str | None, path: str) -> bool:
    """Whether `--model arg` is a source (a GGUF file or Hugging Face folder) that resolve_model converted
    into `path`, a folder of the user cache."""
    root = cache_models_dir()
    src = os.path.expanduser(arg) if arg else None
    return bool(root and src and os.path.exists(src) and not is_converted(src)
                and os.path.abspath(path).startswith(os.path.abspath(root) + os.sep))


# ---- rawinfer models -------------------------------------------------------------------------------------

def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, n)))


def _describe(folder: str) -> str:
    cfg = _read_config(folder) or {}
    kind = cfg.get("quant") or cfg.get("dtype") or "?"
    return f"{cfg.get('architecture', '?')}, {cfg.get('num_layers', '?')} layers, {kind}, " \
           f"{_folder_bytes(folder) / 1e6:.0f} MB"


def installed_models() -> list[tuple[str, str, str]]:
    """(where, folder, description) of every converted model in weights/ and the cache."""
    out = []
    places = [("weights", d) for d in weights_dirs()]
    if cache_models_dir() and os.path.isdir(cache_models_dir()):
        places.append(("cache", cache_models_dir()))
    for where, root in places:
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            if not name.startswith(".") and is_converted(folder):
                desc = _describe(folder)
                try:
                    with open(os.path.join(folder, "source.json"), encoding="utf-8") as f:
                        desc += f", from {json.load(f)['source']}"
                except (OSError, ValueError, KeyError):
                    pass
                out.append((where, folder, desc))
    return out


def cmd_models(args) -> int:
    models = installed_models()
    if models:
        print("converted models (give --model the path, or the name in weights/):")
        for where, folder, desc in models:
            shown = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else folder
            print(f"  {shown:<40} {desc}" if len(shown) <= 40 else f"  {shown}\n  {'':<40} {desc}")
    else:
        print("no converted models yet in weights/ or the cache")
    print("fetchable with `rawinfer fetch NAME`:")
    have = {os.path.basename(folder) for _, folder, _ in models}
    for m in fetchable():
        print(f"  {m.name:<24} {m.description}{' (fetched)' if m.name in have else ''}")
    print("or give --model a Hugging Face folder or a .gguf file: it is converted once into the cache")
    return 0
