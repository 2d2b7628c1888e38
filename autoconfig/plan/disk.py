"""Disk-tier helpers for the planner: which local filesystem, and how much of it.

Pure functions over a ``HostSnapshot`` (container-start process or the
``lmi-cache plan`` CLI); no I/O.
"""
from __future__ import annotations

import posixpath

from autoconfig.probe.snapshot import DiskInfo, HostSnapshot

# Filesystem types that are RAM, kernel views or remote: never a cache disk.
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
PSEUDO_FS_TYPES = frozenset(
    {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs",
     "securityfs", "pstore", "bpf", "autofs", "configfs", "fusectl", "squashfs", "iso9660"}
)
NETWORK_FS_TYPES = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "9p",
     "fuse.s3fs", "fuse.sshfs", "fuse.gcsfuse", "fuse.mountpoint-s3", "efs", "beegfs", "gpfs"}
)

# Keep this much of a filesystem free: full filesystems slow down (ext4/xfs
# allocation) and other writers (logs, compile caches) must not hit ENOSPC.
DISK_RESERVE_MIN_BYTES = 5 << 30
DISK_RESERVE_FRACTION = 0.10


def is_ram_fs(disk: DiskInfo) -> bool:
    return disk.is_tmpfs or disk.fs_type in RAM_FS_TYPES


def is_network_fs(disk: DiskInfo) -> bool:
    return disk.is_network or disk.fs_type in NETWORK_FS_TYPES


def is_overlay_fs(disk: DiskInfo) -> bool:
    return disk.is_overlay or disk.fs_type == "overlay"


def unsuitable_reason(disk: DiskInfo) -> str | None:
    """Why this filesystem must not hold the disk tier, or None if it may."""
    if is_ram_fs(disk):
        return f"{disk.mount} is {disk.fs_type} (RAM: it would compete with the CPU tier)"
    if is_network_fs(disk):
        return f"{disk.mount} is a network filesystem ({disk.fs_type})"
    if disk.fs_type in PSEUDO_FS_TYPES:
        return f"{disk.mount} is a {disk.fs_type} pseudo filesystem"
    if disk.rotational is True:
        return f"{disk.mount} is on a rotational disk ({disk.device})"
    if not disk.writable:
        return f"{disk.mount} is not writable"
    if "," in disk.mount:
        return f"{disk.mount!r} contains a comma, which LMCache's local_disk format reads as two paths"
    if any(ord(c) < 32 for c in disk.mount):
        return f"{disk.mount!r} contains a control character"
    return None


def choose_disk(host: HostSnapshot) -> DiskInfo | None:
    """Best cache filesystem: a real (non-overlay) one first, NVMe first, SSD next, most free space."""
    candidates = [d for d in host.disks if unsuitable_reason(d) is None]
    if not candidates:
        return None

    def rank(disk: DiskInfo) -> tuple[bool, bool, bool, int]:
        return (not is_overlay_fs(disk), disk.nvme, disk.rotational is False, disk.free_bytes)

    return max(candidates, key=rank)


def mount_of(host: HostSnapshot, path: str) -> DiskInfo | None:
    """The snapshot filesystem holding ``path`` (longest mount-point prefix)."""
    path = posixpath.normpath(path)
    best: DiskInfo | None = None
    for disk in host.disks:
        mount = posixpath.normpath(disk.mount)
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > len(posixpath.normpath(best.mount))):
            best = disk
    return best


def cache_dir_on(host: HostSnapshot, disk: DiskInfo) -> str:
    """A directory for the tier on ``disk``; on the root filesystem prefer /tmp (writable without root)."""
    if posixpath.normpath(disk.mount) != "/":
        return posixpath.join(disk.mount, "lmcache")
    for candidate in ("/tmp/lmcache", "/var/tmp/lmcache", "/lmcache"):
        owner = mount_of(host, candidate)
        if owner is not None and posixpath.normpath(owner.mount) == "/":
            return candidate
    return "/lmcache"


def disk_reserve_bytes(disk: DiskInfo) -> int:
    return max(DISK_RESERVE_MIN_BYTES, int(disk.total_bytes * DISK_RESERVE_FRACTION))


def normalize_disk_path(value: str) -> str:
    """``file:///x/`` or ``/x`` -> ``/x`` (LMCache writes the URL form)."""
    if value.startswith("file://"):
        value = value[len("file://"):]
    return posixpath.normpath(value) if value else value
