"""The disk tier's room as its filesystem has it, for the placement directory (vLLM scheduler process).

The configured disk size is an upper bound. When another process fills the
filesystem, the disk tier would refuse planned writes (its safety net,
``lmi_cache_tier_safety_net_total{reason="no_space"}``) because the directory
planned against the configured size only. So the directory also plans against
the filesystem: each budget (a rank's share of one disk directory) may hold
what it has confirmed there plus its share of the free space, less a margin,
and the directory evicts its oldest entries when that shrinks under them.

The scheduler asks the filesystem itself (``statvfs`` of the configured
directories): the scheduler and the workers of a replica share the host, and
asking here keeps the workers' reports and the step metadata unchanged. Free
space is split evenly between every budget on one filesystem (all ranks of all
data-parallel replicas, every directory on it), so ranks never count the same
free bytes twice. Only confirmed entries count as held: a pending entry's file
may not be written yet, so counting it would promise bytes the filesystem no
longer has.

The margin is twice the headroom the disk tier keeps free itself
(``tiers.disk.space``), so the directory plans below the point where the tier
refuses a write: the safety net fires only if the filesystem loses more than
one headroom between two checks. ``statvfs`` is asked at most once per
``space.CHECK_INTERVAL_S``, like the tier asks; between checks the last limits
stand (bytes the directory places since then come out of its budgets).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from lmi_cache.tiers.disk import space

# Budget key: (rank, disk directory number).
BudgetKey = tuple[int, int]


def _filesystem_of(path: str) -> tuple[int, str]:
    """(device id, an existing path on it) of the filesystem that holds or will hold ``path``."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # a directory the workers create later lands on its parent's filesystem
    return os.stat(path).st_dev, path


class DiskSpaceWatch:
    """Limits on the disk budgets of one replica's ranks from the free space of their filesystems."""

    def __init__(self, roots: Sequence[str], num_ranks: int, *, num_replicas: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._roots = list(roots)
        self._num_ranks = num_ranks
        self._num_replicas = max(1, num_replicas)
        self._clock = clock
        self._checked_at: float | None = None

    def limits(self, ready_bytes: Callable[[int, int], int]) -> dict[BudgetKey, int | None] | None:
        """The most each (rank, directory) budget may hold now (None: unknown, the configured size stands), or
        None between checks. ``ready_bytes(rank, directory)``: what the directory has confirmed there."""
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < space.CHECK_INTERVAL_S:
            return None
        self._checked_at = now
        shards_by_fs: dict[int, list[int]] = {}
        probe_path: dict[int, str] = {}
        limits: dict[BudgetKey, int | None] = {}
        for shard, root in enumerate(self._roots):
            try:
                device, path = _filesystem_of(root)
            except OSError:
                limits.update({(rank, shard): None for rank in range(self._num_ranks)})
                continue
            shards_by_fs.setdefault(device, []).append(shard)
            probe_path.setdefault(device, path)
        for device, shards in shards_by_fs.items():
            try:
                free_bytes, headroom_bytes = space.free_and_headroom_bytes(probe_path[device])
            except OSError:
                limits.update({(rank, shard): None for rank in range(self._num_ranks) for shard in shards})
                continue
            # Negative when the filesystem is below the margin: every budget then gives some of its bytes back.
            share = (free_bytes - 2 * headroom_bytes) // (len(shards) * self._num_ranks * self._num_replicas)
            for shard in shards:
                for rank in range(self._num_ranks):
                    limits[(rank, shard)] = max(0, ready_bytes(rank, shard) + share)
        return limits
