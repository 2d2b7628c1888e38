"""CPU-RAM tier: chunk objects held by reference within a byte budget (worker process).

The tier owns no memory of its own: it keeps references to ``ChunkObject``s
(``host_memory``) that a save gathered into, a disk read landed in or a
remote value was decoded into, so putting a chunk here never copies it. The
index and budget (``cpu_index``) are torch-free; the bytes are the
allocator's. A hit hands out another reference, so the connector scatters
straight from the tier's buffer and an eviction meanwhile only drops the
tier's reference (the buffer is recycled once the reader is done).

Budget: the bytes of the objects the tier references. An evicted object that
a reader or a queued disk write still holds lives on outside the budget until
they release it (bounded by one step's loads and the disk write queue).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.eviction import EvictionPolicy, make_policy
from lmi_cache.metrics.series import CacheMetrics, RateLimitedWarner
from lmi_cache.tiers.base import HitBatch, Tier
from lmi_cache.tiers.cpu_index import CpuIndex, Refused
from lmi_cache.tiers.host_memory import ChunkObject

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.tiers.factory import TierContext

# Called with an object the tier evicted, before the tier drops its reference (demote-to-disk takes one).
EvictCallback = Callable[[ChunkObject], None]


class CpuTier(Tier):
    name = "cpu"
    promote_hits = True
    holds_host_buffers = True

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy,
        *,
        metrics: CacheMetrics,
        warner: RateLimitedWarner,
        on_evict: EvictCallback | None = None,
    ) -> None:
        self.index: CpuIndex[ChunkObject] = CpuIndex(capacity_bytes, policy)
        self._metrics = metrics
        self._warner = warner
        self._on_evict = on_evict
        self._report_usage()

    # ------------------------------------------------------------ Tier
    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def contains(self, digest: bytes) -> bool:
        return digest in self.index

    def digests(self) -> list[bytes]:
        return self.index.digests()

    def remove(self, digest: bytes) -> bool:
        obj = self.index.forget(digest)
        if obj is None:
            return False
        obj.release()
        self._report_usage()
        return True

    def clear(self) -> None:
        for obj in self.index.clear():
            obj.release()
        self._report_usage()

    def close(self) -> None:
        self.clear()

    def peek(self, digest: bytes) -> ChunkObject | None:
        return self.index.get(digest, claim=ChunkObject.acquire)

    # ------------------------------------------------------------ data path
    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        batch: HitBatch = []
        for position, key in enumerate(keys):
            obj = self.index.get(key.digest, claim=ChunkObject.acquire)
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
        started = time.perf_counter()
        obj.acquire()
        try:
            existing, evicted = self.index.admit(obj.key.digest, obj, obj.class_bytes)
        except Refused:
            obj.release()
            self._metrics.dropped(self.name, "too_large")
            return False
        if existing is not None:
            obj.release()
            return True
        if evicted:
            self._metrics.evicted(self.name, len(evicted))
            for victim in evicted:
                try:
                    if self._on_evict is not None:
                        self._on_evict(victim)
                finally:
                    victim.release()
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
    # Its own eviction is a safety net: the placement directory (scheduler) decides what leaves, within
    # the same budget, and keeps open sessions' chunks (``session_retention_share``).
    return CpuTier(config.cpu_capacity_bytes, make_policy(config.cache_policy), metrics=context.metrics,
                   warner=context.warner, on_evict=context.on_evict)
