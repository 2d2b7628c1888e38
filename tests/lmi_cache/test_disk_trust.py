"""The disk tier trusts nothing on disk: other users' files, symlinks, FIFOs, foreign or busy directories.

The suite runs as root, so "another user" is uid 65534 through os.chown. A
FIFO read would block forever: every load here runs in a thread joined with a
timeout, so a hang fails the test instead of hanging the suite.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.disk.tier import DiskTier
from disk_verbs import disk_object, disk_put, scan_persisted_digests_in  # noqa: E402

OTHER_UID = 65534
NS = KeyNamespace("m", "uint8", "trust-v1")
KEYS = chunk_keys(list(range(16 * 8)), NS, 16)
SIZE = 5000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting files of another uid needs root (CI runs as root)")


def make_tier(root: Path, capacity: int = 1 << 24) -> DiskTier:
    return DiskTier([str(root)], capacity, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger("t")))


def payload(key: ChunkKey) -> np.ndarray:
    return np.random.default_rng(key.start).integers(0, 256, SIZE, dtype=np.uint8)


def fill(root: Path, keys: list[ChunkKey]) -> None:
    tier = make_tier(root)
    for key in keys:
        data = payload(key)
        assert disk_put(tier, key, ChunkHeader.for_key(key, SIZE, "uint8", (SIZE,)), data)
    assert tier.flush()
    tier.close()


def path_of(root: Path, key: ChunkKey) -> Path:
    return Path(object_files.object_path(str(root), key.digest))


def load_within(tier: DiskTier, key: ChunkKey, timeout_s: float = 10.0) -> Any:
    """[loaded object or None]; fails if the read blocks."""
    results: list[Any] = []

    def run() -> None:
        results.append(disk_object(tier, key))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "a read blocked"
    return results


def counts(tier: DiskTier) -> dict[str, float]:
    return {k: v for k, v in tier._metrics.snapshot().items() if "untrusted" in k}


def test_planted_file_of_another_user_is_never_loaded_nor_deleted(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    fill(root, KEYS[:2])
    planted = path_of(root, KEYS[0])
    os.chown(planted, OTHER_UID, OTHER_UID)  # a valid chunk (checksums match) that someone else owns
    assert scan_persisted_digests_in([str(root)]) == {KEYS[1].digest}
    tier = make_tier(root)
    assert not tier.contains(KEYS[0].digest) and tier.contains(KEYS[1].digest)
    assert load_within(tier, KEYS[0]) == [None]
    assert counts(tier) == {"disk_untrusted_foreign_owner": 1}
    assert planted.exists()  # not ours to delete
    tier.close()


def test_file_swapped_after_start_up_is_refused_at_read(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    fill(root, KEYS[:1])
    tier = make_tier(root)
    assert tier.contains(KEYS[0].digest)
    os.chown(path_of(root, KEYS[0]), OTHER_UID, OTHER_UID)
    (obj,) = load_within(tier, KEYS[0])
    assert obj is None and not tier.contains(KEYS[0].digest)
    assert counts(tier) == {"disk_untrusted_foreign_owner": 1}
    assert path_of(root, KEYS[0]).exists()
    tier.clear()  # even clearing the tier leaves someone else's file alone
    assert path_of(root, KEYS[0]).exists()
    tier.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink_to_fifo", "symlink_to_our_chunk", "device"])
def test_special_files_never_block_and_are_counted(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "kv"
    fill(root, KEYS[:2])
    target = path_of(root, KEYS[0])
    tier = make_tier(root)  # indexes both files, then they are replaced behind its back
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "symlink_to_fifo":
        os.mkfifo(tmp_path / "fifo", 0o600)
        target.symlink_to(tmp_path / "fifo")
    elif kind == "symlink_to_our_chunk":
        target.symlink_to(path_of(root, KEYS[1]))  # a valid file of ours, but not by this name
    else:
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null
    assert load_within(tier, KEYS[0]) == [None]
    expected = "disk_untrusted_not_regular" if kind in ("fifo", "device") else "disk_untrusted_symlink"
    assert counts(tier) == {expected: 1}
    assert os.path.lexists(target)
    tier.close()
    again = make_tier(root)  # the start-up scan skips it as well
    assert not again.contains(KEYS[0].digest) and again.contains(KEYS[1].digest)
    assert counts(again) == {expected: 1}
    again.close()


def test_directory_of_another_user_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kv"
    fill(root, KEYS[:1])
    os.chown(root, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING):
        tier = make_tier(root)
    lines = [r.getMessage() for r in caplog.records if "disk tier" in r.getMessage()]
    assert len(lines) == 1 and str(root) in lines[0] and "off" in lines[0]
    assert not tier.contains(KEYS[0].digest)
    data = payload(KEYS[1])
    assert not disk_put(tier, KEYS[1], ChunkHeader.for_key(KEYS[1], SIZE, "uint8", (SIZE,)), data)
    assert tier.capacity_bytes == 0
    assert counts(tier) == {"disk_untrusted_unsafe_dir": 1}
    assert tier._metrics.snapshot()["disk_dropped_tier_off"] == 1
    tier.close()
    assert path_of(root, KEYS[0]).exists()  # nothing of theirs was touched


def test_parent_owned_by_another_user_turns_the_tier_off(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)  # they can rename our directory away whatever its mode
    tier = make_tier(parent / "kv")
    assert tier.capacity_bytes == 0 and counts(tier) == {"disk_untrusted_unsafe_dir": 1}
    tier.close()


def test_symlinked_tier_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "kv").symlink_to(tmp_path / "real")
    tier = make_tier(tmp_path / "kv")
    assert tier.capacity_bytes == 0
    tier.close()


def test_world_writable_directory_of_ours_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    tier = make_tier(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and tier.capacity_bytes > 0
    tier.close()


def test_foreign_shard_subdirectory_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    fill(root, KEYS[:1])
    sub = path_of(root, KEYS[0]).parent
    os.chown(sub, OTHER_UID, OTHER_UID)
    tier = make_tier(root)
    assert not tier.contains(KEYS[0].digest)
    assert counts(tier) == {"disk_untrusted_unsafe_dir": 1}
    tier.close()


def test_planted_symlink_at_our_tmp_name_is_not_written_through(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    tier = make_tier(root)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    final = path_of(root, KEYS[0])
    final.parent.mkdir(parents=True, exist_ok=True)
    # The writer threads' tmp names are predictable (pid, thread id): plant one for every writer.
    for worker in tier.writer.threads:
        Path(f"{final}.{os.getpid()}-{worker.ident}.tmp").symlink_to(victim)
    data = payload(KEYS[0])
    assert disk_put(tier, KEYS[0], ChunkHeader.for_key(KEYS[0], SIZE, "uint8", (SIZE,)), data)
    assert tier.flush()
    assert victim.read_text() == "precious"
    assert load_within(tier, KEYS[0])[0] is not None
    tier.close()


def test_disk_io_refuses_untrusted_paths_directly(tmp_path: Path) -> None:
    fifo = tmp_path / "f.lmc"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(OSError):
        object_files.read_file_into(str(fifo), np.empty(4096, dtype=np.uint8), odirect=False)
    shutil.copy(__file__, tmp_path / "other.lmc")
    os.chown(tmp_path / "other.lmc", OTHER_UID, OTHER_UID)
    with pytest.raises(OSError):
        object_files.read_file_into(str(tmp_path / "other.lmc"), np.empty(16, dtype=np.uint8), odirect=False)
