"""The CPU backend's memory: the arena as one anonymous mapping with huge pages, and mapping its KV
region in before the first step (CPUBackend.alloc_arena / prefault)."""

from __future__ import annotations

import numpy as np

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module names it only from 3.12 on


def anonymous_arena(nbytes: int) -> np.ndarray:
    """nbytes of uint8 backed by an anonymous mapping (a plain array where mmap is unavailable)."""
    # Pages cost resident memory only once written (KV blocks as they fill). Linux backs the mapping
    # with 2 MiB pages where it can (MADV_HUGEPAGE): the first write to each page faults, a cost paid
    # inside decode steps as the KV cache fills; 2 MiB pages take 512x fewer faults than 4 KiB ones,
    # and the weights take fewer TLB entries.
    import mmap
    try:
        buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return np.empty(nbytes, dtype=np.uint8)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def populate(arena: np.ndarray, offset: int, nbytes: int, threads: int) -> None:
    """Map arena[offset:offset + nbytes] in now, on `threads` threads, without writing to it."""
    # The first write to each page of the KV cache would otherwise fault inside a kernel, and a fault
    # stalls every thread of the parallel region waiting on it. madvise(MADV_POPULATE_WRITE, Linux >=
    # 5.14) maps the pages in without writing to them. It runs at start, on all threads at once and
    # before the first request: run in the background, it competed with the first requests' prefill.
    # Elsewhere, or on an older kernel: a no-op. (Measurements: docs/kernels.md.)
    import ctypes
    import sys
    import threading
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    page, chunk = 4096, 2 << 20
    start = (arena.ctypes.data + offset + page - 1) // page * page
    end = (arena.ctypes.data + offset + nbytes) // page * page
    chunks = list(range(start, end, chunk))

    def run(mine):
        for a in mine:                               # ctypes drops the GIL during each call
            if madvise(a, min(chunk, end - a), _MADV_POPULATE_WRITE) != 0:
                return                               # EINVAL on old kernels: pages fault in on use
    workers = [threading.Thread(target=run, args=(chunks[i::threads],), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
