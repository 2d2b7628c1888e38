"""Tests for autoconfig.probe.disks / blockdev / mounts against fake procfs and sysfs trees."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from autoconfig.probe.snapshot import DiskInfo
from autoconfig.probe import disks as disks_mod
from autoconfig.probe.blockdev import resolve_device
from autoconfig.probe.disks import disk_for_path, odirect_supported, probe_disks
from autoconfig.probe.mounts import mount_holding, parse_mountinfo, read_mountinfo

try:
    from .probe_trees import FakeSysfs, mount_line, write_proc
except ImportError:  # tests/ laid out without __init__.py files
    from probe_trees import FakeSysfs, mount_line, write_proc

MOUNTS = [
    mount_line(1, 0, "0:50", "/", "/", "overlay", "overlay", super_options="rw,lowerdir=/l,upperdir=/u,workdir=/w"),
    mount_line(2, 1, "0:21", "/", "/proc", "proc", "proc"),
    mount_line(3, 1, "0:22", "/", "/sys", "sysfs", "sysfs", "ro,nosuid"),
    mount_line(4, 3, "0:28", "/", "/sys/fs/cgroup", "tmpfs", "tmpfs"),
    mount_line(5, 4, "0:29", "/", "/sys/fs/cgroup/unified", "cgroup2", "cgroup2"),
    mount_line(6, 1, "0:6", "/", "/dev", "devtmpfs", "devtmpfs"),
    mount_line(7, 6, "0:24", "/", "/dev/pts", "devpts", "devpts"),
    mount_line(8, 6, "0:60", "/", "/dev/shm", "tmpfs", "shm", optional=""),
    mount_line(9, 6, "0:61", "/", "/dev/shm", "tmpfs", "tmpfs"),  # mounted over the first
    mount_line(10, 1, "0:33", "/", "/dev/mqueue", "mqueue", "mqueue"),
    mount_line(11, 1, "259:1", "/", "/mnt/nvme", "ext4", "/dev/nvme0n1p1", optional="shared:5 master:2"),
    mount_line(12, 1, "259:1", "/", "/mnt/nvme-bind", "ext4", "/dev/nvme0n1p1"),  # same fs, same root
    mount_line(13, 1, "259:1", "/cache", "/cache", "ext4", "/dev/nvme0n1p1"),  # a subdirectory bind: kept
    mount_line(14, 1, "259:1", "/hosts", "/etc/hosts", "ext4", "/dev/nvme0n1p1"),  # a single file
    mount_line(15, 1, "253:0", "/", "/data", "ext4", "/dev/mapper/crypt"),
    mount_line(16, 1, "9:0", "/", "/raid", "xfs", "/dev/md0"),
    mount_line(17, 1, "8:1", "/", "/mnt/hdd", "ext4", "/dev/sda1"),
    mount_line(18, 1, "0:70", "/", "/mnt/nfs", "nfs4", "fs-1.efs.example:/", "rw", "rw,vers=4.1"),
    mount_line(19, 1, "8:1", "/ro", "/mnt/my disk", "ext4", "/dev/sda1", "ro,relatime"),
    mount_line(20, 1, "0:45", "/", "/btr", "btrfs", "/dev/nvme4n1"),
    mount_line(21, 1, "7:0", "/", "/snap/core/1", "squashfs", "/dev/loop0", "ro"),
]


@pytest.fixture()
def host(tmp_path: Path) -> dict[str, str]:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.disk("nvme0n1", "259:0", rotational=False)
    sysfs.partition("nvme0n1", "nvme0n1p1", "259:1")
    sysfs.disk("nvme1n1", "259:2", rotational=False)
    sysfs.partition("nvme1n1", "nvme1n1p2", "259:4")
    sysfs.stacked("dm-0", "253:0", ["nvme1n1p2"])
    sysfs.disk("nvme2n1", "259:5", rotational=False)
    sysfs.disk("nvme3n1", "259:6", rotational=False)
    sysfs.stacked("md0", "9:0", ["nvme2n1", "nvme3n1"])
    sysfs.disk("sda", "8:0", rotational=True)
    sysfs.partition("sda", "sda1", "8:1")
    sysfs.disk("nvme4n1", "259:7", rotational=False)
    dev = tmp_path / "dev"
    (dev / "mapper").mkdir(parents=True)
    (dev / "nvme4n1").touch()
    root = tmp_path / "root"
    for entry in parse_mountinfo("\n".join(MOUNTS)):
        (root / entry.mount_point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / "etc" / "hosts").rmdir()
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (root / "tmp").mkdir()
    proc = write_proc(tmp_path / "proc", MOUNTS)
    return {"proc_root": str(proc), "sys_root": str(sysfs.root), "dev_root": str(dev), "mount_root": str(root)}


def run(host: dict[str, str], test_odirect: bool = False) -> list[DiskInfo]:
    return probe_disks(proc_root=host["proc_root"], sys_root=host["sys_root"], dev_root=host["dev_root"],
                       mount_root=host["mount_root"], test_odirect=test_odirect)


def by_mount(disks: list[DiskInfo]) -> dict[str, DiskInfo]:
    return {d.mount: d for d in disks}


def test_pseudo_filesystems_kernel_trees_files_and_bind_duplicates_are_dropped(host: dict[str, str]) -> None:
    mounts = [d.mount for d in run(host)]
    assert mounts == ["/", "/dev/shm", "/mnt/nvme", "/cache", "/data", "/raid", "/mnt/hdd", "/mnt/nfs",
                      "/mnt/my disk", "/btr"]


def test_hardware_behind_each_filesystem_is_resolved(host: dict[str, str]) -> None:
    found = by_mount(run(host))
    expect = {  # mount: (device, nvme, rotational)
        "/mnt/nvme": ("/dev/nvme0n1p1", True, False),
        "/data": ("/dev/mapper/crypt", True, False),  # dm-crypt over an NVMe partition
        "/raid": ("/dev/md0", True, False),  # md RAID0 of two NVMe namespaces
        "/mnt/hdd": ("/dev/sda1", False, True),
        "/btr": ("/dev/nvme4n1", True, False),  # anonymous 0:N device, resolved by name
        "/": ("overlay", False, None),
        "/dev/shm": ("tmpfs", False, None),
        "/mnt/nfs": ("fs-1.efs.example:/", False, None),
    }
    assert {m: (found[m].device, found[m].nvme, found[m].rotational) for m in expect} == expect


def test_flags_sizes_and_writability(host: dict[str, str], tmp_path: Path) -> None:
    found = by_mount(run(host))
    assert (found["/"].is_overlay, found["/"].is_tmpfs, found["/"].is_network) == (True, False, False)
    assert found["/dev/shm"].is_tmpfs and not found["/dev/shm"].is_overlay
    assert found["/mnt/nfs"].is_network and found["/mnt/nfs"].fs_type == "nfs4"
    assert not any(found[m].is_network for m in ("/", "/mnt/nvme", "/data", "/raid", "/mnt/hdd"))
    assert found["/mnt/my disk"].writable is False and found["/mnt/my disk"].odirect is None
    assert found["/mnt/nvme"].writable is True
    st = os.statvfs(tmp_path)  # every fake mount point lives on the filesystem holding tmp_path
    assert found["/raid"].total_bytes == st.f_blocks * st.f_frsize
    assert 0 < found["/raid"].free_bytes <= found["/raid"].total_bytes


def test_odirect_is_tested_where_writable_and_never_on_network_mounts(host: dict[str, str]) -> None:
    found = by_mount(run(host, test_odirect=True))
    probed = odirect_supported(host["mount_root"])
    assert isinstance(probed, bool)
    assert found["/mnt/nvme"].odirect is probed
    assert found["/mnt/nfs"].odirect is None  # a stalled server could hang the probe
    assert found["/mnt/my disk"].odirect is None  # read-only
    leftovers = [n for _d, _s, names in os.walk(host["mount_root"]) for n in names if "odirect" in n]
    assert leftovers == []


def test_tmp_holder_is_listed_even_when_it_is_the_root_overlay(host: dict[str, str]) -> None:
    disks = run(host)
    holder = disk_for_path(disks, "/tmp/x")
    assert holder is not None and holder.mount == "/" and holder.is_overlay
    assert disk_for_path(disks, "/cache/models").mount == "/cache"  # type: ignore[union-attr]


def test_own_tmp_mount_is_kept_beside_a_shorter_bind_of_the_same_filesystem(tmp_path: Path) -> None:
    mounts = [
        mount_line(1, 0, "254:0", "/", "/", "ext4", "/dev/vda"),
        mount_line(2, 1, "254:16", "/", "/data", "ext4", "/dev/vdb"),
        mount_line(3, 1, "254:16", "/", "/tmp", "ext4", "/dev/vdb"),  # same fs, same root, shorter name
        mount_line(4, 1, "254:16", "/", "/var/lib/x", "ext4", "/dev/vdb"),
    ]
    root = tmp_path / "root"
    for sub in ("data", "tmp", "var/lib/x"):
        (root / sub).mkdir(parents=True)
    proc = write_proc(tmp_path / "proc", mounts)
    disks = probe_disks(proc_root=str(proc), sys_root=str(tmp_path / "nosys"), mount_root=str(root),
                        test_odirect=False)
    assert [d.mount for d in disks] == ["/", "/data", "/tmp"]
    assert disks[0].rotational is None and disks[0].nvme is False  # no sysfs entry: unknown


def test_lvm_over_nvme_and_hdd_is_rotational_and_not_nvme(tmp_path: Path) -> None:
    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.disk("nvme0n1", "259:0", rotational=False)
    sysfs.disk("sdb", "8:16", rotational=True)
    sysfs.stacked("dm-3", "253:3", ["nvme0n1", "sdb"])
    backing = resolve_device(253, 3, str(sysfs.root))
    assert (backing.device_name, backing.disks, backing.rotational, backing.nvme) == (
        "dm-3", ("nvme0n1", "sdb"), True, False)
    assert resolve_device(1, 99, str(sysfs.root)).disks == ()


def test_mountinfo_parsing_unescapes_and_handles_optional_fields() -> None:
    text = "\n".join([
        mount_line(40, 1, "8:1", "/a b", "/mnt/with space\\and tab\t", "ext4", "/dev/sda1",
                   optional="shared:1 master:3 propagate_from:2"),
        "not a mountinfo line",
        mount_line(41, 1, "0:5", "/", "/x", "tmpfs", "tmpfs", "ro", "ro", optional=""),
    ])
    first, second = parse_mountinfo(text)
    assert (first.root, first.mount_point, first.device_id) == ("/a b", "/mnt/with space\\and tab\t", "8:1")
    assert (second.fs_type, second.read_only, first.read_only) == ("tmpfs", True, False)


# --- the O_DIRECT test itself --------------------------------------------------------------------------


def test_odirect_on_real_dev_shm_gives_an_answer_and_leaves_nothing() -> None:
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this host")
    before = set(os.listdir("/dev/shm"))
    # tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: either way a bool, not None.
    assert isinstance(odirect_supported("/dev/shm"), bool)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_odirect_refused_at_open_is_false_and_cleans_the_half_created_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        # Old kernels create the file, then refuse O_DIRECT with EINVAL.
        os.close(real_open(path, flags & ~os.O_DIRECT, mode))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(disks_mod.os, "open", refusing_open)
    assert odirect_supported(str(tmp_path)) is False
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_odirect_refused_at_write_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing_write(_fd: int, _data: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(disks_mod.os, "write", refusing_write)
    assert odirect_supported(str(tmp_path)) is False
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_odirect_inconclusive_when_the_file_cannot_be_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(_path: str, _flags: int, _mode: int = 0o777) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disks_mod.os, "open", denied)
    assert odirect_supported(str(tmp_path)) is None


def test_odirect_works_on_a_regular_local_directory(tmp_path: Path) -> None:
    holder = mount_holding(str(tmp_path), read_mountinfo())
    if holder is not None and holder.fs_type == "tmpfs":
        pytest.skip("tmp_path is on tmpfs here, which may refuse O_DIRECT by design")
    assert odirect_supported(str(tmp_path)) is True
    assert list(tmp_path.iterdir()) == []
