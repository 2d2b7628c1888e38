"""RemoteTier: the remote store as the last tier of the engine (vLLM worker process).

The top of the remote path: it implements the engine's ``Tier`` protocol
(``get_many`` / ``put`` / ``contains``) on ``RemoteCache`` (verified chunks by
key: ``read_many_into`` / ``write``), which sits on a ``RemoteStore`` (bytes
by name). ``put`` queues a copy of the chunk object for the store's writer
(never waited for); ``get_many`` reads all keys asked of it in one batched
round trip (the engine asks it only for what the local tiers missed),
verifies each value (header, checksum, MAC); values are received straight
into host memory from the allocator (an uncompressed one is then the chunk
object itself, no copy), so the engine's promotion into the CPU tier is a
reference, not a copy. A miss or fault of any kind is a miss, counted by
``RemoteCache``; nothing here raises after construction. A shared store is
never cleared or enumerated by one of its clients: ``clear`` and ``digests``
are no-ops.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from lmi_cache.keys.chunk_format import HEADER_BYTES
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.remote.factory import open_remote
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.value_codec import DecodedChunk
from lmi_cache.tiers.base import HitBatch, RemoteHeldTier
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

if TYPE_CHECKING:
    from lmi_cache.config.cache_config import CacheConfig
    from lmi_cache.tiers.factory import TierContext

logger = logging.getLogger(__name__)


class RemoteTier(RemoteHeldTier):
    """Batched, verified reads and queued writes of chunk objects against one remote store.
    Whether it holds a chunk takes a round trip: the scheduler asks the store itself."""

    def __init__(
        self,
        settings: RemoteSettings,
        *,
        metrics: CacheMetrics,
        warner: RateLimitedWarner,
        allocator: HostAllocator | None = None,
    ) -> None:
        self.cache: RemoteCache = open_remote(settings, metrics=metrics, warner=warner)
        self.name = self.cache.name  # "redis" or "s3": the metrics' tier label
        self._allocator = allocator if allocator is not None else HostAllocator(page_locked=False)
        logger.info("lmi-cache: remote tier on: %s store %s (compression %s, MAC %s)", self.name,
                    settings.display_url, settings.compression, "on" if self.cache.codec.has_mac else "off")

    def get_many(self, keys: Sequence[ChunkKey]) -> Iterator[HitBatch]:
        if not keys:
            return
        batch: HitBatch = []
        received = self.cache.read_many_into(keys, self._body_memory)
        for position, (key, (result, owner)) in enumerate(zip(keys, received)):
            if not isinstance(result, DecodedChunk):
                if owner is not None:
                    self._allocator.recycle(owner)
                continue
            obj = self._to_object(key, result, owner)  # adopts or recycles ``owner``
            if obj is not None:
                batch.append((position, obj))
        if batch:
            yield batch

    def _body_memory(self, num_bytes: int) -> tuple[torch.Tensor, memoryview] | None:
        """Host memory a value's body (chunk header + payload) is received into (an I/O thread)."""
        buffer = self._allocator.allocate(max(num_bytes, HEADER_BYTES))
        return None if buffer is None else (buffer, buffer.numpy().data)

    def _to_object(self, key: ChunkKey, chunk: DecodedChunk, owner: torch.Tensor | None) -> ChunkObject | None:
        if chunk.in_place and owner is not None:
            return ChunkObject(key, chunk.header, owner, self._allocator)  # received in place: no copy
        obj = self._allocator.new_object(key, chunk.header)
        if obj is not None:
            payload = np.frombuffer(chunk.payload, dtype=np.uint8)
            np.copyto(obj.buffer[HEADER_BYTES : chunk.header.total_bytes].numpy(), payload)
        if owner is not None:
            self._allocator.recycle(owner)
        return obj

    def put(self, obj: ChunkObject) -> bool:
        """Queue a copy of the object for the store; False when dropped (counted)."""
        return self.cache.write(obj.key, obj.object_array())

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.cache.flush(timeout_s)

    def stats(self) -> dict[str, int | float]:
        return {f"remote_{name}": value for name, value in self.cache.stats().items()}

    def close(self) -> None:
        self.cache.close()


def build(config: CacheConfig, context: TierContext) -> RemoteTier | None:
    """The remote tier of ``remote_url``, or None without one."""
    from lmi_cache.config.remote import remote_settings

    settings = remote_settings(config)
    if settings is None:
        return None
    return RemoteTier(settings, metrics=context.metrics, warner=context.warner, allocator=context.allocator)
