"""A live line on the terminal while something of unknown length runs (loading a model, compiling its
kernels): its name and the seconds so far, so that a wait is never silent.

The engine's own log lines (what it loaded, that it is warming up) still appear, printed above the
live line. Nothing is drawn when stderr is not a terminal or with -q (tqdm's rule for every bar here).
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

TICK_S = 0.5        # how often the elapsed time is redrawn


@contextmanager
def ticking(desc: str, enabled: bool = True) -> Iterator[None]:
    """`desc 3s` on stderr, redrawn every TICK_S, while the body runs; removed when it ends."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    bar = tqdm(total=None, desc=desc, bar_format="{desc} {elapsed}", leave=False, file=sys.stderr,
               disable=None if enabled else True)
    if bar.disable:
        yield
        return
    stop = threading.Event()

    def redraw() -> None:
        while not stop.wait(TICK_S):
            bar.refresh()
    ticker = threading.Thread(target=redraw, name="rawinfer-progress", daemon=True)
    ticker.start()
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger()]):
            yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
