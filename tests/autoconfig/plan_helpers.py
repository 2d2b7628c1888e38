"""Builders for host snapshots and models used by the planner/render/validate tests."""
from __future__ import annotations

from autoconfig.probe.snapshot import DiskInfo, GpuInfo, HostSnapshot, MemoryInfo
from autoconfig.plan.types import PlanModel
from lmi_cache.kv_layout import KvLayout

GIB = 1 << 30

# Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16 -> 131072 B/token.
LLAMA8B = PlanModel(KvLayout(32, 8, 128, "bfloat16", model_name="llama8b"), 16 * GIB, 131072, "llama8b")


def gpus(count: int, total_gib: int = 80) -> list[GpuInfo]:
    return [GpuInfo(i, "NVIDIA A100-SXM4-80GB", total_gib * GIB, total_gib * GIB) for i in range(count)]


def memory(available_gib: float, *, total_gib: float | None = None, cgroup_gib: float | None = None,
           usage_gib: float | None = None, memlock_gib: float | None = None) -> MemoryInfo:
    def b(v: float | None) -> int | None:
        return None if v is None else int(v * GIB)

    return MemoryInfo(total_bytes=int((total_gib or available_gib) * GIB), available_bytes=int(available_gib * GIB),
                      cgroup_limit_bytes=b(cgroup_gib), memlock_limit_bytes=b(memlock_gib), shm_bytes=GIB,
                      cgroup_usage_bytes=b(usage_gib))


def disk(mount: str, *, free_gib: float, total_gib: float | None = None, nvme: bool = True,
         rotational: bool | None = False, fs_type: str = "xfs", odirect: bool | None = True, **flags: bool) -> DiskInfo:
    return DiskInfo(mount=mount, device=f"/dev/{mount.strip('/') or 'root'}", fs_type=fs_type,
                    total_bytes=int((total_gib or free_gib * 2) * GIB), free_bytes=int(free_gib * GIB),
                    rotational=rotational, nvme=nvme, odirect=odirect, **flags)


def host(num_gpus: int = 1, available_gib: float = 200, disks: list[DiskInfo] | None = None, **mem: float) -> HostSnapshot:
    return HostSnapshot(gpus=gpus(num_gpus), memory=memory(available_gib, **mem), disks=disks or [])
