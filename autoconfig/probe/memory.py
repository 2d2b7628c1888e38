"""Probe host memory: RAM, the container's cgroup budget, memlock and /dev/shm (autoconfig, CLI process).

The CPU tier's size depends on all four: RAM says what exists, the cgroup
limit what the container may take, the memlock rlimit how much can be pinned
for fast GPU copies, and /dev/shm whether shared-memory buffers fit.
"""
from __future__ import annotations

import logging
import os
import resource
from typing import Callable

from autoconfig.probe.snapshot import MemoryInfo
from autoconfig.probe.cgroups import probe_cgroup_memory

log = logging.getLogger(__name__)

_UNIT_BYTES = {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as {key: bytes}; lines that do not parse are skipped."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        if unit not in _UNIT_BYTES:
            continue
        try:
            values[key.strip()] = int(parts[0]) * _UNIT_BYTES[unit]
        except ValueError:
            continue
    return values


def ram_from_meminfo(values: dict[str, int]) -> tuple[int, int]:
    """(total_bytes, available_bytes); kernels before 3.14 lack MemAvailable, so estimate it."""
    total = values.get("MemTotal", 0)
    if "MemAvailable" in values:
        available = values["MemAvailable"]
    else:
        available = values.get("MemFree", 0) + values.get("Buffers", 0) + values.get("Cached", 0)
    return total, (min(available, total) if total else available)


def read_ram(proc_root: str = "/proc") -> tuple[int, int]:
    """(total_bytes, available_bytes) from meminfo, psutil where there is no procfs."""
    try:
        with open(os.path.join(proc_root, "meminfo"), encoding="ascii") as f:
            return ram_from_meminfo(parse_meminfo(f.read()))
    except OSError as err:
        log.debug("cannot read meminfo (%s); asking psutil", err)
    import psutil  # only off Linux: keeps the common path free of the import cost

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def memlock_limit_bytes(
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
) -> int | None:
    """The soft RLIMIT_MEMLOCK (what this process may pin without privileges); None = unlimited."""
    soft, _hard = getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return int(soft)


def shm_size_bytes(shm_path: str = "/dev/shm") -> int:
    """Size of the shared-memory filesystem (Docker's default is only 64 MiB); 0 when absent."""
    try:
        st = os.statvfs(shm_path)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def probe_memory(
    proc_root: str = "/proc",
    shm_path: str = "/dev/shm",
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    mount_root: str = "/",
) -> MemoryInfo:
    """RAM, cgroup budget, memlock and /dev/shm; ``mount_root`` prefixes mountinfo paths (tests)."""
    total_bytes, available_bytes = read_ram(proc_root)
    cgroup = probe_cgroup_memory(proc_root, mount_root)
    return MemoryInfo(
        total_bytes=total_bytes,
        available_bytes=available_bytes,
        cgroup_limit_bytes=cgroup.limit_bytes,
        memlock_limit_bytes=memlock_limit_bytes(getrlimit),
        shm_bytes=shm_size_bytes(shm_path),
        cgroup_usage_bytes=cgroup.usage_bytes,
    )
