"""The disk tier's budget follows the free space of its filesystem (torch-free, worker process).

The configured size (GiB per rank) is an upper bound. When other files fill
the filesystem, the effective budget of a directory shrinks to what the tier
already holds there plus what is still free, less a small headroom; a write
past it is refused (the tier's safety net) instead of failing with ENOSPC.
The placement directory asks the same filesystems (``placement.disk_space``,
with twice this headroom) and evicts the tier's oldest chunks before it gets
there. ``statvfs`` is asked at most once per ``CHECK_INTERVAL_S`` per
directory (and right after a write failed for lack of space); between checks
the last answer stands.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

CHECK_INTERVAL_S = 1.0
# Left free for everybody else: 1% of the filesystem, at most 1 GiB.
HEADROOM_FRACTION = 0.01
HEADROOM_MAX_BYTES = 1 << 30


def free_and_headroom_bytes(path: str) -> tuple[int, int]:
    """(bytes an unprivileged writer may still use, bytes to leave free) of the filesystem holding ``path``."""
    info = os.statvfs(path)
    total = info.f_blocks * info.f_frsize
    return info.f_bavail * info.f_frsize, min(HEADROOM_MAX_BYTES, int(total * HEADROOM_FRACTION))


class FreeSpaceLimit:
    """Rate-limited ``statvfs`` of one directory, turned into a byte limit for the tier there."""

    def __init__(
        self,
        path: str,
        probe: Callable[[str], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._probe = probe if probe is not None else (lambda root: free_and_headroom_bytes(root))
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._free_bytes: int | None = None
        self._headroom_bytes = 0
        self._used_at_check = 0

    def invalidate(self) -> None:
        """Ask ``statvfs`` again at the next ``limit_bytes`` (a write just failed with ENOSPC)."""
        with self._lock:
            self._checked_at = None

    def limit_bytes(self, used_bytes: int) -> int | None:
        """The most the tier may hold in this directory now, given it holds ``used_bytes``; None: unknown.

        Between checks the limit stays what the last check found: bytes the tier
        writes (or deletes) since then come out of (or back into) the free space
        it measured, so its own writes never look like someone else's.
        """
        now = self._clock()
        with self._lock:
            if self._checked_at is None or now - self._checked_at >= CHECK_INTERVAL_S:
                self._checked_at = now
                try:
                    self._free_bytes, self._headroom_bytes = self._probe(self._path)
                except OSError:
                    self._free_bytes = None
                self._used_at_check = used_bytes
            if self._free_bytes is None:
                return None
            return max(0, self._used_at_check + self._free_bytes - self._headroom_bytes)
