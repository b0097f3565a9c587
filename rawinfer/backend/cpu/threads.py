"""How many threads the CPU backend's parallel regions use: all its cores while the machine is otherwise
idle, fewer while other processes keep cores busy.

Why: a parallel region ends when its slowest thread does. A worker that shares its core with a busy
process waits for its time slice in every region, and a decode step has hundreds of regions, so one
busy core can make two threads many times slower than one. Numba's pool can be narrowed between
regions (numba.set_num_threads), which is what `ThreadGovernor` decides: every `interval_s` it reads
how much CPU time the whole machine used (/proc/stat) and how much this process used
(time.process_time), and counts the difference as the cores other processes took. A thread is given
up as soon as one interval shows others took more than `busy` of a core, and taken back once they took
less than `idle` in every interval for `widen_after_s` (the gap between the thresholds, and the wait,
keep it from flapping). The asymmetry follows the costs: a thread too many beside a busy process makes
every region wait for a time slice, a thread too few costs one core's share. The interval is short, as
a whole short request (a hundred decode steps) can end within half a second, and each of its steps
with a busy core beside two threads is several times slower; /proc/stat counts in clock ticks (a
hundredth of a second), so a reading over two cores and 0.1 s is good to about 0.2 of a core. Where
/proc/stat cannot be read it keeps every thread.
"""

from __future__ import annotations

import os
import time
from typing import Callable


def configure_spin(blas_on_numba_pool: bool) -> None:
    """How long Numba's OpenMP workers spin after a parallel region before they sleep (GOMP_SPINCOUNT,
    read once when the pool starts, at its first use; a user's own value wins).

    When every parallel region of a step runs on that one pool (kernels and, through blas.py, the
    GEMMs), a spinning worker is what the next region wants; 100k iterations keep it short enough not
    to starve the step's Python work or other processes afterwards. When the GEMMs run on the BLAS
    library's own pool instead (blas.py unavailable), the two pools' spinning workers take each
    other's cores, so Numba's workers sleep at once (docs/kernels.md)."""
    os.environ.setdefault("GOMP_SPINCOUNT", "100000" if blas_on_numba_pool else "0")


def read_machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (user, nice, system, irq, softirq),
    or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Chooses the thread count of the next parallel regions from other processes' use of the cores."""

    def __init__(self, max_threads: int, cores: int | None = None, interval_s: float = 0.1, busy: float = 0.6,
                 idle: float = 0.3, widen_after_s: float = 0.5,
                 machine: Callable[[], float | None] = read_machine_busy_seconds,
                 process: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic):
        self.max_threads = max(1, max_threads)
        self.cores = cores or available_cores()
        self.interval_s, self.busy, self.idle, self.widen_after_s = interval_s, busy, idle, widen_after_s
        self._machine, self._process, self._clock = machine, process, clock
        self.threads = self.max_threads
        self.others = 0.0                     # cores other processes took over the last interval
        self._calm_since: float | None = None  # start of the run of intervals that would allow a thread more
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._machine()
        return None if busy is None else (self._clock(), busy, self._process())

    def reset(self) -> int:
        """Every thread again, and the other processes' use counted from now on; returns the count."""
        self.threads, self.others, self._calm_since, self._last = self.max_threads, 0.0, None, self._sample()
        return self.threads

    def update(self) -> int:
        """The thread count to use now (cheap between intervals: one clock read)."""
        if self._last is None or self._clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        wall = now[0] - self._last[0]
        others = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self.others = min(max(others, 0.0), float(self.cores))
        self._last = now
        free = self.cores - self.others
        if free > self.threads + 1 - self.idle and self.threads < self.max_threads:
            if self._calm_since is None:
                self._calm_since = now[0] - wall
            if now[0] - self._calm_since >= self.widen_after_s:
                self.threads, self._calm_since = self.threads + 1, None
            return self.threads
        self._calm_since = None
        if free < self.threads - self.busy:
            self.threads = max(1, min(self.threads - 1, int(free + self.busy)))
        return self.threads
