"""Test-side spellings of one-chunk disk-tier operations, built on the Tier protocol (put / get_many)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.keys.chunk_format import ChunkHeader, byte_view
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.tiers.base import Tier
from lmi_cache.tiers.disk import object_files, trust
from lmi_cache.tiers.disk.ranks import replica_rank_dirs
from lmi_cache.tiers.host_memory import HostAllocator

ALLOC = HostAllocator(page_locked=False, pool_limit_bytes=0)


def disk_put(tier: Tier, key: ChunkKey, header: ChunkHeader, payload: Any) -> bool:
    """Put one chunk object holding ``payload`` (any bytes-like) through ``Tier.put``."""
    obj = ALLOC.new_object(key, header)
    assert obj is not None
    obj.payload_array()[:] = np.frombuffer(byte_view(payload), dtype=np.uint8)
    try:
        return tier.put(obj)
    finally:
        obj.release()  # the tier took its own reference if it queued the write


def disk_object(tier: Tier, key: ChunkKey) -> np.ndarray | None:
    """A copy of the verified object (header + payload) through ``Tier.get_many``, or None on a miss."""
    for batch in tier.get_many([key]):
        for _, obj in batch:
            try:
                return obj.object_array().copy()
            finally:
                obj.release()
    return None


def scan_persisted_digests_in(dirs: Sequence[str]) -> set[bytes]:
    """Digests of object files in ``dirs`` by name only (nothing is read or deleted)."""
    digests: set[bytes] = set()
    for root in dirs:
        if trust.tier_dir_problem(root) is None:
            digests.update(f.digest for f in object_files.scan_root(root, remove_garbage=False))
    return digests


def scan_persisted_digests(config: CacheConfig, replica: int = 0, world_size: int | None = None) -> set[bytes]:
    """Digests of one replica's object files (ranks below ``world_size``, all when None), by file name only."""
    if config.disk_capacity_bytes <= 0:
        return set()
    return scan_persisted_digests_in([d.path for _, d in replica_rank_dirs(config.local_disk, replica, world_size)])
