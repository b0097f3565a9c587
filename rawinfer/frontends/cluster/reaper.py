"""The reaper of a local Ray cluster: a small process that outlives `rawinfer serve --replicas` and, once
serve has ended however it ended (SIGKILL included), stops the processes of the raylet serve started.

Ray ties its head processes (GCS, raylet, dashboard, monitors) to the process that called ray.init with
Linux's parent-death signal, so they die with serve; the raylet's actors die with the raylet. Its two
agents (DashboardAgent, RuntimeEnvAgent) do not: they see the raylet gone within about 2 s, then report
its unexpected death to the GCS, which died too, and wait out that call's fixed 60 s timeout before they
exit. The reaper notes the raylet's children while the cluster starts (the agents are started with the
raylet), waits for the end of a pipe whose other end only serve holds, then SIGKILLs those still running
(the same processes: their start times are compared, so a reused pid is left alone). Their environment
and command line cannot tell them apart: Ray rewrites both to show the process title.

    python -m rawinfer.frontends.cluster.reaper RAYLET_PID    (stdin: the pipe)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

WATCH_S = 30.0                      # how long the raylet's children are noted after the reaper starts
WATCH_EVERY_S = 1.0


def _stat(pid: int | str) -> tuple[bytes, int, int] | None:
    """(command name, parent pid, start time in clock ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(b")") + 2:].split()
    return stat[stat.index(b"(") + 1:stat.rindex(b")")], int(rest[1]), int(rest[19])


def children_of(parent: int, name: bytes | None = None) -> dict[int, int]:
    """The children of `parent` (named `name`, if given): pid -> start time."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(entry)
            if st is not None and st[1] == parent and (name is None or st[0] == name):
                out[int(entry)] = st[2]
    return out


def raylets_of(pid: int) -> list[int]:
    """The raylets that process `pid` started."""
    return list(children_of(pid, b"raylet"))


def start(raylet: int) -> subprocess.Popen:
    """The reaper of the raylet `raylet`, in a session of its own (a terminal's Ctrl-C does not reach it). The
    caller keeps the returned Popen, whose stdin is the pipe, for as long as it lives."""
    return subprocess.Popen([sys.executable, "-m", "rawinfer.frontends.cluster.reaper", str(raylet)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raylet, noted = int(sys.argv[1]), {}
    until = time.monotonic() + WATCH_S
    while True:
        if time.monotonic() < until:
            noted.update(children_of(raylet))
            ready, _, _ = select.select([sys.stdin], [], [], WATCH_EVERY_S)
        else:
            ready = [sys.stdin]             # nothing more to note: wait for the end
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break                           # serve has ended
    for pid, started in noted.items():
        st = _stat(pid)
        if st is not None and st[2] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
