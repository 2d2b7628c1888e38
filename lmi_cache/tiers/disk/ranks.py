"""Rank directories of the disk tier: names, data-parallel replicas, ranks that no longer exist (torch-free).

Under each configured ``local_disk`` path every engine has its own directory
and budget: ``rank<r>`` for rank ``r`` of the first data-parallel replica and
``rank<r>-dp<d>`` for replica ``d > 0``. Replicas compute the same KV for the
same tokens, but each keeps its own directory: their indexes and budgets are
per process, and a shared directory would let one replica's eviction delete
what the other's index still promises (the planner already sizes the disk
tier per rank of every replica).

When the tensor/pipeline world of a replica shrinks, directories of ranks at
or beyond the new world size can never be read again: ``prune_orphan_rank_dirs``
(the scheduler, at start-up) deletes the chunk files we own there, unless an
engine holds the directory's lock, so they neither hold disk space outside any
budget nor enter the placement directory as chunks no worker can serve.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.disk.trust import LOCK_NAME, DirLock, tier_dir_problem, unlink_if_ours

logger = logging.getLogger(__name__)

_RANK_DIR_RE = re.compile(r"^rank(\d{1,6})(?:-dp([1-9]\d{0,5}))?$")


def rank_label(rank: int, replica: int = 0) -> str:
    """The label ``rank_disk_dirs`` turns into a directory name: ``rank<label>``."""
    return str(rank) if replica == 0 else f"{rank}-dp{replica}"


def rank_disk_dirs(local_disk: Sequence[str], label: str) -> list[str]:
    """One rank's disk-tier directories: ``<dir>/rank<label>`` under each configured path.

    Ranks on one host share the configured paths, but each rank has its own
    budget (GiB per rank) and index, so each gets its own subdirectory.
    """
    return [os.path.join(root, f"rank{label}") for root in local_disk]


@dataclass(frozen=True)
class RankDir:
    path: str
    rank: int
    replica: int


def list_rank_dirs(root: str) -> list[RankDir]:
    """The rank directories directly under ``root`` (real directories only), by name."""
    found: list[RankDir] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return found
    for entry in entries:
        match = _RANK_DIR_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append(RankDir(entry.path, int(match.group(1)), int(match.group(2) or 0)))
    return sorted(found, key=lambda d: (d.replica, d.rank))


def replica_rank_dirs(roots: Sequence[str], replica: int, world_size: int | None) -> list[tuple[int, RankDir]]:
    """Existing, trustworthy rank directories of one replica, ranks below ``world_size`` (all if None), each with
    the index of its root in ``roots`` (the disk tier's shard it belongs to)."""
    dirs: list[tuple[int, RankDir]] = []
    for shard, root in enumerate(roots):
        for found in list_rank_dirs(root):
            if found.replica != replica or (world_size is not None and found.rank >= world_size):
                continue
            problem = tier_dir_problem(found.path)
            if problem is not None:
                logger.warning("lmi-cache: not reading %s (%s)", found.path, problem)
                continue
            dirs.append((shard, found))
    return dirs


def prune_orphan_rank_dirs(roots: Sequence[str], replica: int, world_size: int) -> int:
    """Delete our chunk files in this replica's directories of ranks >= ``world_size``; returns files removed.

    A directory that another engine holds (its lock is taken) or that is not
    ours is left alone; so are files that are not ours.
    """
    removed = 0
    for root in roots:
        for found in list_rank_dirs(root):
            if found.replica != replica or found.rank < world_size or tier_dir_problem(found.path) is not None:
                continue
            lock = DirLock(found.path)
            try:
                if not lock.try_acquire():
                    continue  # a live engine still uses it (another server on the same path)
            except (OSError, ValueError):
                continue
            try:
                removed += _empty_rank_dir(found.path)
                _remove_empty_dir(found.path)  # still holding the lock: nobody adopts it meanwhile
            finally:
                lock.release()
    if removed:
        logger.info("lmi-cache: removed %d chunk files of ranks >= %d that no longer exist", removed, world_size)
    return removed


def _empty_rank_dir(path: str) -> int:
    removed = 0
    for scanned in object_files.scan_root(path, remove_garbage=True):
        if unlink_if_ours(object_files.object_path(path, scanned.digest)):
            removed += 1
    return removed


def _remove_empty_dir(path: str) -> None:
    """Remove the rank directory if nothing but our empty shard subdirectories and the lock file remain."""
    try:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False) and len(entry.name) == 2:
                os.rmdir(entry.path)  # fails (and stops us) if anything is left in it
        unlink_if_ours(os.path.join(path, LOCK_NAME))
        os.rmdir(path)
    except OSError:
        pass
