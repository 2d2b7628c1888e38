"""Probe the filesystems a disk KV tier could live on (autoconfig probe, CLI process).

Lists mounted filesystems from mountinfo, drops kernel pseudo filesystems,
dedupes bind mounts, and for each one reports size, free space, the hardware
behind it (NVMe? rotating?), whether we can write there and whether it takes
O_DIRECT (the disk tier bypasses the page cache so it does not compete with
the CPU tier for RAM). tmpfs, overlay and network filesystems are kept but
flagged: the planner decides what they are good for.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets

from autoconfig.probe.snapshot import DiskInfo
from autoconfig.probe.blockdev import UNKNOWN, BlockBacking, resolve_by_name, resolve_device
from autoconfig.probe.mounts import (
    MountEntry,
    host_path,
    is_under,
    mount_holding,
    read_mountinfo,
    visible_mounts,
)

log = logging.getLogger(__name__)

# Kernel interfaces and special filesystems: nothing can be cached there.
PSEUDO_FS_TYPES = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "devtmpfs", "mqueue", "debugfs", "tracefs",
    "securityfs", "pstore", "bpf", "autofs", "hugetlbfs", "configfs", "fusectl", "binfmt_misc",
    "nsfs", "rpc_pipefs", "selinuxfs", "efivarfs", "nfsd", "ramfs",
    # read-only images (snaps, ISOs): never writable
    "squashfs", "iso9660", "erofs",
})
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "efs", "ceph", "glusterfs", "gpfs",
    "beegfs", "wekafs", "9p", "afs", "ncpfs", "fuse.s3fs", "fuse.sshfs", "fuse.glusterfs",
    "fuse.mountpoint-s3", "fuse.gcsfuse", "fuse.juicefs", "fuse.goofys", "fuse.rclone",
    "fuse.cephfs", "fuse.lustre",
})
TMPFS_TYPES = frozenset({"tmpfs"})
OVERLAY_TYPES = frozenset({"overlay", "fuse.fuse-overlayfs"})
# Mounts under these trees are kernel plumbing even when their type looks normal
# (e.g. the tmpfs holding /sys/fs/cgroup).
_KERNEL_TREES = ("/proc", "/sys")
ODIRECT_BLOCK_BYTES = 4096


def probe_disks(
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    dev_root: str = "/dev",
    mount_root: str = "/",
    tmp_dir: str = "/tmp",
    test_odirect: bool = True,
) -> list[DiskInfo]:
    """One DiskInfo per distinct filesystem; ``mount_root`` is where mount points are found (tests)."""
    disks: list[DiskInfo] = []
    for entry in select_mounts(read_mountinfo(proc_root), tmp_dir):
        disk = describe_mount(entry, sys_root, dev_root, mount_root, test_odirect)
        if disk is not None:
            disks.append(disk)
    return disks


def select_mounts(entries: list[MountEntry], tmp_dir: str = "/tmp") -> list[MountEntry]:
    """Visible, non-pseudo mounts, one per (device, root) except that ``tmp_dir``'s own mount stays."""
    holder = mount_holding(tmp_dir, entries)
    candidates = [
        e for e in visible_mounts(entries)
        if e is holder or (e.fs_type not in PSEUDO_FS_TYPES and not _in_kernel_tree(e.mount_point))
    ]
    # Bind mounts of one filesystem share device and root: keep the shortest mount
    # point. A /tmp that is its own mount stays beside the winner, not instead of it.
    own_tmp = holder if holder is not None and holder.mount_point == tmp_dir else None
    keep: dict[tuple[str, str], MountEntry] = {}
    for entry in candidates:
        if entry is own_tmp:
            continue
        key = (entry.device_id, entry.root)
        current = keep.get(key)
        if current is None or _shorter(entry.mount_point, current.mount_point):
            keep[key] = entry
    chosen = {id(e) for e in keep.values()}
    if holder is not None:
        # The planner puts scratch files in /tmp: its filesystem must be listed under that name.
        chosen.add(id(holder))
    return [e for e in candidates if id(e) in chosen]


def describe_mount(
    entry: MountEntry,
    sys_root: str = "/sys",
    dev_root: str = "/dev",
    mount_root: str = "/",
    test_odirect: bool = True,
) -> DiskInfo | None:
    """Measure one mount; None when it cannot be stat'ed (gone, or no permission)."""
    path = host_path(entry.mount_point, mount_root)
    try:
        st = os.statvfs(path)
    except OSError as err:
        log.debug("skipping %s: statvfs failed: %s", entry.mount_point, err)
        return None
    if not os.path.isdir(path):
        # Docker and Kubernetes bind single files (/etc/hosts...): no room for a cache.
        log.debug("skipping %s: not a directory", entry.mount_point)
        return None
    backing = _backing(entry, sys_root, dev_root)
    is_network = entry.fs_type in NETWORK_FS_TYPES or entry.fs_type.startswith("nfs")
    writable = not entry.read_only and os.access(path, os.W_OK)
    # A stalled network server can hang an O_DIRECT write: never test those.
    odirect = odirect_supported(path) if (writable and test_odirect and not is_network) else None
    return DiskInfo(
        mount=entry.mount_point,
        device=_device_label(entry, backing),
        fs_type=entry.fs_type,
        total_bytes=st.f_blocks * st.f_frsize,
        free_bytes=st.f_bavail * st.f_frsize,
        rotational=backing.rotational,
        nvme=backing.nvme,
        odirect=odirect,
        writable=writable,
        is_tmpfs=entry.fs_type in TMPFS_TYPES,
        is_overlay=entry.fs_type in OVERLAY_TYPES,
        is_network=is_network,
    )


def odirect_supported(directory: str) -> bool | None:
    """Write one aligned block with O_DIRECT in ``directory``; None when the test itself failed."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None  # not Linux
    name = os.path.join(directory, f".lmi-cache-odirect-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o600)
    except OSError as err:
        if err.errno != errno.EEXIST:
            # Some kernels create the file before refusing O_DIRECT.
            _remove(name)
        return _refused(err, directory)
    # Anonymous mmap memory is page aligned, as O_DIRECT requires of the buffer.
    buf = mmap.mmap(-1, ODIRECT_BLOCK_BYTES)
    try:
        return os.write(fd, buf) == ODIRECT_BLOCK_BYTES
    except OSError as err:
        return _refused(err, directory)
    finally:
        buf.close()
        os.close(fd)
        _remove(name)


def disk_for_path(disks: list[DiskInfo], path: str) -> DiskInfo | None:
    """The listed filesystem holding ``path`` (longest mount prefix), e.g. where /tmp lives."""
    best: DiskInfo | None = None
    for disk in disks:
        if is_under(path, disk.mount) and (best is None or len(disk.mount) > len(best.mount)):
            best = disk
    return best


def _refused(err: OSError, directory: str) -> bool | None:
    if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
        return False
    log.debug("O_DIRECT test in %s inconclusive: %s", directory, err)
    return None


def _remove(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def _backing(entry: MountEntry, sys_root: str, dev_root: str) -> BlockBacking:
    if entry.major != 0:
        return resolve_device(entry.major, entry.minor, sys_root)
    # btrfs and some others report an anonymous 0:N device; the source names the real one.
    if entry.source.startswith("/dev/"):
        device_file = os.path.join(dev_root, entry.source[len("/dev/"):])
        if os.path.exists(device_file):
            return resolve_by_name(os.path.basename(os.path.realpath(device_file)), sys_root)
    return UNKNOWN


def _device_label(entry: MountEntry, backing: BlockBacking) -> str:
    # "/dev/root" is a kernel alias that names nothing a user can find.
    if entry.source.startswith("/dev/") and entry.source != "/dev/root":
        return entry.source
    if backing.device_name:
        return f"/dev/{backing.device_name}"
    return entry.source


def _in_kernel_tree(mount_point: str) -> bool:
    return any(is_under(mount_point, tree) for tree in _KERNEL_TREES)


def _shorter(a: str, b: str) -> bool:
    return (len(a), a) < (len(b), b)
