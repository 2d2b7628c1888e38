"""The disk tier's read path: locate, read, verify, in parallel (worker process).

``DiskReader`` is its own object, given what it needs by the tier: the index,
a way to claim a chunk still queued for writing, the allocator its reads land
in, and the tier's fault handlers. A queued chunk is served from the queued
object itself (a reference, no copy); a file is read straight into a buffer
from the host allocator (so promoting the hit into the CPU tier is free) and
checked (header, fingerprint, checksum); a damaged file is deleted. Every
fault is a counted miss. A path that is not a regular file of ours (a planted
symlink, FIFO, device or someone else's file) is never read or deleted: it is
forgotten and counted.

Several reads run at once on a small thread pool: one file per chunk needs
several reads in flight to match a sequential stream. Hits are yielded as each
read finishes (all those finished by then in one batch), so the caller copies the
first chunks while others are read.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterator, Sequence, TypeVar

from lmi_cache.keys.chunk_format import HEADER_BYTES, BytesLike, ChunkFormatError, ChunkHeader, FingerprintMismatch, verify_parts
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.thread_affinity import unpin_current_thread
from lmi_cache.tiers.disk import object_files, trust
from lmi_cache.tiers.base import HitBatch
from lmi_cache.tiers.disk.index import DiskIndex
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

_T = TypeVar("_T")

ClaimPending = Callable[[bytes], "ChunkObject | None"]  # a reference to a queued object, or None
Forget = Callable[[bytes, bool], None]  # (digest, unlink the file too)
Fault = Callable[[str, OSError, str], None]  # (operation, error, path)
Untrusted = Callable[[str], None]  # (reason)


class DiskReader:
    def __init__(
        self,
        name: str,
        index: DiskIndex,
        allocator: HostAllocator,
        *,
        claim_pending: ClaimPending,
        forget: Forget,
        fault: Fault,
        untrusted: Untrusted,
        metrics: CacheMetrics,
        warner: RateLimitedWarner,
        num_workers: int = 4,
    ) -> None:
        self.name = name
        self._index = index
        self._allocator = allocator
        self._claim_pending = claim_pending
        self._forget = forget
        self._fault = fault
        self._untrusted = untrusted
        self._metrics = metrics
        self._warner = warner
        self._num_workers = max(1, num_workers)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        """Verified hits in batches: each wake-up yields every read finished by then (parallel reads).

        One batch per wake-up rather than per read: the caller copies each batch with one kernel
        call, and page-cached reads finish faster than a copy of one chunk is set up, so one call
        per chunk would cost more than the reads (31 calls vs 1 for a 32M model's 8k-token prompt).
        """
        if len(keys) <= 1 or self._num_workers == 1:
            for position, key in enumerate(keys):
                obj = self.read(key)
                if obj is not None:
                    yield [(position, obj)]
            return
        futures: dict[Future[ChunkObject | None], int] = {
            self._executor().submit(self.read, key): position for position, key in enumerate(keys)
        }
        try:
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                batch: HitBatch = []
                try:
                    for future in sorted(done, key=futures.__getitem__):
                        position = futures.pop(future)  # before the yield: a yielded object is the caller's
                        obj = future.result()
                        if obj is not None:
                            batch.append((position, obj))
                except BaseException:
                    for _, obj in batch:  # not handed over yet
                        obj.release()
                    raise
                if batch:
                    yield batch
        finally:
            # The caller stopped early: reads still running must not leak their buffers.
            for future in futures:
                if not future.cancel():
                    future.add_done_callback(_release_result)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_workers, thread_name_prefix="lmi-disk-reader",
                                                initializer=unpin_current_thread)
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def read(self, key: ChunkKey) -> ChunkObject | None:
        """One verified chunk with a reference for the caller, or None on a miss."""
        queued = self._claim_pending(key.digest)
        if queued is not None:
            if queued.header.fingerprint != key.fingerprint:  # no checksum: these bytes never left memory
                self._metrics.fingerprint_mismatch(self.name)
                queued.release()
                return None
            return queued
        where = self._index.lookup(key.digest)
        if where is None:
            return None
        shard = self._index.shards[where[0]]
        path = object_files.object_path(shard.root, key.digest)
        buffer = self._allocator.allocate(max(where[1], HEADER_BYTES))
        if buffer is None:
            self._metrics.error(self.name, "alloc")
            return None
        array = buffer.numpy()

        def read() -> int:
            try:
                return object_files.read_file_into(path, array, odirect=shard.odirect)
            except object_files.OdirectUnsupported:
                shard.odirect = False
                return object_files.read_file_into(path, array, odirect=False)

        num_read = self._guarded(key, path, read)
        header = None
        if num_read is not None:
            header = self._verified(key, path, array[:HEADER_BYTES], array[HEADER_BYTES:num_read])
        if header is None:
            self._allocator.recycle(buffer)
            return None
        try:
            os.utime(path, follow_symlinks=False)  # keeps LRU order across restarts (the scan sorts by mtime)
        except OSError:
            pass
        return ChunkObject(key, header, buffer, self._allocator)

    def _guarded(self, key: ChunkKey, path: str, read: Callable[[], _T]) -> _T | None:
        try:
            return read()
        except FileNotFoundError:
            self._forget(key.digest, False)  # deleted behind our back
        except OSError as err:
            reason = trust.open_error_reason(err)
            if reason is None:
                self._fault("read", err, path)
            else:
                self._untrusted(reason)
                self._forget(key.digest, False)  # not ours: forgotten, never read, never deleted
        return None

    def _verified(self, key: ChunkKey, path: str, header_bytes: BytesLike, payload: BytesLike) -> ChunkHeader | None:
        try:
            return verify_parts(header_bytes, payload, key)
        except FingerprintMismatch:
            self._metrics.fingerprint_mismatch(self.name)
        except ChunkFormatError as err:
            self._metrics.corrupted(self.name)
            self._warner.warn("disk-corrupt", f"disk tier: {path} is damaged ({err}); removed, treated as a miss")
        self._forget(key.digest, True)
        return None


def _release_result(future: Future[ChunkObject | None]) -> None:
    if not future.cancelled() and future.exception() is None:
        obj = future.result()
        if obj is not None:
            obj.release()
