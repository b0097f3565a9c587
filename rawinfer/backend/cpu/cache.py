"""Keep Numba's disk cache of the CPU kernels consistent with their sources.

Numba checks a cached kernel against the timestamp of the file that defines it, and nothing else.
Our kernels inline code from the other files of rawinfer/backend/cpu/ (llvm.py's AVX2 blocks,
kernels.py's helpers), so after editing one of those in a working tree (a `git pull`, a local change)
the kernels of an unchanged file would load stale machine code. `refresh()` keeps a digest of every
.py source of that directory (and the Numba version) next to the cache files and, when it differs,
deletes the CPU kernels' cache entries so they recompile once. Importing this module does nothing:
the CPU backend calls `refresh()` explicitly, once, when it starts, before its first kernel call
loads a cached build (and the test suite once per session). A fresh install writes every file anew,
so there it changes nothing.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os

_STAMP = "rawinfer-cpu-kernels.sha1"


def _cache_dirs(here: str) -> list[str]:
    dirs = [os.path.join(here, "__pycache__")]          # Numba's in-tree cache (a writable checkout)
    try:
        from numba.core import config
        from numba.core.caching import _CacheLocator
        if config.CACHE_DIR:                             # NUMBA_CACHE_DIR
            sub = _CacheLocator.get_suitable_cache_subpath(os.path.join(here, "kernels.py"))
            dirs.append(os.path.join(config.CACHE_DIR, sub))
    except Exception:  # noqa: BLE001 - another Numba layout: only the in-tree cache is checked
        pass
    return dirs


def digest(here: str) -> str:
    import numba
    h = hashlib.sha1(numba.__version__.encode())
    for path in sorted(glob.glob(os.path.join(here, "*.py"))):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def refresh(here: str | None = None) -> list[str]:
    """Delete cached CPU kernels built from other sources than the current ones; returns what it
    deleted. Never raises (a read-only or missing cache directory is left as it is)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    removed = []
    try:
        want = digest(here)
    except OSError:
        return removed
    for d in _cache_dirs(here):
        stamp = os.path.join(d, _STAMP)
        try:
            with open(stamp) as f:
                if f.read().strip() == want:
                    continue
        except OSError:
            pass
        try:
            os.makedirs(d, exist_ok=True)
            for path in glob.glob(os.path.join(d, "*.nb[ic]")):
                os.remove(path)
                removed.append(path)
            tmp = f"{stamp}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(want + "\n")
            os.replace(tmp, stamp)
        except OSError:
            continue
    return removed


@functools.cache
def refresh_once() -> None:
    """refresh() the package's own cache once per process (the CPU backend calls it when it starts)."""
    refresh()
