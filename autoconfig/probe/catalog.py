"""SageMaker GPU instance types, for what-if planning (``plan --instance ml.g6e.12xlarge``).

Run by the CLI on any machine, including one without a GPU: it turns a catalog
row (autoconfig/data/sagemaker_instances.json, each row citing its AWS page)
into the HostSnapshot that the probe would report inside an LMI container on
that instance, so the planner can size tiers for a host you do not have.

Assumptions in ``host_snapshot_for`` (none is published by AWS as a number):
- Host RAM: the container has no cgroup limit (one model per endpoint instance),
  but the OS, the SageMaker agents and the model server's own processes use
  some: we keep back ``max(2 GiB, 5%)`` of RAM as not available.
- /dev/shm: half of RAM (what a tmpfs gets by default); memlock: unlimited.
- Instance storage: SageMaker uses the whole NVMe instance store of these types
  as the ML storage volume instead of EBS ("SageMaker configures storage paths
  ... to use the entire capacity of the instance storage", SageMaker
  ResourceConfig.VolumeSizeInGB docs). Where the LMI container sees it is not
  documented for endpoints: we assume ``/tmp`` (where LMI downloads models), as
  one non-rotational NVMe file system spanning all devices.
- The container root is an overlay with little free space.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from autoconfig.probe.snapshot import DiskInfo, GpuInfo, HostSnapshot, MemoryInfo
from lmi_cache.errors import UserError

__all__ = ["InstanceType", "UnknownInstanceError", "get_instance", "host_snapshot_for", "list_instances",
           "INSTANCE_STORE_MOUNT", "HOST_RAM_RESERVE_FRACTION", "HOST_RAM_RESERVE_MIN_BYTES"]

_DATA = Path(__file__).parents[1] / "data" / "sagemaker_instances.json"
_GIB = 1024**3

INSTANCE_STORE_MOUNT = "/tmp"  # assumed, see the module docstring
HOST_RAM_RESERVE_FRACTION = 0.05
HOST_RAM_RESERVE_MIN_BYTES = 2 * _GIB
OVERLAY_ROOT_TOTAL_BYTES = 30 * _GIB  # container root file system (image layers)
OVERLAY_ROOT_FREE_BYTES = 8 * _GIB


class UnknownInstanceError(UserError):
    """The instance type is not in the catalog."""


@dataclass(frozen=True)
class InstanceType:
    name: str  # "ml.g5.12xlarge"
    gpu_model: str  # "A10G"
    gpu_count: int
    gpu_nvml_name: str  # what NVML calls the GPU
    gpu_memory_bytes: int  # per GPU, as the AWS page states it
    gpu_memory_nvml_bytes: int  # per GPU, the total NVML typically reports (slightly less)
    host_memory_bytes: int
    vcpus: int
    nvme_device_count: int
    nvme_device_bytes: int  # per device
    nvme_bytes: int  # all devices
    source: str  # the public AWS page the figures come from
    note: str = ""  # where sources disagree, or how a figure was derived


@lru_cache(maxsize=1)
def _catalog() -> dict[str, InstanceType]:
    rows: list[dict[str, Any]] = json.loads(_DATA.read_text(encoding="utf-8"))["instances"]
    return {row["name"]: InstanceType(**row) for row in rows}


def list_instances() -> list[InstanceType]:
    """Every catalog row, in file order (families, then sizes)."""
    return list(_catalog().values())


def get_instance(name: str) -> InstanceType:
    """Look up ``name`` (the ``ml.`` prefix is optional); UnknownInstanceError with a hint otherwise."""
    catalog = _catalog()
    key = name.strip().lower()
    if not key.startswith("ml."):
        key = "ml." + key
    if key in catalog:
        return catalog[key]
    close = difflib.get_close_matches(key, list(catalog), n=3, cutoff=0.6)
    families = sorted({n.rsplit(".", 1)[0] for n in catalog})
    hint = f"did you mean {' or '.join(close)}?" if close else f"known families: {', '.join(families)}"
    raise UnknownInstanceError(f"unknown SageMaker instance type '{name}'; {hint}")


def host_snapshot_for(name: str, *, model_bytes_on_disk: int = 0) -> HostSnapshot:
    """What the probe would see in an LMI container on this instance, before vLLM starts.

    ``model_bytes_on_disk``: weights downloaded to the instance store first
    (LMI does that for S3/HF models), taken off the NVMe free space.
    """
    inst = get_instance(name)
    gpus = [GpuInfo(index=i, name=inst.gpu_nvml_name, memory_total_bytes=inst.gpu_memory_nvml_bytes,
                    memory_free_bytes=inst.gpu_memory_nvml_bytes) for i in range(inst.gpu_count)]
    ram = inst.host_memory_bytes
    reserve = max(HOST_RAM_RESERVE_MIN_BYTES, int(ram * HOST_RAM_RESERVE_FRACTION))
    memory = MemoryInfo(total_bytes=ram, available_bytes=ram - reserve, cgroup_limit_bytes=None,
                        memlock_limit_bytes=None, shm_bytes=ram // 2)
    disks = [DiskInfo(mount="/", device="overlay", fs_type="overlay", total_bytes=OVERLAY_ROOT_TOTAL_BYTES,
                      free_bytes=OVERLAY_ROOT_FREE_BYTES, rotational=None, nvme=False, odirect=False,
                      is_overlay=True)]
    if inst.nvme_device_count:
        # Several devices appear as one striped volume (md RAID 0) under the mount.
        device = "/dev/nvme1n1" if inst.nvme_device_count == 1 else "/dev/md0"
        disks.append(DiskInfo(mount=INSTANCE_STORE_MOUNT, device=device, fs_type="xfs",
                              total_bytes=inst.nvme_bytes,
                              free_bytes=max(0, inst.nvme_bytes - max(0, model_bytes_on_disk)),
                              rotational=False, nvme=True, odirect=True))
    return HostSnapshot(gpus=gpus, memory=memory, disks=disks, cpu_count=inst.vcpus)
