"""The conversion cache (convert/cache.py): a source found in the cache is neither opened nor read whole
(its cheap key: path, size, modification time, the first and last MiB), a changed one is hashed and
converted again."""

from __future__ import annotations

import builtins
import hashlib
import json
import mmap
import os
import warnings

import pytest
from test_convert import write_gguf

from rawinfer.convert.cache import DIGESTS_FILE, MODELS_DIR, cached_conversion

MIB = 1 << 20


class Reads:
    """Counts what is read of one file: bytes through open(), and whether anything maps it."""

    def __init__(self, monkeypatch, path: str):
        self.bytes = 0
        self.maps = 0
        target = os.path.realpath(path)
        real_open, real_mmap = builtins.open, mmap.mmap
        reads = self

        class Counted:
            def __init__(self, f):
                self._f = f

            def read(self, *a):
                data = self._f.read(*a)
                reads.bytes += len(data)
                return data

            def readinto(self, b):
                n = self._f.readinto(b)
                reads.bytes += n or 0
                return n

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

            def __getattr__(self, name):
                return getattr(self._f, name)

        def counting_open(file, *a, **kw):
            f = real_open(file, *a, **kw)
            is_target = isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == target
            return Counted(f) if is_target else f

        def counting_mmap(fileno, *a, **kw):
            if os.path.realpath(f"/proc/self/fd/{fileno}") == target:
                reads.maps += 1
            return real_mmap(fileno, *a, **kw)

        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(mmap, "mmap", counting_mmap)


def padded_gguf(path: str, pad: int = 8 * MIB) -> str:
    """A tiny llama GGUF followed by `pad` bytes (the reader ignores what follows the tensors), so that the
    file is several MiB and reading it whole shows in a byte count."""
    write_gguf(path)
    with open(path, "ab") as f:
        f.write(os.urandom(pad))
    return path


def convert_cached(src: str, root: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cached_conversion(src, root, progress=False)


def folders(root: str) -> list[str]:
    models = os.path.join(root, MODELS_DIR)
    return sorted(d for d in os.listdir(models) if not d.startswith(".") and os.path.isdir(os.path.join(models, d)))


def test_a_cached_gguf_is_found_without_reading_it_whole(tmp_path, monkeypatch):
    src = padded_gguf(str(tmp_path / "tiny.gguf"))
    root = str(tmp_path / "cache")
    first = convert_cached(src, root)
    with open(src, "rb") as f:
        assert os.path.basename(first).endswith(hashlib.sha256(f.read()).hexdigest()[:16])
    reads = Reads(monkeypatch, src)
    assert convert_cached(src, root) == first
    assert reads.maps == 0                              # never opened as a GGUF (the reader maps the file)
    assert 0 < reads.bytes <= 2 * MIB < os.path.getsize(src) // 4
    assert folders(root) == [os.path.basename(first)]


@pytest.mark.parametrize("change", ["appended", "middle", "same size and time"])
def test_a_changed_gguf_is_hashed_and_converted_again(tmp_path, monkeypatch, change):
    """Any change of size or modification time reads the file whole again; so does a change of its ends
    with both kept (a file put back with its old time)."""
    src = padded_gguf(str(tmp_path / "tiny.gguf"))
    root = str(tmp_path / "cache")
    first = convert_cached(src, root)
    st = os.stat(src)
    with open(src, "r+b") as f:
        if change == "appended":
            f.seek(0, os.SEEK_END)
            f.write(b"\1" * 100)
        elif change == "middle":
            f.seek(st.st_size // 2)
            f.write(b"\1" * 100)
        else:
            f.seek(st.st_size - 100)
            f.write(b"\1" * 100)
    if change == "middle":
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "same size and time":
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads = Reads(monkeypatch, src)
    second = convert_cached(src, root)
    assert reads.bytes >= os.path.getsize(src)          # hashed whole
    assert second != first and folders(root) == sorted(os.path.basename(p) for p in (first, second))
    with open(src, "rb") as f:
        assert os.path.basename(second).endswith(hashlib.sha256(f.read()).hexdigest()[:16])


def test_a_memo_of_the_older_layout_is_hashed_again(tmp_path):
    """digests.json entries without the ends' digest (the layout before it) are not trusted: hashed again,
    the same folder found."""
    src = padded_gguf(str(tmp_path / "tiny.gguf"), pad=MIB)
    root = str(tmp_path / "cache")
    first = convert_cached(src, root)
    memo_path = os.path.join(root, MODELS_DIR, DIGESTS_FILE)
    with open(memo_path) as f:
        memo = json.load(f)
    (entry,) = memo.values()
    st = os.stat(src)
    with open(memo_path, "w") as f:
        json.dump({os.path.realpath(src): [st.st_size, st.st_mtime_ns, entry[3]]}, f)
    assert convert_cached(src, root) == first
    with open(memo_path) as f:
        assert len(json.load(f)[os.path.realpath(src)]) == 4
