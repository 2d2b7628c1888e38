"""Property tests: the planner's invariants hold for any host, model and settings."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoconfig.probe.snapshot import DiskInfo, GpuInfo, HostSnapshot, MemoryInfo
from autoconfig.plan.disk import unsuitable_reason
from autoconfig.plan.types import PlanError, PlanModel
from autoconfig.plan.planner import plan_tiers
from autoconfig.render.lmcache_yaml import gib_2dp_floor
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.kv_layout import KV_DTYPE_BYTES, KvLayout

GIB = 1 << 30
sizes = st.integers(min_value=0, max_value=4096 * GIB)

disks = st.builds(
    DiskInfo,
    mount=st.sampled_from(["/", "/tmp", "/mnt/nvme", "/data", "/dev/shm", "/opt/ml"]),
    device=st.just("/dev/x"),
    fs_type=st.sampled_from(["xfs", "ext4", "overlay", "tmpfs", "nfs4", "btrfs"]),
    total_bytes=sizes,
    free_bytes=sizes,
    rotational=st.sampled_from([True, False, None]),
    nvme=st.booleans(),
    odirect=st.sampled_from([True, False, None]),
    writable=st.booleans(),
    is_tmpfs=st.booleans(),
    is_overlay=st.booleans(),
    is_network=st.booleans(),
)


@st.composite
def hosts(draw: st.DrawFn) -> HostSnapshot:
    num_gpus = draw(st.integers(0, 8))
    gpu_total = draw(st.integers(4 * GIB, 192 * GIB))
    gpus = [GpuInfo(i, "gpu", gpu_total, draw(st.integers(0, gpu_total))) for i in range(num_gpus)]
    cgroup = draw(st.one_of(st.none(), sizes))
    mem = MemoryInfo(
        total_bytes=draw(sizes), available_bytes=draw(sizes), cgroup_limit_bytes=cgroup,
        memlock_limit_bytes=draw(st.one_of(st.none(), st.integers(0, 512 * GIB))), shm_bytes=0,
        cgroup_usage_bytes=draw(st.one_of(st.none(), sizes)) if cgroup is not None else None,
    )
    return HostSnapshot(gpus=gpus, memory=mem, disks=draw(st.lists(disks, max_size=5)))


models = st.builds(
    PlanModel,
    layout=st.builds(KvLayout, num_layers=st.integers(1, 128), num_kv_heads=st.integers(1, 128),
                     head_dim=st.sampled_from([32, 64, 128, 256, 576]),
                     kv_dtype=st.sampled_from(sorted(KV_DTYPE_BYTES)), is_mla=st.booleans()),
    weights_bytes=st.integers(0, 1000 * GIB),
    max_position_embeddings=st.one_of(st.none(), st.integers(1, 1 << 20)),
)

serving = st.builds(
    ServingSettings,
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.integers(1, 4), dp=st.integers(1, 4),
    gpu_memory_utilization=st.floats(0.05, 1.0),
    max_model_len=st.one_of(st.none(), st.integers(1, 1 << 18)),
    overrides=st.builds(
        TierOverrides,
        cpu_size_gib=st.one_of(st.none(), st.floats(0, 2048)),
        disk_size_gib=st.one_of(st.none(), st.floats(0, 8192)),
        chunk_size=st.one_of(st.none(), st.sampled_from([16, 100, 128, 256, 1024])),
        disk_path=st.one_of(st.none(), st.sampled_from(["/mnt/nvme/kv", "file:///data/", "/nowhere/kv"])),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(host=hosts(), model=models, s=serving)
def test_plan_invariants(host: HostSnapshot, model: PlanModel, s: ServingSettings) -> None:
    try:
        plan = plan_tiers(host, model, s)
    except PlanError as err:
        assert "\n" not in str(err) and str(err)
        return
    ranks = plan.ranks_per_host
    mem = host.memory
    cpu, disk = plan.cpu, plan.disk
    # Never negative, never above what the container can take.
    assert cpu.bytes_per_rank >= 0 and disk.bytes_per_rank >= 0
    assert cpu.bytes_per_rank * ranks <= mem.usable_bytes
    if mem.cgroup_limit_bytes is not None:
        assert cpu.bytes_per_rank * ranks <= max(0, mem.cgroup_limit_bytes - (mem.cgroup_usage_bytes or 0))
    if host.gpus and mem.memlock_limit_bytes is not None and mem.memlock_limit_bytes >= GIB:
        assert cpu.bytes_per_rank <= mem.memlock_limit_bytes
    # Disk: never above the free space of its filesystem; auto choice never an unsuitable one.
    if disk.enabled and disk.mount is not None:
        chosen = [d for d in host.disks if d.mount == disk.mount]
        assert any(disk.bytes_per_rank * ranks <= d.free_bytes for d in chosen)
        if s.overrides.disk_path is None:
            assert any(unsuitable_reason(d) is None for d in chosen)
    # Disabled tiers hold nothing; auto-enabled tiers add capacity.
    for tier in (cpu, disk):
        if not tier.enabled:
            assert tier.bytes_per_rank == 0 and tier.capacity_tokens == 0
    if cpu.enabled and s.overrides.cpu_size_gib is None:
        assert cpu.capacity_tokens > plan.gpu.kv_capacity_tokens
    if disk.enabled and s.overrides.disk_size_gib is None:
        above = max(plan.gpu.kv_capacity_tokens, cpu.capacity_tokens if cpu.enabled else 0)
        assert disk.capacity_tokens > above
    # Chunk size: a positive multiple of vLLM's block size.
    assert plan.chunk_size > 0 and plan.chunk_size % plan.gpu.block_size == 0
    # The rendered GiB never asks for more than the plan sized.
    cfg = plan.lmcache_config
    assert cfg["max_local_cpu_size"] * GIB <= cpu.bytes_per_rank + 1
    assert cfg["max_local_cpu_size"] == gib_2dp_floor(cpu.bytes_per_rank)
    assert cfg["max_local_disk_size"] * GIB <= disk.bytes_per_rank + 1
    assert plan.gpu.kv_capacity_tokens > 0
