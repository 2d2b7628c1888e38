"""private_dir: directories only the serving user controls (tests run as root; other users by os.chown)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lmi_cache.private_dir import UnsafeDirectoryError, ensure_private_dir, private_dir_problem

OTHER_UID = 65534  # nobody


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_creates_missing_directories_private(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert private_dir_problem(target) is None
    assert ensure_private_dir(target) == target
    assert _mode(target) == 0o700
    assert _mode(tmp_path / "a") == 0o700
    # Idempotent: adopting our own directory again is fine.
    assert ensure_private_dir(target) == target


def test_tightens_own_world_writable_directory(tmp_path: Path) -> None:
    target = tmp_path / "loose"
    target.mkdir()
    os.chmod(target, 0o777)
    assert private_dir_problem(target) is None
    ensure_private_dir(target)
    assert _mode(target) == 0o700


def test_refuses_directory_of_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root to give a directory to another uid (CI runs as root)")
    target = tmp_path / "theirs"
    target.mkdir()
    os.chmod(target, 0o777)
    os.chown(target, OTHER_UID, OTHER_UID)
    problem = private_dir_problem(target)
    assert problem is not None and "owned by uid 65534" in problem and "\n" not in problem
    with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
        ensure_private_dir(target)
    # Nothing was changed on the way.
    assert _mode(target) == 0o777 and os.lstat(target).st_uid == OTHER_UID


def test_refuses_symlink_even_to_own_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert "symlink" in (private_dir_problem(link) or "")
    with pytest.raises(UnsafeDirectoryError, match="symlink"):
        ensure_private_dir(link)


def test_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "not a directory" in (private_dir_problem(blocker) or "")
    assert "never be created" in (private_dir_problem(blocker / "sub") or "")
    with pytest.raises(UnsafeDirectoryError):
        ensure_private_dir(blocker / "sub")


def test_uncreatable_path_under_proc() -> None:
    problem = private_dir_problem("/proc/lmcache-test/x")
    assert problem is not None
    with pytest.raises(UnsafeDirectoryError):
        ensure_private_dir("/proc/lmcache-test/x")


@pytest.mark.parametrize("bad", ["", "   ", "a\0b"])
def test_refuses_empty_or_nul_paths(bad: str) -> None:
    assert private_dir_problem(bad) is not None
    with pytest.raises(UnsafeDirectoryError):
        ensure_private_dir(bad)


def test_problem_check_has_no_side_effects(tmp_path: Path) -> None:
    target = tmp_path / "never" / "made"
    assert private_dir_problem(target) is None
    assert not (tmp_path / "never").exists()


def test_refuses_directory_under_a_parent_another_user_can_write(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root to give a directory to another uid (CI runs as root)")
    parent = tmp_path / "shared-not-sticky"
    parent.mkdir()
    os.chmod(parent, 0o777)
    os.chown(parent, OTHER_UID, OTHER_UID)
    assert "replace it" in (private_dir_problem(parent / "ours") or "")
    with pytest.raises(UnsafeDirectoryError, match="replace it"):
        ensure_private_dir(parent / "ours")
    assert not (parent / "ours").exists()
    # Even with the sticky bit its owner could still rename our directory away.
    os.chmod(parent, 0o1777)
    assert "replace it" in (private_dir_problem(parent / "ours") or "")
    # A sticky parent owned by root (how /tmp is set up) is fine.
    os.chown(parent, 0, 0)
    assert ensure_private_dir(parent / "ours") == parent / "ours"


def test_never_adopts_or_tightens_a_shared_sticky_directory(tmp_path: Path) -> None:
    shared = tmp_path / "like-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert "sticky" in (private_dir_problem(shared) or "")
    with pytest.raises(UnsafeDirectoryError, match="subdirectory"):
        ensure_private_dir(shared)
    assert _mode(shared) == 0o1777
