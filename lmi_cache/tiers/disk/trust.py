"""What the disk tier trusts on disk: its directories, its chunk files, its lock (torch-free, worker and scheduler).

A chunk file is loaded into the model's KV cache, so anything another user can
put there becomes our output. The tier therefore uses a directory only when
``private_dir.ensure_private_dir`` accepts it and every directory above it
belongs to us or root (the owner of a parent can always rename our directory
away and put theirs in its place). A chunk file is opened without following a
symlink and without blocking (a FIFO would hang the reader), and used only when
it is a regular file owned by our effective uid. Anything else is skipped,
never deleted, and counted with a reason (``UNTRUSTED_REASONS``).

Each rank directory is held by one engine at a time through an advisory lock
(``DirLock``): a second engine configured onto the same directory (two
replicas with the same rank, two servers with one ``local_disk``) runs without
that directory instead of evicting the first one's chunks at start-up.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from lmi_cache.private_dir import UnsafeDirectoryError, ensure_private_dir, private_dir_problem

logger = logging.getLogger(__name__)

LOCK_NAME = ".lmi-cache.lock"
# Reasons counted in lmi_cache_untrusted_files_total.
UNTRUSTED_REASONS = ("symlink", "not_regular", "foreign_owner", "unsafe_dir", "busy_dir")


class UntrustedFile(OSError):
    """A chunk path that is not a regular file owned by us; ``reason`` is one of UNTRUSTED_REASONS."""

    def __init__(self, reason: str, path: str) -> None:
        super().__init__(errno.EPERM, f"untrusted chunk file ({reason})", path)
        self.reason = reason


class DirectoryBusy(UnsafeDirectoryError):
    """Another live engine holds this directory's lock."""


def entry_problem(st: os.stat_result) -> str | None:
    """Why a directory entry (from lstat) must not be used as a chunk file, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if not stat.S_ISREG(st.st_mode):
        return "not_regular"
    if st.st_uid != os.geteuid():
        return "foreign_owner"
    return None


def is_our_dir(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def open_chunk(path: str, flags: int) -> int:
    """``os.open`` for reading a chunk file, refusing anything but a regular file of ours (UntrustedFile)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)  # a symlink: ELOOP (see open_error_reason)
    try:
        problem = entry_problem(os.fstat(fd))
    except OSError:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise UntrustedFile(problem, path)
    return fd


def open_error_reason(err: OSError) -> str | None:
    """The untrusted reason of an ``open_chunk`` failure: ELOOP means the name is a symlink."""
    if isinstance(err, UntrustedFile):
        return err.reason
    if err.errno == errno.ELOOP:
        return "symlink"
    return None


def unlink_if_ours(path: str) -> bool:
    """Unlink ``path`` only if it is a regular file we own (never someone else's file); True if removed."""
    try:
        if entry_problem(os.lstat(path)) is not None:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _foreign_ancestor(target: Path) -> str | None:
    for parent in target.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if st.st_uid not in (0, os.geteuid()):
            return (
                f"{target}: its parent {parent} belongs to uid {st.st_uid}, who could replace it; "
                "choose a directory under parents only you (or root) own"
            )
    return None


def ensure_tier_dir(path: str) -> str:
    """Create or adopt a private tier directory (see the module docstring); UnsafeDirectoryError if not ours."""
    target = Path(os.path.abspath(path))
    problem = _foreign_ancestor(target)
    if problem is not None:
        raise UnsafeDirectoryError(problem)
    return str(ensure_private_dir(target))


def tier_dir_problem(path: str) -> str | None:
    """``ensure_tier_dir``'s verdict without side effects (None: usable)."""
    return _foreign_ancestor(Path(os.path.abspath(path))) or private_dir_problem(path)


class DirLock:
    """An exclusive advisory lock on ``<dir>/.lmi-cache.lock``, held until ``release`` (or process exit)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """True when this lock is now held; False when another live process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            if entry_problem(os.fstat(fd)) is not None:
                raise UnsafeDirectoryError(f"{self.path} is not a regular file of ours: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                # A filesystem without locks: run unguarded rather than without the tier.
                logger.warning("disk tier: %s can't be locked (%s); make sure no other server uses this "
                               "directory", self.path, err.strerror)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        try:  # the pid only makes the "in use" message clearer: a full disk must not cost the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return True

    def holder(self) -> str:
        """The pid written by the holder, for messages ('?' if unknown)."""
        try:
            with open(self.path, "rb") as handle:
                return handle.read(32).decode("ascii", "replace").strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def acquire_tier_dir(path: str) -> DirLock:
    """``ensure_tier_dir`` plus its lock; DirectoryBusy when another engine uses the directory now."""
    root = ensure_tier_dir(path)
    lock = DirLock(root)
    try:
        acquired = lock.try_acquire()
    except OSError as err:
        raise UnsafeDirectoryError(f"{lock.path}: can't lock it ({err.strerror}); check the directory") from None
    if not acquired:
        raise DirectoryBusy(
            f"{root} is in use by another lmi-cache engine (pid {lock.holder()}); two engines must not share "
            "a rank directory: give each server its own local_disk"
        )
    return lock
