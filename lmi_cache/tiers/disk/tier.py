"""Persistent disk tier: one file per chunk, async writes, index rebuilt at start (torch-free, worker).

Layout: ``<dir>/<hex[:2]>/<hex>.lmc`` (see ``object_files``). Several directories
share the configured size equally; a chunk's directory is chosen by its digest.
At start-up the directories are scanned (names and stat only) to rebuild the
index, so a restarted process serves what the last one wrote (the placement
directory adopts the same files oldest first; loads refresh the mtime to keep
that order).

A store, not a cache: it writes what the placement directory planned
(``entry_sizes.disk_entry_bytes`` reserved) and deletes what it evicts. Its
size is a safety net only: a write that would take a directory past it (or
past its filesystem's free space) is refused and counted
(``lmi_cache_tier_safety_net_total``), never met by an eviction of its own,
and reported dropped so the directory forgets the entry.

Writes go through a bounded queue to a few worker threads, each holding a
reference to the chunk object it writes (no copy): when the queue is full the
put is dropped and counted, the caller never waits (``writes.DiskWriter``).
The read path (``reads.DiskReader``) serves queued chunks from memory and
verifies files.

A directory is used only when it is ours, private and not held by another
live engine (``trust``); otherwise it is off (one warning, a metric) and
the tier runs without it. Each directory's size shrinks to the free space of
its filesystem when that is smaller (``space``).
"""
from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.private_dir import UnsafeDirectoryError
from lmi_cache.tiers.disk import object_files, trust
from lmi_cache.tiers.base import HitBatch, DropCallback, Tier
from lmi_cache.tiers.disk.index import DiskIndex
from lmi_cache.tiers.disk.reads import DiskReader
from lmi_cache.tiers.disk.writes import DiskWriter
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.tiers.factory import TierContext

logger = logging.getLogger(__name__)


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        dirs: Sequence[str],
        capacity_bytes: int,
        *,
        metrics: CacheMetrics,
        warner: RateLimitedWarner,
        allocator: HostAllocator | None = None,
        use_odirect: bool = False,
        fsync: bool = False,
        num_workers: int = 2,
        num_readers: int = 4,
        queue_depth: int = 64,
        on_drop: DropCallback | None = None,
    ) -> None:
        self._metrics = metrics
        self._warner = warner
        self._on_drop = on_drop
        self._index = DiskIndex(dirs, capacity_bytes, use_odirect)
        self.writer = DiskWriter(
            self.name, self._index, metrics=metrics, warner=warner, fsync=fsync, num_workers=num_workers,
            queue_depth=queue_depth, fault=self._fault, dropped=self._notify_dropped, remove=self.remove,
            report_usage=self._report_usage,
        )
        self.reader = DiskReader(
            self.name, self._index, allocator if allocator is not None else HostAllocator(page_locked=False),
            claim_pending=self.writer.claim_pending, forget=self._forget, fault=self._fault,
            untrusted=self._untrusted, metrics=metrics, warner=warner, num_workers=num_readers,
        )
        self._dir_locks: list[trust.DirLock] = []
        for number in range(len(self._index.shards)):
            self._open_shard(number)
        self._report_usage()

    def _open_shard(self, number: int) -> None:
        shard = self._index.shards[number]
        try:
            self._dir_locks.append(trust.acquire_tier_dir(shard.root))
        except UnsafeDirectoryError as err:
            shard.enabled = False
            busy = isinstance(err, trust.DirectoryBusy)
            self._metrics.untrusted(self.name, "busy_dir" if busy else "unsafe_dir")
            logger.warning("disk tier: %s; the disk tier is off for this directory", err)
            return
        try:
            files = object_files.scan_root(shard.root, on_untrusted=self._untrusted)
        except OSError as err:
            self._metrics.error(self.name, "scan")
            logger.warning("disk tier: cannot use %s (%s); it stays empty", shard.root, err.strerror)
            return
        self._index.adopt(number, files)  # over its size if the size shrank: the directory evicts the excess
        self.writer.follow_free_space(number)
        if files:
            logger.info("disk tier: %d chunks (%d bytes) found in %s", len(files), shard.used_bytes, shard.root)

    # ------------------------------------------------------------ Tier
    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def uses_odirect(self) -> bool:
        """Whether any directory still writes with O_DIRECT (False after a fallback)."""
        return any(shard.odirect for shard in self._index.shards)

    @property
    def queued_writes(self) -> int:
        return self.writer.inflight

    def contains(self, digest: bytes) -> bool:
        return digest in self._index or self.writer.is_pending(digest)

    def digests(self) -> list[bytes]:
        return self._index.digests()

    def remove(self, digest: bytes) -> bool:
        self.writer.cancel(digest)  # queued or being written: deleted once written
        where = self._index.forget(digest)
        if where is None:
            return False
        self._delete(where[0], [digest])
        self._report_usage()
        return True

    def clear(self) -> None:
        self.flush()
        for digest, number in self._index.clear():
            self._delete(number, [digest])
        self._report_usage()

    def close(self) -> None:
        self.flush()
        self.reader.close()
        self.writer.close()
        for lock in self._dir_locks:
            lock.release()
        self._dir_locks.clear()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued writes are done; False on timeout."""
        return self.writer.flush(timeout_s)

    # ------------------------------------------------------------ data path
    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        return self.reader.get_many(keys)

    def put(self, obj: ChunkObject) -> bool:
        """Queue a write of one chunk object (holding a reference until written); never blocks (False: dropped)."""
        return self.writer.put(obj)

    def _delete(self, number: int, digests: list[bytes]) -> None:
        """Unlink files already taken out of the index (outside the lock)."""
        root = self._index.shards[number].root
        for digest in digests:
            try:
                trust.unlink_if_ours(object_files.object_path(root, digest))  # never someone else's file
            except OSError as err:
                self._fault("delete", err, root)

    def _notify_dropped(self, digests: list[bytes]) -> None:
        if self._on_drop is not None:
            for digest in digests:
                self._on_drop(digest)

    def _fault(self, op: str, err: OSError, path: str) -> None:
        code = errno.errorcode.get(err.errno or 0, "error")
        self._metrics.error(self.name, op)
        self._warner.warn(f"disk-{op}-{code}", f"disk tier: {op} failed for {path}: {code} ({err.strerror}); treated as a miss")

    def stats(self) -> dict[str, int | float]:
        return {**super().stats(), "disk_queued_writes": self.queued_writes}

    def _forget(self, digest: bytes, unlink: bool = False) -> None:
        where = self._index.forget(digest)
        if where is not None:
            if unlink:
                self._delete(where[0], [digest])
            self._notify_dropped([digest])
            self._report_usage()

    def _untrusted(self, reason: str) -> None:
        self._metrics.untrusted(self.name, reason)
        self._warner.warn(f"disk-untrusted-{reason}", f"disk tier: ignored an entry that is not ours ({reason})")

    def _report_usage(self) -> None:
        self._metrics.usage(self.name, self.used_bytes, self.capacity_bytes)


def build(config: CacheConfig, context: TierContext) -> DiskTier | None:
    """This rank's disk tier (``local_disk``, ``max_local_disk_size``), or None when it is 0."""
    if config.disk_capacity_bytes <= 0:
        return None
    from lmi_cache.tiers.disk.ranks import rank_disk_dirs

    return DiskTier(
        rank_disk_dirs(config.local_disk, context.rank_label), config.disk_capacity_bytes, metrics=context.metrics, warner=context.warner,
        allocator=context.allocator, use_odirect=config.use_odirect,
        fsync=config.disk_fsync, num_workers=config.disk_write_workers, num_readers=config.disk_read_workers,
        queue_depth=config.disk_queue_depth, on_drop=context.on_drop,
    )
