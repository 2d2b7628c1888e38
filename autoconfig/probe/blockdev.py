"""Resolve a filesystem's block device to the physical disks behind it (autoconfig probe, CLI process).

Whether a disk tier is worth having depends on the hardware: an NVMe SSD
under a dm-crypt volume or an md RAID0 is fast, a spinning disk is not. sysfs
links a device to what backs it: a partition's directory sits inside its
disk's, and dm/md devices list their members under ``slaves/``.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

_NVME_NAMESPACE = re.compile(r"^nvme\d+n\d+$")
_MAX_DEPTH = 16  # stacks (dm on md on partition) are a few levels; guards against link loops


@dataclass(frozen=True)
class BlockBacking:
    """What a block device is built on."""

    device_name: str | None  # kernel name of the device itself ("nvme0n1p1", "dm-0"); None if unknown
    disks: tuple[str, ...]  # physical disks at the bottom of the stack
    rotational: bool | None  # True if any disk rotates; None when no disk could be read
    nvme: bool  # every backing disk is an NVMe namespace


UNKNOWN = BlockBacking(None, (), None, False)


def resolve_device(major: int, minor: int, sys_root: str = "/sys") -> BlockBacking:
    """Follow ``/sys/dev/block/MAJ:MIN`` down through partitions, dm and md to the disks."""
    link = os.path.join(sys_root, "dev", "block", f"{major}:{minor}")
    if not os.path.exists(link):
        return UNKNOWN
    top = os.path.realpath(link)
    disk_dirs: list[str] = []
    _collect_disks(top, disk_dirs, depth=0)
    names = tuple(dict.fromkeys(os.path.basename(d) for d in disk_dirs))
    flags = [_read_flag(os.path.join(d, "queue", "rotational")) for d in disk_dirs]
    known = [f for f in flags if f is not None]
    rotational = any(known) if known else None
    nvme = bool(names) and all(_NVME_NAMESPACE.match(n) for n in names)
    return BlockBacking(os.path.basename(top), names, rotational, nvme)


def resolve_by_name(name: str, sys_root: str = "/sys") -> BlockBacking:
    """Same as resolve_device for a kernel device name (e.g. btrfs reports an anonymous MAJ:MIN)."""
    dev_file = os.path.join(sys_root, "class", "block", name, "dev")
    try:
        with open(dev_file, encoding="ascii") as f:
            major_text, minor_text = f.read().strip().split(":", 1)
        return resolve_device(int(major_text), int(minor_text), sys_root)
    except (OSError, ValueError):
        return UNKNOWN


def _collect_disks(device_dir: str, out: list[str], depth: int) -> None:
    if depth > _MAX_DEPTH:
        log.debug("block device stack too deep at %s", device_dir)
        return
    slaves_dir = os.path.join(device_dir, "slaves")
    try:
        slaves = sorted(os.listdir(slaves_dir))
    except OSError:
        slaves = []
    if slaves:
        for slave in slaves:
            _collect_disks(os.path.realpath(os.path.join(slaves_dir, slave)), out, depth + 1)
        return
    if os.path.exists(os.path.join(device_dir, "partition")):
        # A partition's sysfs directory is nested in its disk's directory.
        _collect_disks(os.path.dirname(device_dir), out, depth + 1)
        return
    if device_dir not in out:
        out.append(device_dir)


def _read_flag(path: str) -> bool | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("0", "1"):
        return text == "1"
    return None
