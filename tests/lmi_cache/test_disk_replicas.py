"""Replicas, rank changes and a filling filesystem: the disk tier loses nothing it should keep.

- Two engines on one rank directory: the second runs without it (nothing of
  the first's is evicted); data-parallel replicas get directories of their own.
- Ranks beyond a shrunk TP/PP world are pruned and never seed the index.
- The size follows the filesystem's free space: writes past it are refused
  (counted), never failed, and nothing is evicted by the tier itself.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.tiers.disk.ranks import rank_disk_dirs
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.disk import object_files, space
from lmi_cache.tiers.disk.ranks import list_rank_dirs, prune_orphan_rank_dirs, rank_label
from lmi_cache.tiers.disk.space import FreeSpaceLimit
from lmi_cache.tiers.disk.tier import DiskTier
from engine_verbs import load, lookup, save  # noqa: E402
from disk_verbs import disk_put, scan_persisted_digests  # noqa: E402

NS = [KeyNamespace("m", "float32", "rep-v1", tp_rank=r, tp_size=4) for r in range(4)]
TOKENS = list(range(16 * 8))
SIZE = 5000


FILE_BYTES = 384  # one chunk file of a (4, 16) float32 tensor: header + 256 bytes


def config(root: Path, files_per_rank: int = 100) -> CacheConfig:
    return CacheConfig(chunk_size=16, local_cpu=False, local_disk=(str(root),),
                       max_local_disk_size=files_per_rank * FILE_BYTES / 1024**3)


def store_all(engine: CacheEngine, keys: list[ChunkKey]) -> None:
    for key in keys:
        assert save(engine, key, torch.full((4, 16), float(key.start)))
    engine.flush()


def make_tier(root: Path, capacity: int = 1 << 24) -> DiskTier:
    return DiskTier([str(root)], capacity, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger("t")))


def put(tier: DiskTier, key: ChunkKey) -> bool:
    data = np.full(SIZE, key.start % 256, dtype=np.uint8)
    return disk_put(tier, key, ChunkHeader.for_key(key, SIZE, "uint8", (SIZE,)), data)


def test_second_engine_on_a_busy_rank_directory_evicts_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = chunk_keys(TOKENS, NS[0], 16)
    with CacheEngine(config(tmp_path), rank_label="0") as first:
        store_all(first, keys)
        # The same rank label with a budget of one file: without the lock its start-up would evict 7 of 8.
        with caplog.at_level(logging.WARNING), CacheEngine(config(tmp_path, files_per_rank=1), rank_label="0") as second:
            assert second.stats()["disk_capacity_bytes"] == 0
            assert save(second, keys[0], torch.zeros(4, 16)) is False
        assert sum("in use by another lmi-cache engine" in r.getMessage() for r in caplog.records) == 1
        assert sum(1 for _ in tmp_path.rglob("*.lmc")) == len(keys)
        assert lookup(first, keys) == keys[-1].end
        assert all(load(first, key) is not None for key in keys)
    with CacheEngine(config(tmp_path), rank_label="0") as restarted:  # the lock died with its holder
        assert lookup(restarted, keys) == keys[-1].end


def test_data_parallel_replicas_keep_separate_directories(tmp_path: Path) -> None:
    keys = chunk_keys(TOKENS, NS[0], 16)
    cfg = config(tmp_path, files_per_rank=12)  # >= 4 KiB: a store must fit a page-rounded file
    with CacheEngine(cfg, rank_label=rank_label(0, 0)) as replica0, \
            CacheEngine(cfg, rank_label=rank_label(0, 1)) as replica1:
        store_all(replica0, keys[:4])
        store_all(replica1, keys[4:])  # a full budget of its own: replica 0 keeps all of its chunks
        assert lookup(replica0, keys[:4]) == keys[3].end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank0-dp1"]
    assert scan_persisted_digests(cfg, replica=0, world_size=1) == {k.digest for k in keys[:4]}
    assert scan_persisted_digests(cfg, replica=1, world_size=1) == {k.digest for k in keys[4:]}


def test_ranks_beyond_a_shrunk_world_are_pruned_and_never_seed_the_index(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    per_rank = {}
    for rank in range(4):  # a TP=4 deployment
        with CacheEngine(cfg, rank_label=str(rank)) as engine:
            per_rank[rank] = chunk_keys(TOKENS, NS[rank], 16)[:2]
            store_all(engine, per_rank[rank])
    with CacheEngine(cfg, rank_label=rank_label(3, 1)) as other_replica:
        store_all(other_replica, per_rank[3])
    # Restarted with TP=2: ranks 2 and 3 of replica 0 can never be read again.
    assert scan_persisted_digests(cfg, replica=0, world_size=2) == {k.digest for r in (0, 1) for k in per_rank[r]}
    foreign = Path(object_files.object_path(str(tmp_path / "rank3"), per_rank[3][0].digest))
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # not ours: must stay
    with CacheEngine(cfg, rank_label="2") as still_running:  # e.g. another server misconfigured onto this path
        store_all(still_running, per_rank[2])
        removed = prune_orphan_rank_dirs(cfg.local_disk, replica=0, world_size=2)
    assert removed == (1 if os.geteuid() == 0 else 2)
    names = {(d.rank, d.replica) for d in list_rank_dirs(str(tmp_path))}
    assert (2, 0) in names  # held by a live engine: untouched
    assert (3, 1) in names  # another replica's directory is not this replica's business
    assert scan_persisted_digests(cfg, replica=0, world_size=None) >= {k.digest for k in per_rank[2]}
    if os.geteuid() == 0:
        assert foreign.exists() and (3, 0) in names
    else:
        assert (3, 0) not in names
    assert prune_orphan_rank_dirs(cfg.local_disk, replica=0, world_size=2) == 2  # rank 2, now unlocked
    assert not (tmp_path / "rank2").exists()


def test_rank_dirs_follow_the_labels() -> None:
    cfg = CacheConfig(local_disk=("/a", "/b"), max_local_disk_size=1.0)
    assert rank_disk_dirs(cfg.local_disk, rank_label(3, 0)) == ["/a/rank3", "/b/rank3"]
    assert rank_disk_dirs(cfg.local_disk, rank_label(3, 2)) == ["/a/rank3-dp2", "/b/rank3-dp2"]


class FakeFilesystem:
    """statvfs as a test controls it: (free bytes, headroom bytes)."""

    def __init__(self, free_bytes: int, headroom_bytes: int = 0) -> None:
        self.free_bytes = free_bytes
        self.headroom_bytes = headroom_bytes
        self.calls = 0

    def __call__(self, path: str) -> tuple[int, int]:
        self.calls += 1
        return self.free_bytes, self.headroom_bytes


def test_free_space_limit_is_rate_limited_and_refreshed_after_enospc() -> None:
    now = [0.0]
    fs = FakeFilesystem(10_000, headroom_bytes=1_000)
    limit = FreeSpaceLimit("/x", probe=fs, clock=lambda: now[0])
    assert limit.limit_bytes(used_bytes=5_000) == 14_000  # what we hold + what is free - headroom
    fs.free_bytes = 0
    assert limit.limit_bytes(used_bytes=6_000) == 14_000 and fs.calls == 1  # within a second: no new statvfs
    limit.invalidate()
    assert limit.limit_bytes(used_bytes=6_000) == 5_000 and fs.calls == 2
    now[0] += space.CHECK_INTERVAL_S
    fs.free_bytes = 100_000
    assert limit.limit_bytes(used_bytes=6_000) == 105_000


def test_a_filling_filesystem_refuses_writes_instead_of_failing_them(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fs = FakeFilesystem(free_bytes=1 << 30)
    monkeypatch.setattr(space, "free_and_headroom_bytes", fs)
    monkeypatch.setattr(space, "CHECK_INTERVAL_S", 0.0)
    keys = chunk_keys(TOKENS, NS[0], 16)
    tier = make_tier(tmp_path / "kv", capacity=1 << 24)
    for key in keys[:4]:
        assert put(tier, key)
        assert tier.flush()
    held = tier.used_bytes
    fs.free_bytes = 0  # other files filled the filesystem
    for key in keys[4:]:
        assert put(tier, key)  # queued: the caller never waits
        assert tier.flush()
    stats = tier._metrics.snapshot()
    assert stats.get("disk_errors_write", 0) == 0  # no write was even attempted into a full disk
    assert tier.used_bytes == held and tier.capacity_bytes <= held
    # The store never evicts on its own: what the directory placed stays, the new writes are refused and counted.
    assert stats.get("disk_evictions", 0) == 0 and stats["disk_safety_net_no_space"] == len(keys) - 4
    assert all(tier.contains(k.digest) for k in keys[:4]) and not any(tier.contains(k.digest) for k in keys[4:])
    fs.free_bytes = 1 << 30  # space came back: so does the configured size
    assert put(tier, keys[4]) and tier.flush() and tier.contains(keys[4].digest)
    assert tier.capacity_bytes == 1 << 24
    tier.close()


def test_full_filesystem_with_nothing_to_evict_drops_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = FakeFilesystem(free_bytes=0)
    monkeypatch.setattr(space, "free_and_headroom_bytes", fs)
    key = chunk_keys(TOKENS, NS[0], 16)[0]
    tier = make_tier(tmp_path / "kv")
    assert put(tier, key)  # queued: the caller never waits
    assert tier.flush()
    assert not tier.contains(key.digest)
    assert tier._metrics.snapshot()["disk_safety_net_no_space"] == 1
    assert not any((tmp_path / "kv").rglob("*.lmc*"))
    tier.close()


def test_real_statvfs_gives_a_limit(tmp_path: Path) -> None:
    free, headroom = space.free_and_headroom_bytes(str(tmp_path))
    assert free > 0 and 0 <= headroom <= space.HEADROOM_MAX_BYTES
    limit = FreeSpaceLimit(str(tmp_path)).limit_bytes(0)
    assert limit is not None and abs(limit - max(0, free - headroom)) < 256 << 20  # others write meanwhile


def test_filesystem_without_locks_keeps_the_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    key = chunk_keys(TOKENS, NS[0], 16)[0]
    tier = make_tier(tmp_path / "kv")
    assert tier.capacity_bytes > 0 and put(tier, key) and tier.flush() and tier.contains(key.digest)
    tier.close()
