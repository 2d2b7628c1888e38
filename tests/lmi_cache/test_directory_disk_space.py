"""The placement directory plans the disk tier against its filesystem's free space, not only its configured size.

Another process filling the filesystem must make the directory evict its own
oldest disk entries (and plan fewer), so the disk tier never has to refuse a
planned write (``lmi_cache_tier_safety_net_total`` stays where it was).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace
from lmi_cache.metrics.worker_series import safety_net_firings
from lmi_cache.placement.book import TierBook, TierSpec
from lmi_cache.placement.disk_space import DiskSpaceWatch
from lmi_cache.tiers.disk import space
from directed_engine import Directed  # noqa: E402
from engine_verbs import keys_for  # noqa: E402

NS = KeyNamespace("space", "float32", "space-v1")
CHUNK_SHAPE = (2, 16, 8)  # 1 KiB of float32: one 4 KiB file with O_DIRECT
PAYLOAD_BYTES = 1024
FILE_BYTES = 4096


class FakeFilesystem:
    """A filesystem of ``total_bytes`` holding the tier's files and ``other_bytes`` of someone else's."""

    def __init__(self, root: Path, total_bytes: int, headroom_bytes: int) -> None:
        self.root, self.total_bytes, self.headroom_bytes = root, total_bytes, headroom_bytes
        self.other_bytes = 0

    def tier_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.root) for f in files
                   if f.endswith(".lmc"))

    def probe(self, path: str) -> tuple[int, int]:
        return self.total_bytes - self.other_bytes - self.tier_bytes(), self.headroom_bytes


@pytest.fixture
def filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeFilesystem:
    fs = FakeFilesystem(tmp_path, total_bytes=40 * FILE_BYTES, headroom_bytes=FILE_BYTES)
    monkeypatch.setattr(space, "free_and_headroom_bytes", fs.probe)  # the tier's probe and the directory's
    monkeypatch.setattr(space, "CHECK_INTERVAL_S", 0.0)  # both ask at every check
    return fs


def data_for(key: ChunkKey) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).reshape(CHUNK_SHAPE) + key.start


def test_another_process_filling_the_disk_makes_the_directory_evict_not_the_tier_refuse(
        tmp_path: Path, filesystem: FakeFilesystem) -> None:
    config = CacheConfig(chunk_size=16, max_local_cpu_size=2 * 4096 / 1024**3, local_disk=(str(tmp_path),),
                         max_local_disk_size=20 * FILE_BYTES / 1024**3, use_odirect=True)
    fired = safety_net_firings()
    with Directed(config, PAYLOAD_BYTES) as d:
        keys = keys_for(d.engine, list(range(16 * 60)), NS)
        for key in keys[:20]:
            assert "disk" in d.save(key, data_for(key))
        d.engine.flush()
        assert len(d.planned("disk")) == 20  # the configured size: the filesystem has room to spare
        filesystem.other_bytes = 25 * FILE_BYTES  # someone else takes most of the disk
        for key in keys[20:40]:
            d.save(key, data_for(key))
            d.engine.flush()
            assert filesystem.tier_bytes() <= filesystem.total_bytes - filesystem.other_bytes
        d.step()
        d.engine.flush()
        # 40 - 25 files of room, less twice the headroom: the directory keeps at most 13 files there.
        assert len(d.planned("disk")) <= 13 and d.held("disk") == d.planned("disk")
        assert d.planned("disk") & {k.digest for k in keys[35:40]}  # the newest stay, the oldest went
        assert d.engine.stats()["disk_evictions"] > 0
        assert d.engine.drain_events()[1] == []  # nothing was lost by the tier on its own
    assert safety_net_firings() == fired  # the tier never refused a planned write


def test_free_space_coming_back_restores_the_configured_size(tmp_path: Path, filesystem: FakeFilesystem) -> None:
    config = CacheConfig(chunk_size=16, max_local_cpu_size=2 * 4096 / 1024**3, local_disk=(str(tmp_path),),
                         max_local_disk_size=20 * FILE_BYTES / 1024**3, use_odirect=True)
    filesystem.other_bytes = 30 * FILE_BYTES
    with Directed(config, PAYLOAD_BYTES) as d:
        keys = keys_for(d.engine, list(range(16 * 40)), NS)
        for key in keys[:20]:
            d.save(key, data_for(key))
            d.engine.flush()
        assert len(d.planned("disk")) <= 8  # 40 - 30 files, less twice the headroom
        filesystem.other_bytes = 0
        for key in keys[20:40]:
            d.save(key, data_for(key))
            d.engine.flush()
        assert len(d.planned("disk")) == 20  # the configured size again


def test_free_space_is_shared_by_the_ranks_on_one_filesystem(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(space, "free_and_headroom_bytes", lambda path: (10_000, 1_000))
    watch = DiskSpaceWatch([str(tmp_path / "a"), str(tmp_path / "b")], num_ranks=2, clock=lambda: 0.0)
    held = {(0, 0): 500, (1, 0): 0, (0, 1): 0, (1, 1): 7_000}
    limits = watch.limits(lambda rank, shard: held[(rank, shard)])
    # (10,000 free - 2 x 1,000 margin) split between 2 ranks x 2 directories on one filesystem.
    assert limits == {(0, 0): 2_500, (1, 0): 2_000, (0, 1): 2_000, (1, 1): 9_000}
    assert watch.limits(lambda rank, shard: 0) is None  # asked again only after CHECK_INTERVAL_S


def test_a_budget_over_its_filesystem_gives_back_its_oldest_unpinned_entries() -> None:
    book = TierBook(TierSpec("disk", 10_000, lambda n: n))
    for digest in (b"a", b"b", b"c", b"d"):
        assert book.reserve(0, digest, 1_000) == []
        book.confirm(digest)
    book.pin([b"a"])  # loaded this step: never its own victim
    assert book.ready_bytes(0, 0) == 4_000
    assert book.limit(0, 0, 2_000) == [(b"b", 1_000), (b"c", 1_000)]
    assert book.holds(b"a") and book.holds(b"d") and book.ready_bytes(0, 0) == 2_000
    assert book.reserve(0, b"e", 1_000) == [(b"d", 1_000)]  # room for a new entry is made under the limit
    assert book.limit(0, 0, None) == [] and book.reserve(0, b"f", 1_000) == []  # the configured size again
