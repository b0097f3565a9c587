"""Converting a model source (a .gguf file or a Hugging Face folder) once into the user cache, keyed by the
digest of its bytes, so that `--model file.gguf` works directly.

    dst = cached_conversion(src, cache_root)      # cache_root/models/<name>-<digest[:16]>[-<dtype>][-<quant>]/

A source's digest is the sha256 of its bytes (a folder's: of each top-level file's name and bytes, in
name order). Hashing a file of several GB takes seconds, and opening a GGUF parses its whole vocabulary,
so a start that finds its conversion in the cache does neither: digests are remembered in
cache_root/models/digests.json under a cheap key of each file (its real path, size, modification time
and the sha256 of its first and last MiB), and a source is opened, checked and hashed whole only when
a key is unknown (a new or changed file: any change of size or modification time is one). A lock file
keeps two processes from converting the same source at once; the conversion writes its folder all at
once (writer.staged_folder), so an interrupted one leaves nothing behind. Beside the converted files,
source.json records where the model came from (`rawinfer models` shows it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

from rawinfer.convert.errors import ConversionError

log = logging.getLogger("rawinfer")

MODELS_DIR = "models"            # under the cache root
DIGESTS_FILE = "digests.json"    # real path -> [size, mtime_ns, sha256 of the ends, sha256 of the bytes]
SOURCE_FILE = "source.json"      # written beside a cached model's config.json
_CHUNK = 1 << 20
_END = 1 << 20                   # bytes at each end of a file that its cheap key hashes


def source_files(src: str) -> list[str]:
    """The files whose bytes make up a source: the file itself, or a folder's visible top-level files."""
    if os.path.isfile(src):
        return [src]
    return sorted(os.path.join(src, n) for n in os.listdir(src)
                  if not n.startswith(".") and os.path.isfile(os.path.join(src, n)))


def _load_digests(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            memo = json.load(f)
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_digests(path: str, memo: dict) -> None:
    """Written to a temporary file and renamed: a reader never sees half a file (a lost update only
    means hashing once more)."""
    fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _ends_digest(path: str, size: int) -> str:
    """sha256 of a file's first and last MiB (the whole file when it is shorter than two): with its size
    and modification time, the cheap key that finds a file's digest without reading it all."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * _END:
            h.update(f.read())
        else:
            h.update(f.read(_END))
            f.seek(size - _END)
            h.update(f.read(_END))
    return h.hexdigest()


def _cheap_keys(files: list[str]) -> dict[str, tuple[str, list]]:
    """file -> (its memo key, the [size, mtime_ns, ends digest] the memo must hold for it)."""
    out = {}
    for f in files:
        st = os.stat(f)
        out[f] = (os.path.realpath(f), [st.st_size, st.st_mtime_ns, _ends_digest(f, st.st_size)])
    return out


def _combined(src: str, digests: dict[str, str]) -> str:
    """The source's digest from its files' digests: a file's own; a folder's over names and digests."""
    if os.path.isfile(src):
        return digests[src]
    whole = hashlib.sha256()
    for f in sorted(digests):
        whole.update(os.path.basename(f).encode() + b"\0" + digests[f].encode() + b"\n")
    return whole.hexdigest()


def _remembered(memo: dict, key: str, cheap: list) -> str | None:
    m = memo.get(key)
    ok = isinstance(m, list) and len(m) == 4 and m[:3] == cheap and isinstance(m[3], str)
    return m[3] if ok else None


def known_digest(src: str, models_dir: str) -> str | None:
    """The source's digest when every one of its files is remembered under its cheap key; None when one
    is new or changed. Reads two MiB of each file at most."""
    files = source_files(src)
    if not files:
        return None
    memo = _load_digests(os.path.join(models_dir, DIGESTS_FILE))
    digests = {}
    for f, (key, cheap) in _cheap_keys(files).items():
        digests[f] = _remembered(memo, key, cheap)
        if digests[f] is None:
            return None
    return _combined(src, digests)


def source_digest(src: str, models_dir: str, progress: bool = True) -> str:
    """sha256 (hex) of the source's bytes: remembered ones from the memo, the others read whole."""
    from tqdm import tqdm
    files = source_files(src)
    if not files:
        raise ConversionError(f"{src!r} is an empty folder; give a Hugging Face model folder or a .gguf file")
    memo_path = os.path.join(models_dir, DIGESTS_FILE)
    memo = _load_digests(memo_path)
    keys = _cheap_keys(files)
    digests = {f: _remembered(memo, *keys[f]) for f in files}
    todo = [f for f in files if digests[f] is None]
    if todo:
        with tqdm(total=sum(keys[f][1][0] for f in todo), unit="B", unit_scale=True, desc="hashing", leave=False,
                  disable=None if progress else True) as bar:
            for f in todo:
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(_CHUNK), b""):
                        h.update(chunk)
                        bar.update(len(chunk))
                digests[f] = h.hexdigest()
                memo[keys[f][0]] = keys[f][1] + [digests[f]]
        _save_digests(memo_path, memo)
    return _combined(src, digests)


def cache_name(src: str, digest: str, dtype: str = "float32", quant: str | None = None) -> str:
    """The cached folder's name: the source's name, its digest's first 16 hex digits, non-default options."""
    base = os.path.basename(os.path.normpath(src))
    if base.lower().endswith(".gguf"):
        base = base[:-5]
    parts = [base, digest[:16]] + ([dtype] if dtype != "float32" else []) + ([quant] if quant else [])
    return "-".join(parts)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)           # released when the file closes
        yield


def cached_conversion(src: str, cache_root: str, dtype: str = "float32", quant: str | None = None,
                      progress: bool = True) -> str:
    """The converted model folder of SRC in the cache, converting it first if it is not there yet."""
    from rawinfer.convert import convert, open_source
    models_dir = os.path.join(os.path.expanduser(cache_root), MODELS_DIR)
    try:
        os.makedirs(models_dir, exist_ok=True)
    except OSError as e:
        raise ConversionError(f"cannot create the model cache {models_dir!r} ({e}); set RAWINFER_CACHE to a "
                              "writable folder") from e
    digest = known_digest(src, models_dir)
    if digest is None:                          # new or changed: opened (refused if not a model), then hashed
        open_source(src).close()
        digest = source_digest(src, models_dir, progress)
    dst = os.path.join(models_dir, cache_name(src, digest, dtype, quant))
    with _locked(os.path.join(models_dir, f".{os.path.basename(dst)}.lock")):
        if os.path.isfile(os.path.join(dst, "config.json")):
            return dst
        log.info("converting %s once into %s", src, dst)
        convert(src, dst, dtype=dtype, quant=quant, progress=progress, overwrite=True)
        with open(os.path.join(dst, SOURCE_FILE), "w", encoding="utf-8") as f:
            json.dump({"source": os.path.abspath(src), "sha256": digest, "dtype": dtype, "quant": quant}, f)
    return dst
