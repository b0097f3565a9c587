"""Writing a converted model folder: staged next to DST and renamed into place, weights streamed to disk.

Nothing half-written ever appears at DST: every file goes into a hidden staging folder in DST's parent
folder (same filesystem, so the final rename is atomic) and the staging folder is removed if anything
fails, Ctrl-C included.

model.safetensors is written by hand rather than through `safetensors.numpy.save_file`: the header
(names, dtypes, shapes, byte offsets) is known from the config before any tensor is read, so each
tensor can be produced, written and dropped in turn and memory stays near one tensor, not one model.

    | u64 little-endian header length N | N bytes of JSON header, space-padded to 8 | tensor bytes ... |
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from rawinfer.convert.errors import ConversionError

# Storage dtype name -> safetensors dtype tag.
SAFETENSORS_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8", "uint8": "U8"}


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a storage dtype name (a key of SAFETENSORS_TAGS)."""
    if name == "bfloat16":
        import ml_dtypes   # registers bfloat16 with NumPy; imported only here, as its import takes seconds
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class StoredTensor:
    """One entry of model.safetensors as it will be stored."""

    name: str
    shape: tuple[int, ...]
    dtype: str                # a key of SAFETENSORS_TAGS

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuse a DST that is a file, or a non-empty folder unless overwrite is set."""
    if os.path.isfile(dst):
        raise ConversionError(f"destination {dst!r} is a file; give a folder path for the converted model")
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise ConversionError(
            f"destination folder {dst!r} already exists and is not empty; choose another folder or pass "
            "--force (overwrite=True) to replace it")


@contextmanager
def staged_folder(dst: str, overwrite: bool) -> Iterator[str]:
    """Yield an empty staging folder; on a clean exit it becomes DST, on any error it is deleted."""
    check_destination(dst, overwrite)
    dst = os.path.abspath(dst)
    parent, base = os.path.split(dst)
    try:
        os.makedirs(parent, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
        os.chmod(stage, 0o755)                   # mkdtemp makes it private; DST is an ordinary folder
    except OSError as e:
        raise ConversionError(f"cannot create the destination folder next to {dst!r} ({e}); "
                              "choose a writable location") from e
    try:
        yield stage
        check_destination(dst, overwrite)          # NOTE: re-checked: DST may have appeared meanwhile
        if os.path.isdir(dst):
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(dst, os.path.join(old, base))
            os.rename(stage, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def safetensors_header(tensors: list[StoredTensor], metadata: dict[str, str]) -> bytes:
    """The length prefix plus JSON header for `tensors` laid out back to back in list order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_TAGS[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)               # data starts 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob


def write_safetensors(path: str, tensors: list[StoredTensor], produce: Callable[[StoredTensor], np.ndarray],
                      metadata: dict[str, str], progress: bool) -> None:
    """Write `tensors` to path, asking `produce` for each array in turn (already in its storage dtype)."""
    from tqdm import tqdm   # lazy: a GPU machine may run converted models without tqdm installed
    total = sum(t.nbytes for t in tensors)
    with open(path, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="converting",
                                     disable=None if progress else True, leave=False) as bar:
        f.write(safetensors_header(tensors, metadata))
        for t in tensors:
            x = produce(t)
            want = storage_dtype(t.dtype)
            if x.shape != t.shape or x.dtype != want:   # NOTE: the header already promised shape and dtype
                raise ConversionError(
                    f"internal error: tensor {t.name!r} came out as {x.dtype}{x.shape}, expected "
                    f"{want}{t.shape}; please report this")
            f.write(np.ascontiguousarray(x).view(np.uint8).data)   # NOTE: little-endian hosts only
            bar.update(t.nbytes)


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str, obj: object) -> None:
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
