"""Where the CPU kernels' compiled code is kept: the user's kernel cache, shared by every checkout.

Numba's disk cache keys a build by the function's bytecode, its argument types, the target CPU (its
name and features: a machine with other features never loads code built for another) and the content
of the file that defines it. Two things it does not do on its own: it does not see the code a kernel
inlines from the other files of this package (llvm.py's blocks, kernels.py's helpers), and it keeps
the builds next to the sources (`__pycache__`), so every new clone, venv or checkout compiles again.

`install(root)` points the package's kernels at one folder of the user's cache instead:

    <root>/kernels/<rawinfer version>-<digest of Numba's version and every .py source of this package>/

An edit anywhere in the package starts a new folder (the old ones are pruned, the newest few kept);
the same sources anywhere on the machine share one. The CPU backend installs it when it starts
(EngineConfig.cache_dir, RAWINFER_CACHE); importing this module changes nothing. Where the folder
cannot be written, Numba's own locations are used as before.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import pickle
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
KEEP_FOLDERS = 4            # kernel folders of other source versions kept in the cache


def digest(package_dir: str = HERE) -> str:
    """sha1 over Numba's version and every .py file of package_dir (names and contents)."""
    import numba
    h = hashlib.sha1(numba.__version__.encode())
    for path in sorted(glob.glob(os.path.join(package_dir, "*.py"))):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()


def kernel_dir(root: str, package_dir: str = HERE) -> str:
    """The folder this package's kernels are cached in under cache root `root`."""
    from rawinfer.config import VERSION
    return os.path.join(os.path.expanduser(root), "kernels", f"{VERSION}-{digest(package_dir)[:16]}")


def _locator_class(directory: str, package_dir: str):
    """A Numba cache locator for the functions defined in package_dir, keeping them in `directory`."""
    from numba.core.caching import _CacheLocator, _SourceFileBackedLocatorMixin

    class KernelCacheLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
        rawinfer_directory = directory

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno

        def get_cache_path(self):
            return directory

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.dirname(os.path.abspath(py_file)) != package_dir:
                return None
            return super().from_function(py_func, py_file)   # None where the folder cannot be written

    return KernelCacheLocator


def _dispatchers(package: str = "rawinfer.backend.cpu") -> list:
    """Every cached Numba dispatcher the package's loaded modules define (Kernel holds two builds)."""
    import sys

    from numba.core.dispatcher import Dispatcher
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(package + ".") or module is None:
            continue
        for value in vars(module).values():
            for d in (value, getattr(value, "serial", None), getattr(value, "parallel", None)):
                if isinstance(d, Dispatcher) and getattr(d, "_cache", None) is not None \
                        and type(d._cache).__name__ != "NullCache" and d not in found:
                    found.append(d)
    return found


def locator_classes() -> list:
    """Numba's list of cache locator classes, tried in order for every cached function (the class that
    holds it is CacheImpl in current Numba, _CacheImpl before)."""
    from numba.core import caching
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    return impl._locator_classes


def install(root: str, package_dir: str = HERE) -> str | None:
    """Cache this package's kernels under `root` (see the module docstring); returns the folder, or None
    where it cannot be created (Numba's own locations stay in use). Idempotent."""
    directory = kernel_dir(root, package_dir)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None
    classes = locator_classes()
    mine = [c for c in classes if getattr(c, "rawinfer_directory", None) is not None]
    if not (mine and mine[0].rawinfer_directory == directory):
        for c in mine:
            classes.remove(c)
        classes.insert(0, _locator_class(directory, package_dir))
        for d in _dispatchers():          # kernels defined before now pick their cache again
            d.enable_caching()
    _prune(os.path.dirname(directory), keep=directory)
    return directory


def merge(src: str, dst: str) -> int:
    """Copy into kernel folder `dst` the compiled builds that kernel folder `src` holds and `dst` lacks;
    returns how many. For a compile helper's private folder (engine/compile_helper.py): only the caller
    writes `dst` meanwhile. Numba keeps one index per function (a .nbi file: the source file's stamp and
    a dict from key to data file) and one .nbc data file per build; a key names the argument types,
    the target CPU and the function's bytecode, so a copied build loads exactly where the same function
    is called with the same types. A build `dst` already has, or an index `src` cannot read, is left."""
    import numba
    from numba.core.caching import IndexDataCacheFile
    merged = 0
    for index in sorted(glob.glob(os.path.join(src, "*.nbi"))):
        base = os.path.basename(index)[:-len(".nbi")]
        try:
            with open(index, "rb") as f:                   # Numba's layout: its version, then (stamp, dict)
                version = pickle.load(f)
                stamp, theirs = pickle.loads(f.read())
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            continue
        if version != numba.__version__:
            continue
        ours = IndexDataCacheFile(dst, base, stamp)
        have = ours._load_index()                          # {} where absent or stamped by other sources
        taken, before = set(have.values()), merged
        for key, name in theirs.items():
            if key in have or not os.path.isfile(os.path.join(src, name)):
                continue
            new = next(n for n in map(ours._data_name, itertools.count(1)) if n not in taken)
            tmp = os.path.join(dst, f"{new}.tmp.{os.getpid()}")
            shutil.copyfile(os.path.join(src, name), tmp)
            os.replace(tmp, os.path.join(dst, new))       # the data file first: an index never names a missing one
            have[key] = new
            taken.add(new)
            merged += 1
        if merged > before:
            ours._save_index(have)
    return merged


def _prune(parent: str, keep: str) -> None:
    """Delete kernel folders of other source versions beyond the KEEP_FOLDERS most recently used."""
    try:
        others = sorted((p for p in glob.glob(os.path.join(parent, "*")) if p != keep and os.path.isdir(p)),
                        key=os.path.getmtime, reverse=True)
        os.utime(keep)
    except OSError:
        return
    for path in others[KEEP_FOLDERS - 1:]:
        shutil.rmtree(path, ignore_errors=True)
