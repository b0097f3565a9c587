"""The server's log of what it does: its lines on stderr with their time, one line per request that
ended, and a periodic line with the generation and prompt throughput, the queue and the KV pool (at most
one per interval, only while there is something to report)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from rawinfer.frontends.server.handoff import Summary

log = logging.getLogger("rawinfer")


def time_format(name: str) -> str:
    """The logging format of a server's lines: time, level, who, message."""
    return f"%(asctime)s %(levelname)s {name}: %(message)s"


def log_with_time(name: str = "rawinfer", level: int | None = None) -> None:
    """Log lines on stderr as `2025-01-31 12:00:00,123 WARNING name: message` (a server's log is read
    after the fact, against clients' times): the root handler the command line set up gets this format,
    or one is made; level, when given, becomes the root's."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr)
    if level is not None:
        root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(time_format(name)))


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def log_request_done(request_id: str, client: bytes, s: Summary) -> None:
    reasons = ",".join(sorted(set(s.reasons))) or "-"
    log.info("request %s of client %s finished: %d tokens, TTFT %s, e2e %s, %s", request_id, client.hex(),
             s.tokens, _seconds(s.ttft_s), _seconds(s.e2e_s), reasons)


def log_requests_lost(client: bytes, why: str, request_ids: list[str]) -> None:
    log.info("client %s %s: %d request(s) counted as aborted, its final not known delivered: %s", client.hex(),
             why, len(request_ids), ", ".join(request_ids[:8]) + (" ..." if len(request_ids) > 8 else ""))


@dataclass
class PeriodicLog:
    """vLLM-style throughput line, from the engine's cumulative counters."""
    interval_s: float
    last_time: float
    last_generated: int = 0
    last_processed: int = 0

    def due(self, now: float) -> bool:
        return now - self.last_time >= self.interval_s

    def emit(self, now: float, stats: dict, in_flight: int) -> None:
        """Log one line if anything happened or is going on since the last one; restart the interval."""
        gen, proc = stats.get("tokens_generated", 0), stats.get("tokens_processed", 0)
        span = max(now - self.last_time, 1e-9)
        d_gen, d_proc = gen - self.last_generated, proc - self.last_processed
        self.last_time, self.last_generated, self.last_processed = now, gen, proc
        if not (d_gen or d_proc or in_flight):
            return
        log.info("generation %.1f tokens/s, prompt %.1f tokens/s, running %d, waiting %d, requests in flight %d, "
                 "KV %.1f%% (%d of %d blocks), prefix cache hit rate %.1f%%", d_gen / span,
                 max(d_proc - d_gen, 0) / span, stats.get("running", 0), stats.get("waiting", 0), in_flight,
                 100 * stats.get("kv_usage", 0.0), stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0),
                 100 * (stats.get("prefix_cache_hit_rate") or 0.0))
