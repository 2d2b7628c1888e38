"""The disk tier's index: which chunk files exist, in which directory, and the bytes they take (worker process).

Pure bookkeeping (no file I/O), thread-safe behind one lock. Each directory
is a shard; a chunk's shard is chosen by its digest for writes, but an
adopted file stays in the shard where it was found (so changing the directory
list between runs loses nothing). No eviction order and no eviction: what
leaves is the placement directory's decision. A shard's size (its share of the
configured size, or less when its filesystem has less free space:
``limit_bytes``, see ``space``) is only a safety net: ``reserve`` refuses a
write that would take the shard past it. A shard whose directory can't be
trusted is disabled.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from lmi_cache.tiers.disk.object_files import ScannedFile


@dataclass
class DiskShard:
    root: str
    capacity_bytes: int
    used_bytes: int = 0
    odirect: bool = False  # cleared when the filesystem refuses O_DIRECT
    enabled: bool = True  # False: the directory is unsafe or busy; nothing is read or written there
    limit_bytes: int | None = None  # what the filesystem's free space allows now (None: unknown)

    @property
    def budget_bytes(self) -> int:
        if not self.enabled:
            return 0
        return self.capacity_bytes if self.limit_bytes is None else min(self.capacity_bytes, self.limit_bytes)


def shard_index(digest: bytes, num_shards: int) -> int:
    return int.from_bytes(digest[:8], "little") % num_shards


class DiskIndex:
    def __init__(self, roots: Sequence[str], capacity_bytes: int, odirect: bool) -> None:
        if not roots:
            raise ValueError("the disk tier needs at least one directory")
        per_shard = capacity_bytes // len(roots)
        self.shards = [DiskShard(root, per_shard, odirect=odirect) for root in roots]
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[int, int]] = {}  # digest -> (shard, file bytes)

    @property
    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self.shards)

    @property
    def capacity_bytes(self) -> int:
        """The effective budget: configured, less what free space or disabled shards take away."""
        return sum(s.budget_bytes for s in self.shards)

    def shard_for(self, digest: bytes) -> int:
        return shard_index(digest, len(self.shards))

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._where

    def __len__(self) -> int:
        return len(self._where)

    def digests(self) -> list[bytes]:
        with self._lock:
            return list(self._where)

    def lookup(self, digest: bytes) -> tuple[int, int] | None:
        """(shard, file bytes), or None."""
        with self._lock:
            return self._where.get(digest)

    def adopt(self, number: int, files: Sequence[ScannedFile]) -> None:
        """Index files found at start-up (the placement directory adopts the same files and evicts any that are
        over its budget)."""
        shard = self.shards[number]
        with self._lock:
            for found in files:
                if found.digest in self._where:
                    continue
                self._where[found.digest] = (number, found.size_bytes)
                shard.used_bytes += found.size_bytes

    def set_limit(self, number: int, limit_bytes: int | None) -> None:
        """Apply a free-space limit to a shard (later writes past it are refused; nothing is evicted)."""
        with self._lock:
            self.shards[number].limit_bytes = limit_bytes

    def reserve(self, number: int, num_bytes: int) -> bool:
        """Account ``num_bytes`` for a file about to be written; False (nothing accounted) past the shard's size."""
        shard = self.shards[number]
        with self._lock:
            if shard.used_bytes + num_bytes > shard.budget_bytes:
                return False
            shard.used_bytes += num_bytes
            return True

    def unreserve(self, number: int, num_bytes: int) -> None:
        with self._lock:
            self.shards[number].used_bytes -= num_bytes

    def commit(self, number: int, digest: bytes, reserved_bytes: int, file_bytes: int) -> None:
        shard = self.shards[number]
        with self._lock:
            shard.used_bytes += file_bytes - reserved_bytes
            self._where[digest] = (number, file_bytes)

    def forget(self, digest: bytes) -> tuple[int, int] | None:
        with self._lock:
            where = self._where.pop(digest, None)
            if where is not None:
                self.shards[where[0]].used_bytes -= where[1]
            return where

    def clear(self) -> list[tuple[bytes, int]]:
        """Forget everything; returns (digest, shard) of every file to delete."""
        with self._lock:
            doomed = [(digest, where[0]) for digest, where in self._where.items()]
            for digest, number in doomed:
                self.shards[number].used_bytes -= self._where[digest][1]
            self._where.clear()
            return doomed
