"""Directories only the serving user controls (torch-free; every process that writes or reads our files).

A directory under a shared parent such as ``/tmp`` can be created first by
another user, who then owns it and can swap or plant files in it: a YAML that
vLLM reads a moment later, or a chunk file that a server would load for a
guessable prompt. So a directory we write to or read cache data from is used
only when it is a real directory (not a symlink) owned by our effective uid
and not writable by group or others. Missing directories are created with
mode 0700; a directory of ours that group or others could write to is
tightened to 0700 (what was planted in it before is caught by the readers,
which accept only regular files owned by us).

``ensure_private_dir`` creates or adopts; ``private_dir_problem`` answers the
same question without touching anything (for ``validate`` and ``plan``).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

_PRIVATE_MODE = 0o700
_LOOSE_BITS = stat.S_IWGRP | stat.S_IWOTH


class UnsafeDirectoryError(ValueError):
    """A directory that someone other than the serving user controls; ``str()`` is one line."""


def _absolute(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    if not text or not text.strip():
        raise UnsafeDirectoryError("an empty directory path was given: set an absolute path")
    if "\0" in text:
        raise UnsafeDirectoryError(f"{text!r}: a path may not contain a NUL byte")
    return Path(os.path.abspath(text))


def _owner_problem(path: Path, st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink: point the setting at a real directory owned by the serving user"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists and is not a directory: choose another path"
    if st.st_mode & stat.S_ISVTX:
        # /tmp and the like: shared by design, and tightening it would break every other user of the host.
        return f"{path} is a shared directory (sticky bit): use a subdirectory of it, e.g. {path / 'lmi-cache'}"
    if st.st_uid != os.geteuid():
        return (
            f"{path} is owned by uid {st.st_uid}, not by the serving user (uid {os.geteuid()}): "
            "another user could plant or swap files there; remove it or choose a directory of your own"
        )
    return None


def _ancestor_problem(target: Path) -> str | None:
    # Whoever can write to a parent can rename our directory away and put theirs in its place, unless the
    # parent is sticky (like /tmp) or belongs to us or root.
    for parent in target.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue  # not there yet: we create it ourselves
        # The sticky bit protects our entry from other writers, but not from the parent's owner.
        if st.st_uid not in (0, os.geteuid()) and st.st_mode & (_LOOSE_BITS | stat.S_ISVTX):
            return (
                f"{target}: its parent {parent} is writable by uid {st.st_uid} and others, who could replace it; "
                "choose a directory under a parent only you (or root) can write to"
            )
    return None


def _first_existing(path: Path) -> tuple[Path, os.stat_result | None]:
    """The deepest existing ancestor-or-self of ``path`` (lstat), or (root, None) if none can be read."""
    probe = path
    while True:
        try:
            return probe, os.lstat(probe)
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                return probe, None
            probe = probe.parent
        except OSError:
            return probe, None


def private_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """None when ``ensure_private_dir(path)`` would accept (or create) the directory; else the one-line reason.

    Nothing is created or changed.
    """
    try:
        target = _absolute(path)
    except UnsafeDirectoryError as err:
        return str(err)
    existing, st = _first_existing(target)
    ancestor = _ancestor_problem(target)
    if ancestor:
        return ancestor
    if st is None:
        return f"{target}: no part of this path can be read; choose another directory"
    if existing == target:
        return _owner_problem(target, st)
    # A missing directory: we would create it below ``existing``, which must be a directory we can write into.
    if stat.S_ISLNK(st.st_mode):
        # A symlinked parent is fine only if it resolves to a directory (e.g. /var/run -> /run).
        try:
            st = os.stat(existing)
        except OSError:
            return f"{existing} is a dangling symlink: {target} can't be created"
    if not stat.S_ISDIR(st.st_mode):
        return f"{existing} is not a directory: {target} can never be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by the serving user: {target} can't be created"
    try:
        no_blocks = os.statvfs(existing).f_blocks == 0
    except OSError:
        no_blocks = True
    if no_blocks:  # /proc, /sys and the like: mkdir fails there even for root
        return f"{existing} is on a pseudo filesystem that holds no files: {target} can never be created"
    return None


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (mode 0700, missing parents too) or adopt it if it is ours; return its absolute path.

    Raises ``UnsafeDirectoryError`` (one line naming the path and what to do) when the directory exists
    but is a symlink, not a directory, or owned by another uid, or when it can't be created.
    """
    target = _absolute(path)
    ancestor = _ancestor_problem(target)
    if ancestor:
        raise UnsafeDirectoryError(ancestor)
    _make_missing(target)
    try:
        st = os.lstat(target)
    except OSError as err:
        raise UnsafeDirectoryError(f"{target}: can't inspect it ({err.strerror})") from None
    problem = _owner_problem(target, st)
    if problem:
        raise UnsafeDirectoryError(problem)
    if st.st_mode & _LOOSE_BITS:
        _tighten(target)
    return target


def _make_missing(target: Path) -> None:
    # os.makedirs gives only the leaf the requested mode; every directory we create here is private.
    missing: list[Path] = []
    probe = target
    while not os.path.lexists(probe) and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, _PRIVATE_MODE)
        except FileExistsError:
            pass  # created concurrently (another rank): its owner is checked by the caller
        except OSError as err:
            raise UnsafeDirectoryError(
                f"{target}: can't create {directory} ({err.strerror}); choose a writable directory"
            ) from None


def _tighten(target: Path) -> None:
    # Through a descriptor opened without following links, so a swap between the lstat and here can't
    # redirect the chmod to someone else's directory.
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        raise UnsafeDirectoryError(f"{target}: can't open it to make it private ({err.strerror})") from None
    try:
        problem = _owner_problem(target, os.fstat(fd))
        if problem:
            raise UnsafeDirectoryError(problem)
        os.fchmod(fd, _PRIVATE_MODE)
    except OSError as err:
        raise UnsafeDirectoryError(
            f"{target} is writable by group or others and can't be made private ({err.strerror}); "
            "run `chmod 700` on it or choose another directory"
        ) from None
    finally:
        os.close(fd)
