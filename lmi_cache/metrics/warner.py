"""A warner that logs each kind of warning at most once per interval (every process: workers, scheduler, peers).

A fault can repeat for every chunk of every step; the first one is logged and
the rest are counted into the next message of the same kind.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict


class RateLimitedWarner:
    """Logs each kind of warning at most once per ``interval_s`` (faults can repeat per chunk)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        extra = f" ({suppressed} similar suppressed)" if suppressed else ""
        self._logger.warning("%s%s", message, extra)
