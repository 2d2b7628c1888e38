"""Builders for fake procfs / sysfs / cgroup trees used by the probe tests (pytest process).

Each builder writes real files and symlinks under a tmp directory laid out the
way the kernel lays them out, so the probe code runs unchanged against them.
"""
from __future__ import annotations

import os
from pathlib import Path

V1_UNLIMITED = 9223372036854771712


def escape(path: str) -> str:
    """mountinfo's octal escaping of space, tab, newline and backslash."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def mount_line(
    mount_id: int,
    parent_id: int,
    device: str,
    root: str,
    mount_point: str,
    fs_type: str,
    source: str,
    mount_options: str = "rw,relatime",
    super_options: str = "rw",
    optional: str = "shared:1",
) -> str:
    fields = [str(mount_id), str(parent_id), device, escape(root), escape(mount_point), mount_options]
    if optional:
        fields.append(optional)
    fields += ["-", fs_type, escape(source), super_options]
    return " ".join(fields)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_proc(proc: Path, mountinfo: list[str], cgroup: str = "0::/\n", meminfo: str | None = None) -> Path:
    write(proc / "self" / "mountinfo", "\n".join(mountinfo) + "\n")
    write(proc / "self" / "cgroup", cgroup)
    if meminfo is not None:
        write(proc / "meminfo", meminfo)
    return proc


def relative_symlink(link: Path, target: Path) -> None:
    """Symlinks in sysfs are relative; keep them so, to exercise realpath the same way."""
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


class FakeSysfs:
    """A /sys with block devices: disks, partitions, and stacked (dm / md) devices."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: dict[str, Path] = {}
        (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        (root / "class" / "block").mkdir(parents=True, exist_ok=True)

    def _register(self, name: str, device_dir: Path, dev: str) -> Path:
        device_dir.mkdir(parents=True, exist_ok=True)
        write(device_dir / "dev", dev + "\n")
        relative_symlink(self.root / "dev" / "block" / dev, device_dir)
        relative_symlink(self.root / "class" / "block" / name, device_dir)
        self.dirs[name] = device_dir
        return device_dir

    def disk(self, name: str, dev: str, rotational: bool | None) -> Path:
        bus = "nvme/nvme0" if name.startswith("nvme") else "ata1/host0/target0:0:0/0:0:0:0"
        device_dir = self._register(name, self.root / "devices" / "pci0000:00" / bus / "block" / name, dev)
        (device_dir / "slaves").mkdir(exist_ok=True)
        if rotational is not None:
            write(device_dir / "queue" / "rotational", "1\n" if rotational else "0\n")
        return device_dir

    def partition(self, disk: str, name: str, dev: str) -> Path:
        device_dir = self._register(name, self.dirs[disk] / name, dev)
        write(device_dir / "partition", "1\n")
        return device_dir

    def stacked(self, name: str, dev: str, slaves: list[str]) -> Path:
        """A dm-* or md* device built on ``slaves`` (names registered earlier)."""
        device_dir = self._register(name, self.root / "devices" / "virtual" / "block" / name, dev)
        # Stacked devices have their own queue; the kernel reports them non-rotational.
        write(device_dir / "queue" / "rotational", "0\n")
        for slave in slaves:
            relative_symlink(device_dir / "slaves" / slave, self.dirs[slave])
        return device_dir


def cgroup_v2_dir(base: Path, relative: str, max_value: str | None, current: int | None) -> Path:
    """One cgroup v2 directory; ``max_value`` None means no memory.max file (the root)."""
    d = base / relative.strip("/") if relative.strip("/") else base
    d.mkdir(parents=True, exist_ok=True)
    if max_value is not None:
        write(d / "memory.max", max_value + "\n")
    if current is not None:
        write(d / "memory.current", f"{current}\n")
    return d


def cgroup_v1_dir(base: Path, relative: str, limit: int, usage: int | None) -> Path:
    d = base / relative.strip("/") if relative.strip("/") else base
    d.mkdir(parents=True, exist_ok=True)
    write(d / "memory.limit_in_bytes", f"{limit}\n")
    if usage is not None:
        write(d / "memory.usage_in_bytes", f"{usage}\n")
    return d
