"""`StatsLog`: a cache's counters as one log line every so often (`CacheStats.summary`), each
line covering the time since the one before, for a server's logs: hit rate, where hit rows came
from, and what the cache holds.

Engine thread: `tick` once per step (a clock read; every ``interval_s``, where the log's logger
shows INFO, a `PrefixCache.stats` call, which takes the cache's locks briefly, and a line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from omni_pcache.errors import ConfigError
from omni_pcache.stats import CacheStats
from omni_pcache.validation import is_seconds

logger = logging.getLogger("omni_pcache")


class _HasStats(Protocol):
    def stats(self) -> CacheStats: ...


def check_interval(interval_s: object, name: str) -> float | None:
    """``interval_s`` as a log interval: ``None`` (no log) or a number of seconds >= 0
    (`validation.is_seconds`; 0: a line every step); anything else raises `ConfigError`
    naming ``name``."""
    if interval_s is None:
        return None
    if not is_seconds(interval_s):
        raise ConfigError(f"{name} must be None or a number of seconds >= 0, got {interval_s!r}")
    return float(interval_s)  # type: ignore[arg-type]


class StatsLog:
    """Logs the summary of a cache's counters at INFO on ``log`` (default: the ``omni_pcache``
    logger) at most once per ``interval_s`` seconds of ``clock``, counting from this log's
    making."""

    def __init__(
        self,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger = logger,
    ) -> None:
        self._interval = interval_s
        self._clock = clock
        self._log = log
        self._since_time = clock()
        self._since: CacheStats | None = None  # (the snapshot of the last line; None: the cache's start)

    def tick(self, cache: _HasStats) -> None:
        """Logs a line when ``interval_s`` has passed since the last one (engine thread)."""
        now = self._clock()
        if now - self._since_time < self._interval or not self._log.isEnabledFor(logging.INFO):
            return
        stats = cache.stats()
        self._log.info("omni_pcache: last %.1f s: %s", now - self._since_time, stats.summary(self._since))
        self._since, self._since_time = stats, now


__all__ = ["StatsLog", "check_interval"]
