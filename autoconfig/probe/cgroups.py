"""Find the memory limit of the cgroup this process runs in (autoconfig probe, CLI process).

A container's RAM budget is its cgroup limit, not the host's MemTotal. The
limit may sit on any ancestor of the process's own cgroup (a pod limit above a
per-container cgroup with none), so we locate the process's cgroup directory
from ``/proc/self/cgroup`` + ``/proc/self/mountinfo`` and walk up to the mount
point, keeping the tightest level. Handles cgroup v2, v1 and hybrid hosts
(v1 memory controller beside an empty v2 hierarchy).
"""
from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass

from autoconfig.probe.mounts import MountEntry, host_path, is_under, read_mountinfo

log = logging.getLogger(__name__)

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX rounded to pages
# (9223372036854771712 with 4 KiB pages); anything this large is no limit.
V1_UNLIMITED_FLOOR_BYTES = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """The binding level of the memory hierarchy (limit/usage None when unknown or unlimited)."""

    limit_bytes: int | None
    usage_bytes: int | None
    version: int | None  # 1, 2, or None when no memory cgroup was found
    path: str | None  # the directory the limit was read from (the process's own when no limit)


NO_CGROUP = CgroupMemory(None, None, None, None)


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    mount: MountEntry
    cgroup_path: str  # as in /proc/self/cgroup, absolute within the hierarchy


def probe_cgroup_memory(proc_root: str = "/proc", mount_root: str = "/") -> CgroupMemory:
    """Limit and usage of the tightest memory cgroup level above this process.

    ``mount_root`` is prefixed to the mount points found in mountinfo (tests).
    """
    try:
        with open(os.path.join(proc_root, "self", "cgroup"), encoding="utf-8") as f:
            cgroup_text = f.read()
    except OSError as err:
        log.debug("no cgroup information: %s", err)
        return NO_CGROUP
    hierarchy = find_memory_hierarchy(cgroup_text, read_mountinfo(proc_root))
    if hierarchy is None:
        return NO_CGROUP
    top = host_path(hierarchy.mount.mount_point, mount_root)
    leaf = host_path(cgroup_directory(hierarchy.mount, hierarchy.cgroup_path), mount_root)
    return read_limits(leaf, top, hierarchy.version)


def find_memory_hierarchy(cgroup_text: str, mounts: list[MountEntry]) -> _Hierarchy | None:
    """Pick the hierarchy that carries the memory controller: v1 "memory" first, else v2."""
    v1_path: str | None = None
    v2_path: str | None = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    # On hybrid hosts the v2 hierarchy exists but holds no memory controller.
    if v1_path is not None:
        mount = _best_mount(
            [m for m in mounts if m.fs_type == "cgroup" and "memory" in m.super_options], v1_path
        )
        if mount is not None:
            return _Hierarchy(1, mount, v1_path)
    if v2_path is not None:
        mount = _best_mount([m for m in mounts if m.fs_type == "cgroup2"], v2_path)
        if mount is not None:
            return _Hierarchy(2, mount, v2_path)
    return None


def _best_mount(candidates: list[MountEntry], cgroup_path: str) -> MountEntry | None:
    """The mount whose root contains our cgroup most closely (several may exist)."""
    containing = [m for m in candidates if is_under(cgroup_path, m.root)]
    if containing:
        return max(containing, key=lambda m: len(m.root))
    # With a cgroup namespace, paths can be relative to a root we cannot see
    # ("/../.."): the mount itself is then our best view of our own cgroup.
    return candidates[0] if candidates else None


def cgroup_directory(mount: MountEntry, cgroup_path: str) -> str:
    """Where the process's cgroup appears under the mount point."""
    if not is_under(cgroup_path, mount.root):
        return mount.mount_point
    relative = posixpath.relpath(cgroup_path, mount.root)
    if relative == ".":
        return mount.mount_point
    return os.path.join(mount.mount_point, relative)


def read_limits(leaf_dir: str, top_dir: str, version: int) -> CgroupMemory:
    """Walk from ``leaf_dir`` up to ``top_dir``; report the level with the least headroom.

    Least headroom rather than smallest limit: a parent with a larger limit
    but mostly used by siblings leaves less room than a child's own limit.
    """
    limit_name, usage_name = (
        ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    leaf_usage = _read_bytes(os.path.join(leaf_dir, usage_name), version)
    best: CgroupMemory | None = None
    directory = leaf_dir
    top = os.path.normpath(top_dir)
    for _ in range(64):  # cgroup trees are shallow; the cap guards against path loops
        limit = _read_bytes(os.path.join(directory, limit_name), version)
        if limit is not None:
            usage = _read_bytes(os.path.join(directory, usage_name), version)
            level = CgroupMemory(limit, usage, version, directory)
            if best is None or _headroom(level) < _headroom(best):
                best = level
        if os.path.normpath(directory) == top or not is_under(directory, top):
            break
        directory = os.path.dirname(directory)
    if best is None:
        return CgroupMemory(None, leaf_usage, version, leaf_dir)
    return best


def _headroom(level: CgroupMemory) -> tuple[int, int]:
    limit = level.limit_bytes or 0
    return (limit - (level.usage_bytes or 0), limit)


def _read_bytes(path: str, version: int) -> int | None:
    """A byte count from a cgroup file; None for missing, unreadable, "max" or v1's unlimited."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        log.debug("unexpected content in %s: %r", path, text)
        return None
    if value < 0 or (version == 1 and value >= V1_UNLIMITED_FLOOR_BYTES):
        return None
    return value
