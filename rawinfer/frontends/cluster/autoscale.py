"""The autoscaling rule on queue depth: the number of replicas the router should have, given how many
requests each serving replica holds.

Queue depth is requests in flight per serving replica, waiting-for-a-replica ones included. When it stays
above `up_depth` for `up_after_s`, one replica is added (up to `max_replicas`); when it stays at or below
`down_depth` for `down_after_s`, one is removed (down to `min_replicas`), drained first by the router.
One change at a time: the clock restarts after each, so a replica that is still loading is not
mistaken for missing capacity twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from rawinfer.settings import SECONDS, check_options, float_argument, int_argument, is_int, is_number, option


_positive = {"check": lambda v: is_number(v) and v > 0, "what": "a positive number"}


@dataclass
class AutoscaleConfig:
    """The autoscaling rule's settings; those with a flag are `rawinfer serve --replicas`'s --autoscale-*."""

    min_replicas: int = option(flag=None, check=lambda v: is_int(v) and v >= 1, what="a positive integer",
                               help="replicas kept when idle (the command line's --replicas)")
    max_replicas: int = option(
        flag="--autoscale-max", parse=int_argument, metavar="N", cli_default=None,
        check=lambda v: is_int(v) and v >= 1, what="a positive integer",
        help="add replicas up to N while requests per replica stay above --autoscale-queue-depth, and remove them "
             "down to --replicas when idle (default: no autoscaling)")
    up_depth: float = option(8.0, flag="--autoscale-queue-depth", parse=float_argument, metavar="Q", **_positive,
                             help="requests in flight per serving replica that count as a queue (default: 8)")
    down_depth: float = option(0.5, flag=None, check=lambda v: is_number(v) and v >= 0, what="a number >= 0",
                               help="requests in flight per serving replica at or below which replicas count as idle")
    up_after_s: float = option(10.0, flag="--autoscale-up-after", **SECONDS,
                               help="how long the queue must last before a replica is added (default: 10)")
    down_after_s: float = option(60.0, flag="--autoscale-down-after", **SECONDS,
                                 help="how long replicas must stay idle before one is removed (default: 60)")

    def __post_init__(self):
        check_options(self, "autoscale option")
        if not self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling needs 1 <= minimum replicas <= maximum replicas, got "
                             f"{self.min_replicas} and {self.max_replicas}")


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig, now: float):
        self.cfg = cfg
        self._high_since: float | None = None
        self._low_since: float | None = None
        self._last_change = now

    def target(self, now: float, current: int, in_flight: int, serving: int) -> int:
        """The replica count to aim for now (current when nothing should change)."""
        cfg = self.cfg
        depth = in_flight / max(serving, 1)
        self._high_since = (self._high_since or now) if depth > cfg.up_depth else None
        self._low_since = (self._low_since or now) if depth <= cfg.down_depth else None
        quiet = now - self._last_change
        if self._high_since is not None and current < cfg.max_replicas \
                and now - self._high_since >= cfg.up_after_s and quiet >= cfg.up_after_s:
            self._last_change, self._high_since = now, None
            return current + 1
        if self._low_since is not None and current > cfg.min_replicas \
                and now - self._low_since >= cfg.down_after_s and quiet >= cfg.down_after_s:
            self._last_change, self._low_since = now, None
            return current - 1
        return max(cfg.min_replicas, min(current, cfg.max_replicas))
