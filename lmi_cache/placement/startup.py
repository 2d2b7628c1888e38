"""The placement directory of a deployment and what it consults, built at scheduler start (vLLM scheduler process).

Besides the directory: the tracker of open sessions (whose chunks it evicts
last) and the scheduler's client of the remote store (existence checks).

Budgets are the cache config's, per rank, with each tier's own rounding
(``tiers.entry_sizes``: the CPU tier's allocator size classes, the disk tier's
file blocks, the functions the tiers count with), so the workers' tiers, which
have the same sizes, never need to evict on their own. The disk tier's files
of every rank of this replica are adopted oldest first (names and stat only: a
file a worker later finds damaged is reported dropped; files over the budget
are evicted with the first step). The disk budgets also follow the free space
of their filesystem (``disk_space``).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING

from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.placement.book import TierSpec
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.placement.remote_asks import RemoteLookups
from lmi_cache.placement.disk_space import DiskSpaceWatch
from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.disk.ranks import prune_orphan_rank_dirs, replica_rank_dirs
from lmi_cache.tiers.entry_sizes import cpu_entry_bytes, disk_entry_bytes

if TYPE_CHECKING:
    from lmi_cache.eviction.session_tracker import SessionTracker
    from lmi_cache.remote.cache import RemoteCache

logger = logging.getLogger(__name__)


def build_directory(config: CacheConfig, *, replica: int, world_size: int, remote: RemoteLookups | None = None,
                    retention: bool = False, metrics: SchedulerMetrics | None = None,
                    num_replicas: int = 1) -> PlacementDirectory:
    demote = config.disk_feed == "demote"
    specs = [
        TierSpec("cpu", config.cpu_capacity_bytes, cpu_entry_bytes, policy=config.cache_policy,
                 retention_share=config.session_retention_share if retention else 0.0),
        TierSpec("disk", config.disk_capacity_bytes, functools.partial(disk_entry_bytes, odirect=config.use_odirect),
                 num_shards=max(1, len(config.local_disk)),
                 policy=config.cache_policy),
    ]
    directory = PlacementDirectory(specs, chunk_tokens=config.chunk_size, write_through=() if demote else ("disk",),
                                   demote_to="disk" if demote else None, remote=remote, remote_writes=remote is not None,
                                   metrics=metrics)
    if config.disk_capacity_bytes > 0 and config.local_disk:
        # The disk tier's budgets also follow its filesystem's free space (``disk_space``: why here).
        directory.watch_space("disk", DiskSpaceWatch(config.local_disk, world_size, num_replicas=num_replicas))
        adopt_disk_files(directory, config, replica, world_size)
    return directory


def adopt_disk_files(directory: PlacementDirectory, config: CacheConfig, replica: int, world_size: int) -> int:
    """Adopt the files the disk tier holds for ranks below ``world_size``; how many were found."""
    started = time.perf_counter()
    found = 0
    try:
        prune_orphan_rank_dirs(config.local_disk, replica, world_size)
        for shard, rank_dir in replica_rank_dirs(config.local_disk, replica, world_size):
            for file in object_files.scan_root(rank_dir.path, remove_garbage=False):  # oldest first
                directory.adopt("disk", rank_dir.rank, shard, file.digest, file.size_bytes)
                found += 1
    except Exception as err:  # noqa: BLE001 - a cold directory is only slower
        logger.warning("lmi-cache: could not scan the disk tier (%s); starting without its files", err)
    logger.info("lmi-cache: placement directory adopted %d persisted chunks in %.3f s", found,
                time.perf_counter() - started)
    return found


def session_tracker(config: CacheConfig) -> SessionTracker | None:
    """Which sessions are open (the directory evicts their chunks last), or None when retention is off."""
    if config.session_retention_share <= 0 or config.cpu_capacity_bytes <= 0:
        return None
    from lmi_cache.eviction.session_tracker import SessionSource, SessionTracker

    source = SessionSource.from_env(os.environ)
    logger.info("lmi-cache: open sessions keep up to %.0f%% of the CPU tier (sessions from %s)",
                100 * config.session_retention_share,
                source.store_path or f"requests, released after {source.expiration_s:.0f} s idle")
    return SessionTracker(source)


def open_remote_lookups(config: CacheConfig) -> RemoteCache | None:
    """The scheduler's client of the remote store (existence checks only), or None without one."""
    from lmi_cache.config.remote import remote_settings

    settings = remote_settings(config, "lmi-cache config")
    if settings is None:
        return None
    from lmi_cache.remote import open_remote

    lookups = open_remote(settings)
    logger.info("lmi-cache: scheduler looks up chunks in the %s store %s (timeout %d ms)", settings.kind,
                settings.display_url, settings.lookup_timeout_ms)
    return lookups
