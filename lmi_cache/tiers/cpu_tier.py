"""CPU-RAM tier: a store of chunk objects held by reference, at the places the directory reserved (worker process).

The tier owns no memory of its own: it keeps references to ``ChunkObject``s
(``host_memory``) that a save gathered into, a disk read landed in or a
remote value was decoded into, so putting a chunk here never copies it. A hit
hands out another reference, so the connector scatters straight from the
tier's buffer and a removal meanwhile only drops the tier's reference (the
buffer is recycled once the reader is done).

No policy and no budget of its own: what it holds, and what leaves, is the
placement directory's decision (``lmi_cache.placement``), which reserves each
chunk's size class (``entry_sizes.cpu_entry_bytes``) within the configured
size. The size is only a safety net: a put that would take the tier past it is
refused and counted (``lmi_cache_tier_safety_net_total``), never met by an
eviction; the worker then reports the store failed.

A reader's reference is also the lease a peer read needs: ``peek(digest)``
hands out the object itself, whose buffer stays valid until that reference is
released, even if the directory removes the entry meanwhile.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.base import HitBatch, Tier
from lmi_cache.tiers.entry_sizes import cpu_entry_bytes
from lmi_cache.tiers.host_memory import ChunkObject

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.tiers.factory import TierContext


class CpuTier(Tier):
    name = "cpu"
    promote_hits = True
    holds_host_buffers = True

    def __init__(self, capacity_bytes: int, *, metrics: CacheMetrics, warner: RateLimitedWarner) -> None:
        self._capacity_bytes = capacity_bytes
        self._metrics = metrics
        self._warner = warner
        self._lock = threading.Lock()  # guards the map and the byte count
        self._entries: dict[bytes, ChunkObject] = {}
        self._used_bytes = 0
        self._report_usage()

    # ------------------------------------------------------------ Tier
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def contains(self, digest: bytes) -> bool:
        return digest in self._entries

    def digests(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def remove(self, digest: bytes) -> bool:
        with self._lock:
            obj = self._entries.pop(digest, None)
            if obj is not None:
                self._used_bytes -= cpu_entry_bytes(obj.header.payload_bytes)
        if obj is None:
            return False
        obj.release()
        self._report_usage()
        return True

    def clear(self) -> None:
        with self._lock:
            objs, self._entries, self._used_bytes = list(self._entries.values()), {}, 0
        for obj in objs:
            obj.release()
        self._report_usage()

    def close(self) -> None:
        self.clear()

    def peek(self, digest: bytes) -> ChunkObject | None:
        """The held object with a reference for the caller (its buffer stays valid until released), or None."""
        with self._lock:  # the reference is taken before a concurrent remove can drop the tier's own
            obj = self._entries.get(digest)
            return obj.acquire() if obj is not None else None

    # ------------------------------------------------------------ data path
    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        batch: HitBatch = []
        for position, key in enumerate(keys):
            obj = self.peek(key.digest)
            if obj is None:
                continue
            header = obj.header
            if (header.fingerprint, header.start, header.end) != (key.fingerprint, key.start, key.end):
                # Same digest, other tokens: a collision (or a bug); never someone else's KV.
                self._metrics.fingerprint_mismatch(self.name)
                obj.release()
                self.remove(key.digest)
                continue
            batch.append((position, obj))
        if batch:
            yield batch

    def put(self, obj: ChunkObject) -> bool:
        """Hold ``obj`` (a reference, no copy); False when it would take the tier past its size (safety net)."""
        started = time.perf_counter()
        size = cpu_entry_bytes(obj.header.payload_bytes)
        with self._lock:
            if obj.key.digest in self._entries:
                return True
            refused = self._used_bytes + size > self._capacity_bytes
            if not refused:
                self._entries[obj.key.digest] = obj.acquire()
                self._used_bytes += size
        if refused:
            self._metrics.safety_net(self.name, "full")
            self._warner.warn("cpu-full", "cpu tier: a planned store does not fit its size (the placement "
                                          "directory's record and the tier disagree); not stored")
            return False
        header = obj.header
        self._metrics.stored(self.name, header.num_tokens, header.total_bytes, time.perf_counter() - started)
        self._report_usage()
        return True

    def _report_usage(self) -> None:
        self._metrics.usage(self.name, self.used_bytes, self.capacity_bytes)


def build(config: CacheConfig, context: TierContext) -> CpuTier | None:
    """The CPU tier of ``config`` (``max_local_cpu_size``), or None when it is 0."""
    if config.cpu_capacity_bytes <= 0:
        return None
    return CpuTier(config.cpu_capacity_bytes, metrics=context.metrics, warner=context.warner)
