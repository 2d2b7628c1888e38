"""Tests for lmi_cache.tiers.disk.tier / disk_io: persistence, verification, budget, faults."""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.disk.tier import DiskTier
from disk_verbs import disk_object, disk_put, scan_persisted_digests_in  # noqa: E402

NS = KeyNamespace("m", "uint8", "test-v1")
KEYS = chunk_keys(list(range(64 * 16)), NS, 16)


def payload_for(key: ChunkKey, size: int = 10_000) -> np.ndarray:
    return np.random.default_rng(key.start).integers(0, 256, size, dtype=np.uint8)


def make_tier(dirs: list[Path], capacity: int = 1 << 24, **kwargs: Any) -> DiskTier:
    return DiskTier([str(d) for d in dirs], capacity, metrics=CacheMetrics(),
                    warner=RateLimitedWarner(logging.getLogger("test")), **kwargs)


def put(tier: DiskTier, key: ChunkKey, size: int = 10_000) -> bool:
    data = payload_for(key, size)
    return disk_put(tier, key, ChunkHeader.for_key(key, data.nbytes, "uint8", (data.nbytes,)), data)


def loads_correctly(tier: DiskTier, key: ChunkKey, size: int = 10_000) -> bool:
    obj = disk_object(tier, key)
    return obj is not None and bytes(obj[HEADER_BYTES : HEADER_BYTES + size]) == payload_for(key, size).tobytes()


def stats(tier: DiskTier) -> dict[str, float]:
    return tier._metrics.snapshot()


def test_round_trip_layout_and_permissions(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    tier = make_tier([root])
    assert put(tier, KEYS[0])
    assert tier.contains(KEYS[0].digest)  # visible while queued
    assert tier.flush()
    path = Path(object_files.object_path(str(root), KEYS[0].digest))
    assert path.parent.name == KEYS[0].hex[:2] and path.name == KEYS[0].hex + ".lmc"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert loads_correctly(tier, KEYS[0])
    assert disk_object(tier, KEYS[1]) is None
    tier.close()


def test_restart_rebuilds_index_and_cleans_tmp(tmp_path: Path) -> None:
    tier = make_tier([tmp_path])
    for key in KEYS[:5]:
        put(tier, key)
    tier.close()
    sub = tmp_path / KEYS[9].hex[:2]
    sub.mkdir(exist_ok=True)
    dead_tmp = sub / f"{KEYS[9].hex}.lmc.999999999-1.tmp"  # no such pid
    dead_tmp.write_bytes(b"torn")
    short = sub / f"{KEYS[9].hex}.lmc"
    short.write_bytes(b"x" * 10)  # shorter than a header: torn
    assert scan_persisted_digests_in([str(tmp_path)]) == {k.digest for k in KEYS[:5]}  # not the torn one
    again = make_tier([tmp_path])
    assert not dead_tmp.exists() and not short.exists()
    assert all(loads_correctly(again, key) for key in KEYS[:5])
    assert again.used_bytes == sum(os.path.getsize(object_files.object_path(str(tmp_path), k.digest)) for k in KEYS[:5])
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty_payload_flip_header"])
def test_damaged_file_is_a_counted_miss_and_removed(tmp_path: Path, damage: str) -> None:
    tier = make_tier([tmp_path])
    put(tier, KEYS[0])
    tier.flush()
    path = Path(object_files.object_path(str(tmp_path), KEYS[0].digest))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 5000] ^= 1
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[20] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert disk_object(tier, KEYS[0]) is None
    assert stats(tier)["disk_corrupted_reads"] == 1
    assert not path.exists() and not tier.contains(KEYS[0].digest)
    tier.close()


def test_fingerprint_mismatch_is_a_miss(tmp_path: Path) -> None:
    tier = make_tier([tmp_path])
    put(tier, KEYS[0])
    tier.flush()
    foreign = ChunkKey(KEYS[0].digest, KEYS[0].start, KEYS[0].end, KEYS[0].fingerprint ^ 1)
    assert disk_object(tier, foreign) is None
    assert stats(tier)["disk_fingerprint_mismatches"] == 1
    tier.close()


def test_a_full_store_refuses_and_only_a_removal_makes_room(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + 10_000
    tier = make_tier([tmp_path], capacity=3 * file_bytes)
    for key in KEYS[:3]:
        put(tier, key)
        tier.flush()
    put(tier, KEYS[3])  # past its size: refused (the directory would have evicted first), nothing evicted
    tier.flush()
    assert [tier.contains(k.digest) for k in KEYS[:4]] == [True, True, True, False]
    assert stats(tier)["disk_safety_net_no_space"] == 1 and stats(tier).get("disk_evictions", 0) == 0
    assert tier.remove(KEYS[1].digest)  # the directory's eviction
    assert not os.path.exists(object_files.object_path(str(tmp_path), KEYS[1].digest))
    put(tier, KEYS[3])
    tier.flush()
    assert [tier.contains(k.digest) for k in KEYS[:4]] == [True, False, True, True]
    assert tier.used_bytes <= tier.capacity_bytes
    tier.close()
    smaller = make_tier([tmp_path], capacity=2 * file_bytes)  # restart with a smaller size: it adopts every file
    assert len(smaller.digests()) == 3  # the directory, which adopts the same files, evicts the excess
    smaller.close()


def test_multiple_dirs_share_load(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    tier = make_tier(dirs)
    for key in KEYS[:40]:
        put(tier, key, 100)
    tier.flush()
    counts = [len(scan_persisted_digests_in([str(d)])) for d in dirs]
    assert sum(counts) == 40 and min(counts) >= 8
    assert all(loads_correctly(tier, key, 100) for key in KEYS[:40])
    tier.close()


def test_full_queue_drops_without_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_write = object_files.write_object_file

    def slow_write(*args: Any, **kwargs: Any) -> int:
        gate.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(object_files, "write_object_file", slow_write)
    tier = make_tier([tmp_path], num_workers=1, queue_depth=2)
    start = time.perf_counter()
    results = [put(tier, key) for key in KEYS[:6]]
    elapsed = time.perf_counter() - start
    gate.set()
    tier.flush()
    assert elapsed < 1.0
    assert 2 <= sum(results) <= 3 and stats(tier)["disk_dropped_queue_full"] == 6 - sum(results)
    tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_fault_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    removed: list[bytes] = []
    tier = make_tier([tmp_path], on_drop=removed.append)
    real_write = os.write

    def failing_write(fd: int, data: Any) -> int:
        if threading.current_thread().name.startswith("lmi-disk-writer"):
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    put(tier, KEYS[0])
    tier.flush()
    monkeypatch.undo()
    assert not tier.contains(KEYS[0].digest) and disk_object(tier, KEYS[0]) is None
    assert removed == [KEYS[0].digest] and tier.used_bytes == 0
    assert list(tmp_path.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.lmc")) == []
    assert stats(tier)["disk_errors_write"] == 1
    put(tier, KEYS[0])  # the tier still works afterwards
    tier.flush()
    assert loads_correctly(tier, KEYS[0])
    tier.close()


def test_permission_denied_and_read_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier([tmp_path])
    put(tier, KEYS[0])
    tier.flush()
    real_open = os.open

    def denied_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied_open)
    assert disk_object(tier, KEYS[0]) is None  # EACCES on read: a miss, the entry is kept
    put(tier, KEYS[1])
    tier.flush()
    monkeypatch.undo()
    assert stats(tier)["disk_errors_read"] == 1 and stats(tier)["disk_errors_write"] == 1
    assert loads_correctly(tier, KEYS[0]) and not tier.contains(KEYS[1].digest)
    tier.close()


def test_odirect_writes_aligned_files(tmp_path: Path) -> None:
    tier = make_tier([tmp_path], use_odirect=True)
    put(tier, KEYS[0], 5000)
    tier.flush()
    path = object_files.object_path(str(tmp_path), KEYS[0].digest)
    if tier.uses_odirect:  # this filesystem accepted O_DIRECT
        assert os.path.getsize(path) % object_files.ALIGN_BYTES == 0
    assert loads_correctly(tier, KEYS[0], 5000)
    tier.close()


def test_odirect_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    real_open = os.open

    def tmpfs_like_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", tmpfs_like_open)
    tier = make_tier([tmp_path], use_odirect=True)
    with caplog.at_level(logging.WARNING):
        put(tier, KEYS[0])
        tier.flush()
    assert not tier.uses_odirect and any("O_DIRECT" in r.message for r in caplog.records)
    assert loads_correctly(tier, KEYS[0]) and stats(tier).get("disk_errors_write", 0) == 0
    tier.close()


def test_aligned_buffer() -> None:
    for size in (1, 4095, 4096, 70_000):
        buffer = object_files.aligned_buffer(size)
        assert buffer.ctypes.data % 4096 == 0 and len(buffer) % 4096 == 0 and len(buffer) >= size


@pytest.mark.parametrize("odirect", [False, True])
def test_get_many_reads_in_parallel_and_verifies(tmp_path: Path, odirect: bool) -> None:
    tier = make_tier([tmp_path], use_odirect=odirect)
    for key in KEYS[:4]:
        put(tier, key)
    pending = disk_object(tier, KEYS[0])  # may still be queued: served from the queued object itself
    assert pending is not None and bytes(pending[HEADER_BYTES:]) == payload_for(KEYS[0]).tobytes()
    tier.flush()
    asked = [KEYS[3], KEYS[9], KEYS[1], KEYS[0], KEYS[2]]
    batches = list(tier.get_many(asked))
    assert sum(len(batch) for batch in batches) == 4  # every read finished by a wake-up comes in one batch
    found = {position: obj for batch in batches for position, obj in batch}
    assert sorted(found) == [0, 2, 3, 4]  # KEYS[9] was never stored
    for position, obj in found.items():
        assert obj.header.payload_bytes == 10_000
        assert bytes(obj.payload_array()) == payload_for(asked[position]).tobytes()
        assert obj.buffer.data_ptr() % 4096 == 0  # host-allocator memory: the CPU tier can adopt it
        obj.release()
    path = Path(object_files.object_path(str(tmp_path), KEYS[1].digest))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 1234] ^= 0x01
    path.write_bytes(bytes(raw))
    assert disk_object(tier, KEYS[1]) is None and not path.exists()
    assert stats(tier)["disk_corrupted_reads"] == 1
    path = Path(object_files.object_path(str(tmp_path), KEYS[0].digest))
    path.write_bytes(path.read_bytes()[:5000])  # torn
    assert disk_object(tier, KEYS[0]) is None
    tier.close()


def test_disk_index_bookkeeping() -> None:
    from lmi_cache.tiers.disk.index import DiskIndex

    index = DiskIndex(["/a", "/b"], 2000, odirect=False)
    assert index.capacity_bytes == 2000 and len(index.shards) == 2
    digests = [bytes([i]) * 16 for i in range(6)]
    number = index.shard_for(digests[0])
    same_shard = [d for d in digests if index.shard_for(d) == number]
    index.adopt(number, [object_files.ScannedFile(d, 400, i) for i, d in enumerate(same_shard)])
    assert all(d in index for d in same_shard)  # adopted as found; the directory evicts any excess
    for digest in same_shard[:-2]:
        index.forget(digest)
    kept = same_shard[-2:]
    assert index.lookup(kept[0]) == (number, 400) and index.shards[number].used_bytes == 800
    assert not index.reserve(number, 300)  # 1000 bytes per shard: refused, nothing evicted
    assert index.reserve(number, 200) and index.shards[number].used_bytes == 1000
    index.unreserve(number, 200)
    assert index.shards[number].used_bytes == 800
    index.commit(number, b"\xff" * 16, 0, 100)
    assert index.used_bytes == 900 and index.forget(b"\xff" * 16) == (number, 100)
    assert sorted(index.clear()) == sorted((d, number) for d in kept) and index.used_bytes == 0


def test_a_caller_that_stops_early_leaks_no_buffer_and_releases_nothing_twice(tmp_path: Path) -> None:
    from lmi_cache.tiers.host_memory import HostAllocator

    allocator = HostAllocator(page_locked=False)
    tier = make_tier([tmp_path], allocator=allocator, num_readers=3)
    for key in KEYS[:6]:
        put(tier, key)
    tier.flush()
    reads = tier.get_many(KEYS[:6])
    first = next(reads)
    reads.close()  # the caller stops after one batch; reads in flight finish in the background
    assert first and all(obj.refs == 1 for _, obj in first)  # still the caller's, not released by the tier
    for _, obj in first:
        obj.release()
    tier.reader.close()  # waits for the reads in flight: their buffers go back to the pool
    assert allocator.pooled_bytes > 0
    tier.close()


class _InlineExecutor:
    """Runs each read as it is submitted: every read has finished before the first wake-up."""

    def submit(self, fn, *args):  # type: ignore[no-untyped-def]
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result(fn(*args))
        return future


def test_reads_finished_by_a_wake_up_come_in_one_batch_in_key_order(tmp_path: Path) -> None:
    tier = make_tier([tmp_path], num_readers=3)
    for key in KEYS[:5]:
        put(tier, key)
    tier.flush()
    tier.reader._executor = _InlineExecutor  # type: ignore[method-assign]
    asked = [KEYS[4], KEYS[9], KEYS[0], KEYS[2]]
    batches = list(tier.get_many(asked))
    assert [[position for position, _ in batch] for batch in batches] == [[0, 2, 3]]  # one copy call, not three
    for (position, obj) in batches[0]:
        assert bytes(obj.payload_array()) == payload_for(asked[position]).tobytes()
        obj.release()
    tier.close()
