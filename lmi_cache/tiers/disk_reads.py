"""Read path of the disk tier: locate, read, verify (torch-free, worker process).

Mixed into ``DiskTier`` (which owns the state named below) to keep the write
queue and the read path in files of readable size. A queued chunk is served
from its pending buffer; a file is read and checked (header, fingerprint,
checksum) and a damaged one is deleted: every fault is a counted miss. A path
that is not a regular file of ours (a planted symlink, FIFO, device or someone
else's file) is never read or deleted: it is forgotten and counted.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from lmi_cache.chunk_format import (
    HEADER_BYTES,
    BytesLike,
    ChunkFormatError,
    ChunkHeader,
    FingerprintMismatch,
    byte_view,
    unpack_header,
    verify_parts,
)
from lmi_cache.chunk_hashing import ChunkKey
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers import disk_io, disk_trust
from lmi_cache.tiers.disk_index import DiskIndex, DiskShard

_T = TypeVar("_T")


@dataclass
class PendingWrite:
    key: ChunkKey
    header: ChunkHeader
    payload: BytesLike
    release: Callable[[], None] | None
    object_buffer: np.ndarray | None
    readers: int = 0  # loads copying from ``payload`` right now: release waits for them
    done: bool = False


class DiskReads:
    """The read half of DiskTier (see there for the state it uses)."""

    name: str
    _index: DiskIndex
    _lock: threading.Lock
    _pending: dict[bytes, PendingWrite]
    _metrics: CacheMetrics
    _warner: RateLimitedWarner

    def _forget(self, digest: bytes, unlink: bool = False) -> None:
        raise NotImplementedError

    def _fault(self, op: str, err: OSError, path: str) -> None:
        raise NotImplementedError

    def _untrusted(self, reason: str) -> None:
        raise NotImplementedError

    def load_object(self, key: ChunkKey, scratch: bool = False) -> np.ndarray | None:
        """The verified chunk object, or None on a miss.

        A fresh uint8 array the caller owns, unless ``scratch``: then a per-thread
        buffer valid until this thread's next scratch load (for callers that copy).
        """
        found = self._locate(key)
        if isinstance(found, np.ndarray) or found is None:
            return found
        shard, path = found
        start_s = time.perf_counter()

        def read() -> np.ndarray:
            try:
                return disk_io.read_object_file(path, odirect=shard.odirect, scratch=scratch)
            except disk_io.OdirectUnsupported:
                shard.odirect = False
                return disk_io.read_object_file(path, odirect=False, scratch=scratch)

        buffer = self._guarded(key, path, read)
        if buffer is None or not self._verified(key, path, buffer[:HEADER_BYTES], buffer[HEADER_BYTES:]):
            return None
        self._loaded(path, start_s)
        return buffer

    def load_into(self, key: ChunkKey, payload_out: np.ndarray) -> ChunkHeader | None:
        """Read the payload straight into ``payload_out`` (uint8, exactly the payload's size), verified.

        Returns the header, or None on a miss (``payload_out`` then holds garbage).
        ValueError if ``payload_out`` has the wrong size (the file is kept).
        O_DIRECT directories read through an aligned bounce buffer instead.
        """
        found = self._locate(key)
        if found is None:
            return None
        if isinstance(found, np.ndarray):
            header = unpack_header(found)
            _check_size(header, payload_out)
            payload_out[:] = found[HEADER_BYTES : header.total_bytes]
            return header
        shard, path = found
        if shard.odirect:
            obj = self.load_object(key, scratch=True)
            if obj is None:
                return None
            header = unpack_header(obj)
            _check_size(header, payload_out)
            payload_out[:] = obj[HEADER_BYTES : header.total_bytes]
            return header
        start_s = time.perf_counter()
        parts = self._guarded(key, path, lambda: disk_io.read_object_into(path, payload_out))
        if parts is None:
            return None
        header_bytes, num_read = parts
        try:
            claimed = unpack_header(header_bytes).payload_bytes
        except ChunkFormatError:
            claimed = len(payload_out)  # damaged: _verified deals with it
        if claimed != len(payload_out):  # the caller's buffer is wrong, not the file
            raise ValueError(f"out holds {len(payload_out)} bytes, the stored chunk {claimed}")
        checked = self._verified(key, path, header_bytes, payload_out[:num_read])
        if checked is None or checked.payload_bytes != len(payload_out):
            return None
        self._loaded(path, start_s)
        return checked

    def _locate(self, key: ChunkKey) -> tuple[DiskShard, str] | np.ndarray | None:
        """Where to read ``key`` from: (shard, path), a pending object (a copy), or None."""
        digest = key.digest
        with self._lock:
            job = self._pending.get(digest)
            if job is not None:
                job.readers += 1  # the payload's owner must not reuse it until we copied it
        where = self._index.lookup(digest) if job is None else None
        if job is not None:
            return self._load_pending(key, job)
        if where is None:
            return None
        shard = self._index.shards[where[0]]
        return shard, disk_io.object_path(shard.root, digest)

    def _guarded(self, key: ChunkKey, path: str, read: Callable[[], _T]) -> _T | None:
        try:
            return read()
        except FileNotFoundError:
            self._forget(key.digest)  # deleted behind our back
        except OSError as err:
            reason = disk_trust.open_error_reason(err)
            if reason is None:
                self._fault("read", err, path)
            else:
                self._untrusted(reason)
                self._forget(key.digest)  # not ours: forgotten, never read, never deleted
        return None

    def _verified(self, key: ChunkKey, path: str, header_bytes: BytesLike, payload: BytesLike) -> ChunkHeader | None:
        try:
            return verify_parts(header_bytes, payload, key)
        except FingerprintMismatch:
            self._metrics.fingerprint_mismatch(self.name)
        except ChunkFormatError as err:
            self._metrics.corrupted(self.name)
            self._warner.warn("disk-corrupt", f"disk tier: {path} is damaged ({err}); removed, treated as a miss")
        self._forget(key.digest, unlink=True)
        return None

    def _loaded(self, path: str, start_s: float) -> None:
        try:
            os.utime(path, follow_symlinks=False)  # keeps LRU order across restarts (the scan sorts by mtime)
        except OSError:
            pass
        self._metrics.loaded(self.name, time.perf_counter() - start_s)

    def _load_pending(self, key: ChunkKey, job: PendingWrite) -> np.ndarray | None:
        """A copy of a queued chunk (no checksum: these bytes never left memory)."""
        try:
            if job.header.fingerprint != key.fingerprint:
                self._metrics.fingerprint_mismatch(self.name)
                return None
            header = job.header
            buffer = np.empty(header.total_bytes, dtype=np.uint8)
            buffer[:HEADER_BYTES] = np.frombuffer(header.pack(), dtype=np.uint8)
            buffer[HEADER_BYTES:] = np.frombuffer(byte_view(job.payload), dtype=np.uint8)
            return buffer
        finally:
            with self._lock:
                job.readers -= 1
                release_now = job.done and job.readers == 0
            if release_now and job.release is not None:
                job.release()


def _check_size(header: ChunkHeader, payload_out: np.ndarray) -> None:
    if header.payload_bytes != len(payload_out):
        raise ValueError(f"out holds {len(payload_out)} bytes, the stored chunk {header.payload_bytes}")
