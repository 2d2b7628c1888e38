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
put is dropped and counted, the caller never waits. The read path
(``reads.DiskReader``) serves queued chunks from memory and verifies files.

A directory is used only when it is ours, private and not held by another
live engine (``trust``); otherwise it is off (one warning, a metric) and
the tier runs without it. Each directory's size shrinks to the free space of
its filesystem when that is smaller (``space``).
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.private_dir import UnsafeDirectoryError
from lmi_cache.thread_affinity import unpin_current_thread
from lmi_cache.tiers.disk import object_files, trust
from lmi_cache.tiers.base import HitBatch, DropCallback, Tier
from lmi_cache.tiers.disk.index import DiskIndex
from lmi_cache.tiers.disk.reads import DiskReader
from lmi_cache.tiers.disk.space import FreeSpaceLimit
from lmi_cache.tiers.entry_sizes import disk_entry_bytes
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
        self._fsync = fsync
        self._on_drop = on_drop
        self._index = DiskIndex(dirs, capacity_bytes, use_odirect)
        self._lock = threading.Lock()  # guards the write queue state; the index has its own
        self._pending: dict[bytes, ChunkObject] = {}  # queued or being written, each with our reference
        self._cancelled: set[bytes] = set()  # pending writes removed meanwhile: not kept once written
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[ChunkObject | None] = queue.Queue(maxsize=queue_depth)
        self.reader = DiskReader(
            self.name, self._index, allocator if allocator is not None else HostAllocator(page_locked=False),
            claim_pending=self._claim_pending, forget=self._forget, fault=self._fault, untrusted=self._untrusted,
            metrics=metrics, warner=warner, num_workers=num_readers,
        )
        self._dir_locks: list[trust.DirLock] = []
        self._space = [FreeSpaceLimit(shard.root) for shard in self._index.shards]
        for number in range(len(self._index.shards)):
            self._open_shard(number)
        self._report_usage()
        self._workers = [
            threading.Thread(target=self._work, name=f"lmi-disk-writer-{i}", daemon=True) for i in range(num_workers)
        ]
        for worker in self._workers:
            worker.start()

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
        self._follow_free_space(number)
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
        return self._inflight

    def contains(self, digest: bytes) -> bool:
        return digest in self._index or digest in self._pending

    def digests(self) -> list[bytes]:
        return self._index.digests()

    def remove(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._pending:  # queued or being written: deleted once written (``_write``)
                self._cancelled.add(digest)
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
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join(timeout=5.0)
        for lock in self._dir_locks:
            lock.release()
        self._dir_locks.clear()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued writes are done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    # ------------------------------------------------------------ data path
    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        return self.reader.get_many(keys)

    def _claim_pending(self, digest: bytes) -> ChunkObject | None:
        with self._lock:
            obj = self._pending.get(digest)
            return obj.acquire() if obj is not None else None

    def put(self, obj: ChunkObject) -> bool:
        """Queue a write of one chunk object (holding a reference until written); never blocks (False: dropped)."""
        digest = obj.key.digest
        shard = self._index.shards[self._index.shard_for(digest)]
        reason = None
        with self._lock:
            if digest in self._index or digest in self._pending:
                reason = "present"
            elif not shard.enabled:
                reason = "tier_off"
            elif disk_entry_bytes(obj.header.payload_bytes, shard.odirect) > shard.capacity_bytes:
                reason = "too_large"
            else:
                obj.acquire()
                try:
                    self._queue.put_nowait(obj)
                except queue.Full:
                    obj.release()
                    reason = "queue_full"
                else:
                    self._pending[digest] = obj
                    self._inflight += 1
        if reason is not None:
            if reason != "present":
                self._metrics.dropped(self.name, reason)
            return reason == "present"
        return True

    def _work(self) -> None:
        unpin_current_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception:  # a bug must not kill the writer thread
                logger.exception("disk tier: unexpected error writing a chunk")
            finally:
                with self._idle:
                    self._pending.pop(job.key.digest, None)
                    self._cancelled.discard(job.key.digest)
                    self._inflight -= 1
                    self._idle.notify_all()
                job.release()

    def _write(self, job: ChunkObject) -> None:
        start_s = time.perf_counter()
        digest = job.key.digest
        number = self._index.shard_for(digest)
        shard = self._index.shards[number]
        payload = job.payload_array()
        header = job.header.with_checksum(payload)
        reserve = disk_entry_bytes(header.payload_bytes, shard.odirect)  # at most what the directory reserved
        self._follow_free_space(number)
        if not self._index.reserve(number, reserve):  # past the directory's size or the filesystem's free space
            self._metrics.safety_net(self.name, "no_space")
            self._warner.warn("disk-full", f"disk tier: {shard.root} has no room for a planned write "
                                           f"({shard.used_bytes} of {shard.budget_bytes} bytes used); not stored")
            self._notify_dropped([digest])
            return
        path = object_files.object_path(shard.root, digest)
        size = 0
        try:
            try:
                size = object_files.write_object_file(
                    path, header, payload, odirect=shard.odirect, fsync=self._fsync, object_buffer=job.buffer.numpy()
                )
            except object_files.OdirectUnsupported:
                shard.odirect = False
                logger.warning("disk tier: %s refuses O_DIRECT; using buffered I/O there", shard.root)
                size = object_files.write_object_file(path, header, payload, odirect=False, fsync=self._fsync)
        except OSError as err:
            self._index.unreserve(number, reserve)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                self._space[number].invalidate()
            self._fault("write", err, path)
            self._notify_dropped([digest])
            return
        self._index.commit(number, digest, reserve, size)
        with self._lock:
            cancelled = digest in self._cancelled
        if cancelled:  # the directory removed it while it was being written
            self.remove(digest)
            return
        self._metrics.stored(self.name, header.num_tokens, size, time.perf_counter() - start_s)
        self._report_usage()

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

    def _follow_free_space(self, number: int) -> None:
        """Shrink (or restore) the shard's size to its filesystem's free space (writes past it are refused)."""
        shard = self._index.shards[number]
        before = shard.budget_bytes
        self._index.set_limit(number, self._space[number].limit_bytes(shard.used_bytes))
        if shard.budget_bytes != before:
            self._report_usage()
            if shard.budget_bytes < shard.capacity_bytes:
                self._warner.warn(
                    "disk-space", f"disk tier: {shard.root} has {shard.budget_bytes} bytes of room left of "
                    f"{shard.capacity_bytes} (the filesystem is filling up); writes past it are refused"
                )

    def _untrusted(self, reason: str) -> None:
        self._metrics.untrusted(self.name, reason)
        self._warner.warn(f"disk-untrusted-{reason}", f"disk tier: ignored an entry that is not ours ({reason})")

    def _report_usage(self) -> None:
        self._metrics.usage(self.name, self.used_bytes, self.capacity_bytes)


def scan_persisted_digests_in(dirs: Sequence[str]) -> set[bytes]:
    """Digests of object files in ``dirs`` by name only (nothing is read or deleted)."""
    digests: set[bytes] = set()
    for root in dirs:
        if trust.tier_dir_problem(root) is None:
            digests.update(f.digest for f in object_files.scan_root(root, remove_garbage=False))
    return digests


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
