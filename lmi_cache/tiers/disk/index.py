"""The disk tier's index: which chunk files exist, in which directory, within what budget (worker process).

Pure bookkeeping (no file I/O), thread-safe behind one lock. Each directory
is a shard with its own byte budget and eviction order; a chunk's shard is
chosen by its digest for writes, but an adopted file stays in the shard where
it was found (so changing the directory list between runs loses nothing).
Methods that evict return the victims: the caller deletes their files
outside the lock. A shard's budget is its share of the configured size, or
less when its filesystem has less free space (``limit_bytes``, see
``space``); a shard whose directory can't be trusted is disabled.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence, cast

from lmi_cache.eviction import EvictionPolicy, make_policy
from lmi_cache.tiers.disk.object_files import ScannedFile


@dataclass
class DiskShard:
    root: str
    capacity_bytes: int
    policy: EvictionPolicy
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
    def __init__(self, roots: Sequence[str], capacity_bytes: int, policy_name: str, odirect: bool) -> None:
        if not roots:
            raise ValueError("the disk tier needs at least one directory")
        per_shard = capacity_bytes // len(roots)
        self.shards = [DiskShard(root, per_shard, make_policy(policy_name), odirect=odirect) for root in roots]
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
        """(shard, file bytes) and mark the entry used, or None."""
        with self._lock:
            where = self._where.get(digest)
            if where is not None:
                self.shards[where[0]].policy.on_access(digest)
            return where

    def adopt(self, number: int, files: Sequence[ScannedFile]) -> list[bytes]:
        """Index files found at start-up (oldest first); returns victims over the budget."""
        shard = self.shards[number]
        with self._lock:
            for found in files:
                if found.digest in self._where:
                    continue
                self._where[found.digest] = (number, found.size_bytes)
                shard.policy.on_insert(found.digest)
                shard.used_bytes += found.size_bytes
            return self._evict_locked(shard, 0)

    def set_limit(self, number: int, limit_bytes: int | None) -> list[bytes]:
        """Apply a free-space limit to a shard; returns the victims now over its budget."""
        shard = self.shards[number]
        with self._lock:
            shard.limit_bytes = limit_bytes
            return self._evict_locked(shard, 0)

    def reserve(self, number: int, num_bytes: int) -> list[bytes]:
        """Account ``num_bytes`` for a file about to be written; returns evicted digests."""
        shard = self.shards[number]
        with self._lock:
            victims = self._evict_locked(shard, num_bytes)
            shard.used_bytes += num_bytes
            return victims

    def unreserve(self, number: int, num_bytes: int) -> None:
        with self._lock:
            self.shards[number].used_bytes -= num_bytes

    def commit(self, number: int, digest: bytes, reserved_bytes: int, file_bytes: int) -> None:
        shard = self.shards[number]
        with self._lock:
            shard.used_bytes += file_bytes - reserved_bytes
            self._where[digest] = (number, file_bytes)
            shard.policy.on_insert(digest)

    def forget(self, digest: bytes) -> tuple[int, int] | None:
        with self._lock:
            where = self._where.pop(digest, None)
            if where is not None:
                shard = self.shards[where[0]]
                shard.policy.on_remove(digest)
                shard.used_bytes -= where[1]
            return where

    def clear(self) -> list[tuple[bytes, int]]:
        """Forget everything; returns (digest, shard) of every file to delete."""
        with self._lock:
            doomed = [(digest, where[0]) for digest, where in self._where.items()]
            for digest, number in doomed:
                shard = self.shards[number]
                shard.policy.on_remove(digest)
                shard.used_bytes -= self._where[digest][1]
            self._where.clear()
            return doomed

    def _evict_locked(self, shard: DiskShard, incoming_bytes: int) -> list[bytes]:
        victims: list[bytes] = []
        candidates = shard.policy.candidates()
        while shard.used_bytes + incoming_bytes > shard.budget_bytes:
            candidate = next(candidates, None)
            if candidate is None:
                break
            digest = cast(bytes, candidate)
            victims.append(digest)
            shard.used_bytes -= self._where.pop(digest)[1]
        for digest in victims:
            shard.policy.on_remove(digest)
        return victims
