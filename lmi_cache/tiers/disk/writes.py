"""The disk tier's write path: a bounded queue, a few writer threads, the filesystem's room (worker process).

``DiskWriter`` is its own object, given what it needs by the tier (as the
read path, ``reads.DiskReader``, is): the index, the metrics, and the tier's
handlers for faults, dropped entries, removals and usage. A put never waits:
it queues the chunk object with a reference (no copy) or drops it, counted,
when the queue is full. A writer thread then checks the shard's room (its
size, shrunk to its filesystem's free space: ``space``) and writes the file;
a write that does not fit is the safety net (``lmi_cache_tier_safety_net_total``),
reported dropped so the placement directory forgets the entry, never met by
an eviction here.
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from typing import Callable

from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.thread_affinity import unpin_current_thread
from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.disk.index import DiskIndex
from lmi_cache.tiers.disk.reads import Fault
from lmi_cache.tiers.disk.space import FreeSpaceLimit
from lmi_cache.tiers.entry_sizes import disk_entry_bytes
from lmi_cache.tiers.host_memory import ChunkObject

logger = logging.getLogger(__name__)

Dropped = Callable[[list[bytes]], None]  # entries the tier lost (the placement directory forgets them)
Remove = Callable[[bytes], bool]  # the tier's own removal (index and file)
ReportUsage = Callable[[], None]


class DiskWriter:
    """Queued writes of one disk tier, each holding a reference to its chunk object until written."""

    def __init__(self, name: str, index: DiskIndex, *, metrics: CacheMetrics, warner: RateLimitedWarner,
                 fsync: bool, num_workers: int, queue_depth: int, fault: Fault, dropped: Dropped, remove: Remove,
                 report_usage: ReportUsage) -> None:
        self.name = name
        self._index = index
        self._metrics = metrics
        self._warner = warner
        self._fsync = fsync
        self._fault = fault
        self._dropped = dropped
        self._remove = remove
        self._report_usage = report_usage
        self._space = [FreeSpaceLimit(shard.root) for shard in index.shards]
        self._lock = threading.Lock()  # guards the write queue state; the index has its own
        self._pending: dict[bytes, ChunkObject] = {}  # queued or being written, each with our reference
        self._cancelled: set[bytes] = set()  # pending writes removed meanwhile: not kept once written
        self.inflight = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[ChunkObject | None] = queue.Queue(maxsize=queue_depth)
        self.threads = [
            threading.Thread(target=self._work, name=f"lmi-disk-writer-{i}", daemon=True) for i in range(num_workers)
        ]
        for thread in self.threads:
            thread.start()

    def is_pending(self, digest: bytes) -> bool:
        return digest in self._pending

    def claim_pending(self, digest: bytes) -> ChunkObject | None:
        """A reference to a chunk still queued or being written (served from memory), or None."""
        with self._lock:
            obj = self._pending.get(digest)
            return obj.acquire() if obj is not None else None

    def cancel(self, digest: bytes) -> None:
        """The entry was removed: a write queued or under way is deleted once written (``_write``)."""
        with self._lock:
            if digest in self._pending:
                self._cancelled.add(digest)

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
                    self.inflight += 1
        if reason is not None:
            if reason != "present":
                self._metrics.dropped(self.name, reason)
            return reason == "present"
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued writes are done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self.inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        for _ in self.threads:
            self._queue.put(None)
        for thread in self.threads:
            thread.join(timeout=5.0)

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
                    self.inflight -= 1
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
        self.follow_free_space(number)
        if not self._index.reserve(number, reserve):  # past the directory's size or the filesystem's free space
            self._metrics.safety_net(self.name, "no_space")
            self._warner.warn("disk-full", f"disk tier: {shard.root} has no room for a planned write "
                                           f"({shard.used_bytes} of {shard.budget_bytes} bytes used); not stored")
            self._dropped([digest])
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
            self._dropped([digest])
            return
        self._index.commit(number, digest, reserve, size)
        with self._lock:
            cancelled = digest in self._cancelled
        if cancelled:  # the directory removed it while it was being written
            self._remove(digest)
            return
        self._metrics.stored(self.name, header.num_tokens, size, time.perf_counter() - start_s)
        self._report_usage()

    def follow_free_space(self, number: int) -> None:
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
