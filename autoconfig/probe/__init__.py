"""Host probing: the only part of autoconfig that reads the live machine (CLI process).

``probe_host()`` gathers GPUs, memory, disks and CPUs into a HostSnapshot,
whose JSON form is the contract ``plan --host-snapshot`` reads back. Each part takes
its root paths as parameters so tests drive it with fake trees.
"""
from __future__ import annotations

import os

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.probe.disks import disk_for_path, probe_disks
from autoconfig.probe.gpus import probe_gpus
from autoconfig.probe.memory import probe_memory

__all__ = ["probe_host", "probe_gpus", "probe_memory", "probe_disks", "disk_for_path", "usable_cpu_count"]


def usable_cpu_count() -> int | None:
    """CPUs this process may run on (the affinity mask, which containers narrow), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def probe_host(
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    dev_root: str = "/dev",
    shm_path: str = "/dev/shm",
    tmp_dir: str = "/tmp",
    mount_root: str = "/",
    test_odirect: bool = True,
) -> HostSnapshot:
    """Probe this machine; never raises for missing hardware or drivers.

    ``mount_root`` is prefixed to mount points read from mountinfo (for fake trees).
    ``test_odirect=False`` skips the one write per filesystem (e.g. a read-only report).
    """
    return HostSnapshot(
        gpus=probe_gpus(),
        memory=probe_memory(proc_root=proc_root, shm_path=shm_path, mount_root=mount_root),
        disks=probe_disks(
            proc_root=proc_root,
            sys_root=sys_root,
            dev_root=dev_root,
            mount_root=mount_root,
            tmp_dir=tmp_dir,
            test_odirect=test_odirect,
        ),
        cpu_count=usable_cpu_count(),
        rdma_drivers=probe_rdma_drivers(sys_root),
    )


def probe_rdma_drivers(sys_root: str = "/sys") -> list[str]:
    """The driver of each RDMA device (``efa`` on AWS EFA): what the peer tier's transport is planned from."""
    import os

    root = os.path.join(sys_root, "class", "infiniband")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.basename(os.path.realpath(os.path.join(root, name, "device", "driver"))) for name in names]
