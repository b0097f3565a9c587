"""Waking the I/O thread from a blocking poll: a socket pair the poll watches, written by the worker threads
when they have messages to send and by the C-level signal handler (signal.set_wakeup_fd).

NOTE: a signal may be delivered to any thread of the process. CPython's C handler only flags it; the Python
handler runs later on the main thread, when that thread next executes bytecode. A main thread blocked in
zmq's poll() would sleep on (until the next message arrives) were the handler's byte not written to a file
descriptor the poll watches: set_wakeup_fd makes the C handler do exactly that, whichever thread it ran on.
"""

from __future__ import annotations

import signal
import socket
import threading
from dataclasses import dataclass
from typing import Callable


@dataclass
class Wakeup:
    """A non-blocking socket pair: set() from any thread (or a signal), the poll watches `reader`."""
    reader: socket.socket
    writer: socket.socket

    @classmethod
    def create(cls) -> "Wakeup":
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        return cls(r, w)

    def set(self) -> None:
        try:
            self.writer.send(b"x")
        except (BlockingIOError, OSError):    # bytes already pending (enough to wake), or closed at shutdown
            pass

    def clear(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def install_stop_signals(wake: Wakeup, stop: Callable[[], None]) -> Callable[[], None]:
    """On the main thread: SIGINT and SIGTERM call stop(), and any signal writes to `wake` so that a blocking
    poll returns and the handler runs. Returns the function that restores what was there before (a no-op
    off the main thread, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = [(sig, signal.getsignal(sig)) for sig in (signal.SIGINT, signal.SIGTERM)]
    old_fd = signal.set_wakeup_fd(wake.writer.fileno(), warn_on_full_buffer=False)
    for sig, _ in previous:
        signal.signal(sig, lambda signum, frame: stop())

    def restore() -> None:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous:
            signal.signal(sig, handler)
    return restore
